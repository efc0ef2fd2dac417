"""The read pipeline: a rank's ``ReadItem``s out of the data files.

Per file, items are visited in storage order. For each, only the byte runs
its requested region occupies are read: a whole item is one run (and its
checksum is verified, where the catalogue has one), a slice along the first
dimensions is one shorter run, other boxes are one run per contiguous row segment; holes between runs are
read through rather than split while that adds at most 5% to the bytes read. Runs go
straight into the target tensor where its memory and the file offset are
co-aligned and ``IOConfig.direct_reads`` allows, else through staging
buffers (copied into place with their checksum in one pass), several
extents in flight; GPU targets always through the staging buffers, then
host-to-device on a side stream (``fp_dcp.gpu.loading``). Targets
are resolved lazily, just before their first bytes are read, and committed
as soon as their last bytes are in.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import math
import os
import stat
from collections import defaultdict, deque
from collections.abc import Iterator

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from .._native import _cio
from ..config import IOConfig
from ..errors import CorruptCheckpointError
from ..format import ItemLocation, checksum_mismatch, chunk_nbytes, describe_item
from ..io.buffers import BufferPool
from ..io.extents import Extent, Piece, interleave, plan_extents
from ..io.files import DataFile, ShortReadError, from_memory, in_place, open_file
from ..io.host_threads import BOUNCE
from ..io.prefault import NOTHING_PREPARED
from ..io.progress import Progress
from ..io.userfault import UserfaultFiller
from ..tensors import ByteSink
from .catalog import Catalog
from .context import ReadContext

__all__ = ["read_items"]

_MAX_WASTE = 0.05  # read through holes between needed runs while they add at most 5% to the bytes read
# Items are resolved, and their memory handed to the prefaulter, this far ahead of their reads: a second of
# reads on a fast disk, which a fault-in on one helper thread keeps up with (docs/benchmarks.md, "Figures
# behind design comments").
_LOOKAHEAD = 1 << 30
_MAX_RUNS = 4096  # beyond this many runs, read the whole stored chunk and narrow it in memory


def byte_runs(sizes: torch.Size, offsets: torch.Size, lengths: torch.Size, itemsize: int) -> list[tuple[int, int]]:
    """(start, length) byte runs, in order, of the box ``offsets``/``lengths`` of a C-order array."""
    ndim = len(sizes)
    if ndim == 0:
        return [(0, itemsize)]
    if 0 in lengths:
        return []
    k = ndim - 1  # dimensions after k are taken whole, so each run spans them
    while k > 0 and offsets[k] == 0 and lengths[k] == sizes[k]:
        k -= 1
    strides = [itemsize * math.prod(sizes[i + 1 :]) for i in range(ndim)]
    run = lengths[k] * strides[k]
    base = offsets[k] * strides[k]
    starts = [base]
    for d in range(k - 1, -1, -1):
        starts = [s + (offsets[d] + i) * strides[d] for i in range(lengths[d]) for s in starts]
        if len(starts) > _MAX_RUNS:
            return []
    starts.sort()
    runs: list[tuple[int, int]] = []
    for s in starts:
        if runs and runs[-1][0] + runs[-1][1] == s:
            runs[-1] = (runs[-1][0], runs[-1][1] + run)
        else:
            runs.append((s, run))
    return runs


class _Item:
    """One ReadItem in flight: where its bytes go and how many have arrived."""

    __slots__ = ("req", "location", "sink", "runs", "total", "done", "crc", "verify", "prepared")

    def __init__(self, req: ReadItem, location: ItemLocation) -> None:
        self.req = req
        self.location = location
        self.sink: ByteSink | memoryview | None = None
        self.runs: list[tuple[int, int]] = []
        self.total = 0
        self.done = 0
        self.crc = 0
        self.verify = False
        self.prepared = NOTHING_PREPARED  # its host memory being faulted in (``io.prefault``)

    def describe(self) -> str:
        return describe_item(self.req.storage_index, self.location)


def _prepare(item: _Item, planner: LoadPlanner, catalog: Catalog, verify: bool, ctx: ReadContext) -> None:
    """Resolve the item's destination (device targets through ``ctx.device_loads``) and the byte runs it needs."""
    req, loc = item.req, item.location
    if req.type == LoadItemType.BYTE_IO:
        item.sink = memoryview(bytearray(loc.length))
        item.runs = [(0, loc.length)] if loc.length else []
    else:
        key = (req.storage_index.fqn, tuple(req.storage_index.offset or ()))
        if key not in catalog.chunks:
            raise CorruptCheckpointError(f"the checkpoint metadata describes no chunk for {item.describe()}")
        sizes, dtype = catalog.chunks[key]
        itemsize = dtype.itemsize
        if chunk_nbytes(sizes, dtype) != loc.length:
            raise CorruptCheckpointError(
                f"stored length {loc.length} does not match shape {list(sizes)} of {dtype} for {item.describe()}"
            )
        target = planner.resolve_tensor(req).detach()
        if tuple(target.shape) != tuple(req.lengths):
            raise ValueError(
                f"target for {item.describe()} has shape {list(target.shape)}, "
                f"the checkpoint region is {list(req.lengths)}"
            )
        runs = byte_runs(sizes, req.storage_offsets, req.lengths, itemsize)
        uploads = ctx.device_loads
        if runs or 0 in req.lengths:
            on_device = uploads is not None and uploads.on_device(target)
            item.sink = ByteSink(target, dtype, req.lengths, on_device=on_device)
            if item.sink.device is not None and uploads is not None:
                uploads.prepare(ctx.pool, target.device)
            item.runs = runs
        else:  # too fragmented: read the chunk whole and narrow it in memory
            item.sink = ByteSink(target, dtype, sizes, (req.storage_offsets, req.lengths))
            item.runs = [(0, loc.length)]
    item.total = sum(n for _, n in item.runs)
    item.verify = verify and item.runs == [(0, loc.length)]


