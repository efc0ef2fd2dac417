"""Page-aligned staging buffers in huge pages, allocated at their first use and reused.

Buffers are anonymous mappings, page-aligned for O_DIRECT, backed by
transparent huge pages where the kernel allows (``MADV_HUGEPAGE``) and
touched once at allocation, which is when a pool is first asked for them:

- A 2 MiB huge page is one run of physical memory, so a request written
  from it fills the device's largest request size, where 4 KiB pages would
  cap it (``io.device``).
- On virtual machines that hand freed memory back to the host, memory touched
  afresh is copied into several times slower than memory already faulted in.

A writer or reader keeps its pool for its whole life: the first pool of a
process faults in memory fresh from the host, many times slower than later
ones that reuse freed huge pages (docs/benchmarks.md, "Figures behind
design comments"). When a pool is closed (or collected: a reader made for
one ``dcp.load`` and dropped), its buffers wait ``SPARE_SECONDS`` for the
next pool of the same shape, which takes them as they are instead of
faulting in fresh memory: a reader made anew for each load, as the README's
example makes one, then starts with warm buffers, for a fraction of the CPU
fresh ones cost (the same section). One set waits at a time; past the wait
one daemon thread a process unmaps it.

Whoever registers the buffers somewhere that outlives a mapping (CUDA's
page-locking) records it with ``register``: the registration stays with the
buffers, also while they wait and in the next pool that takes them (a GPU
load through a reader made anew then finds its buffers page-locked, not
fresh memory to fault in and register again), and its undo runs before they
are unmapped, whatever ends them (``close`` of a pool whose buffers cannot
wait, the end of the wait, garbage collection, interpreter exit), so no
registration ever outlives its memory. A child made by ``fork`` forgets the
registrations of the sets waiting: they are its parent's.
"""

from __future__ import annotations

import atexit
import contextlib
import mmap
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable

from ..units import PAGE

__all__ = ["BufferPool", "ScratchBuffer", "SPARE_SECONDS", "release_spares"]

SPARE_SECONDS = 30.0  # how long a closed pool's buffers wait for the next pool of their shape; 0: not at all

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
    """``count`` buffers of ``size`` bytes, mapped at their first use; ``free`` lists those not in use.

    The buffers are mapped (or taken from a spare set) when first asked for
    (``views``, ``free``, a registration), not when the pool is made: a load
    that reads every byte in place (tmpfs and other buffered files, huge-page
    targets) never faults in memory it does not use (on a VM, memory new to
    the guest faults in slowly: a large share of a fast load's time;
    docs/benchmarks.md, "Figures behind design comments"). ``on_map`` is
    called with the buffers once they are mapped, before anyone uses them
    (the engine registers them with its ring).

    ``huge``: the kernel was asked for huge pages and has them enabled (it
    may still fall back to 4 KiB pages where it finds no free 2 MiB ones);
    before the buffers are mapped, whether it will be asked.
    """

    def __init__(self, size: int, count: int, on_map: Callable[[list[memoryview]], None] | None = None) -> None:
        self.size = size
        self.count = count
        self.huge = _huge_pages_enabled() and hasattr(mmap, "MADV_HUGEPAGE")
        self._on_map = on_map
        self._lock = threading.Lock()
        self._views: list[memoryview] | None = None
        self._free: list[memoryview] = []
        self._maps: list[mmap.mmap] = []
        self._registrations: Registrations = {}
        self._release: Callable[[], object] | None = None
        _start_reaper()

    def _mapped(self) -> list[memoryview]:
        views = self._views
        if views is not None:
            return views
        with self._lock:
            if self._views is None:
                spare = _take_spare(self.size, self.count)
                if spare is not None:
                    maps, asked, self._registrations = spare.maps, spare.asked, spare.registrations
                else:
                    allocated = [_allocate(self.size) for _ in range(self.count)]
                    maps, asked = [m for m, _ in allocated], all(a for _, a in allocated)
                self.huge = _huge_pages_enabled() and asked
                views = [memoryview(m) for m in maps]
                # Holds the mappings (not the pool): they stay mapped until it has run.
                self._release = weakref.finalize(self, _retire, self.size, maps, views, self._registrations, asked)
                if self._on_map is not None:
                    # Then let go of it: an engine kept alive by its pool would still hold the buffers (its ring's
                    # registration) when the pool's finalizer parks them, which would find them in use.
                    on_map, self._on_map = self._on_map, None
                    on_map(views)
                self._maps, self._free = maps, list(views)
                self._views = views
            return self._views

    @property
    def maps(self) -> list[mmap.mmap]:
        """The mappings behind ``views``, mapped now if not yet."""
        self._mapped()
        return self._maps

    @property
    def views(self) -> list[memoryview]:
        """Every buffer, mapped now if not yet."""
        return self._mapped()

    @property
    def free(self) -> list[memoryview]:
        """The buffers not in use, mapped now if not yet."""
        self._mapped()
        return self._free

    def register(self, name: str, state: object, undo: Callable[[], None]) -> None:
        """Record that ``name`` registered the buffers somewhere that outlives a mapping, with ``state`` (what it
        needs to know later, ``registration``) and ``undo``, which runs before the buffers are unmapped (it must
        not refer to the pool)."""
        self._mapped()
        self._registrations[name] = (state, undo)

    def registration(self, name: str) -> object | None:
        """The state ``name`` registered these buffers with, also in an earlier pool; None where it did not."""
        self._mapped()
        entry = self._registrations.get(name)
        return None if entry is None else entry[0]

    def close(self) -> None:
        """Leave the buffers, and what registered them, to the next pool of this shape for a while
        (``SPARE_SECONDS``); where anything still references one, undo the registrations and unmap them
        (that one goes with its last reference). Nothing to do where they were never mapped."""
        self._free.clear()
        if self._release is not None:
            self._release()


