"""``fp-dcp tune``: bounded by its budget, a valid line to paste, and a choice rule that ignores noise."""

from __future__ import annotations

import collections
import dataclasses
import time

import pytest

from fp_dcp import IOConfig
from fp_dcp.tools import tune
from fp_dcp.tools.cli import main
from fp_dcp.units import MiB

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_real_sweep_stays_within_a_tiny_budget_and_cleans_up(tmp_path):
    start = time.perf_counter()
    result = tune.tune(tmp_path, budget_s=2.0, size_bytes=2 * MiB, repeats=1)
    elapsed = time.perf_counter() - start
    assert elapsed < 2.0 + 1.5  # at most one save's misestimate past the budget
    assert list(tmp_path.iterdir()) == []  # the scratch directory is gone
    assert result.axes, "a 2 MiB save takes milliseconds: some setting must have been swept"
    names = [a.name for a in tune.AXES]
    assert [a.axis for a in result.axes] + list(result.untried) == names
    for sweep in result.axes:
        axis = next(a for a in tune.AXES if a.name == sweep.axis)
        assert set(axis.values) <= set(sweep.runs) and sweep.chosen in sweep.runs
        assert all(len(runs) == 1 and runs[0] > 0 for runs in sweep.runs.values())
        assert result.best.value(sweep.axis) == sweep.chosen
    assert result.engine["engine"] in ("io_uring", "threads")


def test_zero_budget_tries_nothing_and_keeps_the_defaults(tmp_path):
    result = tune.tune(tmp_path, budget_s=0.0, size_bytes=1 * MiB)
    assert result.axes == () and result.untried == tuple(a.name for a in tune.AXES)
    assert result.best == result.baseline
    assert result.config_line() == "IOConfig()"
    assert result.writer_line() == "FastPersistWriter(path, config=IOConfig())"


def test_consistent_winner_is_chosen_and_pasted(tmp_path, monkeypatch):
    def fake_save(writer, state, *, warm):  # GB/s by setting, no disk involved
        config = writer.config
        gbps = (1.3 if config.queue_depth == 16 else 1.0) * (1.2 if config.block_size == 8 * MiB else 1.0)
        gbps *= 1.15 if config.direct_writes is False else 1.0  # copying beats auto and in place
        return gbps * (1.1 if writer.lanes_per_dir == 2 else 1.0), 0.001

    monkeypatch.setattr(tune, "_save", fake_save)
    result = tune.tune(tmp_path, budget_s=30, size_bytes=1 * MiB, repeats=3)
    assert result.untried == ()
    best = result.best
    assert (best.config.queue_depth, best.config.block_size, best.lanes_per_dir) == (16, 8 * MiB, 2)
    assert best.config.direct_writes is False
    assert result.best.config.buffer_size == IOConfig().buffer_size  # no gain: the default stays
    pasted = eval(result.config_line(), {"IOConfig": IOConfig})  # the printed line is valid Python
    assert pasted == result.best.config
    assert "lanes_per_dir=2" in result.writer_line()


def test_inconsistent_or_small_gains_keep_the_current_value(tmp_path, monkeypatch):
    saves = collections.Counter()

    def fake_save(writer, state, *, warm):
        depth = writer.config.queue_depth
        saves[depth] += 1
        if depth == 32:  # the best median, but slower than the current value in round 2
            return [2.0, 0.9, 2.0][saves[depth] - 1], 0.001
        return (1.03 if depth == 4 else 1.0), 0.001  # 4: faster in every round, by less than min_gain

    monkeypatch.setattr(tune, "_save", fake_save)
    result = tune.tune(tmp_path, budget_s=30, size_bytes=1 * MiB, repeats=3, min_gain=0.05)
    sweep = next(a for a in result.axes if a.axis == "queue_depth")
    assert sweep.median(32) > sweep.median(4) > sweep.median(8)
    assert result.best == result.baseline


def test_synthetic_state_has_direct_and_staged_tensors():
    state = tune.synthetic_state(64 * MiB)
    total = sum(t.nbytes for t in state.values())
    assert 0.9 * 64 * MiB <= total <= 1.1 * 64 * MiB
    sizes = [t.nbytes for t in state.values()]
    assert max(sizes) >= IOConfig().direct_min > min(sizes)
    assert sum(s for s in sizes if s < IOConfig().direct_min) >= total // 10


def test_cli_prints_a_line_to_paste(tmp_path, capsys):
    assert main(["tune", str(tmp_path), "--budget", "1", "--size-mb", "2", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    best = next(line for line in out.splitlines() if line.startswith("best: "))
    config = eval(best.removeprefix("best: ").split(", lanes_per_dir=")[0].split("  (")[0], {"IOConfig": IOConfig})
    assert isinstance(config, IOConfig)
    assert "paste: writer = FastPersistWriter(path, " in out
    assert list(tmp_path.iterdir()) == []


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
    assert base.with_value("lanes_per_dir", 4).lanes_per_dir == 4 and base.value("block_size") == IOConfig().block_size
