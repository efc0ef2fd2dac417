"""Measuring a step as the benchmarks do: a quiet disk first, then its seconds and CPU-seconds, its GB/s.

- ``quiesce()``: dirty pages written back and, as root, the kernel's caches
  dropped, so that a timed save meets a disk with nothing of the step
  before it pending and a timed load reads from the disk;
- ``timed(run)``: the seconds and the CPU-seconds (this process's, and with
  ``children=True`` its children's: fio, a process pool) of one call; with
  ``device="cuda"`` the device is synchronized before the clock starts and
  before it stops, so that queued copies count; with ``barrier=True`` the
  step runs from a barrier of the default process group to another, so that
  every rank's figure is the slowest rank's time;
- ``rates(run, nbytes, repeats)``: GB/s of repeated calls, warm-ups left out.

The workload (the Llama-shaped state, load targets, evicting one
checkpoint's pages, the CPU meters) is ``fp_dcp.tools.workload``'s, which
``fp-dcp bench`` measures with too; fio is ``fp_dcp.tools.fio``.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..tools.workload import cpu_seconds, drop_caches

__all__ = ["GB", "quiesce", "Timing", "timed", "rates"]

GB = 1e9


def quiesce() -> None:
    """``os.sync()``, then (as root) the page cache, dentries and inodes dropped; without root only the sync."""
    os.sync()
    drop_caches(3)


@dataclasses.dataclass(frozen=True)
class Timing:
    """What one timed call took: wall seconds and CPU-seconds (user + system)."""

    seconds: float
    cpu_seconds: float

    def gbps(self, nbytes: float) -> float:
        """``nbytes`` over the seconds, in GB/s."""
        return nbytes / self.seconds / GB

    def cpu_s_per_gb(self, nbytes: float) -> float:
        """CPU-seconds per GB of ``nbytes``."""
        return self.cpu_seconds / (nbytes / GB)


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _cpu(children: bool) -> float:
    return cpu_seconds() + (cpu_seconds(resource.RUSAGE_CHILDREN) if children else 0.0)


def timed(run: Callable[[], object], *, device: str = "cpu", barrier: bool = False, children: bool = False) -> Timing:
    """One call of ``run``: its seconds and this process's CPU-seconds (and its children's, with ``children``).

    ``device``: a ``cuda`` device is synchronized before and after. ``barrier``: from a ``dist.barrier()``
    before to one after, so that the seconds are the slowest rank's (the CPU-seconds stay this rank's)."""
    _synchronize(device)
    if barrier:
        dist.barrier()
    cpu, start = _cpu(children), time.perf_counter()
    run()
    _synchronize(device)
    if barrier:
        dist.barrier()
    return Timing(time.perf_counter() - start, _cpu(children) - cpu)


def rates(
    run: Callable[[], object], nbytes: float, repeats: int, *, device: str = "cpu", warm_ups: int = 0
) -> list[float]:
    """GB/s of ``nbytes`` for each of ``repeats`` timed calls of ``run``, after ``warm_ups`` untimed ones (a first
    save maps its buffers, page-locks them and builds its kernels)."""
    for _ in range(warm_ups):
        run()
        _synchronize(device)
    return [timed(run, device=device).gbps(nbytes) for _ in range(repeats)]
