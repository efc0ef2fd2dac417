"""Coalescing small device tensors: one kernel launch gathers them into one buffer, one copy brings it over.

The kernel is ``cuda/gather.cu`` (``fp_dcp.gpu.kernel``: compiled at run time
through cupy, an optional dependency).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .kernel import Kernel
from .memory import SideStream

__all__ = ["Gather"]

_THREADS_PER_BLOCK = 256
_MAX_BLOCKS = 8192


class Gather:
    """Copies device segments to offsets of one device buffer.

    The ``cuda/gather.cu`` kernel does it in one launch where cupy can build
    it; otherwise, and on CPU, each segment is one copy on the side stream
    (still one transfer to the host).
    """

    def __init__(self) -> None:
        self.kernel = Kernel("gather.cu", "fp_dcp_gather", fallback="copies")

    @property
    def backend(self) -> str:
        return self.kernel.backend

    def __call__(
        self, side: SideStream, segments: list[tuple[torch.Tensor, int]], out: torch.Tensor, keep: list[Any]
    ) -> None:
        """Queue the copies of ``(source bytes, offset in out)`` on the side stream (the current one)."""
        if self.kernel.function(side) is None:
            for source, offset in segments:
                out[offset : offset + source.numel()].copy_(source)
            return
        table = np.empty((len(segments), 3), dtype=np.uint64)  # struct fp_dcp_segment
        for row, (source, offset) in zip(table, segments, strict=True):
            row[:] = (source.data_ptr(), offset, source.numel())
        device_table = torch.from_numpy(table.view(np.int64)).to(side.device, non_blocking=True)
        keep += [table, device_table]
        args = (np.uint64(device_table.data_ptr()), np.uint32(len(segments)), np.uint64(out.data_ptr()))
        self.kernel.launch(side, min(len(segments), _MAX_BLOCKS), _THREADS_PER_BLOCK, args)
