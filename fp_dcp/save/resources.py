"""What a ``FastPersistWriter`` keeps between saves and never pickles: GPU staging, the I/O engine and its pool."""

from __future__ import annotations

import threading
import weakref

import torch

from ..config import IOConfig
from ..gpu.streaming import Staging
from ..io.context import IOResources
from .context import WriteContext
from .controls import SaveControls

__all__ = ["WriterResources", "shared_resources"]


class WriterResources:
    """A writer's staging (side streams, snapshot arena, page-locking) and its engine and buffer pool.

    Nothing here needs ``close`` to be safe: page-locked memory is unlocked
    by the pool that holds it before that is unmapped, also when a writer
    nobody closed is garbage-collected (``fp_dcp.gpu.memory``). ``close``
    releases it all now.

    The pool is made at the first save, with at least two buffers for each
    of its files (``IOResources.context``).
    """

    def __init__(self, config: IOConfig) -> None:
        self.staging = Staging(config)
        self.io = IOResources(config)
        self.busy = threading.Lock()  # held while a save's data is written through them: one pipeline at a time
        self.shared_as: str | None = None  # the writer id its unpickled copies find it under

    def context(
        self,
        controls: SaveControls,
        files: int = 0,
        ready: dict[torch.device, torch.cuda.Event] | None = None,
    ) -> WriteContext:
        """What one save writes with: a pool of at least two buffers for each of its ``files``, a device copier
        whose side streams wait for ``ready`` (an async save's events), and the save's ``controls``."""
        io = self.io.context(2 * files)
        copier = self.staging.copier(ready)
        return WriteContext(io.engine, io.pool, io.host_threads, io.config, copier, controls)

    def close(self) -> None:
        if self.shared_as is not None and _UNPICKLED.get(self.shared_as) is self:
            del _UNPICKLED[self.shared_as]  # closed resources are not handed to later copies
        self.staging.close()
        self.io.close()


# The resources of writers unpickled in this process, by writer id. DCP's
# process executor unpickles a fresh copy of the writer for every save:
# copies of one writer share one engine and warm buffers while any of them
# lives (DCP's checkpoint process holds one request until the next arrives).
_UNPICKLED: weakref.WeakValueDictionary[str, WriterResources] = weakref.WeakValueDictionary()


def shared_resources(writer_id: str, config: IOConfig) -> WriterResources:
    """The resources the unpickled copies of writer ``writer_id`` share here, made if none of them lives."""
    resources = _UNPICKLED.get(writer_id)
    if resources is None:
        resources = _UNPICKLED[writer_id] = WriterResources(config)
        resources.shared_as = writer_id
    return resources
