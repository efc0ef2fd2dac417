"""Reused files: a pruned step's files are overwritten by the next save, which reads as if written anew."""

from __future__ import annotations

import os

import torch
import torch.distributed.checkpoint as dcp
from conftest import load

from fp_dcp import CheckpointManager, FastPersistWriter, IOConfig, list_steps, unfinished, verify_checkpoint
from fp_dcp.checkpoint import open_checkpoint
from fp_dcp.io.files import kernel_copies
from fp_dcp.names import SPARE_NAME
from fp_dcp.save.commit import SaveLock
from fp_dcp.testing.ranks import run_ranks
from fp_dcp.tools.cli import main

COPIED = IOConfig(direct_io=False)  # the page cache: the kernel copies every byte, as into tmpfs


def state_at(step: int, rows: int = 300) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {
        "small": torch.randint(-100, 100, (1001,), dtype=torch.int8, generator=g),  # sizes off every alignment
        "w": torch.randn(rows, 1031, generator=g),
        "tail": torch.randn(77, generator=g),
    }


def inodes(step_dir) -> set[int]:
    return {os.stat(path).st_ino for path in open_checkpoint(step_dir).own_files().values()}


def assert_restores(root, step: int, expected: dict[str, torch.Tensor], **kwargs) -> None:
    target = {name: torch.empty_like(t) for name, t in expected.items()}
    with CheckpointManager(root, **kwargs) as mgr:
        assert mgr.restore(target) == step
    assert all(torch.equal(target[name], t) for name, t in expected.items())


def test_the_next_save_overwrites_the_files_of_the_step_pruned_last(tmp_path):
    root = tmp_path / "run"
    seen = {}
    with CheckpointManager(root, keep_last=1, asynchronous=False, config=COPIED) as mgr:
        for step in (1, 2, 3, 4):
            mgr.save(step, state_at(step, rows=300 if step % 2 else 200))
            seen[step] = inodes(root / f"step-{step}")
            assert (root / SPARE_NAME).is_dir() == (step > 1)  # step-1 from step 2's pruning on
            assert [s.step for s in list_steps(root)] == [step]
    assert seen[3] == seen[1] and seen[4] == seen[2] and not seen[1] & seen[2]
    assert not (root / SPARE_NAME).exists()  # close: no later save of the manager would take it
    assert verify_checkpoint(root / "step-4").ok
    assert_restores(root, 4, state_at(4, rows=200))


def test_a_reused_file_larger_and_full_of_old_bytes_reads_as_a_new_one(tmp_path):
    # Step 1's file is longer than step 2's and holds random bytes where step 2 leaves padding and
    # gaps between extents: every one of them must be zero again (verify checks) and the size exact.
    spare = tmp_path / "old"
    dcp.save(state_at(1, rows=900), storage_writer=FastPersistWriter(spare, config=COPIED))
    (old_file,) = open_checkpoint(spare).own_files().values()
    old_inode, old_size = os.stat(old_file).st_ino, os.path.getsize(old_file)
    new = tmp_path / "new"
    dcp.save(state_at(2), storage_writer=FastPersistWriter(new, config=COPIED, spare=spare))
    (new_file,) = open_checkpoint(new).own_files().values()
    assert os.stat(new_file).st_ino == old_inode and not os.path.exists(old_file)
    assert os.path.getsize(new_file) == open_checkpoint(new).file_sizes[os.path.basename(new_file)]
    assert os.path.getsize(new_file) < old_size
    report = verify_checkpoint(new)
    assert report.ok, report
    target = {name: torch.empty_like(t) for name, t in state_at(2).items()}
    load(target, new)
    assert all(torch.equal(target[name], t) for name, t in state_at(2).items())


def test_files_of_another_rank_or_a_spare_that_is_not_there_are_not_taken(tmp_path):
    spare = tmp_path / "old"
    dcp.save(state_at(1), storage_writer=FastPersistWriter(spare, config=COPIED))
    writer = FastPersistWriter(tmp_path / "new", config=COPIED, spare=tmp_path / "missing")
    dcp.save(state_at(2), storage_writer=writer)
    old_files = set(open_checkpoint(spare).own_files().values())
    assert all(os.path.exists(f) for f in old_files)
    assert not inodes(tmp_path / "new") & {os.stat(f).st_ino for f in old_files}


def test_data_dirs_files_are_reused_and_the_spare_s_subdirectory_goes_at_close(tmp_path):
    root, data = tmp_path / "run", tmp_path / "nvme1"
    seen = {}
    with CheckpointManager(root, keep_last=1, asynchronous=False, data_dirs=[str(data)], config=COPIED) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state_at(step))
            seen[step] = inodes(root / f"step-{step}")
    assert seen[3] == seen[1]
    assert len(os.listdir(data)) == 1  # only step-3's subdirectory is left
    assert_restores(root, 3, state_at(3), data_dirs=[str(data)])


