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

``load.read_plan`` plans the reads (which extent goes where, ``Route``);
here they run: the engine's reads through a ``Window`` (``_RingReads``),
copies out of files in memory by the host threads (``_MemoryReads``), and,
as the engine's reads retire, the copies out of the staging buffers into
host and device targets (``_Retire``).
"""

from __future__ import annotations

import dataclasses

from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem

from ..errors import CorruptCheckpointError
from ..io.buffers import ScratchBuffer
from ..io.extents import Direct, Extent, Part, Window
from ..io.files import DataFile, ShortReadError, read_all
from ..io.host_threads import BOUNCE
from ..io.progress import Progress
from .catalog import Catalog
from .context import ReadContext
from .read_plan import ReadPlan, Route
from .targets import Target

__all__ = ["ReadCounts", "read_items"]


@dataclasses.dataclass(frozen=True)
class ReadCounts:
    """What one ``read_items`` call read: bytes from the files, the bytes needed, requests issued, and the bytes
    read into a buffer (the staging pool's, or from memory a scratch one) and copied into place (the rest went
    straight into targets)."""

    read: int
    needed: int
    requests: int
    staged: int = 0

    def __add__(self, other: ReadCounts) -> ReadCounts:
        return ReadCounts(
            self.read + other.read,
            self.needed + other.needed,
            self.requests + other.requests,
            self.staged + other.staged,
        )


def read_items(requests: list[ReadItem], planner: LoadPlanner, catalog: Catalog, ctx: ReadContext) -> ReadCounts:
    """Read every request into its planner-resolved destination (device targets through ``ctx.device_loads``).

    Neighbouring items of a file are read with one request where the holes
    between them stay small (``read_plan._MAX_WASTE``), up to a staging buffer's size.
    ``ctx.verify``: check the CRC-32C of items read whole, where the catalogue has them.
    ``ctx.host_threads`` copy and checksum; ``ctx.prefaulter`` faults host targets in ahead of their reads
    (None: the reads and copies fault them in).
    """
    plan = ReadPlan(requests, catalog, ctx)
    progress = Progress("load", plan.total)
    retire = _Retire(ctx, plan, planner)
    window = ctx.window(retire, progress)
    ring = _RingReads(ctx, window, plan.ends)
    memory = _MemoryReads(ctx, window, retire, planner)
    try:
        for f, extent, route in plan.extents(planner):
            if route is Route.STAGED:
                ring.staged(f, extent)
            elif extent.direct is None:
                memory.staged(f, extent)
            else:
                target = extent.direct.owner
                target.prepared.wait(extent.direct.owner_offset + extent.length)  # a read into it would fault
                if route is Route.FROM_MEMORY:
                    memory.read(f, extent, extent.direct)
                else:
                    ring.in_place(f, extent, extent.direct)
        window.finish()
    except ShortReadError as e:
        window.abort()
        raise CorruptCheckpointError(f"{e.filename}: {e.strerror}") from None
    except BaseException:
        window.abort()
        raise
    finally:
        plan.close()
    return ReadCounts(
        ring.read_bytes + memory.read_bytes,
        plan.needed,
        ring.issued + memory.issued,
        ring.staged_bytes + memory.staged_bytes,
    )


class _RingReads:
    """The engine's reads: into a staging buffer, or straight into a target's memory, several in flight."""

    def __init__(self, ctx: ReadContext, window: Window, ends: dict[str, int | None]) -> None:
        self.engine = ctx.engine
        self.block_size = ctx.config.block_size
        self.window = window
        self.ends = ends  # where each file may end (a safetensors file ends inside its last block)
        self.read_bytes = 0
        self.staged_bytes = 0
        self.issued = 0

    def staged(self, f: DataFile, extent: Extent) -> None:
        buffer = self.window.stage(extent.length)
        self._push(f, extent, buffer, buffer)
        self.staged_bytes += extent.length

    def in_place(self, f: DataFile, extent: Extent, run: Direct) -> None:
        self._push(f, extent, run.memory, None)

    def _push(self, f: DataFile, extent: Extent, into: memoryview, buffer: memoryview | None) -> None:
        self.window.push(self.engine.read(f, into, extent.file_offset, self.ends[f.path]), extent, buffer)
        self.read_bytes += extent.length
        self.issued += -(-extent.length // self.block_size)  # the engine splits at block_size


class _MemoryReads:
    """Runs of files in memory, where a read is a copy the CPU makes: the host threads copy them straight into
    the target through a small buffer each, the CRC in the same pass; extents of small items through a
    ``ScratchBuffer``, so that a load from memory never maps the staging pool."""

    def __init__(self, ctx: ReadContext, window: Window, retire: _Retire, planner: LoadPlanner) -> None:
        self.host_threads = ctx.host_threads
        self.window = window
        self.retire = retire
        self.planner = planner
        self.scratch = ScratchBuffer()
        self.read_bytes = 0
        self.staged_bytes = 0
        self.issued = 0

    def staged(self, f: DataFile, extent: Extent) -> None:
        self.window.settle()  # the earlier extents of its items first: their CRCs run in file order
        buffer = self.scratch.take(extent.length)
        read_all(f, buffer, extent.file_offset)
        self.retire(extent, buffer)
        self.window.count(extent)
        self.read_bytes += extent.length
        self.staged_bytes += extent.length
        self.issued += 1

    def read(self, f: DataFile, extent: Extent, run: Direct) -> None:
        target = run.owner
        self.window.settle()  # the target's earlier extents first: its CRC runs in file order
        target.crc = self.host_threads.read_crc32c(f, extent.file_offset, run.memory, target.crc)
        self.window.count(extent)
        target.advance(extent.length, self.planner)
        self.read_bytes += extent.length
        self.issued += -(-extent.length // BOUNCE)


class _Retire:
    """What happens as the engine's reads complete, oldest first: a run read in place has its CRC-32C checked
    (where verified); a staging buffer's parts are copied out, into host targets with their CRC-32C in the
    same pass (through the plan's userfaultfd filler, where there is one), into device targets through the
    device loads, settled before the buffer returns to the pool."""

    def __init__(self, ctx: ReadContext, plan: ReadPlan, planner: LoadPlanner) -> None:
        self.host_threads = ctx.host_threads
        self.device_loads = ctx.device_loads
        self.plan = plan
        self.planner = planner

    def __call__(self, extent: Extent, buffer: memoryview | None) -> None:
        if extent.direct is not None:
            target = extent.direct.owner
            if target.verify:
                target.crc = self.host_threads.crc32c(extent.direct.memory, target.crc)
            target.advance(extent.length, self.planner)
            return
        assert buffer is not None
        on_device = [part for part in extent.parts if not self._to_host(part, buffer)]
        if on_device:
            assert self.device_loads is not None
            self.device_loads.settle()  # the buffer returns to the pool after this: no copy may still read it
            for part in on_device:
                part.owner.advance(part.length, self.planner)

    def _to_host(self, part: Part, buffer: memoryview) -> bool:
        """Copy ``part`` out of ``buffer`` into a host target (False: its target is on a device, and its copy
        is queued there)."""
        owner: Target = part.owner
        region = buffer[part.buf_offset : part.buf_offset + part.length]
        device = owner.device
        if device is None:
            dst = owner.memory[part.owner_offset : part.owner_offset + part.length]
            owner.crc = self.host_threads.copy_crc32c(dst, region, owner.crc, into=self.plan.filler)
            owner.advance(part.length, self.planner)
            return True
        assert self.device_loads is not None
        checked = owner if owner.verify else None  # on the device where it can, else on the host
        target = device[part.owner_offset : part.owner_offset + part.length]
        self.device_loads.copy(region, target, checked, self.host_threads)
        return False
