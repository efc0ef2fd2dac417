"""Progress of long transfers, reported through logging (quiet unless asked for).

Saves and loads log ``fp-dcp <what>: 1.20/4.00 GB, 1.90 GB/s, ETA 2 s`` on the
``fp_dcp`` logger at INFO level, at most every ``interval`` seconds, plus a
final line. Python's default logging level (WARNING) keeps library use quiet;
``logging.getLogger("fp_dcp").setLevel(logging.INFO)`` (with a handler) turns
the lines on. A ``callback(done, total)`` (the CLI's progress bar) is called
on every advance.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ..log import log

__all__ = ["ProgressCallback", "Progress", "progress_text"]


def progress_text(done: int, total: int, seconds: float) -> str:
    """``1.20/4.00 GB, 1.50 GB/s, ETA 2 s``: sizes in the unit that suits the total, the rate in its own."""

    def unit(n: float) -> tuple[float, str]:
        return next((s, u) for s, u in ((1e9, "GB"), (1e6, "MB"), (1.0, "B")) if n >= s or s == 1.0)

    scale, name = unit(total)
    rate = done / seconds if seconds > 0 else 0.0
    rate_scale, rate_name = unit(rate)
    eta = f"ETA {(total - done) / rate:.0f} s" if rate > 0 and done < total else f"{seconds:.1f} s"
    digits = 0 if name == "B" else 2
    return f"{done / scale:.{digits}f}/{total / scale:.{digits}f} {name}, {rate / rate_scale:.2f} {rate_name}/s, {eta}"


ProgressCallback = Callable[[int, int], None]


class Progress:
    """Counts bytes towards ``total``, logs the rate and the time left, and tells ``callback``."""

    def __init__(self, what: str, total: int, interval: float = 5.0, callback: ProgressCallback | None = None) -> None:
        self.what = what
        self.total = total
        self.done = 0
        self.interval = interval
        self.callback = callback
        self.start = self.last = time.perf_counter()
        self.enabled = log.isEnabledFor(logging.INFO)
        if callback is not None:
            callback(0, total)

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        if self.callback is not None:
            self.callback(self.done, self.total)
        if self.enabled and time.perf_counter() - self.last >= self.interval:
            self._log()

    def finish(self) -> None:
        if self.enabled:
            self._log()

    def _log(self) -> None:
        self.last = time.perf_counter()
        log.info("fp-dcp %s: %s", self.what, progress_text(self.done, self.total, self.last - self.start))
