"""Page-aligned staging buffers, allocated once and reused.

Buffers are anonymous mappings populated at allocation: page-aligned for
O_DIRECT, and touched once, because on virtual machines that hand freed
memory back to the host, memory touched afresh is copied into several times
slower than memory already faulted in. A writer or reader keeps its pool for
its whole life, so every save after the first runs on warm memory.
"""

from __future__ import annotations

import contextlib
import mmap

__all__ = ["BufferPool"]


class BufferPool:
    """``count`` buffers of ``size`` bytes; ``free`` lists those not in use."""

    def __init__(self, size: int, count: int) -> None:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        self.size = size
        self.maps = [mmap.mmap(-1, size, flags=flags) for _ in range(count)]
        self.views = [memoryview(m) for m in self.maps]
        self.free: list[memoryview] = list(self.views)

    @property
    def count(self) -> int:
        return len(self.maps)

    def close(self) -> None:
        """Unmap the buffers now; one still referenced elsewhere is unmapped when that goes."""
        self.free.clear()
        for view, m in zip(self.views, self.maps, strict=True):
            with contextlib.suppress(BufferError):
                view.release()
                m.close()
        self.views.clear()
        self.maps.clear()
