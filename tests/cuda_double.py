"""A CUDA runtime double, and the route that runs fp-dcp's GPU code on CPU tensors, for machines without a GPU.

``CudaRuntimeDouble`` stands in for the slice of the CUDA runtime fp-dcp
calls (``fp_dcp.gpu.cudart.Runtime``) with the runtime's rules for page-locked
host memory, kept on a ledger:

- registering a range that overlaps a registered one fails with 712
  (cudaErrorHostMemoryAlreadyRegistered), and memory that is not mapped with 1
  (cudaErrorInvalidValue);
- unregistering an address that does not start a registered range fails with
  713 (cudaErrorHostMemoryNotRegistered);
- a failed call's error stays as the last error until ``cudaGetLastError``
  reads it (torch reads it at its next kernel launch: a pending error is one
  the training loop would trip over).

It also watches the mappings fp-dcp's buffer pools make (``track``), so that
memory unmapped while still registered is caught when it happens. (The real
runtime keeps such a stale registration: the next mapping at that address
fails to register, and copies may land in the old pages.) One ledger serves
every thread: the real last error is per thread, which the checks here do
not need.

``CpuAsDevice`` is a ``Staging`` that treats every tensor as device memory
and page-locks the host memory its copies land in, so that CPU tensors take
the GPU path (side streams without a stream, the gather, landing areas, the
snapshot arena) and its page-locking goes through the double;
``CpuTargetsAsDevice`` does the same for loads. Both checksum the "device"
bytes with ``ModelCrc``: the CRC kernel's launch, run by its numpy model
(``crc_model``), so the device checksums' plumbing runs here too.
"""

from __future__ import annotations

import gc
import mmap
import weakref
from collections.abc import Callable

import numpy as np
import torch
from crc_model import crc32c_rows

from fp_dcp._native import _cio
from fp_dcp.gpu.crc import DeviceCrc
from fp_dcp.gpu.loading import DeviceLoads
from fp_dcp.gpu.memory import SideStream
from fp_dcp.gpu.route import DeviceMemory
from fp_dcp.gpu.streaming import Staging

SUCCESS = 0
INVALID_VALUE = 1
MEMORY_ALLOCATION = 2
ALREADY_REGISTERED = 712
NOT_REGISTERED = 713
_NAMES = {
    INVALID_VALUE: "invalid argument",
    MEMORY_ALLOCATION: "out of memory",
    ALREADY_REGISTERED: "part or all of the requested memory range is already mapped",
    NOT_REGISTERED: "pointer does not correspond to a registered memory region",
}


