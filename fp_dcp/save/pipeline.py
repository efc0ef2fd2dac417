"""The write pipeline: one rank's ``WriteItem``s into its data files.

Every item is resolved and checked before a file is created, so bad input
fails before a byte is written. Items are laid out (``format.layout``), the
file is preallocated (an early, clean ENOSPC), and the extents are written
through the engine: large runs straight from tensor memory, the rest copied
(with its checksum computed in the same pass) into staging buffers, while
earlier extents are still on their way to disk. The file is fsynced before
the results are returned; on any failure the files are removed.

A ``DeviceCopier`` copies the device parts of staged extents (the CPU one
copies nothing; ``fp_dcp.gpu.streaming`` has the GPU one), and the save's
``SaveControls`` can cancel it between extents and are told when every
source has been read.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import os
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from .. import _cio
from ..config import IOConfig
from ..format import ItemLocation, layout, stored_nbytes
from ..gpu.copier import DeviceCopier
from ..io.buffers import BufferPool
from ..io.dealing import deal
from ..io.engine import Engine
from ..io.extents import Extent, Piece, Window, interleave, plan_extents
from ..io.files import DataFile, open_file, preallocate
from ..io.progress import Progress
from ..tensors import ByteSource, check_storable
from .controls import SaveControls

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


def write_files(
    targets: list[tuple[str, list[WriteItem]]],
    planner: SavePlanner,
    engine: Engine,
    pool: BufferPool,
    config: IOConfig,
    controls: SaveControls,
    copier: DeviceCopier,
) -> tuple[list[WriteResult], list[FileWritten]]:
    """Write each (path, items) target into a new file, all durably; return the items' results.

    The files' extents are interleaved, so files on different devices are
    written at the same time. ``controls.released()`` is called once no
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
    copier.prepare(pool, [it.source for _, items, _ in plans for it in items])

    files: list[DataFile] = []
    progress = Progress("save", sum(it.source.nbytes for _, items, _ in plans for it in items))
    window = Window(engine, pool, lambda extent, buffer: None, config.queue_depth + pool.count, progress)
    try:
        streams = []
        for path, items, size in plans:
            f = open_file(path, create=True, direct=config.direct_io)
            files.append(f)
            preallocate(f, size)
            pieces = (Piece(it.offset, it.source.nbytes, it, 0, it.source.memory) for it in items)
            streams.append(zip(itertools.repeat(f), plan_extents(pieces, f.align, pool.size, config.direct_min, None)))
        in_place = False  # whether a transfer reads tensor memory until it completes
        for f, extent in interleave(streams):
            controls.check()
            if extent.direct:
                it = extent.direct.owner
                it.crc = _cio.crc32c(extent.direct.memory, it.crc)
                buffer, data = None, extent.direct.memory
                in_place = True
            else:
                buffer = data = _fill(window.stage(extent.length), extent, copier)
            window.push(engine.write(f, data, extent.file_offset), extent, buffer)
        if not in_place:
            controls.released()
        window.finish()
        controls.released()
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


def _fill(buffer: memoryview, extent: Extent, copier: DeviceCopier) -> memoryview:
    """Copy a staged extent's parts into ``buffer`` at their positions; zero the rest.

    Device parts are copied by the copier while the host fills the rest,
    then checksummed as their copies complete.
    """
    batch = copier.issue(buffer, extent)
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
