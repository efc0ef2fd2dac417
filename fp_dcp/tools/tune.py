"""A short sweep of the I/O settings on one directory, printing the best to paste (after DeepSpeed's ds_nvme_tune).

    fp-dcp tune DIR [--budget 60] [--size-mb 512]

Saves a synthetic state dict (a few large tensors, which may be written
straight from their memory, and many small ones that go through the staging
buffers) into a scratch directory under ``DIR`` with ``FastPersistWriter``,
again and again, sweeping one setting at a time in the order of their usual
effect: ``direct_writes`` (writing large tensors in place against copying
every byte through huge pages, which sets the size of every request;
``IOConfig``'s auto choice is the current value), ``queue_depth``,
``block_size``, ``lanes_per_dir`` (files written at once), ``buffer_size``.
Within a setting, every candidate value and the current best are saved in
turn, round after round (A B C A B C ...), so a disk whose speed drifts
treats them alike. A save is measured by its data path's
throughput (``SaveSummary.gbps``: from resolving the items to the fsync,
which is what these settings change; publishing ``.metadata`` does not
depend on them). A candidate replaces the current value only if it was
faster than it by more than ``min_gain`` (5 %) in every round, and among
such candidates the one with the highest median speed-up wins: on a shared
disk single saves vary by tens of percent, so anything less consistent is
noise, and the defaults win ties. Another
round starts only if the estimate of its time fits in the budget, so the
sweep ends within ``budget_s`` (60 s), whatever the disk; settings it had no
time for keep their current value and are reported as untried.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict_saver import save

from .. import FastPersistWriter, IOConfig, engine_info
from ..units import MiB

__all__ = ["AXES", "Axis", "AxisResult", "Setting", "TuneResult", "synthetic_state", "tune"]

log = logging.getLogger(__name__)


Value = int | bool | None  # None: IOConfig's auto choice (direct_writes)


@dataclasses.dataclass(frozen=True)
class Axis:
    """One setting the sweep varies: an ``IOConfig`` field or ``lanes_per_dir``."""

    name: str
    values: tuple[Value, ...]


AXES = (
    Axis("direct_writes", (True, False)),
    Axis("queue_depth", (2, 4, 8, 16, 32)),
    Axis("block_size", tuple(m * MiB for m in (4, 8, 16, 32, 64))),
    Axis("lanes_per_dir", (1, 2, 4)),
    Axis("buffer_size", tuple(m * MiB for m in (8, 16, 32, 64))),
)


@dataclasses.dataclass(frozen=True)
class Setting:
    """A candidate: I/O settings plus the writer's lanes."""

    config: IOConfig
    lanes_per_dir: int = 1

    def with_value(self, axis: str, value: Value) -> Setting:
        if axis == "lanes_per_dir":
            assert isinstance(value, int)
            return dataclasses.replace(self, lanes_per_dir=value)
        field: dict[str, Any] = {axis: value}  # one of IOConfig's fields, by name
        return dataclasses.replace(self, config=dataclasses.replace(self.config, **field))

    def value(self, axis: str) -> Value:
        return self.lanes_per_dir if axis == "lanes_per_dir" else getattr(self.config, axis)


@dataclasses.dataclass(frozen=True)
class AxisResult:
    """The sweep of one setting: GB/s of every save of each value, and the value kept."""

    axis: str
    runs: dict[Value, list[float]]
    chosen: Value

    def median(self, value: Value) -> float:
        return statistics.median(self.runs[value])


@dataclasses.dataclass(frozen=True)
class TuneResult:
    """What ``tune`` measured and chose."""

    directory: str
    engine: dict[str, Any]
    state_bytes: int
    baseline: Setting
    best: Setting
    axes: tuple[AxisResult, ...]
    untried: tuple[str, ...]  # settings the budget left no time for
    seconds: float

    def config_line(self) -> str:
        """``IOConfig(...)`` with the fields that differ from the defaults, ready to paste."""
        return _config_source(self.best.config)

    def writer_line(self) -> str:
        lanes = f"lanes_per_dir={self.best.lanes_per_dir}, " if self.best.lanes_per_dir != 1 else ""
        return f"FastPersistWriter(path, {lanes}config={self.config_line()})"


def _config_source(config: IOConfig) -> str:
    defaults = IOConfig()
    args = []
    for axis in AXES:
        if axis.name == "lanes_per_dir":
            continue
        value = getattr(config, axis.name)
        if value != getattr(defaults, axis.name):
            sized = axis.name.endswith("_size") and value % MiB == 0
            args.append(f"{axis.name}={value >> 20} << 20" if sized else f"{axis.name}={value}")
    return f"IOConfig({', '.join(args)})"


