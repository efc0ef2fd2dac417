"""Loads into GPU tensors: reads land in page-locked staging buffers and cross to the device on side streams.

The read pipeline reads the bytes of device targets into the reader's pool
buffers (page-locked once, ``memory.page_lock``), and hands each buffer's
parts to ``DeviceLoads.copy``: the host-to-device copies are queued on the
device's side stream while the next reads are in flight, and ``settle``
waits for the copies before the buffer goes back to the pool (a buffer
crosses the bus long before the disk fills the next: docs/benchmarks.md,
"Figures behind design comments"). The parts of items
whose checksum is verified are checksummed where they landed, on the device,
by one launch per buffer after its copies (``fp_dcp.gpu.crc``); where that
kernel cannot run, the host threads checksum them while they cross. No pageable
intermediate and no host copy of the state: host memory is the reader's pool.

Stream semantics: before its first copy after a ``settle``, a side stream
waits for an event on the caller's current stream, so whatever the caller
queued on the targets (the planner may have just allocated or zeroed them)
runs first. Copies are complete when their item is committed: the caller's
stream, and anything else, sees the data.
"""

from __future__ import annotations

from typing import Any

import torch

from ..io.buffers import BufferPool
from ..io.host_threads import HostThreads
from .crc import Checksummed, Checksums
from .memory import SideStream, page_lock
from .route import DeviceMemory

__all__ = ["DeviceLoads"]


class DeviceLoads(DeviceMemory):
    """A reader's host-to-device path: side streams, and its pool page-locked once a load has a device target.

    Which targets go through it (``on_device``: CUDA ones) and for which
    devices the pool is page-locked are ``DeviceMemory``'s.
    """

    def __init__(self) -> None:
        super().__init__()
        self._streams: dict[torch.device, SideStream] = {}
        self._pending: set[SideStream] = set()  # side streams with copies queued since the last settle
        self._checks: dict[SideStream, Checksums] = {}  # what each checksums once its copies are queued

    def prepare(self, pool: BufferPool, device: torch.device) -> None:
        """Before the first copy to ``device`` out of ``pool``'s buffers: page-lock them (once per pool)."""
        if self.page_locks(device):
            page_lock(pool)

    def copy(
        self,
        region: memoryview,
        target: torch.Tensor,
        checksum: Checksummed | None,
        host_threads: HostThreads,
    ) -> None:
        """Queue the copy of ``region`` (staging memory) into ``target`` (its bytes, flat, on a device).

        ``checksum``: the item whose running CRC-32C these bytes continue,
        computed on the device once they landed (its value is there after
        ``settle``), or by the host now, while they cross, where the kernel
        cannot run: over ``host_threads`` (one core checksums far
        slower than the bus carries: docs/benchmarks.md, "Figures behind
        design comments").
        """
        side = self._streams.get(target.device)
        if side is None:
            side = self._streams[target.device] = SideStream(target.device, 0, False)
        if side not in self._pending:
            side.wait_for(side.caller_event())
            self._pending.add(side)
        with side.context():
            target.copy_(torch.frombuffer(region, dtype=torch.uint8), non_blocking=True)
        if checksum is None:
            return
        if self.crc().ready(side):
            self._checks.setdefault(side, Checksums(self.crc(), side)).add(checksum, target)
        else:
            checksum.crc = host_threads.crc32c(region, checksum.crc)

    def settle(self) -> None:
        """Wait for every copy queued so far, and the checksums of what they brought: the staging memory they
        read may be reused, and each item's CRC-32C covers its bytes copied so far."""
        keep: list[Any] = []
        for check in self._checks.values():
            check.launch(keep)
        for side in self._pending:
            event = side.record()
            if event is not None:
                event.synchronize()
        for check in self._checks.values():
            check.fold()
        self._pending.clear()
        self._checks.clear()
