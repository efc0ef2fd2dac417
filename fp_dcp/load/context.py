"""What one load reads with: ``ReadContext``, made by the reader's resources (``load.resources``)."""

from __future__ import annotations

from dataclasses import dataclass

from ..gpu.loading import DeviceLoads
from ..io.context import IOContext
from ..io.prefault import Prefaulter

__all__ = ["ReadContext"]


@dataclass(frozen=True)
class ReadContext(IOContext):
    """The I/O context of one load, with the prefaulter that faults host targets in ahead of their reads (None:
    the reads and copies fault them in), the device loads that carry device targets' bytes across (None: every
    target is host memory), and whether items read whole are checked against their CRC-32C (where the catalogue
    has one)."""

    prefaulter: Prefaulter | None
    device_loads: DeviceLoads | None
    verify: bool
