"""Untouched load targets filled page by page through a userfaultfd (``io.userfault``): the bytes, the
checksums, the zeros a first fault would show, other threads that touch a page first, and every registration
ending with the load, also a failed one."""

from __future__ import annotations

import errno
import itertools
import mmap
import os
import threading

import pytest
import torch
from conftest import failure, load, save
from torch.distributed.checkpoint.api import CheckpointException

from fp_dcp import FastPersistReader, IOConfig
from fp_dcp._native import _cio
from fp_dcp.errors import CorruptCheckpointError
from fp_dcp.io import userfault
from fp_dcp.io.files import kernel_copies
from fp_dcp.io.host_threads import MIN_SLICE, HostThreads
from fp_dcp.io.userfault import UserfaultFiller
from fp_dcp.tools.fio import huge_pages

PAGE = mmap.PAGESIZE
_MAP_HUGETLB = getattr(mmap, "MAP_HUGETLB", 0x40000)  # Linux's value, where Python does not name it


def _refusal() -> str | None:
    try:
        os.close(_cio.userfaultfd())
    except OSError as e:
        return str(e)
    return None


pytestmark = pytest.mark.skipif(_refusal() is not None, reason=f"the kernel refuses a userfaultfd: {_refusal()}")


def _untouched(size: int) -> mmap.mmap:
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


@pytest.fixture
def filler():
    f = UserfaultFiller()
    yield f
    f.close()


