"""Checkpoint tiers on 4 gloo ranks as 2 nodes: peer replicas, the durable drain (POSIX and S3), restore across them."""

from __future__ import annotations

import errno
import os
import shutil

import pytest
import torch
from conftest import flip_byte
from tiers_util import (
    EnvRank,
    committed,
    data_files,
    drop_node,
    incremental_restore,
    incremental_run,
    restore,
    save_steps,
    seaweedfs,
    slow_drain_run,
    unprunable_run,
)

import fp_dcp.tiers.store
from fp_dcp import CheckpointManager, DurableStorageError, list_steps, verify_checkpoint
from fp_dcp.load.stream_check import StreamCheck
from fp_dcp.names import parse_step_name
from fp_dcp.testing.ranks import run_ranks
from fp_dcp.testing.tiers import local_root, same_state
from fp_dcp.tiers import FsspecStore, PosixStore, Retry

pytestmark = pytest.mark.slow  # its tests start processes

WORLD = 4


def check_restored(results, step: int) -> None:
    for rank, (got, state) in enumerate(results):
        assert got == step, f"rank {rank} restored step {got}, not {step}"
        assert same_state(state, step, rank), f"rank {rank}: step {step} restored with other bytes"


def test_a_lost_node_restores_bit_exact_from_its_replicas(tmp_path):
    tmp = str(tmp_path)
    done = run_ranks(WORLD, save_steps, tmp, [1, 2], {"replicas": 2, "keep_last": 2})
    assert all(d["replication"] == [] for d in done), done
    for node in "ab":
        steps = list_steps(local_root(tmp, node))
        assert [(s.step, s.status, s.copies) for s in steps] == [(n, "complete", ("replicated",)) for n in (1, 2)]
    # node a holds node b's files too (its replicas), and the other way round
    assert data_files(os.path.join(local_root(tmp, "a"), "step-2"), (2, 3))
    assert data_files(os.path.join(local_root(tmp, "b"), "step-2"), (0, 1))
    drop_node(tmp, "b")
    check_restored(run_ranks(WORLD, restore, tmp, {"replicas": 2}), 2)
    # the restore put node b's files back on its own disk
    assert data_files(os.path.join(local_root(tmp, "b"), "step-2"), (2, 3))


@pytest.fixture(scope="module")
def s3():
    """A real S3 server (SeaweedFS) on 127.0.0.1 for this module's tests, and the client environment for it."""
    with seaweedfs() as env:
        yield env


@pytest.mark.parametrize("kind", ["posix", "s3"])
def test_b_every_local_root_lost_restores_bit_exact_from_durable(tmp_path, kind, request):
    tmp = str(tmp_path)
    env = request.getfixturevalue("s3") if kind == "s3" else {}
    durable = f"s3://fp-dcp/{tmp_path.name}" if kind == "s3" else os.path.join(tmp, "durable")
    options = {"replicas": 2, "durable": durable, "keep_durable": 2}
    done = run_ranks(WORLD, EnvRank(env, save_steps), tmp, [1, 2, 3], options)
    assert all(d["error"] is None for d in done), done
    for node in "ab":
        assert [s.copies for s in list_steps(local_root(tmp, node))][-1] == ("replicated", "durable")
        drop_node(tmp, node)
    check_restored(run_ranks(WORLD, EnvRank(env, restore), tmp, options), 3)
    if kind == "posix":
        # the last step is drained before close() returns (here step 2's drain came due while step 1's ran,
        # and waited); keep_durable=2; every directory left is a committed step, without temporary files
        kept = sorted(os.listdir(durable))
        assert "step-3" in kept and len(kept) <= 2, kept
        for step in kept:
            names = os.listdir(os.path.join(durable, step))
            assert ".metadata" in names and not [n for n in names if n.endswith(".part")], names


def test_c_a_damaged_replica_is_caught_and_the_durable_copy_used(tmp_path, caplog):
    tmp = str(tmp_path)
    durable = os.path.join(tmp, "durable")
    options = {"replicas": 2, "durable": durable}
    run_ranks(WORLD, save_steps, tmp, [1], options)
    replicas = data_files(os.path.join(local_root(tmp, "a"), "step-1"), (2, 3))  # node b's files, kept on node a
    assert replicas
    for path in replicas:
        flip_byte(path)
    drop_node(tmp, "b")
    results = run_ranks(WORLD, restore, tmp, options)
    check_restored(results, 1)


