"""Host memory the GPU copies into, and the side streams that copy.

Page-locked (pinned) host memory lets device-to-host copies run
asynchronously at full bus speed; fp-dcp pins memory it owns and reuses
(the writer's staging buffers, the snapshot arena, gather landing areas)
with cudaHostRegister, never one fresh copy per save. A ``SideStream`` is a
device's dedicated CUDA stream plus the scratch memory a gather needs on
it; for a CPU "device" (tests route CPU tensors through the same code) it
has no stream and copies are synchronous.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from .. import _cio
from ..io.buffers import BufferPool
from ..units import PAGE, align_up

__all__ = ["pin", "unpin", "HostArea", "SideStream"]

_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every CUDA context


def _cudart() -> Any:
    return torch.cuda.cudart()  # type: ignore[no-untyped-call]  # (unannotated in torch)


def pin(view: memoryview) -> None:
    """Page-lock host memory for the GPU, so that copies into it run asynchronously at full speed."""
    err = int(_cudart().cudaHostRegister(_cio.address(view), len(view), _HOST_REGISTER_PORTABLE))
    if err:
        # Raised, not logged: the runtime keeps the error as its "last error", and
        # torch would report it later against an unrelated kernel launch.
        raise RuntimeError(f"cudaHostRegister of {len(view)} bytes of staging memory failed (CUDA error {err})")


def unpin(view: memoryview) -> None:
    _cudart().cudaHostUnregister(_cio.address(view))


class HostArea:
    """One page-aligned, populated host buffer (a one-buffer ``BufferPool``), page-locked when ``page_locked``."""

    def __init__(self, nbytes: int, page_locked: bool) -> None:
        self.pool = BufferPool(align_up(max(nbytes, 1), PAGE), 1)
        self.view = self.pool.views[0]
        self.pinned = False
        if page_locked:
            pin(self.view)
            self.pinned = True
        self.tensor = torch.frombuffer(self.view, dtype=torch.uint8)

    def close(self) -> None:
        if self.pinned:
            unpin(self.view)
            self.pinned = False
        del self.tensor
        self.pool.close()


class SideStream:
    """A device's side stream and the scratch memory gathers need (one per device and user).

    For a CPU "device" (tests route CPU tensors through the staging engine)
    there is no stream: copies are synchronous and events are None.
    """

    def __init__(self, device: torch.device, capacity: int) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # type: ignore[no-untyped-call]
        self.capacity = capacity
        self._landing: HostArea | None = None
        self._scratch: torch.Tensor | None = None

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

    @property
    def landing(self) -> HostArea:
        """Host memory (page-locked) that a gather's one device-to-host copy lands in."""
        if self._landing is None:
            self._landing = HostArea(self.capacity, page_locked=self.stream is not None)
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
