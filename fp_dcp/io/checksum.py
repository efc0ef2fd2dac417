"""CRC-32C (and the copy fused with it) of large byte ranges, over several threads.

One core checksums at 10-20 GB/s and copies at 6-10: where bytes arrive
faster than that (the page cache, tmpfs, a node's NVMe drives, a GPU) one
thread is the limit. A large range is cut into slices; the calling thread
takes the first, pool threads the others, each checksumming its own slice
from zero; ``crc32c_combine`` then joins the slices' CRCs, so the result is
the one a single pass gives. Small ranges, and ranges whose bytes also feed
a running XXH3-128 (which cannot be split), stay in the calling thread.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait

from .. import _cio
from ..units import MiB
from .userfault import UserfaultFiller

__all__ = ["Checksummer", "MIN_SLICE"]

MIN_SLICE = 4 * MiB  # a task costs ~20 us; 4 MiB take ~400 us on one core


class Checksummer:
    """Checksums and copies with up to ``threads`` threads, the caller's among them."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None  # made on first use: a load of small items never needs it

    def crc32c(self, data: memoryview, crc: int = 0, hasher: _cio.Hash128 | None = None) -> int:
        """``_cio.crc32c(data, crc, hasher)``, over several threads where ``data`` is large and no hasher."""
        if hasher is not None:
            return _cio.crc32c(data, crc, hasher)
        return self._sliced(_cio.crc32c, (data,), crc)

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
        return self._sliced(_cio.copy_crc32c if into is None else into.copy_crc32c, (dst, src), crc)

    def _sliced(self, run: Callable[..., int], views: tuple[memoryview, ...], crc: int) -> int:
        """``run(*views, crc)``: the views cut into slices, run on the threads, their CRCs joined in order."""
        n = views[-1].nbytes
        count = min(self.threads, n // MIN_SLICE)
        if count <= 1:
            return run(*views, crc)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="fp-dcp-crc")
        flat = [v if v.format == "B" and v.ndim == 1 else v.cast("B") for v in views]
        step = -(-n // count)
        slices = [(start, min(step, n - start)) for start in range(0, n, step)]
        tasks = [self._pool.submit(run, *(v[start : start + k] for v in flat), 0) for start, k in slices[1:]]
        start, k = slices[0]
        try:
            crc = run(*(v[start : start + k] for v in flat), crc)
        except BaseException:
            wait(tasks)  # none may still write into memory the caller goes on to release
            raise
        for (_, k), task in zip(slices[1:], tasks, strict=True):
            crc = _cio.crc32c_combine(crc, task.result(), k)
        return crc

    def close(self) -> None:
        """Stop the threads (a later call starts them again)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
