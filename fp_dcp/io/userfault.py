"""Filling a load's untouched targets page by page, without the kernel clearing them first (userfaultfd).

A target nobody has written yet (``torch.empty``, a meta-device model after
``to_empty()``) costs a load three passes over its memory: the kernel
clears each page at its first touch (``io.prefault`` moves that off the
reads' path, but the CPU still pays it), then the bytes are copied over the
zeros. With a userfaultfd, the load registers such a target's untouched
pages and installs each one with its bytes already in it (``UFFDIO_COPY``):
one copy, no clearing, no fault, and clearly less CPU than faulting in,
then copying (docs/benchmarks.md, "Fresh targets filled through a
userfaultfd").

What keeps it invisible to everything else in the process:

- only loads whose reads all go through staging buffers register anything:
  the kernel's own access to a registered page that is still missing (a
  read from the file straight into it) fails (``UFFD_USER_MODE_ONLY``, the
  mode that needs no privilege);
- a target is registered only when every whole page inside it is untouched
  (``mincore``) and it overlaps no target registered before; every copy
  into host memory during the load goes through ``copy_crc32c``, which
  installs registered pages and copies into the rest, so targets that
  share memory (tied weights) are filled either way;
- any other thread that touches a registered page before it is filled gets
  the zero page its first fault would have given it, from a thread that
  answers the userfaultfd (``serve_faults``), and goes on;
- every registration ends with the load: ``close`` (also when the load
  fails) unregisters every range and closes the userfaultfd, and pages
  never filled fault in as zeros from then on, as before.

Where the kernel refuses a userfaultfd (older than Linux 5.11, or a seccomp
filter: Docker's default profile) or the memory (not anonymous or shared
memory), targets are faulted in ahead of the reads as before.
``IOConfig.prepare_targets=False`` turns this off with the rest.
"""

from __future__ import annotations

import bisect
import os
import threading

from .._native import _cio
from ..log import log_once

__all__ = ["UserfaultFiller"]

_refused = False  # the kernel refused a userfaultfd once: not asked again in this process


class UserfaultFiller:
    """One load's userfaultfd: the untouched targets registered with it, until ``close``."""

    def __init__(self) -> None:
        self._fd: int | None = None  # opened at the first registration
        self._stop: tuple[int, int] | None = None  # a pipe: a byte written into it ends the fault server
        self._server: threading.Thread | None = None
        self._starts: list[int] = []  # the registered address ranges, disjoint, in order
        self._ends: list[int] = []

    def register(self, memory: memoryview) -> bool:
        """Register ``memory``'s whole pages, if none of them is touched and they overlap no registered ones;
        whether they were (not: some touched, none whole, or the kernel refuses)."""
        global _refused
        start = _cio.address(memory)
        if _refused or self._overlapping(start, start + memory.nbytes):
            return False
        try:
            if self._fd is None:
                self._open()
            assert self._fd is not None
            span = _cio.register_untouched(self._fd, memory)
        except OSError as e:
            if self._fd is None:
                _refused = True
                log_once(f"fp-dcp: loads fault untouched targets in, then copy: userfaultfd refused: {e}")
            return False  # this memory only (another userfaultfd's, or not anonymous): faulted in as before
        if span is None:
            return False
        at = bisect.bisect(self._starts, span[0])
        self._starts.insert(at, span[0])
        self._ends.insert(at, span[1])
        return True

    def copy_crc32c(self, dst: memoryview, src: memoryview, crc: int = 0) -> int:
        """``_cio.copy_crc32c(dst, src, crc)``, the registered pages of ``dst`` installed with their bytes."""
        start = _cio.address(dst)
        spans = self._overlapping(start, start + dst.nbytes)
        if not spans:
            return _cio.copy_crc32c(dst, src, crc)
        assert self._fd is not None
        at = 0
        for k, (lo, hi) in enumerate(spans):  # each piece up to a span's end; bytes outside spans copied plainly
            stop = dst.nbytes if k == len(spans) - 1 else hi - start
            crc = _cio.fill_crc32c(self._fd, lo, hi, dst[at:stop], src[at:stop], crc)
            at = stop
        return crc

    def close(self) -> None:
        """End every registration: pages never filled fault in as zeros from now on."""
        if self._fd is not None:
            for span in zip(self._starts, self._ends, strict=True):
                try:  # not left to the fd's closing: a child forked meanwhile holds the fd too
                    _cio.unregister(self._fd, *span)
                except OSError as e:
                    log_once(f"fp-dcp: ending a load target's userfaultfd registration failed: {e}")
        if self._stop is not None:
            os.write(self._stop[1], b"x")  # not its closing: a child forked meanwhile holds the pipe too
            assert self._server is not None
            self._server.join()
            os.close(self._stop[0])
            os.close(self._stop[1])
            self._stop = self._server = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._starts.clear()
        self._ends.clear()

    def _open(self) -> None:
        fd = _cio.userfaultfd()
        try:
            stop = os.pipe()
        except OSError:
            os.close(fd)
            raise
        self._fd, self._stop = fd, stop
        self._server = threading.Thread(target=_serve, args=(fd, stop[0]), name="fp-dcp-userfault", daemon=True)
        self._server.start()

    def _overlapping(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """The registered ranges that overlap ``[lo, hi)``, in order."""
        spans = []
        for at in range(bisect.bisect_right(self._ends, lo), len(self._starts)):
            if self._starts[at] >= hi:
                break
            spans.append((self._starts[at], self._ends[at]))
        return spans


def _serve(fd: int, stop: int) -> None:
    try:
        _cio.serve_faults(fd, stop)
    except OSError as e:  # a thread that touched a page then waits until close ends the registrations
        log_once(f"fp-dcp: answering faults in untouched load targets failed: {e}")
