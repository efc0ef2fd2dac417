"""What one save writes its files with: ``WriteContext``, made by the writer's resources (``save.resources``)."""

from __future__ import annotations

from dataclasses import dataclass

from ..gpu.copier import DeviceCopier
from ..io.context import IOContext
from .controls import SaveControls

__all__ = ["WriteContext"]


@dataclass(frozen=True)
class WriteContext(IOContext):
    """The I/O context of one save, with the copier that brings its device tensors' bytes to the host (the CPU
    one copies nothing) and its controls (cancellation, the release of its sources)."""

    copier: DeviceCopier
    controls: SaveControls
