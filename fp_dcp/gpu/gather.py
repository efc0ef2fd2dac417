"""Coalescing small device tensors: one kernel launch gathers them into one buffer, one copy brings it over.

The kernel is ``cuda/gather.cu`` in the source tree, shipped in the wheel as
``fp_dcp/gpu/kernels/gather.cu``; it is compiled at run time through cupy
(an optional dependency: ``pip install fp-dcp[cuda]``).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..log import log_once
from .memory import SideStream

__all__ = ["Gather", "kernel_source"]

_KERNEL_NAME = "fp_dcp_gather"
_THREADS_PER_BLOCK = 256
_MAX_BLOCKS = 8192
_KERNEL_FILE = "gather.cu"


def kernel_source() -> Path | None:
    """The kernel's source: packaged with an installed wheel, else in the source tree's ``cuda/``; None if absent."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "kernels" / _KERNEL_FILE, here.parent.parent / "cuda" / _KERNEL_FILE):
        if candidate.is_file():
            return candidate
    return None


class Gather:
    """Copies device segments to offsets of one device buffer.

    The ``cuda/gather.cu`` kernel does it in one launch, compiled at run time
    through cupy (an optional dependency: ``pip install fp-dcp[cuda]``) when
    cupy and the kernel source are present; otherwise, and on CPU, each
    segment is one copy on the side stream (still one transfer to the host).
    """

    def __init__(self) -> None:
        self._functions: dict[int, Any] = {}
        self._cupy: Any = None
        self._source: Path | None = None
        self.backend = "copies"
        try:
            cupy = importlib.import_module("cupy")  # optional: pip install fp-dcp[cuda]
        except ImportError:
            self.backend = "copies (cupy is not installed)"
            return
        self._source = kernel_source()
        if self._source is None:
            self.backend = "copies (cuda/gather.cu is not in this installation)"
            return
        self._cupy = cupy
        self.backend = "cuda/gather.cu through cupy"

    def _function(self, index: int) -> Any:
        """The kernel for device ``index``, compiled on first use; None (logged once) if cupy cannot build it."""
        if index not in self._functions:
            try:
                assert self._source is not None  # set whenever cupy is
                with self._cupy.cuda.Device(index):
                    module = self._cupy.RawModule(code=self._source.read_text(), options=("--std=c++14",))
                    self._functions[index] = module.get_function(_KERNEL_NAME)
            except Exception as e:  # e.g. cupy without NVRTC: copies are slower, not wrong
                self.backend = f"copies (cupy could not build cuda/gather.cu: {e})"
                log_once(f"fp-dcp: {self.backend}")
                self._functions[index] = None
        return self._functions[index]

    def __call__(
        self, side: SideStream, segments: list[tuple[torch.Tensor, int]], out: torch.Tensor, keep: list[Any]
    ) -> None:
        """Queue the copies of ``(source bytes, offset in out)`` on the side stream (the current one)."""
        stream, kernel, index = side.stream, None, 0
        if self._cupy is not None and stream is not None:
            index = side.device.index if side.device.index is not None else torch.cuda.current_device()
            kernel = self._function(index)
        if kernel is None or stream is None:
            for source, offset in segments:
                out[offset : offset + source.numel()].copy_(source)
            return
        table = np.empty((len(segments), 3), dtype=np.uint64)  # struct fp_dcp_segment
        for row, (source, offset) in zip(table, segments, strict=True):
            row[:] = (source.data_ptr(), offset, source.numel())
        device_table = torch.from_numpy(table.view(np.int64)).to(side.device, non_blocking=True)
        keep += [table, device_table]
        cupy = self._cupy
        with cupy.cuda.Device(index), cupy.cuda.ExternalStream(stream.cuda_stream, index):
            kernel(
                (min(len(segments), _MAX_BLOCKS),),
                (_THREADS_PER_BLOCK,),
                (np.uint64(device_table.data_ptr()), np.uint32(len(segments)), np.uint64(out.data_ptr())),
            )