Registrations = dict[str, tuple[object, Callable[[], None]]]


class ScratchBuffer:
    """Plain memory of one transfer's own for the staged extents (small items gathered) of files the kernel
    copies anyway (tmpfs, the page cache), where the engine's alignment does not apply: grown to the largest
    extent asked for, its pages faulted in as they are written. A pool's first use faults in all of its buffers,
    which on a VM that hands freed memory back took longer than the whole of a load from tmpfs (docs/benchmarks.md,
    "Hugging Face loads and the memory tier")."""

    def __init__(self) -> None:
        self._memory = memoryview(bytearray())

    def take(self, nbytes: int) -> memoryview:
        """``nbytes`` of it, what was there before left in place."""
        if self._memory.nbytes < nbytes:
            self._memory = memoryview(bytearray(nbytes))
        return self._memory[:nbytes]


class _Spare:
    """A closed pool's buffers, mapped and populated, waiting for the next pool with their registrations."""

    __slots__ = ("size", "maps", "asked", "registrations")

    def __init__(self, size: int, maps: list[mmap.mmap], asked: bool, registrations: Registrations) -> None:
        self.size, self.maps, self.asked = size, maps, asked  # asked: whether huge pages were asked for
        self.registrations = registrations


# A pool's finalizer runs wherever the garbage collector does: in any thread, at any allocation, also inside
# threading's own locked sections. So it takes no lock and starts no thread: it appends to `_spares` (a list's
# append, pop and remove are atomic) and hands the set's deadline to the reaper through a SimpleQueue, whose
# put is documented as safe in finalizers. The reaper is started by the pools themselves, in plain code.
_spares: list[_Spare] = []
_deadlines: queue.SimpleQueue[tuple[float, _Spare]] = queue.SimpleQueue()
_reaper: threading.Thread | None = None
_reaper_lock = threading.Lock()  # taken by pools being made (plain code), never by a finalizer


def _take_spare(size: int, count: int) -> _Spare | None:
    for spare in list(_spares):
        if spare.size == size and len(spare.maps) == count:
            with contextlib.suppress(ValueError):
                _spares.remove(spare)
                return spare
    return None


def _unmap(spare: _Spare) -> None:
    """Undo what registered the buffers, then unmap them."""
    for _, undo in spare.registrations.values():
        undo()
    spare.registrations.clear()
    for m in spare.maps:
        with contextlib.suppress(BufferError):  # one still exported goes with its last reference
            m.close()


def _expire(spare: _Spare) -> None:
    with contextlib.suppress(ValueError):
        _spares.remove(spare)  # raises where a pool took it meanwhile: then it owns the buffers
        _unmap(spare)


def release_spares() -> None:
    """Unmap every set waiting for a pool now, undoing what registered it (page-locked memory given back)."""
    for spare in list(_spares):
        _expire(spare)


def _forget_registrations() -> None:
    for spare in _spares:
        spare.registrations.clear()


_exiting = False


def _at_exit() -> None:
    """No set may wait past the interpreter's exit: the undos run while the runtime they call is still up (this
    runs before the exit handlers of torch, which fp_dcp imports first, and the CUDA runtime's own teardown), and
    pools ended after this are not parked."""
    global _exiting
    _exiting = True
    release_spares()


os.register_at_fork(after_in_child=_forget_registrations)
atexit.register(_at_exit)


def _reap() -> None:
    """Unmap each parked set at its deadline, unless a pool took it first (one thread a process, idle between)."""
    waiting: list[tuple[float, _Spare]] = []
    while True:
        timeout = max(min(d for d, _ in waiting) - time.monotonic(), 0) if waiting else None
        with contextlib.suppress(queue.Empty):
            waiting.append(_deadlines.get(timeout=timeout))
        now = time.monotonic()
        for item in [w for w in waiting if w[0] <= now]:
            waiting.remove(item)
            _expire(item[1])


def _start_reaper() -> None:
    global _reaper
    with _reaper_lock:
        if _reaper is None or not _reaper.is_alive():  # not alive: none yet, or a child after fork
            _reaper = threading.Thread(target=_reap, name="fp-dcp-spare-buffers", daemon=True)
            _reaper.start()


def _unshared(m: mmap.mmap) -> bool:
    """Whether nothing but ``m`` itself refers to its memory: no slice or buffer of it is alive, so the next pool
    may write there unseen. mmap does not count its exports in public; a resize refuses while there are any, and
    one to the same size keeps the mapping where it is (Linux's mremap)."""
    try:
        m.resize(len(m))
    except (BufferError, OSError, ValueError, SystemError):
        return False
    return True


def _retire(
    size: int, maps: list[mmap.mmap], views: list[memoryview], registrations: Registrations, asked: bool
) -> None:
    """Park the buffers, with their registrations, as the one spare set; where that cannot be, undo the
    registrations and unmap them."""
    exported = False
    for view in views:
        try:
            view.release()
        except BufferError:  # a buffer taken from it (a tensor over it) still lives
            exported = True
    exported = exported or not all(_unshared(m) for m in maps)
    spare = _Spare(size, list(maps), asked, dict(registrations))
    views.clear()
    maps.clear()
    registrations.clear()
    if not exported and SPARE_SECONDS > 0 and not _exiting:
        _spares.append(spare)
        _deadlines.put((time.monotonic() + SPARE_SECONDS, spare))
        while len(_spares) > 1:  # one set waits: the newest
            with contextlib.suppress(IndexError):
                _expire(_spares[0])
        return
    _unmap(spare)
