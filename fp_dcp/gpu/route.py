"""Which tensors take the GPU path, and what runs there: shared by streaming saves and the snapshot.

A ``DeviceRoute`` says which tensors are copied from a device (CUDA ones),
for which devices host memory is page-locked, and holds the kernels that
run on the device (the gather, the CRC-32C). Tests override the first two
to run the same code on CPU tensors, and the CRC's launch to run a CPU
model of the kernel (``tests/cuda_double.py``).
"""

from __future__ import annotations

import torch

from ..config import IOConfig
from .crc import DeviceCrc
from .gather import Gather

__all__ = ["DeviceRoute"]


class DeviceRoute:
    """Which tensors are device memory, which host memory is page-locked for them, and the device kernels."""

    crc_kernel: type[DeviceCrc] = DeviceCrc

    def __init__(self, config: IOConfig) -> None:
        self.config = config
        self._gather: Gather | None = None
        self._crc: DeviceCrc | None = None

    def copies(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s bytes are copied to the host by this engine (side streams, pinned memory)."""
        return tensor.device.type == "cuda"

    def page_locks(self, device: torch.device) -> bool:
        """Whether host memory that ``device``'s copies land in is page-locked."""
        return device.type == "cuda"

    def gather(self) -> Gather:
        if self._gather is None:
            self._gather = Gather()
        return self._gather

    def crc(self) -> DeviceCrc:
        if self._crc is None:
            self._crc = self.crc_kernel()
        return self._crc

    @property
    def gather_backend(self) -> str:
        """How small GPU tensors are coalesced here (the kernel through cupy, or plain copies, and why)."""
        return self.gather().backend

    @property
    def crc_backend(self) -> str:
        """Where GPU tensors' bytes are checksummed (the kernel through cupy, or the host, and why)."""
        return self.crc().backend
