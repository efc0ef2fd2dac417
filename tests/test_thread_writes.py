"""Saves whose every byte the kernel copies (tmpfs, the page cache), written by the host threads, each its own
files (``save.thread_writes``)."""

from __future__ import annotations

import dataclasses
import errno
import glob
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import SMALL, empty_like, failure, load, needs_xxhash, same_bytes, save
from torch.distributed.checkpoint.api import CheckpointException

from fp_dcp import FastPersistWriter, IOConfig, SaveCancelledError, verify_checkpoint
from fp_dcp._native import _cio
from fp_dcp.checkpoint import open_checkpoint
from fp_dcp.io.device import filesystem_of

pytestmark = pytest.mark.skipif(filesystem_of("/dev/shm") != "tmpfs", reason="no tmpfs at /dev/shm here")

TWO = IOConfig(host_threads=2)


@pytest.fixture
def shm() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        yield Path(d)


class Writes:
    """Each ``_cio.write_crc32c`` call: the thread, the file, the bytes; ``then`` runs after a call."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, str, int]] = []
        self.then = lambda call: None

    def by_file(self) -> dict[str, set[int]]:
        threads: dict[str, set[int]] = {}
        for thread, path, _ in self.calls:
            threads.setdefault(path, set()).add(thread)
        return threads


@pytest.fixture
def writes(monkeypatch) -> Writes:
    seen = Writes()
    real = _cio.write_crc32c
    lock = threading.Lock()

    def spy(fd, offset, src, step, crc=0, hasher=None):
        with lock:
            seen.calls.append((threading.get_ident(), os.readlink(f"/proc/self/fd/{fd}"), memoryview(src).nbytes))
            number = len(seen.calls)
        result = real(fd, offset, src, step, crc, hasher)
        seen.then(number)
        return result

    monkeypatch.setattr(_cio, "write_crc32c", spy)
    return seen


def state_of(seed: int, large: int = 6) -> dict:
    g = torch.Generator().manual_seed(seed)
    state = {f"layer{i}": torch.randn(1024, 1280 + 64 * i, generator=g) for i in range(large)}  # 5-7 MiB each
    state["transposed"] = torch.randn(700, 900, generator=g).t()  # no memory of its own in file order: staged
    state["bf16"] = torch.randn(3001, generator=g).to(torch.bfloat16)  # small: staged
    state["empty"] = torch.empty(0, 3)
    state["objects"] = {"step": seed}
    return state


def large_bytes(state: dict) -> int:
    return sum(v.nbytes for k, v in state.items() if k.startswith("layer"))


def assert_loads(path: Path, state: dict) -> None:
    target = empty_like(state)
    target["objects"] = {"step": -1}
    load(target, path)
    assert all(same_bytes(target[k], v) for k, v in state.items() if isinstance(v, torch.Tensor))
    assert target["objects"] == state["objects"]


def test_saves_into_tmpfs_are_written_by_the_threads_each_file_by_one(shm, writes):
    state = state_of(1)
    writer = save(state, shm / "ck", lanes_per_dir=4, config=TWO)
    files = writes.by_file()
    assert len(files) == 4 and all(len(threads) == 1 for threads in files.values())  # a file's writes stay in order
    assert len(set.union(*files.values())) == 2  # both threads wrote
    # the large items from their memory, all but the unaligned ends of each (staged beside the small items)
    assert large_bytes(state) - 6 * 8192 <= sum(n for _, _, n in writes.calls) <= large_bytes(state)
    assert verify_checkpoint(shm / "ck").ok
    assert_loads(shm / "ck", state)
    assert writer.last_save.bytes >= large_bytes(state)
    assert writer._resources.io.context().pool._views is None  # the small items staged in the threads' own memory

    writes.calls.clear()
    save(state, shm / "null", lanes_per_dir=4, config=IOConfig(host_threads=2, engine="null"))  # stores nothing
    save(state, shm / "one-thread", lanes_per_dir=4, config=IOConfig(host_threads=1))
    save(state, shm / "one-file", lanes_per_dir=1, config=TWO)
    assert writes.calls == []
    assert_loads(shm / "one-file", state)


def test_saves_through_the_page_cache_are_written_by_the_threads_and_o_direct_ones_by_the_ring(
    disk_with_page_cache, writes
):
    state = state_of(11)
    save(state, disk_with_page_cache / "direct", lanes_per_dir=4, config=TWO)
    assert writes.calls == []  # O_DIRECT to a disk: the engine's ring
    save(state, disk_with_page_cache / "buffered", lanes_per_dir=4, config=IOConfig(host_threads=2, direct_io=False))
    files = writes.by_file()
    assert len(files) == 4 and all(len(threads) == 1 for threads in files.values())
    for name in ("direct", "buffered"):
        assert verify_checkpoint(disk_with_page_cache / name).ok
        assert_loads(disk_with_page_cache / name, state)


@pytest.mark.parametrize(
    "config, from_memory",
    [
        (dataclasses.replace(SMALL, host_threads=2), True),  # many small runs, heads and tails staged around them
        (IOConfig(host_threads=2, direct_writes=False), False),  # every byte through the threads' buffers
        (IOConfig(host_threads=3), True),  # a thread for each file
    ],
    ids=["small-buffers", "all-staged", "three-threads"],
)
def test_any_mix_of_staged_and_direct_writes_over_the_threads_loads_bit_exact(shm, writes, config, from_memory):
    state = state_of(10, large=2)
    save(state, shm / "ck", lanes_per_dir=3, config=config)
    assert bool(writes.calls) == from_memory
    assert verify_checkpoint(shm / "ck").ok
    assert_loads(shm / "ck", state)


def test_what_the_threads_write_checksums_as_the_rings_path_does(shm, writes):
    state = state_of(2)
    save(state, shm / "threads", lanes_per_dir=2, config=TWO)
    save(state, shm / "ring", lanes_per_dir=2, config=IOConfig(host_threads=1))
    assert writes.calls
    crcs = {k.fqn: v.crc32c for k, v in open_checkpoint(shm / "threads").metadata.storage_data.items()}
    assert crcs == {k.fqn: v.crc32c for k, v in open_checkpoint(shm / "ring").metadata.storage_data.items()}


def test_state_staged_through_the_device_copier_takes_the_ring(shm, gpu, writes):
    """Device copies belong to the save's thread: a save whose bytes come through the copier uses the ring."""
    state = {k: v for k, v in state_of(3).items() if k != "transposed"}
    on_device = {k: v.to(gpu.device) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    dcp.save(on_device, storage_writer=gpu.writer(shm / "ck", lanes_per_dir=2, config=TWO))
    assert writes.calls == []
    assert_loads(shm / "ck", state)


def test_a_failed_write_stops_every_thread_and_leaves_no_checkpoint(shm, writes):
    def fail(number: int) -> None:
        if number == 2:  # once the other thread is inside a write of its own: it must stop at the next extent
            deadline = time.monotonic() + 10
            while len(writes.calls) < 3 and time.monotonic() < deadline:
                time.sleep(0.001)
            raise OSError(errno.ENOSPC, "No space left on device")
        if number == 3:
            time.sleep(0.2)  # while the failure is raised and flagged

    writes.then = fail
    with pytest.raises(CheckpointException) as info:
        save(state_of(4, large=12), shm / "ck", lanes_per_dir=4, config=TWO)
    err = failure(info)
    assert isinstance(err, OSError) and err.errno == errno.ENOSPC
    assert len(writes.calls) == 3  # the other thread stopped at its next extent, of the 6 or so it had
    assert not glob.glob(str(shm / "ck" / "*.distcp")) and not (shm / "ck" / ".metadata").exists()


def test_a_write_the_kernel_refuses_names_the_file(shm, monkeypatch):
    real = _cio.write_crc32c

    def refuse(fd, offset, src, step, crc=0, hasher=None):
        return real(-1, offset, src, step, crc, hasher)

    monkeypatch.setattr(_cio, "write_crc32c", refuse)
    with pytest.raises(CheckpointException) as info:
        save(state_of(5), shm / "ck", lanes_per_dir=2, config=TWO)
    err = failure(info)
    assert err.errno == errno.EBADF and ".distcp" in err.filename and "writing" in str(err)
    assert not glob.glob(str(shm / "ck" / "*.distcp"))


def test_cancel_stops_the_threads_and_publishes_nothing(shm, writes):
    writer = FastPersistWriter(shm / "ck", lanes_per_dir=4, config=TWO)
    writes.then = lambda number: writer.cancel()
    with pytest.raises(CheckpointException) as info:
        dcp.save(state_of(6, large=12), storage_writer=writer)
    assert isinstance(failure(info), SaveCancelledError)
    assert len(writes.calls) <= 2
    assert not glob.glob(str(shm / "ck" / "*.distcp")) and not (shm / "ck" / ".metadata").exists()


def test_reused_files_in_tmpfs_read_as_new_ones(shm, writes):
    old = state_of(7, large=8)
    for v in old.values():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            v.add_(1000.0)  # bytes nothing in the new state has: stale ones would show
    dcp.save(old, storage_writer=FastPersistWriter(shm / "old", lanes_per_dir=2, config=TWO))
    inodes = {os.stat(p).st_ino for p in open_checkpoint(shm / "old").own_files().values()}
    new = state_of(8, large=3)
    dcp.save(new, storage_writer=FastPersistWriter(shm / "new", lanes_per_dir=2, config=TWO, spare=shm / "old"))
    assert {os.stat(p).st_ino for p in open_checkpoint(shm / "new").own_files().values()} == inodes
    report = verify_checkpoint(shm / "new")
    assert report.ok, report
    assert_loads(shm / "new", new)
    assert writes.calls


@needs_xxhash
def test_incremental_saves_into_tmpfs_hash_what_the_threads_write(shm, writes):
    state = state_of(9)
    with FastPersistWriter(incremental=True, lanes_per_dir=2, config=TWO) as writer:
        dcp.save(state, checkpoint_id=str(shm / "step-1"), storage_writer=writer)
        first = open_checkpoint(shm / "step-1")
        for index, location in first.metadata.storage_data.items():
            h = _cio.Hash128()
            with open(first.files[location.file], "rb") as f:
                f.seek(location.offset)
                h.update(f.read(location.length))
            assert location.xxh3_128 == h.hexdigest(), index.fqn
        state["layer0"].neg_()
        writer.base = str(shm / "step-1")
        dcp.save(state, checkpoint_id=str(shm / "step-2"), storage_writer=writer)
        unchanged = large_bytes(state) - state["layer0"].nbytes
        assert unchanged <= writer.last_save.referenced <= unchanged + state["transposed"].nbytes + 6002
    assert writes.calls
    assert_loads(shm / "step-2", state)