def test_a_spare_is_kept_only_where_the_kernel_copies_and_when_asked(tmp_path):
    for name, kwargs in (
        ("default", {}),
        ("copied", {"config": COPIED}),
        ("off", {"config": COPIED, "reuse_files": False}),
    ):
        root = tmp_path / name
        with CheckpointManager(root, keep_last=1, asynchronous=False, **kwargs) as mgr:
            for step in (1, 2):
                mgr.save(step, state_at(step))
            copies = kernel_copies(str(root), mgr.writer.config.direct_io)
            assert (root / SPARE_NAME).exists() == (copies and name != "off"), name


def test_a_spare_left_by_a_crash_is_removed_by_the_next_manager(tmp_path):
    root = tmp_path / "run"
    with CheckpointManager(root, keep_last=5, asynchronous=False, config=COPIED) as mgr:
        for step in (1, 2):
            mgr.save(step, state_at(step))
    os.rename(root / "step-1", root / SPARE_NAME)  # as a pruning leaves it, then killed before the next save
    CheckpointManager(root).close()
    assert sorted(os.listdir(root)) == [".lock", "step-2"]


def _ranks_save(rank: int, world: int, root: str) -> dict[int, set[int]]:
    seen = {}
    with CheckpointManager(root, keep_last=1, asynchronous=True, config=COPIED) as mgr:
        for step in (1, 2, 3):
            mgr.save(
                step, {"w": torch.full((world * 1000,), float(step)), f"own{rank}": torch.full((300,), rank + step)}
            )
            mgr.wait()
            seen[step] = {
                os.stat(path).st_ino
                for name, path in open_checkpoint(os.path.join(root, f"step-{step}")).own_files().items()
                if name.startswith(f"__{rank}_")
            }
    return seen


def test_each_rank_takes_its_own_files(tmp_path):
    root = str(tmp_path / "run")
    seen = run_ranks(2, _ranks_save, root)
    for rank in (0, 1):
        assert seen[rank][3] == seen[rank][1] and seen[rank][1]
    assert not seen[0][1] & seen[1][1]
    assert verify_checkpoint(os.path.join(root, "step-3")).ok


def test_ls_names_a_spare_and_clean_removes_it_but_not_while_a_manager_has_the_root(tmp_path, capsys):
    root = tmp_path / "run"
    with CheckpointManager(root, keep_last=5, asynchronous=False, config=COPIED) as mgr:
        for step in (1, 2):
            mgr.save(step, state_at(step))
    os.rename(root / "step-1", root / SPARE_NAME)  # as a pruning leaves it, the manager then killed
    assert unfinished(root) == [SPARE_NAME]
    assert main(["ls", str(root)]) == 0
    assert (
        "not checkpoints: .spare (.spare: a pruned step whose files the next save overwrites" in capsys.readouterr().out
    )
    lock = SaveLock(str(root))  # a manager has the root open: its next save may be taking the spare's files
    assert main(["ls", str(root), "--clean"]) == 1
    assert (root / SPARE_NAME).is_dir()
    lock.release()
    assert main(["ls", str(root), "--clean"]) == 0
    assert f"{root}: removed .spare" in capsys.readouterr().err
    assert unfinished(root) == [] and sorted(os.listdir(root)) == [".lock", "step-2"]


def test_a_spare_file_goes_only_where_the_save_writes_one(tmp_path):
    """A save dealing fewer items than it has file names takes as many spare files as it writes files; the rest
    stay in the spare for its removal, none pass through the new checkpoint."""
    spare, path = tmp_path / "spare", tmp_path / "new"
    four = {f"w{i}": torch.randn(200, 301) for i in range(4)}
    dcp.save(four, storage_writer=FastPersistWriter(spare, lanes_per_dir=4, config=COPIED))
    before = inodes(spare)
    assert len(before) == 4
    one = {"w": torch.randn(300, 301)}
    dcp.save(one, storage_writer=FastPersistWriter(path, lanes_per_dir=4, config=COPIED, spare=spare))
    (name,) = open_checkpoint(path).own_files()
    assert [n for n in os.listdir(path) if n.endswith(".distcp")] == [name]
    left = {os.stat(p).st_ino for p in open_checkpoint(spare).own_files().values() if os.path.exists(p)}
    assert inodes(path) < before and left == before - inodes(path)  # one taken, three left where they were
    load_into = {"w": torch.empty(300, 301)}
    load(load_into, path)
    assert torch.equal(load_into["w"], one["w"])
