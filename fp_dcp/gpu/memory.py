"""Host memory the GPU copies into, and the side streams that copy.

Page-locked (pinned) host memory lets device-to-host copies run
asynchronously at full bus speed; fp-dcp page-locks memory it owns and
reuses (the writer's staging buffers, the snapshot arena, gather landing
areas), never one fresh copy per save. Every page-locked byte belongs to a
``BufferPool``, which undoes the registration before it unmaps the buffer,
whatever ends it; buffers are page-locked at most once, and stay so while
they wait for the next pool of their shape (``io.buffers``): a reader made
anew for each GPU load takes them page-locked. A ``SideStream``
is a device's dedicated CUDA stream plus the scratch memory a gather needs
on it; for a CPU "device" (tests route CPU tensors through the same code) it
has no stream and copies are synchronous.
"""

from __future__ import annotations

import functools
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from .._native import _cio
from ..io.buffers import BufferPool
from ..log import log, log_once
from ..units import PAGE, align_up
from . import cudart

__all__ = ["page_lock", "HostArea", "SideStream"]

_PAGE_LOCKED = "cudaHostRegister"  # the pool's registration: whether every buffer is page-locked


def page_lock(pool: BufferPool) -> bool:
    """Page-lock ``pool``'s buffers for the rest of their life (later pools that take them find them so);
    whether all of them are.

    Where the runtime refuses (memory limits, a range registered by someone
    else), the rest stay pageable: copies into them still work, synchronously
    and slower, and one warning says why. A save never fails for it.
    """
    earlier = pool.registration(_PAGE_LOCKED)
    if earlier is not None:
        return bool(earlier)
    rt = cudart.runtime()
    addresses = []
    locked = True
    for view in pool.views:
        address = _cio.address(view)
        try:
            cudart.host_register(rt, address, len(view))
        except cudart.CudaError as e:
            log_once(f"fp-dcp: host memory for GPU copies stays pageable (copies between GPU and host are slower): {e}")
            locked = False
            break
        addresses.append(address)
    pool.register(_PAGE_LOCKED, locked, functools.partial(_unlock, rt, addresses))
    return locked


def _unlock(rt: cudart.Runtime, addresses: list[int]) -> None:
    for address in addresses:
        try:
            cudart.host_unregister(rt, address)
        except cudart.CudaError as e:  # runs as the pool goes: say it, unmap anyway
            log.warning("fp-dcp: %s", e)
    addresses.clear()


class HostArea:
    """One page-aligned, populated host buffer (a one-buffer ``BufferPool``), page-locked when ``page_locked``."""

    def __init__(self, nbytes: int, page_locked: bool) -> None:
        self.pool = BufferPool(align_up(max(nbytes, 1), PAGE), 1)
        self.view = self.pool.views[0]
        if page_locked:
            page_lock(self.pool)
        self.tensor = torch.frombuffer(self.view, dtype=torch.uint8)

    def close(self) -> None:
        del self.tensor
        self.pool.close()


class SideStream:
    """A device's side stream and the scratch memory gathers need (one per device and user).

    For a CPU "device" (tests route CPU tensors through the staging engine)
    there is no stream: copies are synchronous and events are None.
    """

    def __init__(self, device: torch.device, capacity: int, page_locked: bool) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # type: ignore[no-untyped-call]
        self.capacity = capacity
        self.page_locked = page_locked  # whether its landing area is
        self._landing: HostArea | None = None
        self._scratch: torch.Tensor | None = None

    @property
    def index(self) -> int:
        """The device's ordinal (the current one for a device named without, ``"cuda"``)."""
        return self.device.index if self.device.index is not None else torch.cuda.current_device()

    def context(self) -> AbstractContextManager[Any]:
        """Make the side stream current for this device (work queued inside runs on it)."""
        return torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()

    def record(self) -> torch.cuda.Event | None:
        if self.stream is None:
            return None
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self.stream)
        return event

    def wait_for(self, event: torch.cuda.Event | None) -> None:
        if self.stream is not None and event is not None:
            self.stream.wait_event(event)

    def caller_event(self) -> torch.cuda.Event | None:
        """An event on the calling thread's current stream of this device (what it queued so far)."""
        return torch.cuda.current_stream(self.device).record_event() if self.stream is not None else None

    def hold_caller(self, event: torch.cuda.Event | None) -> None:
        """Make the calling thread's current stream of this device wait for ``event``."""
        if self.stream is not None and event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    @property
    def landing(self) -> HostArea:
        """Host memory (page-locked) that a gather's one device-to-host copy lands in."""
        if self._landing is None:
            self._landing = HostArea(self.capacity, self.page_locked)
        return self._landing

    @property
    def scratch(self) -> torch.Tensor:
        """Device memory the gather writes into, allocated on the side stream (stream-ordered reuse)."""
        if self._scratch is None:
            with self.context():
                self._scratch = torch.empty(self.capacity, dtype=torch.uint8, device=self.device)
        return self._scratch

    def close(self) -> None:
        if self._landing is not None:
            self._landing.close()
            self._landing = None
        self._scratch = None
