"""A short sweep of the I/O settings on one directory, printing the best to paste (after DeepSpeed's ds_nvme_tune).

    fp-dcp tune DIR [--budget 60] [--size-mb 512]

First the disk's limit: fio writing, then reading, a file the size of the
state, from buffers in huge pages (``fp_dcp.tools.fio``), each run stopped at
its share of a tenth of the budget; fio's own GB/s is the reference printed.

Then saves of a synthetic state dict (a few large tensors, which may be
written straight from their memory, and many small ones that go through the
staging buffers) into a scratch directory under ``DIR`` with
``FastPersistWriter``, again and again, sweeping one setting at a time in the
order of their usual effect: ``direct_writes`` (writing large tensors in
place against copying every byte through huge pages, which sets the size of
every request; ``IOConfig``'s auto choice is the current value),
``queue_depth``, ``block_size``, ``lanes_per_dir`` (files written at once),
``buffer_size``. A save is measured by its data path's throughput
(``SaveSummary.gbps``: from resolving the items to the fsync, which is what
these settings change; publishing ``.metadata`` does not depend on them).

Then cold loads of that state, saved once with the best save settings, with
``FastPersistReader`` (the checkpoint evicted from the page cache before
each, as ``fp-dcp bench`` does), sweeping the settings the read pipeline
uses, from the same starting settings: ``direct_reads``, ``queue_depth``,
``block_size``, ``buffer_size`` (the largest staged read) and
``num_buffers`` (staged reads in flight), measured by ``LoadSummary.gbps``.

Within a setting, every candidate value and the current best are run in
turn, round after round (A B C A B C ...), so a disk whose speed drifts
treats them alike. A candidate replaces the current value only if it was
faster than it by more than ``min_gain`` (5 %) in every round, and among
such candidates the one with the highest median speed-up wins: on a shared
disk single saves vary by tens of percent, so anything less consistent is
noise, and the defaults win ties. The saves get half of the budget fio
leaves, the loads the rest; another round starts only if the estimate of
its time fits, so the sweep ends within ``budget_s`` (60 s), whatever the
disk; settings it had no time for keep their current value and are
reported as untried.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import save

from .. import FastPersistReader, FastPersistWriter, IOConfig, engine_info
from ..units import MiB, align_up
from . import fio
from .workload import evict, targets

__all__ = [
    "LOAD_AXES",
    "SAVE_AXES",
    "Axis",
    "AxisResult",
    "DiskLimit",
    "Setting",
    "Sweep",
    "TuneResult",
    "synthetic_state",
    "tune",
]

log = logging.getLogger(__name__)

Value = int | bool | None  # None: the auto choice (direct_writes, direct_reads, host_threads, lanes_per_dir)
FIO_SHARE = 0.1  # of the budget, for fio's write and read together
_FIO_MIN_S = 0.05  # a fio run given less than this is not started


@dataclasses.dataclass(frozen=True)
class Axis:
    """One setting the sweep varies: an ``IOConfig`` field or ``lanes_per_dir``."""

    name: str
    values: tuple[Value, ...]


_SIZES = tuple(m * MiB for m in (4, 8, 16, 32, 64))
_THREADS = (1, 2, 4, 8)
SAVE_AXES = (
    Axis("direct_writes", (True, False)),
    Axis("queue_depth", (2, 4, 8, 16, 32)),
    Axis("block_size", _SIZES),
    Axis("lanes_per_dir", (1, 2, 4)),
    Axis("buffer_size", _SIZES[1:]),
    Axis("host_threads", _THREADS),
)
LOAD_AXES = (
    Axis("direct_reads", (True, False)),
    Axis("prepare_targets", (False,)),
    Axis("queue_depth", (2, 4, 8, 16, 32)),
    Axis("block_size", _SIZES),
    Axis("buffer_size", _SIZES[1:]),
    Axis("num_buffers", (2, 4, 8, 16)),
    Axis("host_threads", _THREADS),
)


@dataclasses.dataclass(frozen=True)
class Setting:
    """A candidate: I/O settings plus the writer's lanes (None: its auto choice)."""

    config: IOConfig
    lanes_per_dir: int | None = None

    def with_value(self, axis: str, value: Value) -> Setting:
        if axis == "lanes_per_dir":
            assert value is None or isinstance(value, int)
            return dataclasses.replace(self, lanes_per_dir=value)
        field: dict[str, Any] = {axis: value}  # one of IOConfig's fields, by name
        return dataclasses.replace(self, config=dataclasses.replace(self.config, **field))

    def value(self, axis: str) -> Value:
        return self.lanes_per_dir if axis == "lanes_per_dir" else getattr(self.config, axis)


