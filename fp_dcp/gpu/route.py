"""Which tensors take the GPU path, and what runs there: shared by saves (``DeviceRoute``) and loads.

``DeviceMemory`` says which tensors are device memory (CUDA ones), for
which devices host memory is page-locked, and holds the CRC-32C kernel that
checksums bytes where they are on the device; a save's ``DeviceRoute`` adds
the gather kernel, and a reader's ``fp_dcp.gpu.loading.DeviceLoads`` its
side streams. Tests override the first two to run the same code on CPU
tensors, and the CRC's launch to run a CPU model of the kernel
(``tests/cuda_double.py``).
"""

from __future__ import annotations

import torch

from ..config import IOConfig
from .crc import DeviceCrc
from .gather import Gather

__all__ = ["DeviceMemory", "DeviceRoute"]


class DeviceMemory:
    """Which tensors are device memory, which host memory their copies page-lock, and the device CRC kernel."""

    crc_kernel: type[DeviceCrc] = DeviceCrc

    def __init__(self) -> None:
        self._crc: DeviceCrc | None = None

    def on_device(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s bytes cross between it and the host on side streams, through staging memory."""
        return tensor.device.type == "cuda"

    def page_locks(self, device: torch.device) -> bool:
        """Whether host memory that ``device``'s copies come from or land in is page-locked."""
        return device.type == "cuda"

    def crc(self) -> DeviceCrc:
        if self._crc is None:
            self._crc = self.crc_kernel()
        return self._crc

    @property
    def crc_backend(self) -> str:
        """Where GPU tensors' bytes are checksummed (the kernel through cupy, or the host, and why)."""
        return self.crc().backend


class DeviceRoute(DeviceMemory):
    """A save's GPU path: ``DeviceMemory`` and the gather kernel that coalesces small tensors on the device."""

    def __init__(self, config: IOConfig) -> None:
        super().__init__()
        self.config = config
        self._gather: Gather | None = None

    def gather(self) -> Gather:
        if self._gather is None:
            self._gather = Gather()
        return self._gather

    @property
    def gather_backend(self) -> str:
        """How small GPU tensors are coalesced here (the kernel through cupy, or plain copies, and why)."""
        return self.gather().backend
