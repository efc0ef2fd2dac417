"""A checkpoint is complete and verified, or recognisably not a checkpoint."""

from __future__ import annotations

import os
import pickle
import random

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import failure, load, save
from torch.distributed.checkpoint.api import CheckpointException

from fp_dcp import (
    CheckpointBusyError,
    CorruptCheckpointError,
    FastPersistReader,
    FastPersistWriter,
    IOConfig,
)
from fp_dcp.io import engine
from fp_dcp.save import commit
from fp_dcp.save import pipeline as packer


def state_of(value: float) -> dict:
    return {"a": torch.full((1000, 300), value), "b": torch.arange(777) * value, "meta": {"step": int(value)}}


def target() -> dict:
    return {"a": torch.zeros(1000, 300), "b": torch.zeros(777), "meta": {"step": -1}}


def assert_loads(path, value: float) -> None:
    t = target()
    load(t, path)
    assert torch.equal(t["a"], state_of(value)["a"]) and torch.equal(t["b"], state_of(value)["b"])
    assert t["meta"]["step"] == int(value)


def data_files(path) -> list:
    return sorted(p for p in path.iterdir() if p.suffix == ".distcp")


def load_failure(path) -> BaseException:
    with pytest.raises(CheckpointException) as e:
        load(target(), path)
    return failure(e)


def test_flipped_bytes_are_detected_and_named(ckpt):
    save(state_of(1.0), ckpt)
    (f,) = data_files(ckpt)
    original = f.read_bytes()
    storage = FastPersistReader(ckpt).read_metadata().storage_data
    spans = [(offset, offset + length, index.fqn) for index, (_, offset, length, *_) in storage.items()]
    rng = random.Random(0)
    for _ in range(12):
        start, stop, fqn = rng.choice(spans)
        pos = rng.randrange(start, stop)
        corrupted = bytearray(original)
        corrupted[pos] ^= 1 << rng.randrange(8)
        f.write_bytes(bytes(corrupted))
        err = load_failure(ckpt)
        assert isinstance(err, CorruptCheckpointError), err
        assert "checksum mismatch" in str(err) and f.name in str(err) and repr(fqn) in str(err)
    f.write_bytes(original)
    assert_loads(ckpt, 1.0)