def _finish(item: _Item, planner: LoadPlanner) -> None:
    if item.verify and item.crc != item.location.crc32c:
        raise CorruptCheckpointError(checksum_mismatch(item.req.storage_index, item.location, item.crc))
    if isinstance(item.sink, memoryview):
        planner.load_bytes(item.req, io.BytesIO(item.sink.tobytes()))
    else:
        assert item.sink is not None
        planner.commit_tensor(item.req, item.sink.commit())


def fill_from_bytes(req: ReadItem, planner: LoadPlanner, catalog: Catalog, data: memoryview, ctx: ReadContext) -> int:
    """Complete ``req`` from ``data``, the whole stored item (another rank read it), checking its CRC-32C first
    where the catalogue has one.

    Returns the bytes of the region ``req`` asks for.
    """
    loc = catalog.location(req)
    item = _Item(req, loc)
    if len(data) != loc.length:
        raise CorruptCheckpointError(f"{item.describe()}: received {len(data)} bytes from a peer")
    if catalog.checksums and (crc := _cio.crc32c(data)) != loc.crc32c:
        raise CorruptCheckpointError(checksum_mismatch(req.storage_index, loc, crc) + " (as received from a peer)")
    _prepare(item, planner, catalog, False, ctx)
    device = _sink_device(item)
    at = 0
    for start, length in item.runs:
        region = data[start : start + length]
        if device is not None:  # received memory is pageable: a synchronous copy
            device[at : at + length].copy_(torch.frombuffer(region, dtype=torch.uint8))
        else:
            _sink_memory(item)[at : at + length] = region
        at += length
    _finish(item, planner)
    return item.total


def _sink_memory(item: _Item) -> memoryview:
    """The host memory the item's bytes go into (not for device sinks: ``_sink_device``)."""
    sink = item.sink
    memory = sink if isinstance(sink, memoryview) else sink.memory  # type: ignore[union-attr]
    assert memory is not None
    return memory


def _sink_device(item: _Item) -> torch.Tensor | None:
    """The item's bytes on a device, written by host-to-device copies; None for host sinks."""
    return item.sink.device if isinstance(item.sink, ByteSink) else None


def _ahead(
    items: list[_Item],
    planner: LoadPlanner,
    catalog: Catalog,
    verify: bool,
    ctx: ReadContext,
    filler: UserfaultFiller | None,
    lookahead: int,
) -> Iterator[_Item]:
    """The items, each resolved ``lookahead`` bytes before it is yielded, its host memory handed to the
    prefaulter then, so that its pages are in before its reads (or registered with ``filler``, where given:
    every read is staged); items with nothing to read are finished."""
    prefaulter = ctx.prefaulter
    waiting: deque[_Item] = deque()
    queued = 0
    for item in items:
        _prepare(item, planner, catalog, verify, ctx)
        if not item.total:
            waiting.append(item)
            continue
        if prefaulter is not None and _sink_device(item) is None:
            item.prepared = prefaulter.prepare(_sink_memory(item), filler)
        waiting.append(item)
        queued += item.total
        while waiting and queued - waiting[0].total >= lookahead:
            queued -= waiting[0].total
            yield from _ready(waiting.popleft(), planner)
    while waiting:
        yield from _ready(waiting.popleft(), planner)


