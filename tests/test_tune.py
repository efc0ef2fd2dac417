"""``fp-dcp tune``: bounded by its budget, saves and loads swept, fio as the reference, valid lines to paste, and a
choice rule that ignores noise."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import shutil
import time

import pytest

from fp_dcp import IOConfig
from fp_dcp.tools import fio, tune
from fp_dcp.tools.cli import main
from fp_dcp.units import MiB

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

needs_fio = pytest.mark.skipif(
    shutil.which("fio") is None, reason="fio is not installed (make system-deps installs it)"
)
SAVES = [a.name for a in tune.SAVE_AXES]
LOADS = [a.name for a in tune.LOAD_AXES]


def no_fio(path, size, until):
    return tune.DiskLimit(None, None, "not run in this test")


def check_sweep(sweep: tune.Sweep, axes: tuple[tune.Axis, ...], side: str) -> None:
    """Every setting swept or reported untried, each list in the axes' order; each value run once per round; the
    best is the chosen. An axis with fewer values may fit the budget left where the one before it did not (the
    lanes after the block sizes): untried and swept may alternate."""
    names = [a.name for a in axes]
    swept = [a.axis for a in sweep.axes]
    assert sorted(swept + list(sweep.untried), key=names.index) == names
    assert swept == sorted(swept, key=names.index) and list(sweep.untried) == sorted(sweep.untried, key=names.index)
    for result in sweep.axes:
        axis = next(a for a in axes if a.name == result.axis)
        assert result.side == side
        assert set(axis.values) <= set(result.runs) and result.chosen in result.runs
        assert len({len(runs) for runs in result.runs.values()}) == 1
        assert all(gbps > 0 for runs in result.runs.values() for gbps in runs)
        assert sweep.best.value(result.axis) == result.chosen


def test_real_sweep_stays_within_a_tiny_budget_and_cleans_up(tmp_path):
    start = time.perf_counter()
    result = tune.tune(tmp_path, budget_s=2.0, size_bytes=2 * MiB, repeats=1)
    elapsed = time.perf_counter() - start
    assert elapsed < 2.0 + 1.5  # at most one save's misestimate past the budget
    assert list(tmp_path.iterdir()) == []  # the scratch directory is gone
    assert result.save.axes, "a 2 MiB save takes milliseconds: some setting must have been swept"
    check_sweep(result.save, tune.SAVE_AXES, "save")
    check_sweep(result.load, tune.LOAD_AXES, "load")
    assert result.engine["engine"] in ("io_uring", "threads")


def test_real_loads_sweep_the_read_settings_from_the_defaults(tmp_path, monkeypatch):
    monkeypatch.setattr(tune, "_disk_limit", no_fio)
    loads = []
    real_load = tune._load

    def counted(reader, checkpoint, state, warm_up):
        loads.append((reader.config, warm_up is not None))
        return real_load(reader, checkpoint, state, warm_up)

    monkeypatch.setattr(tune, "_load", counted)
    result = tune.tune(tmp_path, budget_s=30, size_bytes=2 * MiB, repeats=1)
    assert result.load.axes, "2 MiB loads take milliseconds: some read setting must have been swept"
    check_sweep(result.load, tune.LOAD_AXES, "load")
    assert result.load.baseline == tune.Setting(IOConfig())  # not the save's best: the reader has its own
    first = result.load.axes[0]
    assert first.axis == "direct_reads" and set(first.runs) == {None, True, False}
    assert {config.direct_reads for config, _ in loads[:3]} == {None, True, False}
    assert all(warm for _, warm in loads[:3])  # each reader's first load warms up on the tiny checkpoint
    assert list(tmp_path.iterdir()) == []


def test_zero_budget_tries_nothing_and_keeps_the_defaults(tmp_path):
    result = tune.tune(tmp_path, budget_s=0.0, size_bytes=1 * MiB)
    assert result.save.axes == () and result.save.untried == tuple(SAVES)
    assert result.load.axes == () and result.load.untried == tuple(LOADS)
    assert result.save.best == result.save.baseline and result.load.best == result.load.baseline
    assert result.save.config_line() == result.load.config_line() == "IOConfig()"
    assert result.writer_line() == "FastPersistWriter(path, config=IOConfig())"
    assert result.reader_line() == "FastPersistReader(path, config=IOConfig())"
    assert result.fio.write_gbps is None and result.fio.read_gbps is None
    assert result.fio.note in (
        "not run: no time left in the budget",
        "fio is not installed (apt-get install fio): no reference",
    )


def fake_save(writer, state, *, warm):  # GB/s by setting, no disk involved
    config = writer.config
    gbps = (1.3 if config.queue_depth == 16 else 1.0) * (1.2 if config.block_size == 8 * MiB else 1.0)
    gbps *= 1.15 if config.direct_writes is False else 1.0  # copying beats auto and in place
    return gbps * (1.1 if writer.lanes_per_dir == 2 else 1.0), 0.001


def fake_load(reader, checkpoint, state, warm_up):
    config = reader.config
    gbps = (1.3 if config.queue_depth == 32 else 1.0) * (1.2 if config.num_buffers == 8 else 1.0)
    return gbps * (1.1 if config.direct_reads is False else 1.0), 0.001


def test_consistent_winners_are_chosen_for_saves_and_loads_and_pasted(tmp_path, monkeypatch):
    monkeypatch.setattr(tune, "_save", fake_save)
    monkeypatch.setattr(tune, "_load", fake_load)
    monkeypatch.setattr(tune, "_disk_limit", no_fio)
    result = tune.tune(tmp_path, budget_s=30, size_bytes=1 * MiB, repeats=3)
    assert result.save.untried == result.load.untried == ()
    save, load = result.save.best, result.load.best
    assert (save.config.queue_depth, save.config.block_size, save.lanes_per_dir) == (16, 8 * MiB, 2)
    assert save.config.direct_writes is False and save.config.direct_reads is None
    assert save.config.buffer_size == IOConfig().buffer_size  # no gain: the default stays
    assert (load.config.queue_depth, load.config.num_buffers, load.config.direct_reads) == (32, 8, False)
    assert load.config.block_size == IOConfig().block_size  # the save's choice does not leak into the reader's
    assert load.config.direct_writes is None
    pasted = eval(result.save.config_line(), {"IOConfig": IOConfig})  # the printed lines are valid Python
    assert pasted == save.config
    assert "lanes_per_dir=2" in result.writer_line()
    reader = eval(
        result.reader_line(), {"FastPersistReader": lambda path, config: config, "IOConfig": IOConfig, "path": 0}
    )
    assert reader == load.config


def test_inconsistent_or_small_gains_keep_the_current_value(tmp_path, monkeypatch):
    saves = collections.Counter()

    def noisy_save(writer, state, *, warm):
        depth = writer.config.queue_depth
        saves[depth] += 1
        if depth == 32:  # the best median, but slower than the current value in round 2
            return [2.0, 0.9, 2.0][saves[depth] - 1], 0.001
        return (1.03 if depth == 4 else 1.0), 0.001  # 4: faster in every round, by less than min_gain

    monkeypatch.setattr(tune, "_save", noisy_save)
    monkeypatch.setattr(tune, "_load", lambda reader, checkpoint, state, warm_up: (1.0, 0.001))
    monkeypatch.setattr(tune, "_disk_limit", no_fio)
    result = tune.tune(tmp_path, budget_s=30, size_bytes=1 * MiB, repeats=3, min_gain=0.05)
    sweep = next(a for a in result.save.axes if a.axis == "queue_depth")
    assert sweep.median(32) > sweep.median(4) > sweep.median(8)
    assert result.save.best == result.save.baseline
    assert result.load.best == result.load.baseline and len(result.load.axes) == len(LOADS)


class FakeClock:
    """``tune``'s clock: moves only when a fake save or load says it took time."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def test_saves_get_half_the_budget_loads_the_rest_and_what_does_not_fit_is_untried(tmp_path, monkeypatch):
    clock = FakeClock()

    def one_second(gbps):
        def run(*args, **kwargs):
            clock.now += 1.0
            return gbps, 1.0

        return run

    monkeypatch.setattr(tune, "time", clock)
    monkeypatch.setattr(tune, "_save", one_second(1.0))
    monkeypatch.setattr(tune, "_load", one_second(2.0))
    monkeypatch.setattr(tune, "_disk_limit", no_fio)
    result = tune.tune(tmp_path, budget_s=40, size_bytes=1 * MiB, repeats=3)
    # Saves until 20 s: direct_writes 3 rounds of 3 (9 s), queue_depth 2 rounds of 5 (a third would end at 24 s).
    assert [(a.axis, len(a.runs[None if a.axis == "direct_writes" else 8])) for a in result.save.axes] == [
        ("direct_writes", 3),
        ("queue_depth", 2),
    ]
    assert result.save.untried == ("block_size", "lanes_per_dir", "buffer_size", "host_threads")
    # Loads from 19 s: the checkpoint's save (1 s), direct_reads 3 rounds of 3 (9 s), prepare_targets 3 rounds
    # of 2 (6 s); queue_depth's first round, guessed at twice 5 s, does not fit in the 5 s left.
    assert [a.axis for a in result.load.axes] == ["direct_reads", "prepare_targets"]
    assert result.load.untried == ("queue_depth", "block_size", "buffer_size", "num_buffers", "host_threads")
    assert clock.now <= 40 and result.seconds == clock.now


