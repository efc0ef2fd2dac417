"""What one transfer moves its bytes with (``IOContext``), and what keeps those between transfers (``IOResources``).

A save or a load takes one context: the engine, its staging-buffer pool,
the host threads (``io.host_threads``) and the settings. The pipelines'
own contexts add what is theirs to it: ``save.context.WriteContext`` the
device copier and the save's controls, ``load.context.ReadContext`` the
prefaulter, the device loads and whether checksums are verified.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..config import IOConfig
from .buffers import BufferPool
from .engine import Engine, create_engine
from .extents import Extent, Window
from .host_threads import HostThreads
from .prefault import Prefaulter
from .progress import Progress

__all__ = ["IOContext", "IOResources"]


@dataclass(frozen=True)
class IOContext:
    """The engine and pool one transfer goes through, the host threads that copy and checksum beside it, and
    its settings."""

    engine: Engine
    pool: BufferPool
    host_threads: HostThreads
    config: IOConfig

    def window(self, retire: Callable[[Extent, memoryview | None], None], progress: Progress) -> Window:
        """A window over the engine and pool: ``queue_depth`` transfers in flight beyond one per pool buffer."""
        return Window(self.engine, self.pool, retire, self.config.queue_depth + self.pool.count, progress)


class IOResources:
    """An engine and a staging-buffer pool, created on first use and kept until ``close``, and the host
    threads beside them: ``host_threads`` (copies and checksums over several threads, a save's files written
    side by side) and ``prefaulter`` (load targets faulted in ahead of the reads; no threads where
    ``prepare_targets`` is off)."""

    def __init__(self, config: IOConfig) -> None:
        self.config = config
        self._engine: Engine | None = None
        self._pool: BufferPool | None = None
        threads = config.threads()
        self.host_threads = HostThreads(threads)
        self.prefaulter = Prefaulter(threads if config.prepare_targets else 0)

    def context(self, min_buffers: int = 0) -> IOContext:
        """The engine and the pool: ``num_buffers`` buffers, or ``min_buffers`` where that is more. A writer asks
        for two per file it writes at once, one filling while another is written: with fewer, saves staged from
        a GPU into 8 directories on tmpfs kept fewer writes in flight than files and fell well short of fio's 8
        jobs (docs/benchmarks.md, "Figures behind design comments"). Made at the first call and kept; made
        anew, larger, where a later call asks for more (call it between transfers)."""
        if self._pool is not None and self._pool.count < min_buffers:
            self.close_pool()
        if self._engine is None or self._pool is None:
            engine = self._engine = create_engine(self.config)
            count = max(self.config.num_buffers, min_buffers)
            self._pool = BufferPool(self.config.buffer_size, count, on_map=engine.register_buffers)
        return IOContext(self._engine, self._pool, self.host_threads, self.config)

    def close_pool(self) -> None:
        """Close the engine and the pool (a later ``context`` makes them anew)."""
        if self._engine is not None:
            self._engine.close()  # first: the ring holds the buffers while registered
            self._engine = None
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def close(self) -> None:
        self.close_pool()
        self.prefaulter.close()
        self.host_threads.close()
