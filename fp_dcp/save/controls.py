"""What a save in progress can be told, and what it tells: cancellation and the release of its sources.

Every save (CPU or GPU, sync or async) has one ``SaveControls``. The write
pipeline calls ``check`` between transfers, so ``FastPersistWriter.cancel``
stops a save at its next one, and ``released`` once it no longer reads any
source tensor, which is when an async save lets training change them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from ..errors import SaveCancelledError

__all__ = ["SaveControls"]


class SaveControls:
    def __init__(self, cancel: threading.Event | None = None, on_released: Callable[[], None] | None = None) -> None:
        self.cancel = cancel
        self.on_released = on_released

    def check(self) -> None:
        """Raise ``SaveCancelledError`` once ``FastPersistWriter.cancel()`` was called."""
        if self.cancel is not None and self.cancel.is_set():
            raise SaveCancelledError("the save was cancelled (FastPersistWriter.cancel()); nothing was published")

    def released(self) -> None:
        """The pipeline has read every source's memory: the tensors may change from now on (said once)."""
        if self.on_released is not None:
            self.on_released()
            self.on_released = None
