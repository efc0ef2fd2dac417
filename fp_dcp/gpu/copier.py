"""The write pipeline's one door to device memory: ``DeviceCopier``.

The write pipeline fills each staging buffer with the bytes of the items
placed in it. Parts that live in device memory are handed to a copier, which
queues their device-to-host copies and returns a ``Batch``; the pipeline
fills the host parts meanwhile, then completes the batch (waiting for each
copy and checksumming what it brought). This base class is the CPU
implementation: it copies nothing and returns no batch, so a CPU-only save
never touches CUDA. ``fp_dcp.gpu.streaming.StreamingCopier`` is the GPU one.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch

from ..io.buffers import BufferPool
from ..io.extents import Extent
from ..tensors import ByteSource

__all__ = ["Batch", "DeviceCopier"]


class Batch(Protocol):
    """Device-to-host copies of one staging buffer's device parts, in flight."""

    def __contains__(self, owner: object) -> bool:
        """Whether the item ``owner`` is copied by this batch (the pipeline skips it)."""
        ...

    def complete(self) -> None:
        """Wait for the copies in turn and checksum what each brought."""
        ...

    def wait(self) -> None:
        """Only wait for the copies (failure paths): none may outlive the buffer it writes."""
        ...


class DeviceCopier:
    """Copies the device parts of staged extents; this base has no device and copies nothing."""

    def copies(self, tensor: torch.Tensor) -> bool:
        """Whether this copier moves ``tensor``'s bytes to the host (its ``ByteSource`` keeps the tensor)."""
        return False

    def prepare(self, pool: BufferPool, sources: Iterable[ByteSource]) -> None:
        """Before a save first reads a source, given the pool the buffers come from and every item's source.

        After it, device tensors may be read on this thread's current stream too.
        """

    def issue(self, buffer: memoryview, extent: Extent) -> Batch | None:
        """Queue the copies of ``extent``'s device parts into ``buffer``; None when it has none."""
        return None

    def describe(self) -> str:
        """How this save's device tensors reached the host (``SaveSummary.staging``)."""
        return "none"
