"""What ``fp-dcp bench`` compares: a method (a way to save, and the loads of what it saved) and its measured runs."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

__all__ = ["Step", "Runs", "Method"]

Step = Callable[[str], Any]  # a save or load of a path; a float it returns: the seconds it took by its own clock


class Runs:
    """One kind of transfer of one method, over the repeats: GB/s, CPU-s/GB, the disk's queue and request size."""

    def __init__(self) -> None:
        self.gbps: list[float] = []
        self.cpu_per_gb: list[float] = []
        self.in_flight: list[float] = []
        self.request_kib: list[float] = []

    def summary(self) -> dict[str, Any]:
        """Medians; None for a figure never measured."""

        def med(values: list[float]) -> float | None:
            return statistics.median(values) if values else None

        return {
            "gbps": med(self.gbps),
            "cpu_s_per_gb": med(self.cpu_per_gb),
            "in_flight": med(self.in_flight),
            "request_kib": med(self.request_kib),
            "runs_gbps": self.gbps,
        }


class Method:
    """A way to save, and the loads of what it saved: ``loads`` by target kind (``fresh``, ``touched``, or
    ``disk`` for a read that fills none); ``check`` runs after each load, untimed; ``child``: it runs as a
    child process, so its CPU time is the children's. ``beside``: by target kind, references timed right after
    that load, before its check (its targets still held); a reference has no ``save`` and runs only there.
    ``place`` maps the path it is given in the benchmark's directory to where it writes instead (tmpfs);
    ``prepare(path)`` runs before each save, off the clock. A step that returns seconds (fio's own clock) is
    timed by them instead of by the call (a step may return anything else too: ``torch.load``)."""

    def __init__(
        self,
        name: str,
        save: Step | None,
        loads: dict[str, Step] | None = None,
        check: Callable[[], None] | None = None,
        *,
        child: bool = False,
        beside: dict[str, Method] | None = None,
        place: Callable[[str], str] | None = None,
        prepare: Callable[[str], None] | None = None,
    ) -> None:
        self.name = name
        self.save = save
        self.loads = loads or {}
        self.check = check
        self.child = child
        self.beside = beside or {}
        self.place = place  # where its path in the work directory goes instead (tmpfs); None: there
        self.prepare = prepare  # run before each save, untimed
        self.saved = Runs()
        self.peak_rss: list[int] = []
        self.loaded = {kind: Runs() for kind in self.loads}