@dataclasses.dataclass(frozen=True)
class AxisResult:
    """The sweep of one setting for saves or loads (``side``): GB/s of every run of each value, the value kept."""

    side: str
    axis: str
    runs: dict[Value, list[float]]
    chosen: Value

    def median(self, value: Value) -> float:
        return statistics.median(self.runs[value])


@dataclasses.dataclass(frozen=True)
class Sweep:
    """One side's sweep, saves or loads: each setting's result, the best settings, the settings not reached."""

    baseline: Setting
    best: Setting
    axes: tuple[AxisResult, ...]
    untried: tuple[str, ...]  # settings the budget left no time for

    def config_line(self) -> str:
        """``IOConfig(...)`` with the fields that differ from the defaults, ready to paste."""
        defaults = IOConfig()
        args = []
        for name in dict.fromkeys(a.name for a in SAVE_AXES + LOAD_AXES if a.name != "lanes_per_dir"):
            value = getattr(self.best.config, name)
            if value != getattr(defaults, name):
                sized = name.endswith("_size") and value % MiB == 0
                args.append(f"{name}={value >> 20} << 20" if sized else f"{name}={value}")
        return f"IOConfig({', '.join(args)})"


@dataclasses.dataclass(frozen=True)
class DiskLimit:
    """fio's write and read of a file the state's size (``fp_dcp.tools.fio``); None for a run that did not happen."""

    write_gbps: float | None
    read_gbps: float | None
    note: str  # the buffers fio used, or why it did not run


