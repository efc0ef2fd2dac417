"""fp-dcp's own CUDA kernels (``cuda/*.cu``), compiled at run time through cupy for the GPU at hand.

The sources are in the source tree's ``cuda/`` and shipped in the wheel as
``fp_dcp/gpu/kernels/``. cupy is optional (``pip install fp-dcp[cuda]``):
without it, or where it cannot build a kernel, each user of a kernel falls
back to a slower way that gives the same bytes, and says which it runs.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..log import log_once
from .memory import SideStream

__all__ = ["Kernel", "kernel_source"]


def kernel_source(file: str) -> Path | None:
    """A kernel's source: packaged with an installed wheel, else in the source tree's ``cuda/``; None if absent."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "kernels" / file, here.parent.parent / "cuda" / file):
        if candidate.is_file():
            return candidate
    return None


class Kernel:
    """The function ``name`` of ``cuda/<file>``, built for each device on first use; ``fallback`` names what
    runs instead where it cannot be (``backend`` says which runs, and why)."""

    def __init__(self, file: str, name: str, fallback: str) -> None:
        self.file = file
        self.name = name
        self.fallback = fallback
        self._functions: dict[int, Any] = {}
        self._cupy: Any = None
        self._source = kernel_source(file)
        self.problem: str | None = None  # why the fallback runs
        try:
            cupy = importlib.import_module("cupy")  # optional: pip install fp-dcp[cuda]
        except ImportError:
            self.problem = "cupy is not installed"
            return
        if self._source is None:
            self.problem = f"cuda/{file} is not in this installation"
            return
        self._cupy = cupy

    @property
    def backend(self) -> str:
        return f"{self.fallback} ({self.problem})" if self.problem else f"cuda/{self.file} through cupy"

    def function(self, side: SideStream) -> Any:
        """The kernel for the side stream's device, compiled on first use; None (said once) where it cannot be."""
        if self._cupy is None or side.stream is None:
            return None
        index = side.index
        if index not in self._functions:
            try:
                assert self._source is not None  # set whenever cupy is
                with self._cupy.cuda.Device(index):
                    module = self._cupy.RawModule(code=self._source.read_text(), options=("--std=c++14",))
                    self._functions[index] = module.get_function(self.name)
            except Exception as e:  # e.g. cupy without NVRTC: the fallback is slower, not wrong
                self.problem = f"cupy could not build cuda/{self.file}: {e}"
                log_once(f"fp-dcp: {self.backend}")
                self._functions[index] = None
        return self._functions[index]

    def launch(self, side: SideStream, blocks: int, threads: int, args: Sequence[Any]) -> None:
        """Queue the kernel on the side stream (``function`` returned it for this stream)."""
        function = self.function(side)
        assert function is not None and side.stream is not None
        with self._cupy.cuda.Device(side.index), self._cupy.cuda.ExternalStream(side.stream.cuda_stream, side.index):
            function((blocks,), (threads,), tuple(args))
