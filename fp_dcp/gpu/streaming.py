"""Streaming GPU tensors to disk: device-to-host copies on side streams, pipelined with the writes.

The write pipeline hands each staging buffer's GPU parts to
``StreamingCopier.issue``; they are copied device-to-host on a dedicated
CUDA stream per device straight into the writer's pool buffers (page-locked
once with cudaHostRegister), in pieces of ``staging_chunk`` bytes, while
the buffers filled before are on their way to disk. Small parts sharing a
buffer are first gathered on the GPU (``fp_dcp.gpu.gather``) and cross the
bus in one copy. Each buffer's GPU parts are checksummed on their GPU
before they cross, in one launch (``fp_dcp.gpu.crc``); where that kernel
cannot run, or an incremental save hashes the bytes anyway, the host
checksums each piece as soon as it lands, while the next pieces still
cross. Host memory: the pool, whatever the size of the state.

Stream semantics: a side stream waits for an event recorded on the stream
that produced the values (the caller's current stream when the save starts),
never the other way round, so training kernels are not held up by it; every
source tensor, and every buffer a copy reads or writes, stays referenced
until the host has waited for that copy's event.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .._native import _cio
from ..config import IOConfig
from ..io.buffers import BufferPool
from ..io.extents import Extent, Part
from ..tensors import ByteSource, plain_layout
from .copier import DeviceCopier
from .crc import Checksums
from .memory import SideStream, page_lock
from .route import DeviceRoute
from .snapshot import Snapshot

__all__ = ["Staging", "CopyBatch", "StreamingCopier"]


class Staging(DeviceRoute):
    """A writer's GPU staging: side streams, its page-locked pool, the device kernels, the snapshot.

    Created cheaply with the writer; CUDA is touched only once a save holds
    GPU tensors. Which tensors it copies and which memory it page-locks is
    the ``DeviceRoute``'s (tests route CPU tensors through it:
    ``tests/cuda_double.py``). Page-locked memory belongs to the pools it
    lives in (``memory.page_lock``), so dropping a ``Staging`` without
    ``close`` leaks nothing.
    """

    def __init__(self, config: IOConfig) -> None:
        super().__init__(config)
        self._streams: dict[torch.device, SideStream] = {}
        self._snapshot: Snapshot | None = None
        self.pinned: bool | None = None  # whether the last pool of a GPU save is page-locked

    def flat(self, source: ByteSource) -> torch.Tensor | None:
        """The source's bytes as one flat uint8 tensor on its device, or None if they are not contiguous there."""
        t = source.device_tensor
        if t is None or not plain_layout(t):
            return None
        return t.reshape(-1).view(torch.uint8)

    def side_stream(self, device: torch.device) -> SideStream:
        side = self._streams.get(device)
        if side is None:
            side = self._streams[device] = SideStream(device, self.config.buffer_size, self.page_locks(device))
        return side

    @property
    def snapshot(self) -> Snapshot:
        """The writer's snapshot arena (``mode="snapshot"``), with side streams of its own."""
        if self._snapshot is None:
            self._snapshot = Snapshot(self)
        return self._snapshot

    def pin(self, pool: BufferPool) -> None:
        """Page-lock the writer's pool buffers (once per pool), so device-to-host copies into them are asynchronous."""
        self.pinned = page_lock(pool)

    def copier(self, ready: dict[torch.device, torch.cuda.Event] | None = None) -> StreamingCopier:
        """The ``DeviceCopier`` of one save; ``ready``: events the side streams wait for (async saves)."""
        return StreamingCopier(self, ready or {})

    def close(self) -> None:
        """Release the snapshot arena, landing areas and device scratch now (garbage collection would too)."""
        if self._snapshot is not None:
            self._snapshot.close()
            self._snapshot = None
        for side in self._streams.values():
            side.close()
        self._streams.clear()


def _crc(owner: Any, region: memoryview) -> None:
    owner.crc = _cio.crc32c(region, owner.crc, owner.hasher)


def _copy_crc(owner: Any, region: memoryview, landed: memoryview) -> None:
    owner.crc = _cio.copy_crc32c(region, landed, owner.crc, owner.hasher)


def _copy(region: memoryview, landed: memoryview) -> None:
    region[:] = landed  # checksummed on the device


def _copy_through_host(side: SideStream, part: Part, region: memoryview) -> None:
    # Not contiguous on the device: the host path materializes it slab by slab,
    # here on the side stream, so it is ordered after the values were produced.
    with side.context():
        part.owner.crc = part.owner.source.copy_into(region, part.owner_offset, part.owner.crc, part.owner.hasher)


class CopyBatch:
    """The device-to-host copies of one staging buffer's GPU parts, in flight until ``complete``."""

    def __init__(self) -> None:
        self.owners: set[int] = set()
        self.steps: list[tuple[torch.cuda.Event | None, Callable[[], None] | None]] = []
        self.keep: list[Any] = []  # what the queued copies read or write: referenced until they are done

    def __contains__(self, owner: object) -> bool:
        return id(owner) in self.owners

    def then(self, event: torch.cuda.Event | None, action: Callable[[], None] | None) -> None:
        """Run ``action`` (a checksum, a copy out of the landing area), if any, once ``event`` has completed."""
        self.steps.append((event, action))

    def complete(self) -> None:
        """Wait for each copy in turn and checksum what it brought, while later copies still run."""
        for event, action in self.steps:
            if event is not None:
                event.synchronize()
            if action is not None:
                action()
        self.steps.clear()
        self.keep.clear()

    def wait(self) -> None:
        """Only wait for the copies (failure paths): no transfer may outlive the buffer it writes."""
        for event, _ in self.steps:
            if event is not None:
                event.synchronize()