@dataclasses.dataclass(frozen=True)
class TuneResult:
    """What ``tune`` measured and chose."""

    directory: str
    engine: dict[str, Any]
    state_bytes: int
    fio: DiskLimit
    save: Sweep
    load: Sweep
    seconds: float

    def writer_line(self) -> str:
        lanes = f"lanes_per_dir={self.save.best.lanes_per_dir}, " if self.save.best.lanes_per_dir is not None else ""
        return f"FastPersistWriter(path, {lanes}config={self.save.config_line()})"

    def reader_line(self) -> str:
        return f"FastPersistReader(path, config={self.load.config_line()})"


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
    """Sweep the save and load settings on ``directory`` within ``budget_s`` seconds and return the best.

    Args:
        directory: where checkpoints will be written (created if missing, as
            the writer creates a checkpoint's directory; a scratch directory is
            made in it and removed afterwards; it needs room for twice
            ``size_bytes``).
        budget_s: wall-clock bound of the whole run, state creation and fio included.
        size_bytes: size of the synthetic state dict (held in memory).
        repeats: rounds per setting; each value's score is its median.
        min_gain: relative speed-up a value needs to replace the current one.
        base: the settings both sweeps start from (default ``IOConfig()``).
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
    run = _Run(state, scratch, repeats, min_gain, on_axis)
    try:
        info = engine_info(scratch, baseline.config)
        limit = _disk_limit(os.path.join(scratch, "fio"), state_bytes, min(deadline, start + FIO_SHARE * budget_s))
        saved, estimate = run.saves(baseline, time.perf_counter() + (deadline - time.perf_counter()) / 2)
        loaded = run.loads(saved.best, baseline, deadline, estimate)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return TuneResult(directory, info, state_bytes, limit, saved, loaded, time.perf_counter() - start)


def _disk_limit(path: str, size: int, until: float) -> DiskLimit:
    """fio writing, then reading, ``size`` bytes of ``path``, stopped by ``until`` (the write at half the time
    left); the file is removed afterwards."""
    if not fio.installed():
        return DiskLimit(None, None, "fio is not installed (apt-get install fio): no reference")
    if (until - time.perf_counter()) / 2 < _FIO_MIN_S:
        return DiskLimit(None, None, "not run: no time left in the budget")
    with fio.reference() as runner:  # the huge pages are reserved for these two runs only
        assert runner is not None  # installed, as checked above
        try:
            wrote = runner.run(path, "write", align_up(size, runner.block), (until - time.perf_counter()) / 2)
            left = until - time.perf_counter()
            read = runner.run(path, "read", wrote.bytes, left) if wrote.bytes and left >= _FIO_MIN_S else None
        except RuntimeError as e:  # a filesystem without O_DIRECT, for one: no reference, but the sweep runs
            return DiskLimit(None, None, str(e))
        finally:
            if os.path.exists(path):
                os.unlink(path)
        return DiskLimit(wrote.gbps, read.gbps if read is not None else None, runner.buffers)


_Runner = Callable[[bool], tuple[float, float]]  # one run (warm: first allocate the buffers): GB/s, wall seconds
_Trial = Callable[[Setting], contextlib.AbstractContextManager[_Runner]]


@dataclasses.dataclass(frozen=True)
class _Run:
    """What one ``tune`` call's sweeps share: the state, the scratch directory, the choice rule, the callback."""

    state: dict[str, torch.Tensor]
    scratch: str
    repeats: int
    min_gain: float
    on_axis: Callable[[AxisResult], None] | None

    @contextlib.contextmanager
    def _saving(self, setting: Setting, path: str) -> Iterator[_Runner]:
        writer = FastPersistWriter(path, lanes_per_dir=setting.lanes_per_dir, config=setting.config)
        try:
            yield lambda warm: _save(writer, self.state, warm=warm)
        finally:
            writer.close()

    @contextlib.contextmanager
    def _loading(self, setting: Setting, checkpoint: str) -> Iterator[_Runner]:
        reader = FastPersistReader(checkpoint, config=setting.config)
        warm_up = os.path.join(self.scratch, "warm-up")
        try:
            yield lambda warm: _load(reader, checkpoint, self.state, warm_up if warm else None)
        finally:
            reader.close()

    def saves(self, baseline: Setting, deadline: float) -> tuple[Sweep, float | None]:
        """The save sweep, and the estimate of one save's seconds (None if none ran)."""
        path = os.path.join(self.scratch, "save")
        try:
            return self._sweep("save", SAVE_AXES, baseline, lambda s: self._saving(s, path), deadline, None)
        finally:
            shutil.rmtree(path, ignore_errors=True)  # room for the checkpoint the loads read

    def loads(self, saved_with: Setting, baseline: Setting, deadline: float, save_seconds: float | None) -> Sweep:
        """The load sweep over the state saved once with ``saved_with``; untried if that save does not fit."""
        if save_seconds is None or time.perf_counter() + save_seconds > deadline:
            return Sweep(baseline, baseline, (), tuple(a.name for a in LOAD_AXES))
        checkpoint = os.path.join(self.scratch, "load")
        tiny = FastPersistWriter(os.path.join(self.scratch, "warm-up"))
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                save({"warm_up": torch.zeros(1)}, storage_writer=tiny, no_dist=True)
        finally:
            tiny.close()
        with self._saving(saved_with, checkpoint) as run:
            run(False)

        def trial(s: Setting) -> contextlib.AbstractContextManager[_Runner]:
            return self._loading(s, checkpoint)

        # a load takes about a save's time: the first guess, replaced by the loads' own
        return self._sweep("load", LOAD_AXES, baseline, trial, deadline, save_seconds)[0]

    def _sweep(
        self,
        side: str,
        axes: tuple[Axis, ...],
        start: Setting,
        trial: _Trial,
        deadline: float,
        estimate: float | None,
    ) -> tuple[Sweep, float | None]:
        """Each of ``axes`` in turn from ``start``, each keeping the best found so far; and the estimate of a run."""
        best = start
        done: list[AxisResult] = []
        untried: list[str] = []
        for axis in axes:
            result, estimate = self._axis(side, axis, best, trial, deadline, estimate)
            if result is None:
                untried.append(axis.name)
                continue
            done.append(result)
            best = best.with_value(axis.name, result.chosen)
            log.info("fp-dcp tune: %s %s: GB/s by value %s, chose %s", side, axis.name, result.runs, result.chosen)
            if self.on_axis is not None:
                self.on_axis(result)
        return Sweep(start, best, tuple(done), tuple(untried)), estimate

    def _axis(
        self, side: str, axis: Axis, current: Setting, trial: _Trial, deadline: float, estimate: float | None
    ) -> tuple[AxisResult | None, float | None]:
        """Rounds over ``axis``'s values around ``current`` while the budget allows; None if not one round fit.

        ``estimate`` is the running estimate of one run's seconds, returned updated.
        """
        values = sorted({*axis.values, current.value(axis.name)}, key=lambda v: (v is not None, v))  # auto first
        runs: dict[Value, list[float]] = {v: [] for v in values}
        with contextlib.ExitStack() as stack:
            runners = {v: stack.enter_context(trial(current.with_value(axis.name, v))) for v in values}
            for round_ in range(self.repeats):
                first = round_ == 0  # a first run also allocates its buffers: count it double
                if estimate is not None and time.perf_counter() + len(values) * estimate * (1 + first) > deadline:
                    break
                got: dict[Value, float] = {}
                for v in values:
                    if time.perf_counter() + (estimate or 0.0) * (1 + first) > deadline:
                        break  # only possible before the first estimate: the very first round
                    gbps, seconds = runners[v](first)
                    estimate = seconds if estimate is None else 0.5 * (estimate + seconds)
                    got[v] = gbps
                if len(got) < len(values):
                    break  # a partial round would favour the values it reached
                for v, gbps in got.items():
                    runs[v].append(gbps)
        if not runs[values[0]]:
            return None, estimate
        here = current.value(axis.name)
        chosen, best_ratio = here, 1.0
        for v in values:
            # Compare within rounds: runs next to each other see the same disk.
            ratios = [a / b for a, b in zip(runs[v], runs[here], strict=True)]
            if v != here and min(ratios) > 1 + self.min_gain and statistics.median(ratios) > best_ratio:
                chosen, best_ratio = v, statistics.median(ratios)
        return AxisResult(side, axis.name, runs, chosen), estimate


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


def _load(
    reader: FastPersistReader, checkpoint: str, state: dict[str, torch.Tensor], warm_up: str | None
) -> tuple[float, float]:
    """GB/s of one cold load's data path into ``state``, and its wall time with the eviction; a ``warm_up``
    checkpoint is loaded first (allocating the reader's buffers)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        if warm_up is not None:
            load({"warm_up": torch.zeros(1)}, storage_reader=reader, checkpoint_id=warm_up, no_dist=True)
        start = time.perf_counter()
        evict(checkpoint)
        load(targets(state, "fresh"), storage_reader=reader, checkpoint_id=checkpoint, no_dist=True)
        seconds = time.perf_counter() - start
    if reader.last_load is None:
        raise RuntimeError("FastPersistReader recorded no summary of the load")
    return reader.last_load.gbps, seconds
