"""``CheckpointManager``: retention, restore from the newest intact step, interrupted removals, kills."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy
import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import needs_xxhash

from fp_dcp import CheckpointManager, FastPersistReader, list_steps
from fp_dcp.checkpoint import open_checkpoint
from fp_dcp.names import METADATA_NAME
from fp_dcp.runs import resume, steps
from fp_dcp.testing.ranks import run_ranks

ROOT = Path(__file__).resolve().parents[1]


def state_at(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 16, generator=g), "step": torch.tensor(step)}


def empty() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(64, 16), "step": torch.tensor(-1)}


def restored(root, **kwargs) -> tuple[int | None, dict[str, torch.Tensor]]:
    state = empty()
    with CheckpointManager(root, **kwargs) as mgr:
        step = mgr.restore(state)
    return step, state


def steps_on_disk(root) -> list[int]:
    return [s.step for s in list_steps(root)]


@pytest.mark.parametrize("asynchronous", [True, False])
def test_a_run_keeps_the_last_k_every_nth_and_what_the_predicate_wants(tmp_path, asynchronous):
    root = tmp_path / "run"
    with CheckpointManager(
        root, keep_last=2, keep_every=4, keep=lambda step: step == 3, asynchronous=asynchronous
    ) as mgr:
        assert mgr.restore(empty()) is None
        for step in range(1, 10):
            mgr.save(step, state_at(step))
    assert steps_on_disk(root) == [3, 4, 8, 9]
    assert all(s.status == "complete" for s in list_steps(root))
    step, state = restored(root)
    assert step == 9 and torch.equal(state["w"], state_at(9)["w"]) and int(state["step"]) == 9


def test_state_may_change_as_soon_as_an_async_save_returns(tmp_path):
    root = tmp_path / "run"
    state = state_at(1)
    with CheckpointManager(root) as mgr:
        mgr.save(1, state)
        state["w"].fill_(123.0)  # the next training step, while the write goes on
    step, back = restored(root)
    assert step == 1 and torch.equal(back["w"], state_at(1)["w"])


def test_should_save_by_steps_and_by_seconds(tmp_path):
    mgr = CheckpointManager(tmp_path / "a", every_n_steps=5)
    assert [s for s in range(12) if mgr.should_save(s)] == [0, 5, 10]
    mgr.close()
    mgr = CheckpointManager(tmp_path / "b", every_seconds=0.2)
    assert mgr.should_save(1)  # nothing saved yet
    mgr.save(1, state_at(1))
    assert not mgr.should_save(2)
    time.sleep(0.25)
    assert mgr.should_save(3)
    mgr.close()


def flip(path, offset_from_end: int | None = None, offset: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) - offset_from_end if offset_from_end else offset] ^= 0x40
    path.write_bytes(bytes(data))


def newest_data_file(root, step: int = 3):
    checkpoint = open_checkpoint(root / f"step-{step}")
    return next(iter(checkpoint.own_files().values()))


DAMAGE = {
    "incomplete": lambda root: (root / "step-3" / METADATA_NAME).unlink(),
    "metadata byte": lambda root: flip(root / "step-3" / METADATA_NAME, offset=30),
    "data byte": lambda root: flip(type(root)(newest_data_file(root)), offset=100),
    "data file missing": lambda root: os.unlink(newest_data_file(root)),
    "data file short": lambda root: os.truncate(newest_data_file(root), 100),
}


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_restore_skips_a_damaged_newest_step_for_the_next_older_one(tmp_path, caplog, damage, verify):
    root = tmp_path / "run"
    with CheckpointManager(root, keep_last=5) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state_at(step))
    DAMAGE[damage](root)
    step, state = restored(root, verify=verify)
    # a damaged data byte is found by verify=True before loading, else by the load's own checksums
    assert step == 2, caplog.text
    assert torch.equal(state["w"], state_at(2)["w"])
    assert "step 3" in caplog.text


def test_a_removal_cut_short_is_finished_by_the_next_manager(tmp_path):
    root = tmp_path / "run"
    with CheckpointManager(root, keep_last=5) as mgr:
        for step in (1, 2):
            mgr.save(step, state_at(step))
    os.rename(root / "step-1", root / ".deleting-step-1")  # killed right after the rename
    assert steps_on_disk(root) == [2]
    CheckpointManager(root).close()
    assert sorted(os.listdir(root)) == [".lock", "step-2"]


def test_data_dirs_are_cleaned_with_their_step(tmp_path):
    root, data = tmp_path / "run", tmp_path / "nvme1"
    with CheckpointManager(root, keep_last=1, data_dirs=[str(data)]) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state_at(step))
    assert steps_on_disk(root) == [3]
    assert len(os.listdir(data)) == 1  # only step-3's subdirectory is left
    step, state = restored(root, data_dirs=[str(data)])
    assert step == 3 and torch.equal(state["w"], state_at(3)["w"])


def _ranks_save(rank: int, world: int, root: str) -> None:
    with CheckpointManager(root, keep_last=2) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": torch.full((world * 4,), float(step)), f"own{rank}": torch.full((3,), rank + step)})


def _ranks_restore(rank: int, world: int, root: str) -> tuple[int | None, float]:
    state = {"w": torch.zeros(8), f"own{rank}": torch.zeros(3, dtype=torch.long)}
    with CheckpointManager(root) as mgr:
        step = mgr.restore(state)
    return step, float(state["w"][0]) + float(state[f"own{rank}"][0])


def test_a_state_that_does_not_match_is_an_error_not_a_reason_to_go_back(tmp_path):
    root = tmp_path / "run"
    with CheckpointManager(root, keep_last=5) as mgr:
        for step in (1, 2):
            mgr.save(step, state_at(step))
    with CheckpointManager(root) as mgr, pytest.raises(BaseException, match="w") as e:
        mgr.restore({"w": torch.zeros(3, 3), "step": torch.tensor(0)})
    assert "CorruptCheckpointError" not in repr(e.value)


@pytest.mark.slow
def test_two_ranks_save_prune_and_restore_in_fresh_processes(tmp_path):
    root = str(tmp_path / "run")
    run_ranks(2, _ranks_save, root)
    assert steps_on_disk(root) == [2, 3]
    flip(type(tmp_path)(root) / "step-3" / METADATA_NAME, offset=30)
    assert run_ranks(2, _ranks_restore, root) == [(2, 2.0 + 2), (2, 2.0 + 3)]


@pytest.mark.slow
@needs_xxhash
def test_kills_at_random_points_always_leave_a_restorable_complete_step(tmp_path):
    # benchmarks/manager_crash_trials.py is the harness (100 kills for the figures); a few here, both engines
    script = ROOT / "benchmarks" / "manager_crash_trials.py"
    run = subprocess.run(
        [sys.executable, str(script), "--trials", "8", "--mib", "4", "--max-delay", "0.8", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert re.search(r"8 kills, 4 MiB state: .*ok [1-8]", run.stdout), run.stdout


# ------------------------------------------------------------------ incremental runs


def tuned_at(step: int, frozen_until: int = 10**9) -> dict[str, torch.Tensor]:
    """Fine-tuning: "base" stays as it was (until ``frozen_until``: then it changes once), "head" changes each step."""
    g = torch.Generator().manual_seed(step)
    base = torch.Generator().manual_seed(0 if step < frozen_until else frozen_until)
    return {
        "base": torch.randn(256, 256, generator=base),
        "head": torch.randn(8, 8, generator=g),
        "step": torch.tensor(step),
    }


def tuned_empty() -> dict[str, torch.Tensor]:
    return {"base": torch.zeros(256, 256), "head": torch.zeros(8, 8), "step": torch.tensor(-1)}


def assert_tuned(state: dict[str, torch.Tensor], step: int, **kwargs) -> None:
    expected = tuned_at(step, **kwargs)
    assert all(torch.equal(state[k], expected[k]) for k in expected), step


@needs_xxhash
@pytest.mark.parametrize("mode", ["snapshot", "streaming"])
def test_incremental_runs_retire_steps_whose_files_newer_steps_use(tmp_path, mode):
    root = tmp_path / "run"
    with CheckpointManager(root, keep_last=2, incremental=True, mode=mode) as mgr:
        for step in range(1, 6):
            mgr.save(step, tuned_at(step))
        mgr.wait()
        assert mgr.writer.last_save.referenced == 256 * 256 * 4
    infos = {s.step: s for s in list_steps(root)}
    assert [(s, i.status) for s, i in infos.items()] == [(1, "retired"), (4, "complete"), (5, "complete")]
    assert infos[5].references == ("step-1",) and infos[5].written < infos[5].bytes / 10
    # step-1 keeps only the file with "base" in it; steps 2 and 3 are gone whole
    used = next(iter(open_checkpoint(root / "step-5").owners))
    assert sorted(os.listdir(root / "step-1")) == [".lock", ".retired", used]
    state = tuned_empty()
    with CheckpointManager(root, incremental=True) as mgr:
        assert mgr.restore(state) == 5
        assert_tuned(state, 5)
        mgr.save(6, tuned_at(6))  # against the restored step
        mgr.wait()
        assert mgr.writer.last_save.referenced == 256 * 256 * 4
    # the frozen weights change at step 7: step-1's file is no longer used once steps 5 and 6 go
    with CheckpointManager(root, keep_last=1, incremental=True) as mgr:
        mgr.restore(tuned_empty())
        for step in (7, 8):
            mgr.save(step, tuned_at(step, frozen_until=7))
    assert [(s.step, s.status, s.references) for s in list_steps(root)] == [
        (7, "retired", ()),
        (8, "complete", ("step-7",)),
    ]
    state = tuned_empty()
    with CheckpointManager(root) as mgr:
        assert mgr.restore(state) == 8
    assert_tuned(state, 8, frozen_until=7)


@needs_xxhash
def test_a_stock_dcp_load_reads_an_incremental_step_through_the_fp_dcp_reader(tmp_path):
    root = tmp_path / "run"
    with CheckpointManager(root, incremental=True, asynchronous=False) as mgr:
        for step in (1, 2):
            mgr.save(step, tuned_at(step))
    state = tuned_empty()
    dcp.load(state, storage_reader=FastPersistReader(root / "step-2"))
    assert_tuned(state, 2)


def referenced_file(root, step: int) -> str:
    checkpoint = open_checkpoint(root / f"step-{step}")
    return next(path for name, path in checkpoint.files.items() if name in checkpoint.owners)


def _flip_base_in(root, step: int) -> None:
    location = next(
        loc
        for index, loc in open_checkpoint(root / f"step-{step}").metadata.storage_data.items()
        if index.fqn == "base"
    )
    flip(root / "step-2" / location.file, offset=location.offset + 5)


INCREMENTAL_DAMAGE = {
    "newest incomplete": lambda root: (root / "step-4" / METADATA_NAME).unlink(),
    "newest metadata byte": lambda root: flip(root / "step-4" / METADATA_NAME, offset=30),
    "newest data byte": lambda root: flip(type(root)(newest_data_file(root, 4)), offset=newest_data_offset(root, 4)),
    "referenced file missing": lambda root: os.unlink(referenced_file(root, 4)),
    "referenced byte": lambda root: _flip_base_in(root, 4),
}


def newest_data_offset(root, step: int) -> int:
    checkpoint = open_checkpoint(root / f"step-{step}")
    location = next(loc for index, loc in checkpoint.metadata.storage_data.items() if index.fqn == "head")
    return location.offset + 3


@needs_xxhash
@pytest.mark.parametrize("damage", list(INCREMENTAL_DAMAGE))
def test_restore_picks_the_newest_intact_step_of_an_incremental_run(tmp_path, caplog, damage):
    # "base" changes at step 2: steps 3 and 4 reference step-2's file, step 1 stands alone
    root = tmp_path / "run"
    with CheckpointManager(root, keep_last=5, incremental=True) as mgr:
        for step in (1, 2, 3, 4):
            mgr.save(step, tuned_at(step, frozen_until=2))
    assert [s.references for s in list_steps(root)] == [(), (), ("step-2",), ("step-2",)]
    INCREMENTAL_DAMAGE[damage](root)
    expected = 3 if damage.startswith("newest") else 1  # a damaged referenced file spoils steps 2, 3 and 4
    state = tuned_empty()
    with CheckpointManager(root, verify=damage.endswith("byte")) as mgr:
        assert mgr.restore(state) == expected, caplog.text
    assert_tuned(state, expected, frozen_until=2)


@needs_xxhash
def test_a_retirement_cut_short_is_never_restored_and_is_finished(tmp_path):
    root = tmp_path / "run"
    with CheckpointManager(root, keep_last=5, incremental=True) as mgr:
        for step in (1, 2):
            mgr.save(step, tuned_at(step))
    (root / "step-2" / ".retired").write_text('{"files": []}')  # killed between the marker and removing .metadata
    assert [s.status for s in list_steps(root)] == ["complete", "retired"]
    state = tuned_empty()
    with CheckpointManager(root) as mgr:
        assert not (root / "step-2" / METADATA_NAME).exists()  # finished on opening
        assert mgr.restore(state) == 1
    assert_tuned(state, 1)


def _ranks_incremental_run(rank: int, world: int, root: str) -> list[int]:
    referenced = []
    with CheckpointManager(root, keep_last=1, incremental=True) as mgr:
        for step in (1, 2, 3):
            state = tuned_at(step)
            state[f"own{rank}"] = torch.full((20_000,), float(rank))  # each rank's own, unchanged
            mgr.save(step, state)
            mgr.wait()
            referenced.append(mgr.writer.last_save.referenced)
    return referenced


def _ranks_restore_tuned(rank: int, world: int, root: str) -> tuple[int | None, bool]:
    state = tuned_empty()
    state[f"own{rank}"] = torch.zeros(20_000)
    with CheckpointManager(root) as mgr:
        step = mgr.restore(state)
    return step, torch.equal(state[f"own{rank}"], torch.full((20_000,), float(rank)))


@pytest.mark.slow
@needs_xxhash
def test_two_ranks_reference_their_own_unchanged_items_and_restore_in_fresh_processes(tmp_path):
    root = str(tmp_path / "run")
    referenced = run_ranks(2, _ranks_incremental_run, root)
    # each rank references its own "own" tensor; "base", replicated, is saved (and referenced) by one rank
    assert all(r[0] == 0 and r[1] == r[2] >= 80_000 for r in referenced)
    assert sum(r[1] for r in referenced) == 2 * 80_000 + 256 * 256 * 4
    assert [(s.step, s.status) for s in list_steps(root)] == [(1, "retired"), (3, "complete")]
    assert run_ranks(2, _ranks_restore_tuned, root) == [(3, True), (3, True)]
    state = tuned_empty()
    with CheckpointManager(root) as mgr:  # one process restores what two saved
        assert mgr.restore(state) == 3
    assert_tuned(state, 3)


@needs_xxhash
def test_saving_over_a_step_that_a_newer_one_references_is_refused(tmp_path):
    root = tmp_path / "run"
    with CheckpointManager(root, keep_last=1, incremental=True) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, tuned_at(step))
        with pytest.raises(ValueError, match=r"step 1 of .* holds data files that step-3 references"):
            mgr.save(1, tuned_at(4))  # retired, kept for step 3
        mgr.save(3, tuned_at(3))  # the newest step may be saved again: nothing newer uses it
    state = tuned_empty()
    with CheckpointManager(root) as mgr:
        assert mgr.restore(state) == 3
    assert_tuned(state, 3)


@pytest.mark.parametrize("step", [-1, 2.0, "2", True, None])
def test_a_step_that_is_not_a_non_negative_int_is_refused(tmp_path, step):
    with CheckpointManager(tmp_path, asynchronous=False) as mgr:
        with pytest.raises(ValueError, match=rf"got {re.escape(repr(step))}$"):
            mgr.save(step, state_at(2))  # step--1, step-2.0, step-True: no listing would ever find it
        mgr.save(numpy.int64(2), state_at(2))  # an integer of another type names step-2
    assert sorted(os.listdir(tmp_path)) == [".lock", "step-2"]
    assert restored(tmp_path)[0] == 2


@needs_xxhash
def test_a_staying_step_whose_references_cannot_be_read_stops_pruning(tmp_path, caplog):
    root = tmp_path / "run"
    with CheckpointManager(root, keep_last=2, incremental=True) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, tuned_at(step))
        mgr.wait()
        assert [s.status for s in list_steps(root)] == ["retired", "complete", "complete"]
        flip(root / "step-3" / METADATA_NAME, offset_from_end=3)  # the trailer's magic: its footer is unreadable
        mgr.save(4, tuned_at(4))
        mgr.wait()
    assert "the references of" in caplog.text and "step-3 cannot be read" in caplog.text
    # step 2 was not retired or removed: what step 3 references was unknown
    assert [(s.step, s.status) for s in list_steps(root)] == [
        (1, "retired"),
        (2, "complete"),
        (3, "corrupt"),
        (4, "complete"),
    ]
    state = tuned_empty()
    with CheckpointManager(root) as mgr:
        assert mgr.restore(state) == 4
    assert_tuned(state, 4)


@pytest.mark.parametrize("when", ["after the listing", "after its metadata was read"])
def test_a_step_pruned_while_the_steps_are_listed_is_left_out(tmp_path, monkeypatch, when):
    """Ranks of a node share a root: one lists or restores while another prunes (a rank once failed on it)."""
    root = tmp_path / "run"
    with CheckpointManager(root, asynchronous=False) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": torch.full((1000,), float(step))})
    listed, opened = steps.step_directories, steps.open_checkpoint
    gone = []

    def prune(step: int) -> None:
        if step not in gone:
            os.rename(root / f"step-{step}", root / f".deleting-step-{step}")  # as a pruning takes it away
            gone.append(step)

    def listing(path):
        found = listed(path)
        if when == "after the listing":
            prune(2)
        return found

    def opening(path, *args, **kwargs):
        checkpoint = opened(path, *args, **kwargs)
        if when == "after its metadata was read" and os.path.basename(path) in ("step-2", "step-3"):
            prune(int(os.path.basename(path)[5:]))
        return checkpoint

    monkeypatch.setattr(steps, "step_directories", listing)
    monkeypatch.setattr(steps, "open_checkpoint", opening)
    assert [(s.step, s.status) for s in list_steps(root)] == (
        [(1, "complete"), (3, "complete")] if when == "after the listing" else [(1, "complete")]
    )
    if when == "after its metadata was read":  # a restore meets the newest step pruned under it: the next older
        os.rename(root / ".deleting-step-3", root / "step-3")
        gone.remove(3)
        monkeypatch.setattr(resume, "step_directories", listing)
        target = {"w": torch.zeros(1000)}
        with CheckpointManager(root) as mgr:
            assert mgr.restore(target) == 1
        assert torch.equal(target["w"], torch.full((1000,), 1.0))
