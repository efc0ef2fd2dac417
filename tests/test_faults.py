"""Real faults: a full disk, I/O errors in every engine, io_uring refused by a seccomp filter.

Each failure must be clean: a clear error, no ``.metadata`` for the failed
save, none of its files left behind, no file descriptor or staging buffer
leaked, and any earlier checkpoint (in the same directory or beside it)
still loading bit-exact.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import platform
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import SMALL, empty_like, failure, same_bytes, save, tmpfs
from test_misuse import long_path
from test_roundtrip import ENGINES
from torch.distributed.checkpoint.api import CheckpointException

from fp_dcp import FastPersistReader, FastPersistWriter, IOConfig, engine_info, verify_checkpoint
from fp_dcp._native import _cio
from fp_dcp.io import engine
from fp_dcp.tools.workload import evict


def open_fds() -> dict[int, str]:
    """This process's open file descriptors and what they point at."""
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):  # the descriptor listdir itself used
            fds[int(name)] = os.readlink(f"/proc/self/fd/{name}")
    return fds


def state_of(value: float, mib: int = 1) -> dict:
    n = mib << 18  # float32 elements
    few = {str(i): torch.ones(i + 1) * value for i in range(6)}
    return {"w": torch.full((n,), value), "b": torch.arange(1000) * int(value), "few": few}


def assert_loads(path, expected: dict) -> None:
    target = empty_like(expected)
    with FastPersistReader(path) as reader:
        dcp.load(target, storage_reader=reader)
    assert same_bytes(target["w"], expected["w"]) and same_bytes(target["b"], expected["b"])
    assert verify_checkpoint(path).ok


def leftovers(path) -> list[str]:
    """Files a save may create that do not belong to the published checkpoint."""
    published = set()
    if (path / ".metadata").exists():
        published = {file for file, *_ in FastPersistReader(path).read_metadata().storage_data.values()}
    return sorted(n for n in os.listdir(path) if n not in published and n not in (".metadata", ".lock"))


def save_with(writer: FastPersistWriter, state: dict) -> None:
    dcp.save(state, storage_writer=writer)