def test_truncated_and_missing_files_are_detected(ckpt):
    save(state_of(2.0), ckpt)
    (f,) = data_files(ckpt)
    original = f.read_bytes()
    f.write_bytes(original[: len(original) // 2])
    err = load_failure(ckpt)
    assert isinstance(err, CorruptCheckpointError) and "truncated" in str(err) and f.name in str(err)
    f.unlink()
    err = load_failure(ckpt)
    assert isinstance(err, CorruptCheckpointError) and "missing" in str(err) and f.name in str(err)


@pytest.mark.parametrize("where", ["pickle", "footer", "trailer"])
def test_corrupted_metadata_is_detected(ckpt, where):
    save(state_of(3.0), ckpt)
    md = ckpt / ".metadata"
    data = bytearray(md.read_bytes())
    pos = {"pickle": 40, "footer": len(data) - 40, "trailer": len(data) - 3}[where]
    data[pos] ^= 0x10
    md.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError):
        FastPersistReader(ckpt).read_metadata()


def test_failed_save_leaves_no_checkpoint_and_no_files(ckpt, monkeypatch):
    monkeypatch.setenv(engine.FAULT_ENV, "2")
    with pytest.raises(CheckpointException) as e:
        save(state_of(4.0), ckpt, config=IOConfig(block_size=64 << 10))  # requests enough for a second to fail
    err = failure(e)
    assert isinstance(err, OSError) and "injected" in str(err)
    assert not (ckpt / ".metadata").exists()
    assert data_files(ckpt) == []
    assert "holds no checkpoint" in str(load_failure(ckpt))


def test_failed_overwrite_keeps_the_previous_checkpoint(ckpt, monkeypatch):
    save(state_of(5.0), ckpt)
    old_files = data_files(ckpt)
    monkeypatch.setenv(engine.FAULT_ENV, "1")
    with pytest.raises(CheckpointException):
        save(state_of(6.0), ckpt)
    monkeypatch.delenv(engine.FAULT_ENV)
    assert data_files(ckpt) == old_files
    assert_loads(ckpt, 5.0)


def test_crash_before_publish_keeps_the_previous_checkpoint(ckpt, monkeypatch):
    """Data of the new save written and fsynced, then the process dies before the rename."""
    save(state_of(7.0), ckpt)

    def die(*args, **kwargs):
        raise KeyboardInterrupt("simulated crash")

    monkeypatch.setattr(commit, "publish", die)
    with pytest.raises((CheckpointException, KeyboardInterrupt)):
        save(state_of(8.0), ckpt)
    monkeypatch.undo()
    assert len(data_files(ckpt)) == 2  # the new, unpublished file is there but unreferenced
    assert_loads(ckpt, 7.0)
    save(state_of(9.0), ckpt).close()  # the next save publishes and removes both leftovers (close: waits)
    assert len(data_files(ckpt)) == 1
    assert_loads(ckpt, 9.0)


def test_durable_steps_happen_in_order(ckpt, monkeypatch):
    """Data, then its directory entry, then .metadata (written, fsynced, renamed, dir fsynced), then old files go."""
    save(state_of(1.0), ckpt)
    (old,) = data_files(ckpt)
    events: list[str] = []

    def spy(obj, name, label):
        real = getattr(obj, name)

        def wrapper(*args, **kwargs):
            result = real(*args, **kwargs)
            event = label(*args)
            if event:
                events.append(event)
            return result

        monkeypatch.setattr(obj, name, wrapper)

    def fsync_label(fd: int) -> str | None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if path == str(ckpt):
            return "fsync dir"
        name = os.path.basename(path)
        return None if name.endswith(".distcp") else "fsync " + name.split(".")[1]  # ".metadata.<token>.tmp"

    for cls in (engine.UringEngine, engine.ThreadEngine):
        spy(cls, "sync", lambda *a: "fsync data")
    spy(os, "fsync", fsync_label)
    spy(os, "replace", lambda src, dst: f"rename {os.path.basename(src).split('.')[1]} -> {os.path.basename(dst)}")
    spy(
        os, "unlink", lambda path: "unlink " + ("old" if os.path.basename(path) == old.name else os.path.basename(path))
    )
    save(state_of(2.0), ckpt).close()  # close: the replaced file is removed on a thread of its own
    monkeypatch.undo()
    assert events == [
        "fsync data",
        "fsync dir",  # the data file and its name are durable...
        "fsync metadata",
        "rename metadata -> .metadata",
        "fsync dir",  # ...before .metadata is published, durably...
        "unlink old",
        "fsync dir",  # ...and only then is the replaced data removed
    ]
    assert_loads(ckpt, 2.0)


def test_concurrent_save_to_the_same_directory_is_refused(ckpt):
    save(state_of(1.0), ckpt)
    held = commit.SaveLock(str(ckpt))  # another process (or writer) saving there now
    try:
        with pytest.raises(CheckpointException) as e:
            save(state_of(2.0), ckpt)
        err = failure(e)
        assert isinstance(err, CheckpointBusyError) and "in progress" in str(err)
    finally:
        held.release()
    assert_loads(ckpt, 1.0)
    save(state_of(3.0), ckpt)
    assert_loads(ckpt, 3.0)


def test_write_items_are_checked_before_any_file_exists(ckpt, monkeypatch):
    created = []
    real = packer.open_file

    def spy(path, **kwargs):
        created.append(path)
        return real(path, **kwargs)

    monkeypatch.setattr(packer, "open_file", spy)
    with pytest.raises(CheckpointException):
        save({"ok": torch.ones(10), "bad": torch.empty(3, device="meta")}, ckpt)
    assert created == []


def test_writer_reused_after_a_failed_save_without_checkpoint_id(ckpt, monkeypatch):
    """DCP resets a writer only when given a checkpoint_id: a retry must not trip over its own stale lock."""
    writer = FastPersistWriter(ckpt)
    monkeypatch.setenv(engine.FAULT_ENV, "1")
    with pytest.raises(CheckpointException):
        dcp.save(state_of(1.0), storage_writer=writer)
    monkeypatch.delenv(engine.FAULT_ENV)
    dcp.save(state_of(2.0), storage_writer=writer)
    assert_loads(ckpt, 2.0)


def test_a_crash_before_the_replaced_files_are_removed_leaves_garbage_the_next_save_removes(ckpt, monkeypatch):
    """The replaced checkpoint's files are removed after the new one is published, on a thread of their own; a
    crash in between leaves the new checkpoint whole plus unreferenced files, which the next save removes."""
    save(state_of(1.0), ckpt).close()
    (first,) = data_files(ckpt)
    monkeypatch.setattr(commit.Cleanup, "start", lambda self, directories, names: None)  # the process died here
    save(state_of(2.0), ckpt).close()
    monkeypatch.undo()
    assert first in data_files(ckpt) and len(data_files(ckpt)) == 2
    assert_loads(ckpt, 2.0)  # complete, the garbage beside it
    save(state_of(3.0), ckpt).close()
    assert len(data_files(ckpt)) == 1 and first not in data_files(ckpt)
    assert_loads(ckpt, 3.0)


def test_replacing_a_stock_checkpoint_removes_only_its_own_files(tmp_path):
    """A stock .metadata whose item names a path outside its directory: the save over it leaves that file alone."""
    ckpt, victim = tmp_path / "ckpt", tmp_path / "victim"
    dcp.save(state_of(1.0), storage_writer=dcp.FileSystemWriter(str(ckpt)), no_dist=True)
    victim.write_bytes(b"not the checkpoint's")
    with open(ckpt / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    for info in metadata.storage_data.values():
        info.relative_path = "../victim"
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    save(state_of(2.0), str(ckpt)).close()
    assert victim.read_bytes() == b"not the checkpoint's"
    assert_loads(str(ckpt), 2.0)