def _ready(item: _Item, planner: LoadPlanner) -> Iterator[_Item]:
    if item.total:
        yield item
    else:
        _finish(item, planner)


def _pieces(items: Iterator[_Item], placement: str) -> Iterator[Piece]:
    """The items' runs, in order. ``placement``: ``"staged"`` (every run through the staging buffers),
    ``"in place"`` (runs of host targets straight into their memory) or ``"huge in place"`` (only the parts
    of host targets that the prefaulter asked huge pages for: memory in 4 KiB pages caps this disk's
    requests, memory in 2 MiB ones does not)."""
    for item in items:
        memory = _sink_memory(item) if placement != "staged" and _sink_device(item) is None else None
        direct = [(0, item.total)] if placement == "in place" else item.prepared.huge
        at = 0
        for start, length in item.runs:
            for lo, hi, inside in _cut(at, at + length, direct if memory is not None else []):
                run = memory[lo:hi] if inside and memory is not None else None
                yield Piece(item.location.offset + start + lo - at, hi - lo, item, lo, run)
            at += length


def _cut(lo: int, hi: int, spans: list[tuple[int, int]]) -> Iterator[tuple[int, int, bool]]:
    """``[lo, hi)`` cut at the edges of ``spans`` (sorted ``(offset, length)``): (start, end, inside a span)."""
    for offset, length in spans:
        start, end = max(lo, offset), min(hi, offset + length)
        if start >= end:
            continue
        if start > lo:
            yield lo, start, False
        yield start, end, True
        lo = end
    if lo < hi:
        yield lo, hi, False


def _open_all(items: list[_Item], catalog: Catalog, direct: bool | None) -> dict[str, DataFile]:
    files: dict[str, DataFile] = {}
    sizes: dict[str, int] = {}
    try:
        for item in items:
            name = item.location.file
            if name in files:
                continue
            path = catalog.paths.get(name)
            if path is None:
                raise CorruptCheckpointError(
                    f"the checkpoint footer does not list data file {name}, which holds {item.describe()}"
                )
            try:
                f = open_file(path, create=False, direct=direct)
            except FileNotFoundError:
                raise CorruptCheckpointError(f"data file {path} is missing; it holds {item.describe()}") from None
            files[name] = f
            status = os.fstat(f.fd)
            if not stat.S_ISREG(status.st_mode):  # a directory where the rules find the file
                raise CorruptCheckpointError(f"data file {path} is not a regular file; it holds {item.describe()}")
            sizes[name] = status.st_size
            expected = catalog.file_sizes.get(name)
            if expected is not None and sizes[name] < expected:
                raise CorruptCheckpointError(
                    f"data file {path} is truncated: {sizes[name]} bytes, written as {expected}; "
                    f"it holds {item.describe()}"
                )
        for item in items:
            if sizes[item.location.file] < item.location.offset + item.location.length:
                raise CorruptCheckpointError(f"data file {item.location.file} ends before the end of {item.describe()}")
    except BaseException:
        for f in files.values():
            f.close()
        raise
    return files


def _placement(config: IOConfig, f: DataFile, pool: BufferPool) -> str:
    """How runs of ``f`` reach host targets (``_pieces``)."""
    if in_place(config.direct_reads, f, pool):
        return "in place"
    return "huge in place" if config.direct_reads is None else "staged"


@dataclasses.dataclass(frozen=True)
class ReadCounts:
    """What one ``read_items`` call read: bytes from the files, the bytes needed, and requests issued."""

    read: int
    needed: int
    requests: int

    def __add__(self, other: ReadCounts) -> ReadCounts:
        return ReadCounts(self.read + other.read, self.needed + other.needed, self.requests + other.requests)


