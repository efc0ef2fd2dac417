"""The write pipeline: one rank's ``WriteItem``s into its data files.

Every item is resolved and checked before a file is created, so bad input
fails before a byte is written. Items are laid out (``format.layout``), the
file is preallocated (an early, clean ENOSPC), and the extents are written
through the engine: large runs straight from tensor memory, the rest copied
(with its checksum computed in the same pass) into staging buffers, while
earlier extents are still on their way to disk. The file is fsynced before
the results are returned; on any failure the files are removed.

A ``staging.Session`` (the writer passes one for every save) copies the GPU
parts of staged extents device-to-host on a side stream, can cancel the save
between extents, and is told when every source has been read.
"""

from __future__ import annotations

import contextlib
import errno
import io
import itertools
import os
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from . import _cio
from .buffers import BufferPool
from .config import IOConfig
from .engine import DataFile, Engine, open_file
from .extents import Extent, Piece, Window, interleave, plan_extents
from .format import ItemLocation, layout, stored_nbytes
from .planner import deal
from .progress import Progress
from .staging import Session
from .tensors import ByteSource, check_storable

__all__ = ["FileWritten", "split_items", "write_files"]

_ZEROS = bytes(64 * 1024)


@dataclass
class FileWritten:
    name: str
    size: int
    payload: int  # item bytes, without padding
    direct: bool


class _Item:
    __slots__ = ("write_item", "source", "offset", "crc")

    def __init__(self, write_item: WriteItem, source: ByteSource) -> None:
        self.write_item = write_item
        self.source = source
        self.offset = 0
        self.crc = 0


def _resolve(write_item: WriteItem, planner: SavePlanner, slab_bytes: int) -> _Item:
    fqn = write_item.index.fqn
    data = planner.resolve_data(write_item)
    if write_item.type == WriteItemType.BYTE_IO:
        if not isinstance(data, io.BytesIO):
            raise TypeError(f"planner resolved {fqn!r} to {type(data).__name__}, expected io.BytesIO")
        return _Item(write_item, ByteSource(data, slab_bytes))
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"planner resolved {fqn!r} to {type(data).__name__}, expected a tensor")
    check_storable(data, fqn)
    source = ByteSource(data, slab_bytes)
    expected = stored_nbytes(write_item)
    if source.nbytes != expected:
        raise ValueError(f"{fqn!r}: the plan expects {expected} bytes but the tensor holds {source.nbytes}")
    return _Item(write_item, source)


def split_items(items: list[WriteItem], n: int) -> list[list[WriteItem]]:
    """Deal items into ``n`` groups of near-equal bytes, keeping plan order within each."""
    owners, _ = deal([stored_nbytes(item) or 0 for item in items], [range(n)] * len(items), n)
    groups: list[list[WriteItem]] = [[] for _ in range(n)]
    for item, group in zip(items, owners, strict=True):
        groups[group].append(item)
    return groups


def _zero(buf: memoryview, start: int, stop: int) -> None:
    while start < stop:
        n = min(stop - start, len(_ZEROS))
        buf[start : start + n] = _ZEROS[:n]
        start += n


def _preallocate(f: DataFile, size: int) -> None:
    try:
        _cio.fallocate(f.fd, 0, size)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise OSError(e.errno, f"no space left for a {size}-byte checkpoint file", f.path) from None
        if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS):
            raise OSError(e.errno, e.strerror, f.path) from None
        os.ftruncate(f.fd, size)


def write_files(
    targets: list[tuple[str, list[WriteItem]]],
    planner: SavePlanner,
    engine: Engine,
    pool: BufferPool,
    config: IOConfig,
    session: Session | None = None,
) -> tuple[list[WriteResult], list[FileWritten]]:
    """Write each (path, items) target into a new file, all durably; return the items' results.

    The files' extents are interleaved, so files on different devices are
    written at the same time. ``session.released()`` is called once no
    transfer reads tensor memory any more: after the last staged extent was
    filled or, when extents were written straight from tensor memory, once
    those writes completed.
    """
    plans = []
    for path, write_items in targets:
        items = [_resolve(wi, planner, pool.size) for wi in write_items]
        offsets, size = layout([(it.source.nbytes, it.source.address) for it in items], config.direct_min)
        for it, offset in zip(items, offsets, strict=True):
            it.offset = offset
        plans.append((path, items, size))
    if session is not None:
        session.prepare(pool, [it.source for _, items, _ in plans for it in items])

    files: list[DataFile] = []
    progress = Progress("save", sum(it.source.nbytes for _, items, _ in plans for it in items))
    window = Window(engine, pool, lambda extent, buffer: None, config.queue_depth + pool.count, progress)
    try:
        streams = []
        for path, items, size in plans:
            f = open_file(path, create=True, direct=config.direct_io)
            files.append(f)
            _preallocate(f, size)
            pieces = (Piece(it.offset, it.source.nbytes, it, 0, it.source.memory) for it in items)
            streams.append(zip(itertools.repeat(f), plan_extents(pieces, f.align, pool.size, config.direct_min, None)))
        in_place = False  # whether a transfer reads tensor memory until it completes
        for f, extent in interleave(streams):
            if session is not None:
                session.check()
            if extent.direct:
                it = extent.direct.owner
                it.crc = _cio.crc32c(extent.direct.memory, it.crc)
                buffer, data = None, extent.direct.memory
                in_place = True
            else:
                buffer = data = _fill(window.stage(extent.length), extent, session)
            window.push(engine.write(f, data, extent.file_offset), extent, buffer)
        if session is not None and not in_place:
            session.released()
        window.finish()
        if session is not None:
            session.released()
        engine.sync(files)
    except BaseException:
        window.abort()
        for f in files:
            f.close()
            with contextlib.suppress(OSError):
                os.unlink(f.path)
        raise
    for f in files:
        f.close()

    results = []
    written = []
    for (path, items, size), f in zip(plans, files, strict=True):
        name = os.path.basename(path)
        results += [
            WriteResult(
                index=it.write_item.index,
                size_in_bytes=it.source.nbytes,
                storage_data=tuple(ItemLocation(name, it.offset, it.source.nbytes, it.crc)),
            )
            for it in items
        ]
        written.append(FileWritten(name, size, sum(it.source.nbytes for it in items), f.direct))
    return results, written


def _fill(buffer: memoryview, extent: Extent, session: Session | None = None) -> memoryview:
    """Copy a staged extent's parts into ``buffer`` at their positions; zero the rest.

    GPU parts are copied by the session's side streams while the host fills
    the rest, then checksummed as their copies complete.
    """
    batch = session.issue(buffer, extent) if session is not None else None
    try:
        cursor = 0
        for owner, owner_offset, buf_offset, length in extent.parts:
            _zero(buffer, cursor, buf_offset)
            cursor = buf_offset + length
            if batch is None or owner not in batch:
                owner.crc = owner.source.copy_into(buffer[buf_offset:cursor], owner_offset, owner.crc)
        _zero(buffer, cursor, extent.length)
    except BaseException:
        if batch is not None:
            batch.wait()  # no device copy may outlive the buffer it writes into
        raise
    if batch is not None:
        batch.complete()
    return buffer
