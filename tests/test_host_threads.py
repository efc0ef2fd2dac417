"""The host threads beside the I/O: copies and checksums split over several (``io.host_threads``), and load targets
faulted in ahead of the reads (``io.prefault``)."""

from __future__ import annotations

import errno
import mmap
import os
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import empty_like, failure, load, needs_xxhash, save
from torch.distributed.checkpoint.api import CheckpointException

from fp_dcp import CorruptCheckpointError, IOConfig
from fp_dcp._native import _cio
from fp_dcp.io import host_threads, prefault
from fp_dcp.io.device import filesystem_of
from fp_dcp.io.files import ShortReadError, open_file
from fp_dcp.io.host_threads import BOUNCE, MIN_SLICE, HostThreads
from fp_dcp.tools.workload import evict


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
@pytest.mark.parametrize("size", [0, 1, MIN_SLICE - 1, 2 * MIN_SLICE, 5 * MIN_SLICE + 4099])
def test_sliced_checksums_and_copies_equal_one_pass(threads, size):
    data = os.urandom(size + 3)
    src = memoryview(data)[3:]  # an unaligned start
    summer = HostThreads(threads)
    try:
        assert summer.crc32c(src) == _cio.crc32c(src)
        assert summer.crc32c(src, 0x1234) == _cio.crc32c(src, 0x1234)  # continuing a running checksum
        dst = bytearray(size)
        assert summer.copy_crc32c(memoryview(dst), src, 77) == _cio.copy_crc32c(bytearray(size), src, 77)
        assert dst == src
        floats = torch.frombuffer(bytearray(data[: size // 4 * 4]), dtype=torch.float32) if size >= 4 else None
        if floats is not None:  # a view of another format is checksummed as its bytes
            assert summer.crc32c(memoryview(floats.numpy())) == _cio.crc32c(data[: size // 4 * 4])
    finally:
        summer.close()


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("size", [0, 1, BOUNCE + 1, 2 * MIN_SLICE + 4099])
def test_reads_through_a_small_buffer_equal_one_pass(tmp_path, threads, size):
    data = os.urandom(size + 100)
    (tmp_path / "f").write_bytes(data)
    f = open_file(str(tmp_path / "f"), create=False, direct=False)
    summer = HostThreads(threads)
    try:
        dst = bytearray(size)
        assert summer.read_crc32c(f, 37, memoryview(dst), 0x99) == _cio.crc32c(data[37 : 37 + size], 0x99)
        assert dst == data[37 : 37 + size]
        if size:
            with pytest.raises(ShortReadError, match=f"file ends before byte {size + 101}"):
                summer.read_crc32c(f, 101, memoryview(dst))  # the file holds size + 99 bytes from there
        f.close()
        with pytest.raises(OSError, match="Bad file descriptor"):
            summer.read_crc32c(f, 0, memoryview(bytearray(10)))
    finally:
        f.close()
        summer.close()


def test_a_failing_slice_returns_only_after_every_other_slice_ended():
    """A slice that fails at once, this thread's or a pool thread's, must not leave the others writing into
    memory the caller goes on to release."""
    summer = HostThreads(3)
    try:
        for failing in (0, MIN_SLICE):
            ended: list[int] = []

            def run(at: int, n: int, crc: int, failing: int = failing, ended: list[int] = ended) -> int:
                if at == failing:
                    raise OSError(errno.EIO, "a slice fails at once")
                if at == 2 * MIN_SLICE:
                    time.sleep(0.2)
                ended.append(at)
                return crc

            with pytest.raises(OSError, match="fails at once"):
                summer._sliced(run, 3 * MIN_SLICE, 0)
            assert sorted(ended) == sorted({0, MIN_SLICE, 2 * MIN_SLICE} - {failing})
    finally:
        summer.close()


@pytest.fixture
def read(monkeypatch) -> list[int]:
    """The bytes of each ``HostThreads.read_crc32c`` call: what a load read from memory through the threads."""
    calls: list[int] = []
    real = HostThreads.read_crc32c

    def spy(self, f, offset, dst, crc=0):
        calls.append(dst.nbytes)
        return real(self, f, offset, dst, crc)

    monkeypatch.setattr(HostThreads, "read_crc32c", spy)
    return calls


@pytest.mark.skipif(filesystem_of("/dev/shm") != "tmpfs", reason="no tmpfs at /dev/shm here")
def test_loads_from_tmpfs_read_through_the_threads_buffers_and_check_every_byte(tmp_path, read):
    """From a file in memory, a read into the target is a copy the CPU makes; it goes through a small buffer per
    thread with the CRC folded in, and a flipped byte is still caught. The small item's extent goes through the
    load's own scratch memory: the load never maps the staging pool."""
    state = {"w": torch.randn(3 << 20), "m": torch.randn(2048, 1024), "b": torch.arange(10)}
    large = [state["w"].nbytes, state["m"].nbytes]
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        save(state, Path(shm) / "ck")
        target = empty_like(state)
        reader = load(target, Path(shm) / "ck", config=IOConfig(host_threads=2))
        assert all(torch.equal(target[k], v) for k, v in state.items())
        assert sorted(read) == sorted(large)  # the large items whole, wherever their memory
        assert reader.last_load is not None and 0 < reader.last_load.staged_bytes < 4096  # the small one's extent
        assert reader._resources.io.context().pool._views is None
        read.clear()
        data = next(p for p in (Path(shm) / "ck").iterdir() if p.suffix == ".distcp" and p.stat().st_size > 1 << 20)
        raw = bytearray(data.read_bytes())
        at = len(raw) // 2
        raw[at] ^= 0x40
        data.write_bytes(raw)
        with pytest.raises(CheckpointException) as e:
            load(empty_like(state), Path(shm) / "ck")
        assert isinstance(failure(e), CorruptCheckpointError) and "checksum mismatch" in str(failure(e))
        assert read


def test_loads_of_files_in_the_page_cache_read_them_there(disk_with_page_cache, monkeypatch, read):
    """A disk file whose every page is cached is read through the page cache by the threads, as from tmpfs, not
    from the disk again with O_DIRECT; a file not (or not all) cached, or where the kernel cannot tell, or with
    ``direct_io=True``, is read as before."""
    state = {"w": torch.randn(3 << 20), "m": torch.randn(2048, 1024), "b": torch.arange(10)}
    large = state["w"].nbytes + state["m"].nbytes
    ck = disk_with_page_cache / "ck"
    save(state, ck)
    data = [p for p in ck.iterdir() if p.suffix == ".distcp"]

    def loaded(config: IOConfig | None = None) -> list[int]:
        read.clear()
        target = empty_like(state)
        load(target, ck, config=config)
        assert all(torch.equal(target[k], v) for k, v in state.items())
        return list(read)

    evict(str(ck))
    assert loaded() == []  # saved with O_DIRECT and evicted: from the disk
    for p in data:
        p.read_bytes()
    assert sum(loaded(IOConfig(host_threads=2))) == large
    assert loaded(IOConfig(direct_io=True)) == []
    with monkeypatch.context() as m:
        m.setattr(_cio, "cached_pages", lambda fd, offset, length: None)
        assert loaded() == []
    biggest = max(data, key=lambda p: p.stat().st_size)
    fd = os.open(biggest, os.O_RDONLY)
    os.posix_fadvise(fd, biggest.stat().st_size // 2, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    assert sum(loaded()) < large  # half of its file evicted: the disk serves that file
    raw = bytearray(biggest.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    biggest.write_bytes(raw)  # in the page cache, dirty
    read.clear()
    with pytest.raises(CheckpointException) as e:
        load(empty_like(state), ck)
    assert isinstance(failure(e), CorruptCheckpointError) and "checksum mismatch" in str(failure(e))
    assert read


def test_large_ranges_are_split_over_the_threads(monkeypatch):
    calls: list[tuple[str, int]] = []
    real = _cio.crc32c

    def recording(*args):
        calls.append((threading.current_thread().name, len(args[0])))
        return real(*args)

    monkeypatch.setattr(host_threads._cio, "crc32c", recording)
    summer = HostThreads(3)
    data = os.urandom(3 * MIN_SLICE)
    assert summer.crc32c(memoryview(data)) == real(data)
    summer.close()
    assert sorted(n for _, n in calls) == [MIN_SLICE] * 3  # three slices...
    here = threading.current_thread().name
    assert [n for who, n in calls if who == here] == [MIN_SLICE]  # ...one in the calling thread, two elsewhere
    calls.clear()
    assert HostThreads(3).crc32c(memoryview(data[: MIN_SLICE + 1])) == real(data[: MIN_SLICE + 1])
    assert calls == [(here, MIN_SLICE + 1)]  # too small to be worth a second thread


def test_run_all_runs_the_tasks_at_once_and_raises_the_first_failure_once_all_ended():
    summer = HostThreads(3)
    try:
        together = threading.Barrier(3, timeout=30)  # breaks unless all three run at once
        seen: list[str] = []
        summer.run_all([lambda: seen.append(threading.current_thread().name) or together.wait()] * 3)
        assert len(set(seen)) == 3 and threading.current_thread().name in seen
        ended = threading.Event()

        def slow() -> None:
            time.sleep(0.2)
            ended.set()

        def fail() -> None:
            raise OSError(errno.ENOSPC, "full")

        for tasks in ([fail, slow], [slow, fail]):  # the failure in this thread, then in a pool thread
            ended.clear()
            with pytest.raises(OSError, match="full"):
                summer.run_all(tasks)
            assert ended.is_set()
        with pytest.raises(ValueError, match="4 tasks for 3 threads"):
            summer.run_all([slow] * 4)
        summer.run_all([])
    finally:
        summer.close()


@needs_xxhash
def test_a_running_content_hash_keeps_the_pass_in_one_thread():
    data = memoryview(os.urandom(3 * MIN_SLICE))
    ours, reference = _cio.Hash128(), _cio.Hash128()
    summer = HostThreads(4)
    dst = bytearray(len(data))
    assert summer.copy_crc32c(memoryview(dst), data, 0, ours) == _cio.crc32c(data, 0, reference)
    assert ours.hexdigest() == reference.hexdigest() and dst == data
    summer.close()


def _untouched(size: int) -> mmap.mmap:
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def test_prepared_memory_is_faulted_in_slice_by_slice_and_keeps_its_bytes():
    m = _untouched(5 * prefault.SLICE + 12345)
    view = memoryview(m)
    view[100:104] = b"keep"
    prefaulter = prefault.Prefaulter(2, huge=True)
    try:
        prepared = prefaulter.prepare(view[64:])
        if not prefault.populate_supported():
            assert prepared is prefault.NOTHING_PREPARED
            return
        prepared.wait(len(m) - 64)
        assert _cio.advise_huge(view) == []  # every 2 MiB block holds pages now
        assert bytes(view[100:104]) == b"keep"
        huge = 2 << 20
        for offset, length in prepared.huge:  # the runs asked for huge pages: whole aligned blocks of it
            assert (_cio.address(view) + 64 + offset) % huge == 0 and length % huge == 0
    finally:
        prefaulter.close()
        view.release()
        m.close()


def test_small_read_only_or_unprepared_memory_is_left_alone():
    prefaulter = prefault.Prefaulter(1)
    small = _untouched(1 << 20)
    assert prefaulter.prepare(memoryview(small)) is prefault.NOTHING_PREPARED
    assert prefaulter.prepare(memoryview(bytes(8 << 20))) is prefault.NOTHING_PREPARED
    prefaulter.close()
    off = prefault.Prefaulter(0)  # prepare_targets=False
    large = _untouched(8 << 20)
    assert off.prepare(memoryview(large)) is prefault.NOTHING_PREPARED
    small.close()
    large.close()


def test_a_kernel_without_populate_is_said_once_and_loads_go_on(monkeypatch, caplog):
    monkeypatch.setattr(prefault, "_supported", None)

    def refuse(buffer):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(prefault._cio, "populate", refuse)
    prefaulter = prefault.Prefaulter(1)
    m = _untouched(8 << 20)
    assert prefaulter.prepare(memoryview(m)) is prefault.NOTHING_PREPARED
    assert "MADV_POPULATE_WRITE" in caplog.text
    prefaulter.close()
    m.close()


@pytest.mark.parametrize("prepare", [True, False])
@pytest.mark.parametrize("direct_reads", [None, True, False])
def test_loads_into_untouched_targets_are_bit_exact(tmp_path, prepare, direct_reads):
    from conftest import load, save

    state = {"big": torch.randn(9 << 20), "odd": torch.randn(3, 1_000_003), "small": torch.arange(100)}
    save(state, tmp_path / "ck")
    target = {k: torch.empty_like(v) for k, v in state.items()}
    config = IOConfig(prepare_targets=prepare, direct_reads=direct_reads, host_threads=2)
    load(target, tmp_path / "ck", config=config)
    assert all(torch.equal(target[k], v) for k, v in state.items())


def test_auto_host_threads_follow_the_cpus_and_the_ranks_of_the_node(monkeypatch):
    cpus = len(os.sched_getaffinity(0))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert IOConfig().threads() == max(1, min(8, cpus))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cpus * 2))
    assert IOConfig().threads() == 1
    assert IOConfig(host_threads=3).threads() == 3
    with pytest.raises(ValueError, match="host_threads"):
        IOConfig(host_threads=0)


@pytest.mark.parametrize(
    "enabled, defrag, asked",
    [
        ("always [madvise] never", "always defer defer+madvise [madvise] never", False),  # faults would compact
        ("always [madvise] never", "always defer [defer+madvise] madvise never", False),
        ("[always] madvise never", "always [defer] defer+madvise madvise never", True),
        ("always [madvise] never", "always defer defer+madvise madvise [never]", True),
        ("always madvise [never]", "always [defer] defer+madvise madvise never", False),  # no huge pages at all
    ],
)
def test_huge_pages_are_asked_for_only_where_a_fault_would_not_compact_memory(
    tmp_path, monkeypatch, enabled, defrag, asked
):
    (tmp_path / "enabled").write_text(enabled + "\n")
    (tmp_path / "defrag").write_text(defrag + "\n")
    monkeypatch.setattr(prefault, "_THP", f"{tmp_path}/")
    assert prefault.huge_pages_without_stalls() is asked
    assert prefault.Prefaulter(1).huge is asked
    monkeypatch.setattr(prefault, "_THP", f"{tmp_path}/absent/")
    assert prefault.huge_pages_without_stalls() is False