def read_items(requests: list[ReadItem], planner: LoadPlanner, catalog: Catalog, ctx: ReadContext) -> ReadCounts:
    """Read every request into its planner-resolved destination (device targets through ``ctx.device_loads``).

    Neighbouring items of a file are read with one request where the holes
    between them stay small (``_MAX_WASTE``), up to a staging buffer's size.
    ``ctx.verify``: check the CRC-32C of items read whole, where the catalogue has them.
    ``ctx.host_threads`` copy and checksum; ``ctx.prefaulter`` faults host targets in ahead of their reads
    (None: the reads and copies fault them in).
    """
    engine, pool, config, checksum, uploads = ctx.engine, ctx.pool, ctx.config, ctx.host_threads, ctx.device_loads
    verify = ctx.verify and catalog.checksums
    by_file: dict[str, list[_Item]] = defaultdict(list)
    for req in requests:
        loc = catalog.location(req)
        by_file[loc.file].append(_Item(req, loc))
    files = _open_all([it for items in by_file.values() for it in items], catalog, config.direct_io)

    def retire(extent: Extent, buffer: memoryview | None) -> None:
        if extent.direct is not None:
            item = extent.direct.owner
            if item.verify:
                item.crc = checksum.crc32c(extent.direct.memory, item.crc)
            _advance(item, extent.length)
            return
        assert buffer is not None
        on_device = []
        for part in extent.parts:
            owner, region = part.owner, buffer[part.buf_offset : part.buf_offset + part.length]
            device = _sink_device(owner)
            if device is None:
                dst = _sink_memory(owner)[part.owner_offset : part.owner_offset + part.length]
                owner.crc = checksum.copy_crc32c(dst, region, owner.crc, into=filler)
                _advance(owner, part.length)
                continue
            assert uploads is not None
            checked = owner if owner.verify else None  # on the device where it can, else on the host
            uploads.copy(region, device[part.owner_offset : part.owner_offset + part.length], checked, checksum)
            on_device.append(part)
        if on_device:
            assert uploads is not None
            uploads.settle()  # the buffer returns to the pool after this: no copy may still read it
            for part in on_device:
                _advance(part.owner, part.length)

    def _advance(item: _Item, n: int) -> None:
        item.done += n
        if item.done == item.total:
            _finish(item, planner)

    read = 0
    issued = 0
    progress = Progress("load", sum(it.location.length for items in by_file.values() for it in items))
    window = ctx.window(retire, progress)
    ends = {files[name].path: catalog.file_sizes.get(name) for name in by_file}  # safetensors files end mid-block
    lookahead = _LOOKAHEAD // max(1, len(by_file))
    filler: UserfaultFiller | None = None
    try:
        placements = {name: _placement(config, files[name], pool) for name in by_file}
        from_memory_files = {f.path for f in files.values() if from_memory(f)}
        if ctx.prefaulter is not None and "in place" not in placements.values():
            filler = UserfaultFiller()  # fills untouched targets page by page: no read goes straight into them
        streams = []
        for name, items in by_file.items():
            f = files[name]
            items.sort(key=lambda it: it.location.offset)
            ahead = _ahead(items, planner, catalog, verify, ctx, filler, lookahead)
            pieces = _pieces(ahead, placements[name])
            align = 1 if f.path in from_memory_files else f.align  # memory takes any offset, also with O_DIRECT
            extents = plan_extents(pieces, align, pool.size, config.direct_min, _MAX_WASTE)
            streams.append(zip(itertools.repeat(f), extents))
        for f, extent in interleave(streams):
            buffer: memoryview | None
            if extent.direct is not None:
                owner = extent.direct.owner
                owner.prepared.wait(extent.direct.owner_offset + extent.length)  # a read into it would fault
                if f.path in from_memory_files:  # the CPU copies: through a small buffer, the CRC in the same pass
                    window.settle()  # the item's earlier extents first: its CRC runs in file order
                    owner.crc = checksum.read_crc32c(f, extent.file_offset, extent.direct.memory, owner.crc)
                    window.count(extent)
                    _advance(owner, extent.length)
                    read += extent.length
                    issued += -(-extent.length // BOUNCE)
                    continue
                buffer, into = None, extent.direct.memory
            else:
                buffer = into = window.stage(extent.length)
            window.push(engine.read(f, into, extent.file_offset, ends[f.path]), extent, buffer)
            read += extent.length
            issued += -(-extent.length // config.block_size)  # the engine splits at block_size
        window.finish()
    except ShortReadError as e:
        window.abort()
        raise CorruptCheckpointError(f"{e.filename}: {e.strerror}") from None
    except BaseException:
        window.abort()
        raise
    finally:
        for f in files.values():
            f.close()
        if filler is not None:
            filler.close()  # after the last copy: no page of a target waits on a fill from here on
    needed = sum(it.total for items in by_file.values() for it in items)
    return ReadCounts(read, needed, issued)
