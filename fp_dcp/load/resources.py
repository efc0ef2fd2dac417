"""What a ``FastPersistReader`` keeps between loads: the I/O engine, its pool and host threads, and the device loads."""

from __future__ import annotations

from ..config import IOConfig
from ..gpu.loading import DeviceLoads
from ..io.context import IOResources
from .context import ReadContext

__all__ = ["ReaderResources"]


class ReaderResources:
    """A reader's engine, buffer pool, host threads and prefaulter (``io``), and its path to device targets
    (``device_loads``: page-locked staging, side streams). The pool is made at the first load."""

    def __init__(self, config: IOConfig) -> None:
        self.io = IOResources(config)
        self.device_loads = DeviceLoads()

    def context(self, verify: bool) -> ReadContext:
        """What one load reads with; ``verify``: check the CRC-32C of items read whole."""
        io = self.io.context()
        return ReadContext(
            io.engine, io.pool, io.host_threads, io.config, self.io.prefaulter, self.device_loads, verify
        )

    def close(self) -> None:
        """Release the engine, the pool and the threads (the device loads hold nothing to release)."""
        self.io.close()