def synthetic_state(total_bytes: int) -> dict[str, torch.Tensor]:
    """About ``total_bytes`` of tensors: 7/8 in large bf16 matrices, 1/8 in 64 KiB fp32 vectors.

    The large ones may be written straight from their memory
    (``direct_writes``), the small ones are packed into the staging buffers,
    as the parameters and the norms, biases and optimizer scalars of a real
    model are. Contents are irrelevant to the
    disk, so they are filled, not drawn at random (which would take longer
    than saving them).
    """
    small_bytes = 64 * 1024
    n_small = max(1, total_bytes // 8 // small_bytes)
    large_total = max(0, total_bytes - n_small * small_bytes)
    n_large = max(1, min(8, large_total // (4 * MiB)))
    cols = 4096
    rows = max(1, large_total // n_large // (2 * cols))
    state: dict[str, torch.Tensor] = {}
    for i in range(n_large):
        state[f"layers.{i}.weight"] = torch.empty(rows, cols, dtype=torch.bfloat16).fill_(i + 1)
    for i in range(n_small):
        state[f"small.{i}"] = torch.empty(small_bytes // 4, dtype=torch.float32).fill_(i)
    return state


def tune(
    directory: str | os.PathLike[str],
    *,
    budget_s: float = 60.0,
    size_bytes: int = 512 * MiB,
    repeats: int = 3,
    min_gain: float = 0.05,
    base: IOConfig | None = None,
    on_axis: Callable[[AxisResult], None] | None = None,
) -> TuneResult:
    """Sweep the I/O settings on ``directory`` within ``budget_s`` seconds and return the best.

    Args:
        directory: where checkpoints will be written (created if missing, as
            the writer creates a checkpoint's directory; a scratch directory is
            made in it and removed afterwards; it needs room for twice
            ``size_bytes``).
        budget_s: wall-clock bound of the whole sweep, state creation included.
        size_bytes: size of the synthetic state dict (held in memory).
        repeats: rounds per setting; each value's score is its median.
        min_gain: relative speed-up a value needs to replace the current one.
        base: the settings to start from (default ``IOConfig()``).
        on_axis: called after each setting's sweep (the CLI prints it).
    """
    start = time.perf_counter()
    deadline = start + budget_s
    directory = os.fspath(directory)
    try:
        os.makedirs(directory, exist_ok=True)  # before the state: a bad path fails at once
    except OSError as e:
        raise OSError(
            e.errno, f"cannot tune {directory}: no such directory, and it cannot be created ({e.strerror})"
        ) from None
    state = synthetic_state(size_bytes)
    state_bytes = sum(t.nbytes for t in state.values())
    baseline = Setting(base if base is not None else IOConfig())
    scratch = tempfile.mkdtemp(prefix=".fp-dcp-tune-", dir=directory)
    best = baseline
    done: list[AxisResult] = []
    untried: list[str] = []
    save_seconds: float | None = None  # estimate of one save, measured as we go
    try:
        info = engine_info(scratch, baseline.config)
        for axis in AXES:
            result, save_seconds = _sweep(axis, best, state, scratch, repeats, min_gain, deadline, save_seconds)
            if result is None:
                untried.append(axis.name)
                continue
            done.append(result)
            best = best.with_value(axis.name, result.chosen)
            log.info("fp-dcp tune: %s: GB/s by value %s, chose %s", axis.name, result.runs, result.chosen)
            if on_axis is not None:
                on_axis(result)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return TuneResult(
        directory=directory,
        engine=info,
        state_bytes=state_bytes,
        baseline=baseline,
        best=best,
        axes=tuple(done),
        untried=tuple(untried),
        seconds=time.perf_counter() - start,
    )


def _sweep(
    axis: Axis,
    current: Setting,
    state: dict[str, torch.Tensor],
    scratch: str,
    repeats: int,
    min_gain: float,
    deadline: float,
    save_seconds: float | None,
) -> tuple[AxisResult | None, float | None]:
    """Rounds over ``axis``'s values around ``current`` while the budget allows; None if not one round fit.

    ``save_seconds`` is the running estimate of one save, returned updated.
    """
    values = sorted({*axis.values, current.value(axis.name)}, key=lambda v: (v is not None, v))  # auto first
    writers = {}
    for v in values:
        setting = current.with_value(axis.name, v)
        writers[v] = FastPersistWriter(scratch, lanes_per_dir=setting.lanes_per_dir, config=setting.config)
    runs: dict[Value, list[float]] = {v: [] for v in values}
    try:
        for round_ in range(repeats):
            first = round_ == 0  # a writer's first save also allocates its buffers: count it double
            if save_seconds is not None and time.perf_counter() + len(values) * save_seconds * (1 + first) > deadline:
                break
            got: dict[Value, float] = {}
            for v in values:
                if time.perf_counter() + (save_seconds or 0.0) * (1 + first) > deadline:
                    break  # only possible before the first estimate: the very first round
                gbps, seconds = _save(writers[v], state, warm=first)
                save_seconds = seconds if save_seconds is None else 0.5 * (save_seconds + seconds)
                got[v] = gbps
            if len(got) < len(values):
                break  # a partial round would favour the values it reached
            for v, gbps in got.items():
                runs[v].append(gbps)
    finally:
        for w in writers.values():
            w.close()
    if not runs[values[0]]:
        return None, save_seconds
    here = current.value(axis.name)
    chosen, best_ratio = here, 1.0
    for v in values:
        # Compare within rounds: saves next to each other see the same disk.
        ratios = [a / b for a, b in zip(runs[v], runs[here], strict=True)]
        if v != here and min(ratios) > 1 + min_gain and statistics.median(ratios) > best_ratio:
            chosen, best_ratio = v, statistics.median(ratios)
    return AxisResult(axis.name, runs, chosen), save_seconds


def _save(writer: FastPersistWriter, state: dict[str, torch.Tensor], *, warm: bool) -> tuple[float, float]:
    """GB/s of one save's data path and the save's wall time; ``warm`` first allocates the writer's buffers."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        if warm:
            save({"warm_up": torch.zeros(1)}, storage_writer=writer, no_dist=True)
        start = time.perf_counter()
        save(state, storage_writer=writer, no_dist=True)
        seconds = time.perf_counter() - start
    if writer.last_save is None:
        raise RuntimeError("FastPersistWriter recorded no summary of the save")
    return writer.last_save.gbps, seconds
