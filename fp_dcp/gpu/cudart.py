"""The CUDA runtime calls fp-dcp makes itself: page-locking host memory, and clearing a failed call's error.

fp-dcp page-locks memory it owns with ``cudaHostRegister`` (``memory.page_lock``).
A failed runtime call leaves its error as the runtime's *last error* of the
calling thread, and torch reads that at its next kernel launch: it then
reports, against some unrelated line of the training loop, an error fp-dcp
caused ("CUDA error: part or all of the requested memory range is already
mapped"). torch binds ``cudaHostRegister`` and ``cudaHostUnregister``
(``torch.cuda.cudart()``) but not ``cudaGetLastError``, so every failed call
here is followed at once by ``cudaGetLastError`` in the ``libcudart`` torch
loaded, which reads and clears it.

``Runtime`` is the slice of the runtime's API used, named as in CUDA, so
that tests can put a double in its place (``use``): CI machines have no GPU,
and the double keeps the runtime's ledger of registered ranges and its rules.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator
from typing import Any, Protocol

__all__ = ["Runtime", "CudaError", "runtime", "use", "host_register", "host_unregister"]

HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every CUDA context


class Runtime(Protocol):
    """The CUDA runtime functions fp-dcp calls, with CUDA's names and return codes (0: cudaSuccess)."""

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int: ...

    def cudaHostUnregister(self, ptr: int) -> int: ...

    def cudaGetLastError(self) -> int: ...

    def cudaGetErrorString(self, error: int) -> str: ...


class CudaError(RuntimeError):
    """A CUDA runtime call fp-dcp made failed; the runtime's last error was cleared already."""

    def __init__(self, call: str, code: int, text: str) -> None:
        super().__init__(f"{call} failed: CUDA error {code} ({text})")
        self.code = code


def _loaded_cudart() -> ctypes.CDLL | None:
    """The libcudart this process already loaded (torch's), or None where torch links the runtime statically."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart.so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        if os.path.basename(path).startswith("libcudart.so"):
            try:  # RTLD_NOLOAD: the instance torch uses, never a second runtime with its own state
                return ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            except OSError:
                continue
    return None


class _TorchRuntime:
    """The runtime torch uses: its bindings for registration, its libcudart for the last error."""

    def __init__(self) -> None:
        import torch

        self._torch = torch
        self._bound: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]  # (unannotated in torch)
        self._lib = _loaded_cudart()
        if self._lib is not None:
            self._lib.cudaGetErrorString.restype = ctypes.c_char_p

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        return int(self._bound.cudaHostRegister(ptr, size, flags))

    def cudaHostUnregister(self, ptr: int) -> int:
        return int(self._bound.cudaHostUnregister(ptr))

    def cudaGetLastError(self) -> int:
        if self._lib is not None:
            return int(self._lib.cudaGetLastError())
        # A statically linked runtime: torch's own launch check reads the pending error, clearing it.
        try:
            self._torch.cuda._sleep(0)  # type: ignore[no-untyped-call]
        except RuntimeError:
            return -1  # there was one; its code went into torch's message
        return 0

    def cudaGetErrorString(self, error: int) -> str:
        if self._lib is None:
            return "see the CUDA runtime's error codes"
        text: bytes = self._lib.cudaGetErrorString(ctypes.c_int(error))
        return text.decode(errors="replace")


_runtime: Runtime | None = None


def runtime() -> Runtime:
    """The CUDA runtime in use (torch's, made on first use; a double where a test put one)."""
    global _runtime
    if _runtime is None:
        _runtime = _TorchRuntime()
    return _runtime


@contextlib.contextmanager
def use(double: Runtime) -> Iterator[Runtime]:
    """Run fp-dcp's CUDA calls against ``double`` inside the block (tests on machines without a GPU)."""
    global _runtime
    previous, _runtime = _runtime, double
    try:
        yield double
    finally:
        _runtime = previous


def _check(rt: Runtime, call: str, code: int) -> None:
    if code:
        rt.cudaGetLastError()  # at once: torch would report it at its next kernel launch
        raise CudaError(call, code, rt.cudaGetErrorString(code))


def host_register(rt: Runtime, address: int, length: int) -> None:
    """Page-lock ``length`` bytes at ``address``; ``CudaError`` (the last error cleared) if the runtime refuses."""
    _check(rt, f"cudaHostRegister of {length} bytes", rt.cudaHostRegister(address, length, HOST_REGISTER_PORTABLE))


def host_unregister(rt: Runtime, address: int) -> None:
    """Undo ``host_register`` of the range starting at ``address``; ``CudaError`` as ``host_register``."""
    _check(rt, "cudaHostUnregister", rt.cudaHostUnregister(address))