def test_c_a_damaged_durable_object_is_caught_and_an_older_intact_step_restored(tmp_path):
    tmp = str(tmp_path)
    durable = os.path.join(tmp, "durable")
    options = {"durable": durable, "keep_durable": 2, "durable_every_n_steps": 1}
    for step in (1, 2):  # one manager per step: each drains its first step
        run_ranks(WORLD, save_steps, tmp, [step], options)
    # without replicas each node's directory of a step holds its own ranks' files: partial, not corrupt
    assert {(s.step, s.status, s.copies) for s in list_steps(local_root(tmp, "b"))} == {
        (1, "partial", ("durable",)),
        (2, "partial", ("durable",)),
    }
    step_1 = os.path.join(local_root(tmp, "b"), "step-1")
    report = verify_checkpoint(step_1)  # the files there checked, no damage
    assert report.ok and report.problems == [] and report.bytes > 0, report
    held = len([n for n in os.listdir(step_1) if n.endswith(".distcp")])
    assert 0 < held < report.files  # node b's ranks' files of the step's
    assert report.partial == (
        f"partial: node b's files only ({held} of {report.files} data files), complete with the other tiers' roots"
    )
    assert {s.status for s in list_steps(local_root(tmp, "b"), verify=True)} == {"partial"}
    drop_node(tmp, "a")
    drop_node(tmp, "b")
    flip_byte(data_files(os.path.join(durable, "step-2"), (2,))[0])
    check_restored(run_ranks(WORLD, restore, tmp, options), 1)


def test_c_a_damaged_copy_on_a_nodes_own_disk_is_fetched_again_from_its_replica(tmp_path):
    tmp = str(tmp_path)
    options = {"replicas": 2}
    run_ranks(WORLD, save_steps, tmp, [1], options)
    for path in data_files(os.path.join(local_root(tmp, "b"), "step-1"), (2, 3)):  # node b's own files
        flip_byte(path)
    check_restored(run_ranks(WORLD, restore, tmp, options), 1)


def test_c_a_fifo_where_a_nodes_own_copy_should_be_is_replaced_from_its_replica(tmp_path):
    """A restore that verifies first opens it without blocking: it does not wait on it for a writer, it fetches the
    file again (a restore that does not verify first reads it as a data file, opened the same way)."""
    tmp = str(tmp_path)
    options = {"replicas": 2}
    run_ranks(WORLD, save_steps, tmp, [1], options)
    for path in data_files(os.path.join(local_root(tmp, "b"), "step-1"), (2, 3)):
        os.unlink(path)
        os.mkfifo(path)
    check_restored(run_ranks(WORLD, restore, tmp, {**options, "verify": True}, timeout=60), 1)


def test_e_a_slow_drain_with_keep_last_1_never_removes_the_newest_durable_step(tmp_path):
    tmp = str(tmp_path)
    seen = run_ranks(WORLD, slow_drain_run, tmp, 6)[0]
    first = next(i for i, steps in enumerate(seen) if steps)
    newest = [max(steps) if steps else None for steps in seen[first:]]
    assert None not in newest, "the durable root held no committed step for a moment"
    assert newest == sorted(newest), f"the newest durable step went backwards: {newest}"
    assert seen[-1] == [6], seen[-1]  # the last step is drained before close() returns; keep_durable=1
    assert [s.step for s in list_steps(local_root(tmp, "a"))] == [6]  # keep_last=1 once the drains were done
    drop_node(tmp, "a")
    drop_node(tmp, "b")
    check_restored(run_ranks(WORLD, restore, tmp, {"durable": os.path.join(tmp, "durable")}), 6)


def test_f_an_incremental_run_drains_only_the_files_that_changed(tmp_path):
    tmp = str(tmp_path)
    runs = run_ranks(WORLD, incremental_run, tmp)
    for (_, up1, skip1), (files2, up2, skip2) in runs:
        assert skip1 == 0 and up1 > 1 << 20, runs  # step 1: everything, each rank uploading the file it wrote
        assert files2 == 1 and skip2 == WORLD, runs  # step 2 references each rank's step-1 file, uploaded before
        assert up2 < 64 * 1024, runs  # only the changed 4 KB tensors (one file per rank), not the frozen MiB
    durable = os.path.join(tmp, "durable")
    assert sorted(os.listdir(durable)) == ["step-1", "step-2"]
    assert sum(os.path.getsize(p) for p in data_files(os.path.join(durable, "step-2"), (0, 1, 2, 3))) < 256 * 1024
    drop_node(tmp, "a")
    drop_node(tmp, "b")
    assert run_ranks(WORLD, incremental_restore, tmp) == [(2, True)] * WORLD


class BrokenStore(PosixStore):
    """A durable directory whose uploads always fail: a store that is down for good."""

    retry = Retry(attempts=3, delay=0.01)

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.attempts = 0

    def put_file(self, key, source, size, check):
        self.attempts += 1
        raise ConnectionError("the store refuses the connection")


def test_a_failing_drain_is_retried_reported_and_never_stops_training(tmp_path, caplog):
    store = BrokenStore(str(tmp_path / "durable"))
    with CheckpointManager(tmp_path / "run-{node}", durable=store, raise_durable_errors=True) as mgr:
        state = {"w": torch.arange(1000.0)}
        mgr.save(1, state)  # returns: the drain runs behind it
        mgr.wait_for_copies()
        assert store.attempts == 3  # retried with backoff, then given up
        assert isinstance(mgr.durable_error, DurableStorageError)
        assert "refuses the connection" in str(mgr.durable_error)
        assert "step 1 was not copied" in caplog.text or "drain of step 1" in caplog.text
        with pytest.raises(DurableStorageError, match="step 1 was not copied"):
            mgr.save(2, state)  # asked to: the next save raises it, once
        mgr.save(2, state)
        mgr.wait()
        assert [(s.step, s.status) for s in mgr.steps()][-1] == (2, "complete")  # the local tier went on all along
    assert not os.path.exists(tmp_path / "durable" / "step-1" / ".metadata")  # nothing committed


