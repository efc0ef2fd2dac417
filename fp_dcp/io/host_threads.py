"""The host threads: CRC-32C (and the copy fused with it) of large byte ranges over several threads, and tasks
run side by side (a save's files written by the threads, ``save.thread_writes``).

One core checksums and copies only so fast: where bytes arrive faster than
that (the page cache, tmpfs, a node's NVMe drives, a GPU) one thread is the
limit (docs/benchmarks.md, "Figures behind design comments"). A large range
is cut into slices; the calling thread takes the first, pool threads the
others, each checksumming its own slice from zero; ``crc32c_combine`` then
joins the slices' CRCs, so the result is
the one a single pass gives. Small ranges, and ranges whose bytes also feed
a running XXH3-128 (which cannot be split), stay in the calling thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait

from .._native import _cio
from ..units import MiB
from .files import DataFile, short_read
from .userfault import UserfaultFiller

__all__ = ["HostThreads", "ONE_THREAD", "MIN_SLICE", "BOUNCE"]

# The measurements behind both: docs/benchmarks.md, "Figures behind design comments".
MIN_SLICE = 4 * MiB  # a slice takes one core many times what handing it to a pool thread costs
BOUNCE = 256 << 10  # read_crc32c's buffer: stays in a core's cache (smaller and larger ones ran alike from tmpfs)


def _bytes(view: memoryview) -> memoryview:
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class HostThreads:
    """Up to ``count`` threads, the caller's among them, that checksum and copy (sliced) and run tasks side by
    side (``run_all``)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._pool: ThreadPoolExecutor | None = None  # made on first use: a load of small items never needs it
        self._bounce = threading.local()  # each thread's buffer for read_crc32c

    def crc32c(self, data: memoryview, crc: int = 0, hasher: _cio.Hash128 | None = None) -> int:
        """``_cio.crc32c(data, crc, hasher)``, over several threads where ``data`` is large and no hasher."""
        if hasher is not None:
            return _cio.crc32c(data, crc, hasher)
        flat = _bytes(data)
        return self._sliced(lambda at, n, c: _cio.crc32c(flat[at : at + n], c), flat.nbytes, crc)

    def copy_crc32c(
        self,
        dst: memoryview,
        src: memoryview,
        crc: int = 0,
        hasher: _cio.Hash128 | None = None,
        into: UserfaultFiller | None = None,
    ) -> int:
        """``_cio.copy_crc32c(dst, src, crc, hasher)``, over several threads where large and no hasher; ``into``:
        the load's userfaultfd, which installs the pages of ``dst`` registered with it (``io.userfault``; with a
        hasher, they fault in, answered as zeros, and are copied into)."""
        if hasher is not None:
            return _cio.copy_crc32c(dst, src, crc, hasher)
        copy = _cio.copy_crc32c if into is None else into.copy_crc32c
        out, flat = _bytes(dst), _bytes(src)
        return self._sliced(lambda at, n, c: copy(out[at : at + n], flat[at : at + n], c), flat.nbytes, crc)

    def read_crc32c(self, f: DataFile, offset: int, dst: memoryview, crc: int = 0) -> int:
        """Fill ``dst`` from ``f`` at ``offset`` through a small buffer per thread (``_cio.read_crc32c``), over
        several threads where large; the CRC-32C of the bytes, continued from ``crc``. For files in memory,
        where a read is a copy the CPU makes. Raises ``ShortReadError`` where the file ends first."""
        out = _bytes(dst)

        def read(at: int, n: int, c: int) -> int:
            bounce = getattr(self._bounce, "buffer", None)
            if bounce is None:
                bounce = self._bounce.buffer = bytearray(BOUNCE)
            c, got = _cio.read_crc32c(f.fd, offset + at, out[at : at + n], bounce, c)
            if got < n:
                raise short_read(f.path, n, offset + at)
            return c

        return self._sliced(read, out.nbytes, crc)

    def run_all(self, tasks: Sequence[Callable[[], None]]) -> None:
        """Run ``tasks`` (at most ``count``) at once, the first in this thread; return once every one has ended,
        raising the first failure."""
        if len(tasks) > self.count:
            raise ValueError(f"run_all: {len(tasks)} tasks for {self.count} threads")
        if not tasks:
            return
        workers = self._workers()
        started = [workers.submit(task) for task in tasks[1:]]
        try:
            tasks[0]()
        finally:
            wait(started)
        for task in started:
            task.result()

    def _workers(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.count - 1, thread_name_prefix="fp-dcp-crc")
        return self._pool

    def _sliced(self, run: Callable[[int, int, int], int], n: int, crc: int) -> int:
        """``run(start, length, crc)`` over ``n`` bytes cut into slices, run on the threads, CRCs joined in order.
        Returns, or raises the first failure, only once every slice has ended: none may still write into memory
        the caller goes on to release."""
        count = min(self.count, n // MIN_SLICE)
        if count <= 1:
            return run(0, n, crc)
        step = -(-n // count)
        slices = [(start, min(step, n - start)) for start in range(0, n, step)]
        workers = self._workers()
        tasks = [workers.submit(run, start, k, 0) for start, k in slices[1:]]
        start, k = slices[0]
        try:
            crc = run(start, k, crc)
        finally:
            wait(tasks)
        for (_, k), task in zip(slices[1:], tasks, strict=True):
            crc = _cio.crc32c_combine(crc, task.result(), k)
        return crc

    def close(self) -> None:
        """Stop the threads (a later call starts them again)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


ONE_THREAD = HostThreads(1)  # the calling thread alone: where a copy is not split (it runs on a host thread already)
