"""The write pipeline: one rank's ``WriteItem``s into its data files.

Every item is resolved and checked before a file is created, so bad input
fails before a byte is written. Items are laid out (``format.layout``), the
file is preallocated (an early, clean ENOSPC), and the extents are written
through the engine: large runs straight from tensor memory, the rest copied
(with its checksum computed in the same pass) into staging buffers, while
earlier extents are still on their way to disk. Where every write is a
copy the kernel makes (tmpfs, the page cache), the host threads write them
instead (``save.thread_writes``). The file is fsynced before
the results are returned; on any failure the files are removed.

Everything a save writes with comes in one ``WriteContext``: the engine, its
pool and the host threads, the settings, a ``DeviceCopier`` that copies the
device parts of staged extents (the CPU one copies nothing;
``fp_dcp.gpu.streaming`` has the GPU one), and the save's ``SaveControls``,
which can cancel it between extents and are told when every source has been
read.

In an incremental save (``fp_dcp.save.incremental``) the items unchanged
since its base are found first and only referenced; the others are written,
their XXH3-128 computed in the same pass as their CRC-32C.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import os
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from .._native import _cio
from ..format import ItemLocation, layout, stored_nbytes
from ..gpu.copier import DeviceCopier
from ..io.dealing import deal
from ..io.extents import Extent, Piece, Window, interleave, plan_extents
from ..io.files import DataFile, in_place, open_file
from ..io.progress import Progress
from ..tensors import ByteSource, check_storable
from .context import WriteContext
from .filling import fill, zero_file, zero_stale
from .incremental import Incremental, sample_digest
from .thread_writes import threads_write, write_by_threads

__all__ = ["FileWritten", "Placed", "Item", "resolve", "write_files", "write_laid_out"]


@dataclass
class FileWritten:
    name: str
    size: int
    payload: int  # item bytes, without padding
    direct: bool


class Placed:
    """Bytes to write at ``offset`` of a file, from ``source``; their CRC-32C is computed on the way."""

    __slots__ = ("source", "offset", "crc", "hasher")

    def __init__(self, source: ByteSource, offset: int = 0) -> None:
        self.source = source
        self.offset = offset
        self.crc = 0
        self.hasher: _cio.Hash128 | None = None  # incremental saves: fed wherever crc is


class Item(Placed):
    """A planned item's bytes."""

    __slots__ = ("write_item", "sample")

    def __init__(self, write_item: WriteItem, source: ByteSource) -> None:
        super().__init__(source)
        self.write_item = write_item
        self.sample: str | None = None  # incremental saves: its sample's hash

    def location(self, name: str) -> ItemLocation:
        digest = self.hasher.hexdigest() if self.hasher is not None else None
        return ItemLocation(name, self.offset, self.source.nbytes, self.crc, digest, self.sample)


def resolve(write_item: WriteItem, planner: SavePlanner, slab_bytes: int, copier: DeviceCopier) -> Item:
    fqn = write_item.index.fqn
    data = planner.resolve_data(write_item)
    if write_item.type == WriteItemType.BYTE_IO:
        if not isinstance(data, io.BytesIO):
            raise TypeError(f"planner resolved {fqn!r} to {type(data).__name__}, expected io.BytesIO")
        return Item(write_item, ByteSource(data, slab_bytes))
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"planner resolved {fqn!r} to {type(data).__name__}, expected a tensor")
    check_storable(data, fqn)
    source = ByteSource(data, slab_bytes, copier.copies(data))
    expected = stored_nbytes(write_item)
    if source.nbytes != expected:
        raise ValueError(f"{fqn!r}: the plan expects {expected} bytes but the tensor holds {source.nbytes}")
    return Item(write_item, source)


def _split(items: list[Item], n: int) -> list[list[Item]]:
    """Deal items into ``n`` groups of near-equal bytes (objects count as none), keeping plan order within each."""
    sizes = [stored_nbytes(it.write_item) or 0 for it in items]
    owners, _ = deal(sizes, [range(n)] * len(items), n)
    groups: list[list[Item]] = [[] for _ in range(n)]
    for item, group in zip(items, owners, strict=True):
        groups[group].append(item)
    return groups


def _pieces(item: Placed, from_tensor: bool, most: int) -> Iterator[Piece]:
    """``item``'s bytes as pieces for ``plan_extents``: written from its memory (``from_tensor``), runs of at
    most ``most`` bytes, one request each. Interleaved with the other files' runs, a large item then holds
    only its share of the requests in flight, not all of them: the other files' devices, or on tmpfs the
    kernel's other workers (each copies into one file at a time), keep busy."""
    memory = item.source.memory if from_tensor else None
    if memory is None or item.source.nbytes <= most:
        yield Piece(item.offset, item.source.nbytes, item, 0, memory)
        return
    for at in range(0, item.source.nbytes, most):
        n = min(most, item.source.nbytes - at)
        yield Piece(item.offset + at, n, item, at, memory[at : at + n])