def test_a_durable_root_that_cannot_be_pruned_is_reported_on_every_rank_and_hangs_none(tmp_path):
    tmp = str(tmp_path)
    done = run_ranks(2, unprunable_run, tmp)  # rank 0 prunes; rank 1 waits for its word in the drain's group
    for rank, result in enumerate(done):
        problems, _, _ = result["drain"]
        assert len(problems) == 1 and "refuses to delete step-1/.metadata" in problems[0], (rank, result)
        assert result["error"].startswith("step 2 was copied to "), (rank, result)  # committed, but not pruned
        assert "older durable steps were not pruned" in result["error"], (rank, result)
    assert committed(os.path.join(tmp, "durable")) == [1, 2]  # step 2 is durable; step 1 could not be removed
    assert list_steps(local_root(tmp, "a"))[-1].copies == ("durable",)


# ², Arabic-Indic 3; and leading zeros: step-01 beside step-1 would be a second directory of one step
NOT_STEPS = ["step-\u00b2", "step-\u0663", "step-", "step-1a", "step--1", "step-+1", "step- 1", "step-01", "step-007"]


def test_only_the_names_step_name_writes_name_a_step_in_every_tier(tmp_path):
    assert [parse_step_name(f"step-{n}") for n in (0, 7, 10, 1234)] == [0, 7, 10, 1234]
    assert [parse_step_name(name) for name in NOT_STEPS] == [None] * len(NOT_STEPS)
    durable = str(tmp_path / "durable")
    state = {"w": torch.arange(1000.0)}
    with CheckpointManager(tmp_path / "run-{node}", durable=durable, keep_durable=1) as mgr:
        mgr.save(1, state)
        root = mgr.tiers.root
    for name in NOT_STEPS:  # a user's, or another tool's: never a step, never an error
        for directory in (os.path.join(root, name), os.path.join(durable, name)):
            os.mkdir(directory)
            shutil.copy(os.path.join(root, "step-1", ".metadata"), directory)
    assert [s.step for s in list_steps(root)] == [1]
    assert list(PosixStore(durable).inventory()) == ["step-1"]
    assert list(FsspecStore(f"file://{durable}").inventory()) == ["step-1"]
    with CheckpointManager(tmp_path / "run-{node}", durable=durable, keep_durable=1) as mgr:
        restored = {"w": torch.zeros(1000)}
        assert mgr.restore(restored) == 1 and torch.equal(restored["w"], state["w"])
        mgr.save(2, state)  # drained, and the durable root pruned to step 2
    assert sorted(os.listdir(durable)) == sorted(["step-2", *NOT_STEPS])


def s3_store(env: dict[str, str], prefix: str) -> FsspecStore:
    return FsspecStore(
        f"s3://fp-dcp/{prefix}",
        key=env["AWS_ACCESS_KEY_ID"],
        secret=env["AWS_SECRET_ACCESS_KEY"],
        client_kwargs={"endpoint_url": env["AWS_ENDPOINT_URL"]},
    )


@pytest.mark.parametrize("kind", ["s3", "memory"])
@pytest.mark.parametrize("chunks", [0, 2])  # the source fails before anything, or after 16 MiB went up in parts
def test_an_upload_that_fails_midway_leaves_nothing_under_its_key(tmp_path, kind, chunks, monkeypatch, request):
    store = (
        s3_store(request.getfixturevalue("s3"), tmp_path.name) if kind == "s3" else FsspecStore(f"memory://{tmp_path}")
    )
    data = os.urandom(20 << 20)
    source = tmp_path / "source"
    source.write_bytes(data)
    key = "step-1/__0_0.0123456789abcdef.distcp"
    read_chunks = fp_dcp.tiers.store._read_chunks

    def failing(f, size):  # the local copy's disk fails while it is read for the upload
        for k, chunk in enumerate(read_chunks(f, size)):
            if size is not None and k == chunks:
                raise OSError(errno.EIO, "the local disk failed")
            yield chunk

    monkeypatch.setattr(fp_dcp.tiers.store, "_read_chunks", failing)
    with pytest.raises(OSError, match="the local disk failed"):
        store.put_file(key, str(source), len(data), StreamCheck(key, len(data), [], whole=False))
    assert store.inventory() == {}
    assert not store.fs.exists(f"{store.root}/{key}")
    if kind == "s3":  # the parts already sent were thrown away, not left for the bucket to keep
        assert not [u for u in store.fs.list_multipart_uploads("fp-dcp") if u["Key"].startswith(tmp_path.name)]
    monkeypatch.undo()
    assert store.put_file(key, str(source), len(data), StreamCheck(key, len(data), [], whole=False)) == []
    assert store.inventory() == {"step-1": {os.path.basename(key): len(data)}}
    assert store.get_bytes(key) == data
