"""Progress of long transfers, reported through logging (quiet unless asked for).

Saves and loads log ``fp-dcp <what>: 1.2/4.0 GB, 1.9 GB/s, ETA 1.5 s`` on the
``fp_dcp`` logger at INFO level, at most every ``interval`` seconds, plus a
final line. Python's default logging level (WARNING) keeps library use quiet;
``logging.getLogger("fp_dcp").setLevel(logging.INFO)`` (with a handler) turns
the lines on.
"""

from __future__ import annotations

import logging
import time

__all__ = ["Progress"]

log = logging.getLogger("fp_dcp")


class Progress:
    """Counts bytes towards ``total`` and logs the rate and the time left."""

    def __init__(self, what: str, total: int, interval: float = 5.0) -> None:
        self.what = what
        self.total = total
        self.done = 0
        self.interval = interval
        self.start = self.last = time.perf_counter()
        self.enabled = log.isEnabledFor(logging.INFO)

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        if self.enabled and time.perf_counter() - self.last >= self.interval:
            self._log()

    def finish(self) -> None:
        if self.enabled:
            self._log()

    def _log(self) -> None:
        now = time.perf_counter()
        self.last = now
        rate = self.done / (now - self.start) if now > self.start else 0.0
        eta = (self.total - self.done) / rate if rate else float("inf")
        log.info(
            "fp-dcp %s: %.2f/%.2f GB, %.2f GB/s, ETA %.1f s",
            self.what,
            self.done / 1e9,
            self.total / 1e9,
            rate / 1e9,
            max(eta, 0.0),
        )
