"""A background thread that runs one kind of tier work (replication, or the drain) in the order it was queued.

Each kind has a process group of its own, and all ranks queue the same jobs
in the same order, so every rank's thread makes the same collective calls in
the same order without further agreement.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Callable

from ..log import log

__all__ = ["Worker"]

_NICE = 10


class Worker:
    """Runs queued jobs one after another on a daemon thread; ``steps()`` tells which steps they concern."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.Queue[tuple[int, Callable[[], None]] | None] = queue.Queue()
        self._steps: list[int] = []  # queued or running, oldest first
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._run, name=f"fp-dcp-{name}", daemon=True)
        self._thread.start()

    def submit(self, step: int, job: Callable[[], None]) -> None:
        with self._lock:
            self._steps.append(step)
        self._jobs.put((step, job))

    def steps(self) -> set[int]:
        """The steps of the jobs queued or running."""
        with self._lock:
            return set(self._steps)

    def wait(self, timeout: float | None = None) -> bool:
        """Until every job queued so far has run, or ``timeout`` seconds passed: whether they all ran."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._steps, timeout)

    def close(self) -> None:
        """Run what is queued, then stop the thread."""
        self._jobs.put(None)
        self._thread.join()

    def _run(self) -> None:
        # Background copies yield the CPU to training and to the saves themselves (Linux: nice is per thread).
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _NICE)
        while (entry := self._jobs.get()) is not None:
            step, job = entry
            try:
                job()
            except BaseException as e:  # a job reports its own failures; this is a bug, not a tier error
                log.error("fp-dcp: %s of step %d failed unexpectedly: %r", self.name, step, e, exc_info=True)
            finally:
                with self._idle:
                    self._steps.remove(step)
                    self._idle.notify_all()