def write_files(
    write_items: list[WriteItem],
    paths: list[str],
    planner: SavePlanner,
    ctx: WriteContext,
    incremental: Incremental | None = None,
    reuse: Callable[[list[str]], Collection[str]] | None = None,
) -> tuple[list[WriteResult], list[FileWritten]]:
    """Write the items, dealt over new files at ``paths`` (those that get none are not made), durably.

    ``reuse`` is given the paths that get items and puts files there (taken
    over from a retired checkpoint, ``fp_dcp.save.spare``); it returns those
    it put, which are overwritten instead of made.

    Returns the items' results, whose ``storage_data`` is (an ``ItemLocation``
    as a tuple, whether it is a reference into the incremental base).
    """
    resolved = [resolve(wi, planner, ctx.pool.size, ctx.copier) for wi in write_items]
    ctx.copier.prepare(ctx.pool, [it.source for it in resolved])
    references: dict[int, ItemLocation] = {}
    if incremental is not None:
        tensors = [it for it in resolved if it.write_item.type != WriteItemType.BYTE_IO]
        for it in tensors:
            it.sample = sample_digest(it.source)
        references = incremental.unchanged(
            [(it.write_item, it.source) for it in resolved], [it.sample for it in resolved]
        )
    to_write = [it for position, it in enumerate(resolved) if position not in references]
    if incremental is not None:
        for it in to_write:
            it.hasher = _cio.Hash128()
    plans = []
    for path, items in zip(paths, _split(to_write, len(paths)), strict=True):
        if not items:
            continue
        offsets, size = layout([(it.source.nbytes, it.source.address) for it in items], ctx.config.direct_min)
        for it, offset in zip(items, offsets, strict=True):
            it.offset = offset
        plans.append((path, items, size))

    reused = reuse([path for path, _, _ in plans]) if reuse is not None else ()
    directs = write_laid_out(plans, ctx, reused)

    results = []
    written = []
    for (path, items, size), direct in zip(plans, directs, strict=True):
        name = os.path.basename(path)
        for it in items:
            location = it.location(name)
            results.append(WriteResult(it.write_item.index, it.source.nbytes, (tuple(location), False)))
        written.append(FileWritten(name, size, sum(it.source.nbytes for it in items), direct))
    for position, location in references.items():
        it = resolved[position]
        location = location._replace(xxh3_sample=it.sample or location.xxh3_sample)  # the same bytes: the same sample
        results.append(WriteResult(it.write_item.index, it.source.nbytes, (tuple(location), True)))
    return results, written


def write_laid_out(
    plans: Sequence[tuple[str, Sequence[Placed], int]], ctx: WriteContext, reused: Collection[str] = ()
) -> list[bool]:
    """Create each file ``(path, items, size)``, write its items (in file order) at their offsets, make it
    ``size`` bytes, durably. A path in ``reused`` is an existing file, overwritten: its old bytes outside the
    new extents are zeroed, so that it reads as a new file would.

    The files' extents are interleaved, so files on different devices are
    written at the same time; where the kernel copies every byte (tmpfs, the
    page cache) the host threads write them, each its own files
    (``save.thread_writes``). The bytes between items are zeros. On failure
    every file is removed. ``ctx.controls.released()`` is called once no
    transfer reads tensor memory any more: after the last staged extent was
    filled or, when extents were written straight from tensor memory, once
    those writes completed. Returns whether each file was written with O_DIRECT.
    """
    engine, pool, config = ctx.engine, ctx.pool, ctx.config
    files: list[DataFile] = []
    progress = Progress("save", sum(it.source.nbytes for _, items, _ in plans for it in items))
    window = ctx.window(lambda extent, buffer: None, progress)
    try:
        for path, _, _ in plans:
            files.append(open_file(path, create=True, direct=config.direct_io, reuse=path in reused))
        stale = {f: 0 for f in files if f.path in reused}  # reused files: where their old bytes start
        engine.preallocate(files, [size for _, _, size in plans], ctx.host_threads.count)  # an early, clean ENOSPC
        extents = []
        for f, (_, items, _) in zip(files, plans, strict=True):
            from_tensors = in_place(config.direct_writes, f, pool)
            pieces = [piece for it in items for piece in _pieces(it, from_tensors, config.block_size)]
            extents.append(plan_extents(pieces, f.align, pool.size, config.direct_min, None))
        on_host = all(it.source.device_tensor is None for _, items, _ in plans for it in items)
        if threads_write(ctx, files, on_host):
            write_by_threads(files, [list(e) for e in extents], stale, ctx, progress)
            progress.finish()
        else:
            _write_through_ring(files, extents, stale, window, ctx)
        ctx.controls.released()
        for f, (_, _, size) in zip(files, plans, strict=True):
            if os.fstat(f.fd).st_size != size:
                os.ftruncate(f.fd, size)  # O_DIRECT wrote the last block whole, past a size that ends inside it
            if f in stale:
                zero_file(f, stale[f], size)
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
    return [f.direct for f in files]


def _write_through_ring(
    files: list[DataFile],
    extents: list[Iterator[Extent]],
    stale: dict[DataFile, int],
    window: Window,
    ctx: WriteContext,
) -> None:
    """Write the files' extents through the engine, the files in turn, ``window`` keeping several in flight."""
    engine, controls, host_threads = ctx.engine, ctx.controls, ctx.host_threads
    reads_tensors = False  # whether a transfer reads tensor memory until it completes
    for f, extent in interleave([zip(itertools.repeat(f), e) for f, e in zip(files, extents, strict=True)]):
        controls.check()
        zero_stale(f, stale, extent)
        if extent.direct:
            it = extent.direct.owner
            window.push(engine.write(f, extent.direct.memory, extent.file_offset), extent, None)
            it.crc = host_threads.crc32c(extent.direct.memory, it.crc, it.hasher)  # while the write is in flight
            reads_tensors = True
        else:
            buffer = fill(window.stage(extent.length), extent, ctx.copier, host_threads)
            window.push(engine.write(f, buffer, extent.file_offset), extent, buffer)
    if not reads_tensors:
        controls.released()
    window.finish()