def test_registered_pages_are_installed_with_their_bytes_and_zeros_around_them():
    m = _untouched(3 * MIN_SLICE)
    view = memoryview(m)
    dst = view[100 : len(m) - 100]
    fd = _cio.userfaultfd()
    try:
        start, end = _cio.register_untouched(fd, dst)
        base = _cio.address(dst)
        assert start % PAGE == 0 and end % PAGE == 0  # the whole pages inside dst, no more
        assert base < start < base + PAGE and base + len(dst) - PAGE < end <= base + len(dst)
        src = memoryview(bytearray(os.urandom(len(dst))))
        crc = 0
        cuts = [0, 12345, 12345 + 3 * PAGE, len(dst) // 2 + 7, len(dst)]  # pieces that split pages between them
        for lo, hi in itertools.pairwise(cuts):
            crc = _cio.fill_crc32c(fd, start, end, dst[lo:hi], src[lo:hi], crc)
        assert crc == _cio.crc32c(src)
        assert bytes(dst) == bytes(src)
        assert bytes(view[:100]) == bytes(100) and bytes(view[-100:]) == bytes(100)
        assert _cio.register_untouched(fd, dst) is None  # every page is there now
    finally:
        os.close(fd)
        dst.release()
        view.release()
        m.close()


def test_memory_touched_or_without_a_whole_page_is_not_registered():
    fd = _cio.userfaultfd()
    try:
        assert _cio.register_untouched(fd, memoryview(bytearray(4 * MIN_SLICE))) is None  # written by bytearray
        m = _untouched(4 * PAGE)
        view = memoryview(m)
        view[3 * PAGE] = 1
        assert _cio.register_untouched(fd, view) is None  # one page touched
        assert _cio.register_untouched(fd, view[10 : PAGE + 10]) is None  # no whole page inside
        view.release()
        m.close()
    finally:
        os.close(fd)


def test_hugetlbfs_memory_is_not_registered():
    """Its pages take neither the zero page nor copies of small pages: the kernel's own ioctls say so."""
    with huge_pages(4 << 20) as (page, why):
        if page is None:
            pytest.skip(why)
        m = mmap.mmap(-1, 2 * page, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_HUGETLB)
        fd = _cio.userfaultfd()
        try:
            with pytest.raises(OSError) as e:
                _cio.register_untouched(fd, memoryview(m))
            assert e.value.errno == errno.EOPNOTSUPP
        finally:
            os.close(fd)
            m.close()


@pytest.mark.parametrize("write", [False, True])
def test_a_thread_that_touches_a_registered_page_first_sees_zeros_and_goes_on(filler, write):
    m = _untouched(MIN_SLICE)
    view = memoryview(m)
    assert filler.register(view)
    seen = []

    def touch():
        if write:
            view[5 * PAGE + 3] = 9
        seen.append(view[5 * PAGE + 3])

    thread = threading.Thread(target=touch, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "a thread touching a registered page was left waiting"
    assert seen == [9 if write else 0]
    src = memoryview(bytearray(os.urandom(len(view))))
    assert filler.copy_crc32c(view, src) == _cio.crc32c(src)  # the touched page is copied into, the rest installed
    assert bytes(view) == bytes(src)
    filler.close()
    view.release()
    m.close()


def _registrable_anew(view: memoryview) -> bool:
    """Whether a new userfaultfd can register ``view``: not while another one still has it (EBUSY)."""
    fd = _cio.userfaultfd()
    try:
        return _cio.register_untouched(fd, view) is not None
    finally:
        os.close(fd)


def test_close_ends_the_registrations(filler):
    m = _untouched(MIN_SLICE)
    view = memoryview(m)
    assert filler.register(view)
    assert not filler.register(view)  # registered already: not twice
    filler.close()
    assert _registrable_anew(view)
    view[7] = 1  # a plain fault again
    assert view[7] == 1
    view.release()
    m.close()


def test_close_ends_the_registrations_while_a_forked_child_holds_the_userfaultfd(filler):
    m = _untouched(MIN_SLICE)
    view = memoryview(m)
    assert filler.register(view)
    go_r, go_w = os.pipe()
    child = os.fork()
    if child == 0:  # holds every fd of the parent, the userfaultfd among them, until told to go
        os.read(go_r, 1)
        os._exit(0)
    try:
        filler.close()
        assert _registrable_anew(view)  # the child's copy of the fd keeps nothing registered
    finally:
        os.write(go_w, b"x")
        os.waitpid(child, 0)
        os.close(go_r)
        os.close(go_w)
    view.release()
    m.close()


def test_copies_split_over_threads_fill_the_same_bytes_and_crc(filler):
    size = 5 * MIN_SLICE + 4099
    m = _untouched(size + 2 * PAGE)
    view = memoryview(m)
    dst = view[PAGE - 33 : PAGE - 33 + size]
    assert filler.register(dst)
    src = memoryview(bytearray(os.urandom(size)))
    host_threads = HostThreads(4)
    try:
        assert host_threads.copy_crc32c(dst, src, 7, into=filler) == _cio.crc32c(src, 7)
    finally:
        host_threads.close()
    assert bytes(dst) == bytes(src)
    dst.release()
    view.release()
    m.close()


def _untouched_like(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Targets in fresh anonymous mappings (each tensor keeps its own alive): memory nobody has written, as a
    large ``torch.empty`` gives."""
    return {k: torch.frombuffer(_untouched(v.nbytes), dtype=v.dtype).view(v.shape) for k, v in state.items()}


@pytest.fixture
def registrations(monkeypatch):
    """The fillers the loads made, and how many targets each registered."""
    made: list[tuple[UserfaultFiller, list[bool]]] = []
    real = UserfaultFiller.register

    def register(self, memory):
        done = real(self, memory)
        for filler, results in made:
            if filler is self:
                results.append(done)
                break
        else:
            made.append((self, [done]))
        return done

    monkeypatch.setattr(UserfaultFiller, "register", register)
    return made


def _staged(tmp_path) -> bool:
    return not kernel_copies(str(tmp_path), None)


def test_a_load_fills_untouched_targets_page_by_page_bit_exact(tmp_path, registrations):
    state = {"a": torch.randn(3 << 20), "b": torch.randn(5, 777_777).bfloat16(), "small": torch.arange(10)}
    save(state, tmp_path / "ck")
    targets = _untouched_like(state)
    load(targets, tmp_path / "ck", config=IOConfig(direct_reads=False, host_threads=2))
    assert all(torch.equal(targets[k], v) for k, v in state.items())
    if _staged(tmp_path):
        assert [r for _, r in registrations] == [[True, True]]  # the two large ones; the small one is left
        assert all(f._fd is None for f, _ in registrations)  # closed with the load


def test_targets_that_share_memory_are_filled_whichever_registered_it(tmp_path, registrations):
    tied = torch.randn(1 << 20)
    save({"embed": tied, "head": tied.clone(), "half": tied[: 1 << 19].clone()}, tmp_path / "ck")
    made = _untouched_like({"t": tied})
    shared = made["t"]
    targets = {"embed": shared, "head": shared, "half": shared[: 1 << 19]}
    load(targets, tmp_path / "ck", config=IOConfig(direct_reads=False))
    assert torch.equal(shared, tied)
    if _staged(tmp_path):
        assert [r for _, r in registrations] == [[True, False, False]]  # registered once, filled three times


@pytest.mark.parametrize("config", [IOConfig(direct_reads=True), IOConfig(direct_io=False)])
def test_no_target_is_registered_where_reads_go_straight_into_it(tmp_path, registrations, config):
    state = {"a": torch.randn(3 << 20)}
    save(state, tmp_path / "ck")
    targets = _untouched_like(state)
    load(targets, tmp_path / "ck", config=config)  # a direct read into a registered page would fail: EFAULT
    assert torch.equal(targets["a"], state["a"])
    assert registrations == []


def test_a_failed_load_ends_its_registrations(tmp_path, registrations):
    state = {"a": torch.randn(3 << 20), "b": torch.randn(3 << 20)}
    save(state, tmp_path / "ck")
    storage = FastPersistReader(tmp_path / "ck").read_metadata().storage_data
    (name, offset, length, *_) = next(v for k, v in storage.items() if k.fqn == "b")
    with open(tmp_path / "ck" / name, "r+b") as f:  # a byte of b flipped: the load fails once b is in
        f.seek(offset + length - 100)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))
    targets = _untouched_like(state)
    with pytest.raises(CheckpointException) as e:
        load(targets, tmp_path / "ck", config=IOConfig(direct_reads=False))
    assert isinstance(failure(e), CorruptCheckpointError)
    if _staged(tmp_path):
        assert [r for _, r in registrations] == [[True, True]]
    assert all(f._fd is None for f, _ in registrations)
    assert float(targets["b"].sum()) == float(targets["b"].sum())  # every page can be touched: none waits


def test_where_the_kernel_refuses_a_userfaultfd_loads_fault_targets_in_and_say_so(tmp_path, monkeypatch, caplog):
    def refuse():
        raise OSError(1, "Operation not permitted")

    monkeypatch.setattr(userfault, "_refused", False)
    monkeypatch.setattr(userfault._cio, "userfaultfd", refuse)
    state = {"a": torch.randn(3 << 20)}
    save(state, tmp_path / "ck")
    for _ in range(2):
        targets = _untouched_like(state)
        load(targets, tmp_path / "ck", config=IOConfig(direct_reads=False))
        assert torch.equal(targets["a"], state["a"])
    if _staged(tmp_path):
        assert caplog.text.count("userfaultfd refused") == 1
        assert userfault._refused