class StreamingCopier(DeviceCopier):
    """One save's device-to-host copies: each staging buffer's GPU parts, on the side streams."""

    def __init__(self, staging: Staging, ready: dict[torch.device, torch.cuda.Event]) -> None:
        self.staging = staging
        self.ready = ready
        self.devices: set[torch.device] = set()

    def copies(self, tensor: torch.Tensor) -> bool:
        return self.staging.on_device(tensor)

    def prepare(self, pool: BufferPool, sources: Iterable[ByteSource]) -> None:
        """Before the first read of a device tensor: streams wait for the values; the pool gets page-locked.

        Both the side streams and the current stream wait: incremental saves read device tensors to hash
        them through the current (default) stream.
        """
        staging = self.staging
        self.devices = {s.device_tensor.device for s in sources if s.device_tensor is not None}
        if any(map(staging.page_locks, self.devices)):
            staging.pin(pool)
        for device in self.devices:
            side = staging.side_stream(device)
            event = self.ready.get(device)
            if event is None:  # dcp.save: this thread's stream made the values
                event = side.caller_event()
            else:  # async_save: the values were made on the training thread's stream
                side.hold_caller(event)
            side.wait_for(event)

    def describe(self) -> str:
        if not self.devices:
            return "none"
        unpinned = " (host memory pageable: page-locking was refused)" if self.staging.pinned is False else ""
        return (
            f"side streams on {', '.join(sorted(map(str, self.devices)))}{unpinned}; "
            f"small parts: {self.staging.gather_backend}; checksums: {self.staging.crc_backend}"
        )

    def issue(self, buffer: memoryview, extent: Extent) -> CopyBatch | None:
        """Queue the checksums and copies of the extent's GPU parts into ``buffer``; None when it has none.

        The parts are then this batch's: the caller fills the other parts on
        the host meanwhile, and ``complete`` finishes their checksums.
        """
        if not self.devices:
            return None
        staging = self.staging
        parts = [p for p in extent.parts if p.owner.source.device_tensor is not None]
        if not parts:
            return None
        batch = CopyBatch()
        gather_max = min(staging.config.gather_max, staging.config.buffer_size)
        small: dict[SideStream, list[tuple[Part, torch.Tensor]]] = {}
        single: list[tuple[SideStream, Part, torch.Tensor]] = []
        checks: dict[SideStream, Checksums] = {}
        for part in parts:
            batch.owners.add(id(part.owner))
            source = part.owner.source
            side = staging.side_stream(source.device_tensor.device)
            flat = staging.flat(source)
            if flat is None:
                region = buffer[part.buf_offset : part.buf_offset + part.length]
                batch.then(None, functools.partial(_copy_through_host, side, part, region))
                continue
            data = flat[part.owner_offset : part.owner_offset + part.length]
            # An incremental save's XXH3-128 is computed on the host, and the CRC with it in the same pass.
            if part.owner.hasher is None and staging.crc().ready(side):
                checks.setdefault(side, Checksums(staging.crc(), side)).add(part.owner, data)
            if part.length <= gather_max:
                small.setdefault(side, []).append((part, data))
            else:
                single.append((side, part, data))
        for side, check in checks.items():  # before the copies: the checksums are of the bytes on the device
            check.launch(batch.keep)
            batch.then(side.record(), check.fold)
        on_device = {id(owner) for check in checks.values() for owner in check.owners}
        for side, group in small.items():
            if len(group) == 1:  # nothing to coalesce
                single.append((side, *group[0]))
            else:
                self._gather(batch, buffer, side, group, on_device)
        for side, part, data in single:
            self._copy(batch, buffer, side, part, data, id(part.owner) in on_device)
        return batch

    def _gather(
        self,
        batch: CopyBatch,
        buffer: memoryview,
        side: SideStream,
        group: list[tuple[Part, torch.Tensor]],
        on_device: set[int],
    ) -> None:
        # Parts keep their buffer offsets in the device scratch and in the landing
        # area (both one buffer long); the span between the first and last crosses
        # in one copy, and each part is then copied into place (with its checksum,
        # unless the device computed it).
        start = group[0][0].buf_offset
        end = group[-1][0].buf_offset + group[-1][0].length
        landing = side.landing
        with side.context():
            self.staging.gather()(side, [(data, part.buf_offset) for part, data in group], side.scratch, batch.keep)
            landing.tensor[start:end].copy_(side.scratch[start:end], non_blocking=True)
            event = side.record()
        batch.keep += [data for _, data in group]
        for part, _ in group:
            lo, hi = part.buf_offset, part.buf_offset + part.length
            region, landed = buffer[lo:hi], landing.view[lo:hi]
            if id(part.owner) in on_device:
                batch.then(event, functools.partial(_copy, region, landed))
            else:
                batch.then(event, functools.partial(_copy_crc, part.owner, region, landed))

    def _copy(
        self, batch: CopyBatch, buffer: memoryview, side: SideStream, part: Part, data: torch.Tensor, on_device: bool
    ) -> None:
        chunk = self.staging.config.staging_chunk
        with side.context():
            for start in range(0, part.length, chunk):
                lo = part.buf_offset + start
                hi = min(lo + chunk, part.buf_offset + part.length)
                target = torch.frombuffer(buffer[lo:hi], dtype=torch.uint8)
                target.copy_(data[start : start + hi - lo], non_blocking=True)
                batch.keep += [target, data]
                batch.then(side.record(), None if on_device else functools.partial(_crc, part.owner, buffer[lo:hi]))
