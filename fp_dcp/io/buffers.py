"""Page-aligned staging buffers in huge pages, allocated once and reused.

Buffers are anonymous mappings, page-aligned for O_DIRECT, backed by
transparent huge pages where the kernel allows (``MADV_HUGEPAGE``) and
touched once at allocation:

- A 2 MiB huge page is one run of physical memory, so a request written
  from it fills the device's largest request size, where 4 KiB pages would
  cap it (``io.device``).
- On virtual machines that hand freed memory back to the host, memory touched
  afresh is copied into several times slower than memory already faulted in.

A writer or reader keeps its pool for its whole life. (The first pool of a
process took 0.28 s per 128 MiB here, fresh memory from the host; later
ones, reusing freed huge pages, 0.02 s.)

Whoever registers the buffers somewhere that outlives a mapping (CUDA's
page-locking) says how to undo it with ``before_unmap``: the pool runs that
before it unmaps, whatever ends it (``close``, garbage collection of a pool
nobody closed, interpreter exit), so no registration ever outlives its memory.
"""

from __future__ import annotations

import contextlib
import mmap
import weakref
from collections.abc import Callable

from ..units import PAGE

__all__ = ["BufferPool"]

# madvise(MADV_POPULATE_WRITE), Linux 5.14; Python's mmap module does not name it.
_MADV_POPULATE_WRITE = 23


def _huge_pages_enabled() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def _allocate(size: int) -> tuple[mmap.mmap, bool]:
    """A populated mapping of ``size`` bytes, and whether huge pages were asked for."""
    # Not MAP_POPULATE: that faults 4 KiB pages in before madvise could ask for huge ones.
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
        asked = True
    except (AttributeError, OSError):
        asked = False
    try:
        m.madvise(_MADV_POPULATE_WRITE)
    except OSError:  # an older kernel: a write per page faults each in
        for offset in range(0, size, PAGE):
            m[offset] = 0
    return m, asked


class BufferPool:
    """``count`` buffers of ``size`` bytes; ``free`` lists those not in use.

    ``huge``: the kernel was asked for huge pages and has them enabled (it
    may still fall back to 4 KiB pages where it finds no free 2 MiB ones).
    """

    def __init__(self, size: int, count: int) -> None:
        self.size = size
        allocated = [_allocate(size) for _ in range(count)]
        self.maps = [m for m, _ in allocated]
        self.huge = _huge_pages_enabled() and all(asked for _, asked in allocated)
        self.views = [memoryview(m) for m in self.maps]
        self.free: list[memoryview] = list(self.views)
        self._undo: list[Callable[[], None]] = []
        # Holds the mappings (not the pool): they stay mapped until it has run.
        self._release = weakref.finalize(self, _unmap, self.maps, self.views, self._undo)

    @property
    def count(self) -> int:
        return len(self.maps)

    def before_unmap(self, undo: Callable[[], None]) -> None:
        """Have ``undo`` run before the buffers are unmapped (it must not refer to the pool)."""
        self._undo.append(undo)

    def close(self) -> None:
        """Run the ``before_unmap`` calls, then unmap the buffers; one still referenced elsewhere goes with that."""
        self.free.clear()
        self._release()


def _unmap(maps: list[mmap.mmap], views: list[memoryview], undo: list[Callable[[], None]]) -> None:
    for call in undo:
        call()
    undo.clear()
    for view, m in zip(views, maps, strict=True):
        with contextlib.suppress(BufferError):
            view.release()
            m.close()
    views.clear()
    maps.clear()