def test_missing_directory_is_created(tmp_path):
    directory = tmp_path / "new" / "disk"
    result = tune.tune(directory, budget_s=0.0, size_bytes=1 * MiB)
    assert result.directory == str(directory)
    assert directory.is_dir() and list(directory.iterdir()) == []


def test_cli_says_when_the_directory_cannot_be_created(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    directory = tmp_path / "file" / "disk"  # under a regular file: never creatable
    assert main(["tune", str(directory), "--budget", "0", "--size-mb", "1"]) == 1
    error = capsys.readouterr().err
    assert f"cannot tune {directory}: no such directory, and it cannot be created (Not a directory)" in error
    assert ".fp-dcp-tune-" not in error


def test_setting_replaces_one_field():
    base = tune.Setting(IOConfig())
    assert base.with_value("queue_depth", 2).config == dataclasses.replace(IOConfig(), queue_depth=2)
    assert base.with_value("num_buffers", 8).config.num_buffers == 8
    assert base.with_value("lanes_per_dir", 4).lanes_per_dir == 4 and base.value("block_size") == IOConfig().block_size


# ---- the disk's limit: fio from huge-page buffers, within the budget


@needs_fio
def test_fio_reference_writes_and_reads_within_its_time_and_removes_its_file(tmp_path):
    path = str(tmp_path / "fio")
    knob = fio.NR_HUGEPAGES
    before = open(knob).read() if os.path.exists(knob) else None
    limit = tune._disk_limit(path, 3 * MiB, time.perf_counter() + 10)
    assert limit.write_gbps is not None and limit.write_gbps > 0
    assert limit.read_gbps is not None and limit.read_gbps > 0
    assert limit.note == "huge-page buffers" or limit.note.startswith("plain buffers (")
    assert not os.path.exists(path)
    assert (open(knob).read() if before is not None else None) == before  # the huge pages given back


@needs_fio
def test_fio_reference_is_skipped_when_the_budget_has_no_time_for_it(tmp_path):
    limit = tune._disk_limit(str(tmp_path / "fio"), MiB, time.perf_counter())
    assert limit == tune.DiskLimit(None, None, "not run: no time left in the budget")


@contextlib.contextmanager
def no_huge_pages(nbytes):
    yield None, "not in this test"


def test_fio_failure_is_reported_not_raised(tmp_path, monkeypatch):
    def broken(self, path, rw, size, runtime_s=None):
        raise RuntimeError(f"fio {rw} of {path} failed: O_DIRECT refused")

    monkeypatch.setattr(fio, "installed", lambda: True)
    monkeypatch.setattr(fio, "huge_pages", no_huge_pages)
    monkeypatch.setattr(fio.Fio, "run", broken)
    limit = tune._disk_limit(str(tmp_path / "fio"), MiB, time.perf_counter() + 10)
    assert limit.write_gbps is None and limit.note.endswith("failed: O_DIRECT refused")


def test_cli_prints_the_fio_line_and_a_writer_and_a_reader_to_paste(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(fio, "installed", lambda: False)  # fio missing: said, not an error
    assert main(["tune", str(tmp_path), "--budget", "1", "--size-mb", "2", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "  fio (the disk's limit): fio is not installed (apt-get install fio): no reference" in out
    lines = {line.split(": ", 1)[0]: line.split(": ", 1)[1] for line in out.splitlines() if line.startswith("best ")}
    for side in ("save", "load"):
        config = eval(lines[f"best {side}"].split(", lanes_per_dir=")[0].split("  (")[0], {"IOConfig": IOConfig})
        assert isinstance(config, IOConfig)
    assert "give each its own" in out
    assert "paste: writer = FastPersistWriter(path, " in out and "paste: reader = FastPersistReader(path, " in out
    assert list(tmp_path.iterdir()) == []