class CudaRuntimeDouble:
    """The host-registration rules of the CUDA runtime, on a ledger (see the module's docstring)."""

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}  # start address -> length
        self.mappings: dict[int, tuple[int, weakref.ref[mmap.mmap]]] = {}  # start -> (length, the mapping)
        self.last_error = SUCCESS
        self.failed: list[str] = []  # every call that returned an error
        self.unmapped: list[str] = []  # registered memory that was unmapped
        self.registrations = 0
        self.refuse = SUCCESS  # set by a test: every registration fails with this error

    # ------------------------------------------------------------ the runtime

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self._sweep()
        if self.refuse:
            return self._fail(self.refuse, f"cudaHostRegister({ptr:#x}, {size})")
        if size <= 0 or not self._mapped(ptr, size):
            return self._fail(INVALID_VALUE, f"cudaHostRegister({ptr:#x}, {size}) of memory that is not mapped")
        for start, length in self.registered.items():
            if start < ptr + size and ptr < start + length:
                return self._fail(ALREADY_REGISTERED, f"cudaHostRegister({ptr:#x}, {size}) over {start:#x}+{length}")
        self.registered[ptr] = size
        self.registrations += 1
        return SUCCESS

    def cudaHostUnregister(self, ptr: int) -> int:
        self._sweep()
        if ptr not in self.registered:
            return self._fail(NOT_REGISTERED, f"cudaHostUnregister({ptr:#x})")
        del self.registered[ptr]
        return SUCCESS

    def cudaGetLastError(self) -> int:
        error, self.last_error = self.last_error, SUCCESS
        return error

    def cudaGetErrorString(self, error: int) -> str:
        return _NAMES.get(error, "unrecognized error code")

    def _fail(self, error: int, call: str) -> int:
        self.failed.append(f"{call}: {error} ({_NAMES.get(error, '?')})")
        self.last_error = error
        return error

    # ------------------------------------------------- the process's mappings

    def tracking(self, allocate: Callable[[int], tuple[mmap.mmap, bool]]) -> Callable[[int], tuple[mmap.mmap, bool]]:
        """``fp_dcp.io.buffers._allocate``, with every mapping it makes watched."""

        def tracked(size: int) -> tuple[mmap.mmap, bool]:
            m, huge = allocate(size)
            self.track(m)
            return m, huge

        return tracked

    def track(self, m: mmap.mmap) -> None:
        # A mapping closed since the last sweep may have left its address to this one: it is gone first.
        self._sweep()
        with memoryview(m) as view:
            start = _cio.address(view)
        entry = self.mappings[start] = (len(m), weakref.ref(m))
        weakref.finalize(m, self._collected, start, entry)

    def _collected(self, start: int, entry: tuple[int, weakref.ref[mmap.mmap]]) -> None:
        """A mapping's object was collected; unless a sweep saw it closed before (and its address may since hold
        another mapping), its memory goes now."""
        if self.mappings.get(start) is entry:
            del self.mappings[start]
            self._gone(start, entry[0])

    def _gone(self, start: int, length: int) -> None:
        for address, size in self.registered.items():
            if start <= address < start + length:
                self.unmapped.append(f"{size} bytes at {address:#x} unmapped while registered")

    def _sweep(self) -> None:
        """Mappings closed since the last call are gone (a closed mmap object unmapped its memory)."""
        for start, (length, ref) in list(self.mappings.items()):
            m = ref()
            if m is None or m.closed:
                del self.mappings[start]
                self._gone(start, length)

    def _mapped(self, ptr: int, size: int) -> bool:
        return any(start <= ptr and ptr + size <= start + length for start, (length, _) in self.mappings.items())

    # ----------------------------------------------------------------- checks

    def is_registered(self, view: memoryview) -> bool:
        address = _cio.address(view)
        return any(start <= address < start + length for start, length in self.registered.items())

    def problems(self) -> list[str]:
        """What the runtime's rules were broken by, or would trip torch over: empty when all is well."""
        gc.collect()
        self._sweep()
        found = [f"left registered: {length} bytes at {start:#x}" for start, length in self.registered.items()]
        found += self.unmapped + [f"failed: {call}" for call in self.failed]
        if self.last_error:
            found.append(f"error {self.last_error} pending as the runtime's last error")
        return found


class ModelCrc(DeviceCrc):
    """The CRC kernel's launch, run by its numpy model on the CPU "device" (synchronously: no stream)."""

    @property
    def backend(self) -> str:
        return "the numpy model of cuda/crc32c.cu"

    def ready(self, side: SideStream) -> bool:
        return True

    def __call__(self, side: SideStream, rows: list[torch.Tensor], keep: list) -> torch.Tensor:
        crcs = crc32c_rows([row.numpy() for row in rows])
        return torch.from_numpy(crcs.view(np.int32))


class HostCrc(ModelCrc):
    """The CRC kernel's launch answered by the host's CRC-32C: for tests that measure host memory, which the
    numpy model's temporaries (the size of its rows) would swell."""

    def __call__(self, side: SideStream, rows: list[torch.Tensor], keep: list) -> torch.Tensor:
        crcs = np.array([_cio.crc32c(row.numpy()) for row in rows], dtype=np.uint32)
        return torch.from_numpy(crcs.view(np.int32))


class CpuAsDeviceMemory(DeviceMemory):
    """Every tensor as device memory, all host memory its copies use page-locked, the CRC kernel's CPU model."""

    crc_kernel = ModelCrc

    def on_device(self, tensor: torch.Tensor) -> bool:
        return True

    def page_locks(self, device: torch.device) -> bool:
        return True


class CpuAsDevice(CpuAsDeviceMemory, Staging):
    """A writer's staging on that route: the GPU save path, run on the CPU."""


class CpuTargetsAsDevice(CpuAsDeviceMemory, DeviceLoads):
    """A reader's device loads on that route: the GPU load path, run on the CPU."""