def free_bytes(path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def room_for_data_only(fs, state: dict) -> None:
    """Fill ``fs`` so that ``state``'s data file just fits and not one page more (for .metadata)."""
    save(state, fs / "probe").close()  # the same tensors give the same layout: learn the data file's size
    size = sum(p.stat().st_size for p in (fs / "probe").iterdir() if p.suffix == ".distcp")
    shutil.rmtree(fs / "probe")
    with open(fs / "filler", "wb") as f:
        f.write(bytes(free_bytes(fs) - size))
    assert free_bytes(fs) == size


# ---------------------------------------------------------------- a full disk


@pytest.fixture
def small_fs(tmp_path):
    """A 64 MiB tmpfs, unmounted afterwards."""
    with tmpfs(tmp_path / "mnt", "64m") as mnt:
        yield mnt


def test_enospc_saving_128mib_on_a_64mib_filesystem(small_fs):
    earlier, same_dir = state_of(1.0, mib=4), state_of(2.0, mib=4)
    save(earlier, small_fs / "earlier").close()
    save(same_dir, small_fs / "ckpt").close()
    before = free_bytes(small_fs)
    for target in ("new", "ckpt"):  # a fresh directory, and overwriting the checkpoint there
        writer = FastPersistWriter(small_fs / target)
        with pytest.raises(CheckpointException) as e:
            save_with(writer, state_of(3.0, mib=128))
        writer.close()
        err = failure(e)
        assert isinstance(err, OSError) and err.errno == errno.ENOSPC
        assert "no space left for a" in str(err) and str(small_fs / target) in str(err)
        assert leftovers(small_fs / target) == []  # no data file, no temporary .metadata
    assert not (small_fs / "new" / ".metadata").exists()
    assert free_bytes(small_fs) == before  # nothing of the failed saves still holds space
    assert_loads(small_fs / "earlier", earlier)
    assert_loads(small_fs / "ckpt", same_dir)


def test_enospc_writing_metadata_keeps_the_previous_checkpoint(small_fs):
    """Room for the data file, none for .metadata: the save fails, the checkpoint it would replace stays."""
    old, new = state_of(1.0), state_of(2.0, mib=4)
    save(old, small_fs / "ckpt").close()
    room_for_data_only(small_fs, new)
    writer = FastPersistWriter(small_fs / "ckpt")
    with pytest.raises(CheckpointException) as e:
        save_with(writer, new)
    writer.close()
    err = failure(e)
    assert isinstance(err, OSError) and err.errno == errno.ENOSPC and "No space left" in str(err)
    assert not [n for n in os.listdir(small_fs / "ckpt") if n.startswith(".metadata.")]  # the temporary one is gone
    assert_loads(small_fs / "ckpt", old)


@pytest.mark.parametrize("cause", ["ENOSPC", "ENAMETOOLONG"])
def test_failed_publish_removes_the_saves_data_files(request, tmp_path, cause):
    if cause == "ENOSPC":
        fs = request.getfixturevalue("small_fs")
        new = state_of(2.0, mib=4)
        room_for_data_only(fs, new)
        path = fs / "ckpt"
    else:  # a directory name just short enough for the data files, one byte too long for .metadata.<token>.tmp
        new = state_of(2.0)
        path = long_path(tmp_path, 4065)
    writer = FastPersistWriter(path)
    with pytest.raises(CheckpointException) as e:
        save_with(writer, new)
    writer.close()
    assert failure(e).errno == getattr(errno, cause)
    assert leftovers(path) == []  # the unpublished data files went with the failure


# ---------------------------------------------------------------- injected I/O errors


def requests_of_a_save(tmp_path, config: IOConfig, state: dict) -> int:
    with FastPersistWriter(tmp_path / "count", config=config) as writer:
        save_with(writer, state)
        return writer._resources.io.context().engine._requests  # the fault hook's own counter


def small(config: str) -> IOConfig:
    """SMALL's tiny buffers and requests (many requests to fail) with one of the engines."""
    return dataclasses.replace(SMALL, engine=ENGINES[config].engine, direct_io=ENGINES[config].direct_io)


@pytest.mark.parametrize("k", ["first", "middle", "last"])
@pytest.mark.parametrize("config", ENGINES)
def test_injected_eio_fails_the_save_cleanly(tmp_path, monkeypatch, config, k):
    cfg = small(config)
    ckpt = tmp_path / "ckpt"
    old, new = state_of(1.0), state_of(2.0)
    save(old, ckpt, config=cfg).close()
    n = requests_of_a_save(tmp_path, cfg, new)
    assert n > 3
    fds = open_fds()
    monkeypatch.setenv(engine.FAULT_ENV, str({"first": 1, "middle": n // 2, "last": n}[k]))
    writer = FastPersistWriter(ckpt, config=cfg)
    with pytest.raises(CheckpointException) as e:
        save_with(writer, new)
    monkeypatch.delenv(engine.FAULT_ENV)
    err = failure(e)
    assert isinstance(err, OSError) and err.errno == errno.EIO and "injected" in str(err) and ckpt.name in str(err)
    opened = {fd: target for fd, target in open_fds().items() if fd not in fds}
    assert not [t for t in opened.values() if t.endswith(".distcp") or ".metadata" in t], opened
    pool = writer._resources.io.context().pool
    assert len(pool.free) == pool.count  # every staging buffer back in the pool
    writer.close()
    assert open_fds() == fds
    assert leftovers(ckpt) == []
    assert_loads(ckpt, old)


@pytest.mark.parametrize("k", ["first", "last"])
@pytest.mark.parametrize("config", ENGINES)
def test_injected_eio_fails_the_load_cleanly(ckpt, monkeypatch, config, k):
    state = state_of(1.0)
    save(state, ckpt, config=SMALL).close()
    with FastPersistReader(ckpt, config=small(config)) as reader:
        dcp.load(empty_like(state), storage_reader=reader)
        n = reader._resources.io.context().engine._requests  # the fault hook's own counter
    evict(str(ckpt))  # else the buffered read above leaves the files in the page cache, read there, not by the engine
    fds = open_fds()
    monkeypatch.setenv(engine.FAULT_ENV, str({"first": 1, "last": n}[k]))
    reader = FastPersistReader(ckpt, config=small(config))
    with pytest.raises(CheckpointException) as e:
        dcp.load(empty_like(state), storage_reader=reader)
    monkeypatch.delenv(engine.FAULT_ENV)
    err = failure(e)
    assert isinstance(err, OSError) and err.errno == errno.EIO and "injected" in str(err)
    pool = reader._resources.io.context().pool
    assert len(pool.free) == pool.count
    reader.close()
    assert open_fds() == fds
    assert_loads(ckpt, state)


def test_after_a_failed_save_a_new_writer_can_save(ckpt, monkeypatch):
    """Typical retry code makes a new writer; the failed one still holds the directory's lock."""
    monkeypatch.setenv(engine.FAULT_ENV, "1")
    failed = FastPersistWriter(ckpt)
    with pytest.raises(CheckpointException):
        save_with(failed, state_of(1.0))
    monkeypatch.delenv(engine.FAULT_ENV)
    try:
        save(state_of(2.0), ckpt).close()
    finally:
        failed.close()
    assert_loads(ckpt, state_of(2.0))


# ---------------------------------------------------------------- io_uring refused


AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}  # io_uring_setup is syscall 425 on both

SECCOMP_CHILD = textwrap.dedent(
    """
    import ctypes, errno, json, sys
    # seccomp BPF: io_uring_setup (425) fails with EPERM, as under Docker's default profile; all else allowed
    arch, path = int(sys.argv[1]), sys.argv[2]
    class Filter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]
    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filter))]
    LD_ABS_W, JEQ_K, RET_K = 0x20, 0x15, 0x06
    ALLOW, ERRNO = 0x7FFF0000, 0x00050000
    rules = [
        Filter(LD_ABS_W, 0, 0, 4),            # seccomp_data.arch
        Filter(JEQ_K, 0, 3, arch),            # another architecture: allow (its numbers differ)
        Filter(LD_ABS_W, 0, 0, 0),            # seccomp_data.nr
        Filter(JEQ_K, 0, 1, 425),             # io_uring_setup?
        Filter(RET_K, 0, 0, ERRNO | errno.EPERM),
        Filter(RET_K, 0, 0, ALLOW),
    ]
    program = Program(len(rules), (Filter * len(rules))(*rules))
    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) or libc.prctl(
        PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(program), 0, 0
    ):
        raise OSError(ctypes.get_errno(), "seccomp filter not installed")

    import warnings
    warnings.filterwarnings("ignore")
    import torch, torch.distributed.checkpoint as dcp
    from fp_dcp import FastPersistReader, FastPersistWriter, IOConfig, engine_info
    from fp_dcp.io.engine import create_engine
    out = {"seccomp": open("/proc/self/status").read().split("Seccomp:")[1].split()[0], "info": engine_info()}
    try:
        create_engine(IOConfig(engine="io_uring"))
    except RuntimeError as e:
        out["forced"] = str(e)
    state = {"w": torch.randn(300, 500), "b": torch.arange(10)}
    writer = FastPersistWriter(path)
    dcp.save(state, storage_writer=writer)
    target = {"w": torch.zeros(300, 500), "b": torch.zeros(10, dtype=torch.int64)}
    reader = FastPersistReader(path)
    dcp.load(target, storage_reader=reader)
    out.update(saved=writer.last_save.engine, loaded=reader.last_load.engine,
               exact=all(torch.equal(state[k], target[k]) for k in state))
    print(json.dumps(out))
    """
)


@pytest.mark.skipif(platform.machine() not in AUDIT_ARCH, reason=f"no seccomp filter written for {platform.machine()}")
def test_io_uring_refused_by_seccomp_falls_back_and_says_so(ckpt):
    if not _cio.HAVE_IO_URING:
        pytest.skip("built without liburing: there is no io_uring to refuse")
    assert engine_info()["engine"] == "io_uring"  # without the filter, this machine uses io_uring
    child = subprocess.run(
        [sys.executable, "-c", SECCOMP_CHILD, str(AUDIT_ARCH[platform.machine()]), str(ckpt)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 0, child.stderr
    out = json.loads(child.stdout.strip().splitlines()[-1])
    reason = "io_uring refused by the kernel: Operation not permitted"
    assert out["seccomp"] == "2"  # filter mode
    assert out["info"]["engine"] == "threads" and out["info"]["fallback_reason"] == reason
    assert out["forced"] == f"engine='io_uring' was requested but {reason}"
    assert out["saved"] == out["loaded"] == f"threads ({reason})"
    assert out["exact"]
    assert f"using the threads engine because {reason}" in child.stderr  # logged for the operator
    assert verify_checkpoint(ckpt).ok
