"""Preparing the memory a load fills: huge pages asked for, and pages faulted in ahead of the reads.

Targets nobody has written yet (``torch.empty``, a meta-device model after
``to_empty()``) are untouched anonymous memory: each first write of a page
is a fault in which the kernel finds and clears it, several times slower
than a second write of the same page (docs/benchmarks.md, "Figures behind
design comments"). A load that takes those faults in the thread that also
keeps the reads going drains the disk's queue. So, for each target a load is
about to fill:

- ``advise_huge`` asks for transparent huge pages on its 2 MiB-aligned blocks
  that hold no page yet (never on memory already touched), synchronously: a
  2 MiB fault clears as much as 512 small ones, and a block in one huge page
  is one run of physical memory, so a direct read into it is not split into
  small requests (``io.device``). Only where the kernel's THP ``defrag``
  setting is ``defer`` or ``never``: with ``madvise`` (the kernel's default),
  ``defer+madvise`` or ``always``, a fault in advised memory compacts memory
  itself when no huge page is free, and that made loads into fresh targets
  slower and erratic against populating 4 KiB pages (docs/benchmarks.md,
  "Fresh and touched targets, the null sink");
- ``populate`` faults in every page that holds none yet (``MADV_POPULATE_WRITE``,
  Linux 5.14) on helper threads, a window ahead of the reads, in slices, so
  reads into the target's first slices can start while its last ones are
  still faulted in. Pages already there (targets written before) are
  skipped, found by ``mincore``: faulting them in again cost a touched-target
  load CPU for nothing (docs/benchmarks.md, "Figures behind design comments").

- where every read of the load goes through staging buffers, a target whose
  whole pages are all untouched is instead registered with the load's
  userfaultfd (``io.userfault``) and filled page by page from the buffers,
  never cleared (not where huge pages are asked for: those are read in place).

None of them changes a byte. ``IOConfig.prepare_targets=False`` turns them off.
"""

from __future__ import annotations

import mmap
from concurrent.futures import Future, ThreadPoolExecutor

from .._native import _cio
from ..log import log_once
from ..units import MiB
from .userfault import UserfaultFiller

__all__ = ["Prefaulter", "Prepared", "NOTHING_PREPARED", "SLICE", "populate_supported", "huge_pages_without_stalls"]

SLICE = 16 * MiB  # faulted in per task: the first reads of a large target wait for one slice, not all of it
_MIN_BYTES = 2 * MiB  # smaller targets are not worth a task: the copy into them faults them in quickly

_supported: bool | None = None
_THP = "/sys/kernel/mm/transparent_hugepage/"


def populate_supported() -> bool:
    """Whether the kernel has ``MADV_POPULATE_WRITE`` (Linux 5.14); asked once per process."""
    global _supported
    if _supported is None:
        probe = mmap.mmap(-1, mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            _cio.populate(memoryview(probe))
            _supported = True
        except OSError as e:
            log_once(f"fp-dcp: loads fault their targets in as they go: madvise(MADV_POPULATE_WRITE) failed: {e}")
            _supported = False
        finally:
            probe.close()
    return _supported


def huge_pages_without_stalls() -> bool:
    """Whether a fault in memory advised ``MADV_HUGEPAGE`` gets a huge page without compacting memory itself:
    transparent huge pages on (``always`` or ``madvise``) and ``defrag`` set to ``defer`` or ``never``."""
    try:
        with open(_THP + "enabled") as enabled, open(_THP + "defrag") as defrag:
            on, compaction = enabled.read(), defrag.read()
    except OSError:
        return False
    return "[never]" not in on and ("[defer]" in compaction or "[never]" in compaction)


class Prepared:
    """One target's memory being faulted in: slices in order, each a task of the prefaulter.

    ``huge`` lists the ``(offset, length)`` runs asked for huge pages.
    """

    __slots__ = ("huge", "_slices")

    def __init__(self, huge: list[tuple[int, int]], slices: list[tuple[int, Future[None]]]) -> None:
        self.huge = huge
        self._slices = slices  # (offset of the slice's end, its task)

    def wait(self, end: int) -> None:
        """Return once the memory before byte ``end`` is faulted in (or its task gave up)."""
        for stop, task in self._slices:
            task.result()
            if stop >= end:
                return


NOTHING_PREPARED = Prepared([], [])  # memory nobody prepares


class Prefaulter:
    """Helper threads that fault in load targets' memory, in the order they are handed over."""

    def __init__(self, threads: int, huge: bool | None = None) -> None:
        self.threads = threads
        self.huge = huge_pages_without_stalls() if huge is None else huge  # ask for huge pages (None: where cheap)
        self._pool: ThreadPoolExecutor | None = None  # made on first use

    def prepare(self, memory: memoryview, filler: UserfaultFiller | None = None) -> Prepared:
        """Ask for huge pages on ``memory``'s untouched blocks now; queue its faulting-in. With ``filler`` (the
        load copies into ``memory`` from staging buffers), where huge pages are not asked for and all of its
        pages are untouched, register them with ``filler`` instead."""
        if not self.threads or memory.nbytes < _MIN_BYTES or memory.readonly or not populate_supported():
            return NOTHING_PREPARED
        if filler is not None and not self.huge and filler.register(memory):
            return NOTHING_PREPARED  # filled page by page as its bytes arrive
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="fp-dcp-prefault")
        memory = memory if memory.format == "B" and memory.ndim == 1 else memory.cast("B")
        huge = _cio.advise_huge(memory) if self.huge else []
        slices = []
        for start in range(0, memory.nbytes, SLICE):
            stop = min(start + SLICE, memory.nbytes)
            slices.append((stop, self._pool.submit(_populate, memory[start:stop])))
        return Prepared(huge, slices)

    def close(self) -> None:
        """Drop what has not started, wait for what has: no thread touches a target after this (a later
        ``prepare`` starts the threads again)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


def _populate(memory: memoryview) -> None:
    try:
        _cio.populate(memory)
    except OSError:
        pass  # e.g. memory the kernel will not fault in writable: the read itself then says what is wrong
