"""Where a load's bytes go: each ``ReadItem``'s destination, the byte runs of the stored item it needs, and its
commit once they are all in (``Target``); and requests completed from bytes another rank read
(``fill_from_bytes``)."""

from __future__ import annotations

import io
import math

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from .._native import _cio
from ..errors import CorruptCheckpointError
from ..format import ItemLocation, checksum_mismatch, chunk_nbytes, describe_item
from ..io.prefault import NOTHING_PREPARED
from ..tensors import ByteSink
from .catalog import Catalog
from .context import ReadContext

__all__ = ["byte_runs", "Target", "fill_from_bytes"]

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


class Target:
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

    def resolve(self, planner: LoadPlanner, catalog: Catalog, ctx: ReadContext, verify: bool) -> None:
        """Resolve the destination (device targets through ``ctx.device_loads``) and the byte runs it needs;
        ``verify``: check its CRC-32C where it is read whole."""
        req, loc = self.req, self.location
        if req.type == LoadItemType.BYTE_IO:
            self.sink = memoryview(bytearray(loc.length))
            self.runs = [(0, loc.length)] if loc.length else []
        else:
            key = (req.storage_index.fqn, tuple(req.storage_index.offset or ()))
            if key not in catalog.chunks:
                raise CorruptCheckpointError(f"the checkpoint metadata describes no chunk for {self.describe()}")
            sizes, dtype = catalog.chunks[key]
            itemsize = dtype.itemsize
            if chunk_nbytes(sizes, dtype) != loc.length:
                raise CorruptCheckpointError(
                    f"stored length {loc.length} does not match shape {list(sizes)} of {dtype} for {self.describe()}"
                )
            target = planner.resolve_tensor(req).detach()
            if tuple(target.shape) != tuple(req.lengths):
                raise ValueError(
                    f"target for {self.describe()} has shape {list(target.shape)}, "
                    f"the checkpoint region is {list(req.lengths)}"
                )
            runs = byte_runs(sizes, req.storage_offsets, req.lengths, itemsize)
            loads = ctx.device_loads
            if runs or 0 in req.lengths:
                on_device = loads is not None and loads.on_device(target)
                self.sink = ByteSink(target, dtype, req.lengths, on_device=on_device)
                if self.sink.device is not None and loads is not None:
                    loads.prepare(ctx.pool, target.device)
                self.runs = runs
            else:  # too fragmented: read the chunk whole and narrow it in memory
                self.sink = ByteSink(target, dtype, sizes, (req.storage_offsets, req.lengths))
                self.runs = [(0, loc.length)]
        self.total = sum(n for _, n in self.runs)
        self.verify = verify and self.runs == [(0, loc.length)]

    @property
    def memory(self) -> memoryview:
        """The host memory the bytes go into (not for device sinks: ``device``)."""
        sink = self.sink
        memory = sink if isinstance(sink, memoryview) else sink.memory  # type: ignore[union-attr]
        assert memory is not None
        return memory

    @property
    def device(self) -> torch.Tensor | None:
        """The bytes on a device, written by host-to-device copies; None for host sinks."""
        return self.sink.device if isinstance(self.sink, ByteSink) else None

    def advance(self, n: int, planner: LoadPlanner) -> None:
        """``n`` more bytes are in; the last ones finish it."""
        self.done += n
        if self.done == self.total:
            self.finish(planner)

    def finish(self, planner: LoadPlanner) -> None:
        """Check the CRC-32C (where verified) and hand the bytes to the planner."""
        if self.verify and self.crc != self.location.crc32c:
            raise CorruptCheckpointError(checksum_mismatch(self.req.storage_index, self.location, self.crc))
        if isinstance(self.sink, memoryview):
            planner.load_bytes(self.req, io.BytesIO(self.sink.tobytes()))
        else:
            assert self.sink is not None
            planner.commit_tensor(self.req, self.sink.commit())


def fill_from_bytes(req: ReadItem, planner: LoadPlanner, catalog: Catalog, data: memoryview, ctx: ReadContext) -> int:
    """Complete ``req`` from ``data``, the whole stored item (another rank read it), checking its CRC-32C first
    where the catalogue has one.

    Returns the bytes of the region ``req`` asks for.
    """
    loc = catalog.location(req)
    target = Target(req, loc)
    if len(data) != loc.length:
        raise CorruptCheckpointError(f"{target.describe()}: received {len(data)} bytes from a peer")
    if catalog.checksums and (crc := _cio.crc32c(data)) != loc.crc32c:
        raise CorruptCheckpointError(checksum_mismatch(req.storage_index, loc, crc) + " (as received from a peer)")
    target.resolve(planner, catalog, ctx, False)
    device = target.device
    at = 0
    for start, length in target.runs:
        region = data[start : start + length]
        if device is not None:  # received memory is pageable: a synchronous copy
            device[at : at + length].copy_(torch.frombuffer(region, dtype=torch.uint8))
        else:
            target.memory[at : at + length] = region
        at += length
    target.finish(planner)
    return target.total
