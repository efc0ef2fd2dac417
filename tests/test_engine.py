"""Engines and their fallbacks: io_uring refused, O_DIRECT refused, no liburing at build time."""

from __future__ import annotations

import errno
import gc
import itertools
import json
import logging
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from conftest import empty_like, load, save

import fp_dcp
from fp_dcp import IOConfig, log
from fp_dcp._native import _cio
from fp_dcp._native.libraries import LIBRARIES
from fp_dcp.checkpoint import open_checkpoint
from fp_dcp.io import buffers, engine, files
from fp_dcp.io.buffers import BufferPool
from fp_dcp.tools.workload import evict

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def fresh_log_once():
    log._logged.clear()
    yield
    log._logged.clear()


class Request(NamedTuple):
    offset: int
    length: int
    address: int


def record_writes(monkeypatch, kind: str, writes: bool = True) -> list[Request]:
    """The direct write (or read) requests the ``kind`` engine will be handed, as they are queued."""
    cls = engine.UringEngine if kind == "io_uring" else engine.ThreadEngine
    queue = cls._queue
    requests: list[Request] = []

    def recording(self, ticket, is_write, file, view, offset, end):
        if is_write == writes and file.direct:
            requests.append(Request(offset, len(view), _cio.address(view)))
        return queue(self, ticket, is_write, file, view, offset, end)

    monkeypatch.setattr(cls, "_queue", recording)
    return requests


@pytest.fixture(params=["io_uring", "threads"])
def kind(request) -> str:
    """Each engine by name; io_uring only where the build has liburing."""
    if request.param == "io_uring" and not _cio.HAVE_IO_URING:
        pytest.skip("built without liburing")
    return str(request.param)


def test_direct_writes_keep_to_the_filesystem_block(tmp_path, monkeypatch, kind):
    """ext4 and XFS run a direct write that is not aligned to their block one at a time, under the
    inode lock: every request of a save, offset, length and memory, must keep to the block."""
    block = min(os.stat(tmp_path).st_blksize, os.sysconf("SC_PAGE_SIZE"))
    requests = record_writes(monkeypatch, kind)
    # views into one buffer, so the tensors start at many offsets within a page
    flat = torch.randn(8 << 20)
    state = {f"t{i}": flat[i * 1_000_003 + i * 17 :][: 1 << 20] for i in range(6)}
    state["small"] = torch.arange(10)
    save(state, tmp_path / "ck", config=IOConfig(engine=kind, direct_io=True, direct_writes=True))
    assert requests, "no direct writes were made"
    unaligned = [r for r in requests if r.offset % block or r.length % block or r.address % block]
    assert not unaligned, f"requests off the {block}-byte block: {unaligned[:3]}"
    back = empty_like(state)
    load(back, tmp_path / "ck")
    assert all(torch.equal(back[k], v) for k, v in state.items())


def co_aligned_targets(path: Path, make) -> dict[str, torch.Tensor]:
    """Float targets made by ``make`` (``untouched``, or ``torch.zeros``: touched), each co-aligned
    with its bytes in the file, so that it can be read in place."""
    target = {}
    for index, location in open_checkpoint(path).metadata.storage_data.items():
        backing = make(location.length + 4096, dtype=torch.uint8)
        skew = (location.offset - backing.data_ptr()) % 4096
        target[index.fqn] = backing[skew : skew + location.length].view(torch.float32)
    return target


def untouched(nbytes: int, dtype: torch.dtype) -> torch.Tensor:
    """Memory no page of which was ever touched (``torch.empty`` may reuse freed heap memory)."""
    import mmap

    return torch.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=dtype)


def transparent_huge_pages() -> bool:
    """Whether this kernel gives anonymous memory huge pages when asked (madvise)."""
    import mmap

    m = mmap.mmap(-1, 8 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        return bool(_cio.advise_huge(memoryview(m)))
    finally:
        m.close()


# (setting, disk's requests capped by scattered memory, huge pages enabled, every byte staged)
IN_PLACE_OR_STAGED = [
    (True, True, True, False),
    (False, False, False, True),
    (None, True, True, True),  # auto: the disk takes larger requests than 4 KiB pages fill
    (None, False, True, False),  # auto: it does not
    (None, True, False, False),  # auto: no huge pages to fill them from
]


@pytest.mark.parametrize(("direct_writes", "caps", "huge", "staged"), IN_PLACE_OR_STAGED)
def test_direct_writes_from_tensor_memory_or_staging_buffers(tmp_path, monkeypatch, direct_writes, caps, huge, staged):
    """Where the disk's requests from 4 KiB pages are capped and huge pages can do better (auto), or
    when told, every byte goes through the staging buffers; else large items are written in place."""
    from fp_dcp.io import buffers

    monkeypatch.setattr(files, "scatter_caps_requests", lambda directory: caps)
    monkeypatch.setattr(buffers, "_huge_pages_enabled", lambda: huge)
    requests = record_writes(monkeypatch, "io_uring" if _cio.HAVE_IO_URING else "threads")
    state = {f"t{i}": torch.randn(1 << 20) for i in range(3)}
    save(state, tmp_path / "ck", config=IOConfig(direct_io=True, direct_writes=direct_writes))
    tensor_memory = [(t.data_ptr(), t.data_ptr() + t.nbytes) for t in state.values()]
    from_tensors = [r for r in requests if any(lo <= r.address < hi for lo, hi in tensor_memory)]
    assert (not from_tensors) if staged else from_tensors, (direct_writes, len(requests), len(from_tensors))


@pytest.mark.parametrize(("direct_reads", "caps", "huge", "staged"), IN_PLACE_OR_STAGED)
def test_direct_reads_into_tensor_memory_or_staging_buffers(tmp_path, monkeypatch, direct_reads, caps, huge, staged):
    """Loads decide as saves do: through the staging buffers (then copied into place, checksummed in the same
    pass) where huge pages get the disk larger requests, else large items read straight into the targets."""
    from fp_dcp.io import buffers

    state = {f"t{i}": torch.randn(1 << 20) for i in range(3)}
    save(state, tmp_path / "ck")
    monkeypatch.setattr(files, "scatter_caps_requests", lambda directory: caps)
    monkeypatch.setattr(buffers, "_huge_pages_enabled", lambda: huge)
    requests = record_writes(monkeypatch, "io_uring" if _cio.HAVE_IO_URING else "threads", writes=False)
    target = co_aligned_targets(tmp_path / "ck", torch.zeros)  # touched: no huge pages for them (see below)
    summary = load(target, tmp_path / "ck", config=IOConfig(direct_io=True, direct_reads=direct_reads)).last_load
    assert all(torch.equal(target[k], v) for k, v in state.items())
    tensor_memory = [(t.data_ptr(), t.data_ptr() + t.nbytes) for t in target.values()]
    into_tensors = [r for r in requests if any(lo <= r.address < hi for lo, hi in tensor_memory)]
    assert requests and ((not into_tensors) if staged else into_tensors), (direct_reads, len(requests))
    through_buffers = sum(r.length for r in requests if r not in into_tensors)
    assert summary is not None and summary.staged_bytes == through_buffers > 0
    assert (summary.staged_bytes == summary.bytes) if staged else (summary.staged_bytes < summary.bytes / 2)
    back = empty_like(state)
    load(back, tmp_path / "ck")
    assert all(torch.equal(back[k], v) for k, v in state.items())


@pytest.mark.parametrize("prepare", [True, False])
def test_untouched_targets_read_their_huge_page_blocks_in_place(tmp_path, monkeypatch, prepare):
    """Auto, where 4 KiB pages cap the disk's requests: the 2 MiB-aligned blocks of a target nobody touched yet get
    huge pages before their first touch (``prepare_targets``), so they are read in place at full request size;
    the rest of the target goes through the staging buffers. Without preparing, every byte is staged."""
    from fp_dcp.io import buffers, prefault

    state = {f"t{i}": torch.randn(3 << 20) for i in range(2)}
    save(state, tmp_path / "ck")
    monkeypatch.setattr(files, "scatter_caps_requests", lambda directory: True)
    monkeypatch.setattr(buffers, "_huge_pages_enabled", lambda: True)
    monkeypatch.setattr(prefault, "huge_pages_without_stalls", lambda: True)  # asked for whatever THP's defrag
    requests = record_writes(monkeypatch, "io_uring" if _cio.HAVE_IO_URING else "threads", writes=False)
    target = co_aligned_targets(tmp_path / "ck", untouched)
    load(target, tmp_path / "ck", config=IOConfig(direct_io=True, prepare_targets=prepare))
    assert all(torch.equal(target[k], v) for k, v in state.items())
    huge = 2 << 20
    blocks = [(-(-t.data_ptr() // huge) * huge, (t.data_ptr() + t.nbytes) // huge * huge) for t in target.values()]
    into_tensors = [
        r for r in requests if any(t.data_ptr() <= r.address < t.data_ptr() + t.nbytes for t in target.values())
    ]
    if prepare and transparent_huge_pages():
        assert into_tensors
        outside = [
            r for r in into_tensors if not any(lo <= r.address and r.address + r.length <= hi for lo, hi in blocks)
        ]
        assert not outside, outside[:3]  # only whole huge-page blocks are read in place
        in_place = sum(r.length for r in into_tensors)
        assert in_place >= sum(hi - lo for lo, hi in blocks) - len(blocks) * 2 * 4096  # all of them, but the edges
    else:
        assert not into_tensors


@pytest.mark.parametrize(("segments", "max_kib", "caps"), [(254, 4096, True), (256, 1024, False), (None, 4096, False)])
def test_scatter_caps_requests_from_the_disks_queue_limits(monkeypatch, tmp_path, segments, max_kib, caps):
    from fp_dcp.io import device

    limits = {"max_segments": segments, "max_sectors_kb": max_kib}
    monkeypatch.setattr(device, "disk_of", lambda directory: "vdz")
    monkeypatch.setattr(device, "_queue_value", lambda disk, name: limits[name])
    assert device.scatter_caps_requests(str(tmp_path)) is caps
    monkeypatch.setattr(device, "disk_of", lambda directory: None)  # tmpfs, NFS, overlay
    assert device.scatter_caps_requests(str(tmp_path)) is False


def test_staging_buffers_are_populated_without_madv_populate_write(monkeypatch):
    """Kernels before 5.14 refuse MADV_POPULATE_WRITE: every page is then faulted in by a write."""
    from fp_dcp.io import buffers

    monkeypatch.setattr(buffers, "_MADV_POPULATE_WRITE", 0x7FFF)  # no such advice: EINVAL

    def resident() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    before = resident()
    pool = BufferPool(8 << 20, 2)
    assert resident() - before < 4 << 20  # nothing mapped before the buffers are first used
    assert len(pool.views) == 2
    assert resident() - before >= 15 << 20  # both buffers faulted in
    pool.views[1][:4] = b"abcd"
    assert bytes(pool.views[1][:4]) == b"abcd"
    pool.close()


@pytest.mark.parametrize("direct", [True, False])
def test_engine_transfers_and_errors(tmp_path, kind, direct):
    config = IOConfig(engine=kind, block_size=8192, queue_depth=2)
    eng = engine.create_engine(config)
    pool = BufferPool(1 << 16, 2)
    eng.register_buffers(pool.views)
    data = os.urandom(1 << 16)
    out, back = pool.views
    out[:] = data
    f = files.open_file(str(tmp_path / "f"), create=True, direct=direct)
    assert f.direct is direct and (f.align >= 512 if direct else f.align == 1)
    eng.wait(eng.write(f, out, 0))  # 8 requests through a queue of 2
    eng.sync([f])
    f.close()
    g = files.open_file(str(tmp_path / "f"), create=False, direct=direct)
    eng.wait(eng.read(g, back, 0))
    assert bytes(back) == data
    with pytest.raises(engine.ShortReadError, match="file ends before"):
        eng.wait(eng.read(g, back, 1 << 16))  # past the end
    g.close()
    with pytest.raises(FileExistsError):
        files.open_file(str(tmp_path / "f"), create=True, direct=direct)  # never clobbers
    eng.close()
    pool.close()


@pytest.mark.parametrize("direct", [True, False])
def test_a_read_may_stop_where_the_caller_says_the_file_ends(tmp_path, kind, direct):
    """Whole blocks are read (O_DIRECT): a file ending inside its last block ends the read there, if allowed."""
    size = 3 * 4096 + 1000
    data = os.urandom(size)
    (tmp_path / "f").write_bytes(data)
    eng = engine.create_engine(IOConfig(engine=kind, block_size=8192, queue_depth=2))
    pool = BufferPool(1 << 16, 1)
    into = pool.views[0][: 4 * 4096]
    f = files.open_file(str(tmp_path / "f"), create=False, direct=direct)
    eng.wait(eng.read(f, into, 0, end=size))
    assert bytes(into[:size]) == data
    for end in (None, size + 1):  # the file must hold every byte, or all up to a later end
        with pytest.raises(engine.ShortReadError, match="file ends before"):
            eng.wait(eng.read(f, into, 0, end=end))
    f.close()
    eng.close()
    pool.close()


def test_a_file_all_in_the_page_cache_is_read_through_it(disk_with_page_cache, monkeypatch):
    """O_DIRECT would fetch from the disk what is in memory: a file whose every page is cached is opened for
    reading without it, where O_DIRECT is only allowed (None); not when required, for writing, or where the
    file is not all there or the kernel cannot tell."""
    path = disk_with_page_cache / "f"
    path.write_bytes(os.urandom(3 * 4096 + 100))  # through the cache: every page there

    def direct(**how) -> bool:
        f = files.open_file(str(path), **how)
        f.close()
        return f.direct

    assert not direct(create=False, direct=None)
    assert direct(create=False, direct=True)
    assert direct(create=True, direct=None, reuse=True)
    with monkeypatch.context() as m:
        m.setattr(_cio, "cached_pages", lambda fd, offset, length: None)
        assert direct(create=False, direct=None)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 4096, 0, os.POSIX_FADV_DONTNEED)  # the first page stays
    os.close(fd)
    assert direct(create=False, direct=None)


def test_fault_injection_fails_the_kth_request(tmp_path, kind, monkeypatch):
    monkeypatch.setenv(engine.FAULT_ENV, "3")
    eng = engine.create_engine(IOConfig(engine=kind, block_size=4096))
    pool = BufferPool(1 << 14, 2)
    f = files.open_file(str(tmp_path / "f"), create=True, direct=None)
    ticket = eng.write(f, pool.views[0], 0)  # four requests, the third fails
    with pytest.raises(OSError) as e:
        eng.wait(ticket)
    assert e.value.errno == errno.EIO and e.value.filename == f.path and "injected" in str(e.value)
    f.close()
    eng.close()
    pool.close()


def test_io_uring_refused_falls_back_to_threads(ckpt, monkeypatch, caplog):
    if not _cio.HAVE_IO_URING:
        pytest.skip("built without liburing")

    def refused(depth):
        raise PermissionError(errno.EPERM, "Operation not permitted", "io_uring_queue_init")

    monkeypatch.setattr(_cio, "Ring", refused)
    caplog.set_level(logging.WARNING, logger="fp_dcp")
    state = {"w": torch.randn(1000, 100)}
    writer = save(state, ckpt)
    assert writer.last_save.engine.startswith("threads (io_uring refused by the kernel")
    assert "using the threads engine because io_uring refused" in caplog.text
    target = {"w": torch.zeros(1000, 100)}
    reader = load(target, ckpt)
    assert torch.equal(target["w"], state["w"])
    assert reader.last_load.engine.startswith("threads")
    assert caplog.text.count("using the threads engine") == 1  # logged once
    with pytest.raises(RuntimeError, match="engine='io_uring' was requested but io_uring refused"):
        engine.create_engine(IOConfig(engine="io_uring"))


def test_o_direct_refused_falls_back_to_page_cache(ckpt, monkeypatch, caplog):
    """As on a filesystem without O_DIRECT: open(O_DIRECT) fails with EINVAL."""
    real_open = os.open

    def no_direct(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(files.os, "open", no_direct)
    caplog.set_level(logging.WARNING, logger="fp_dcp")
    state = {"w": torch.randn(777, 33), "b": torch.arange(5)}
    writer = save(state, ckpt)
    assert writer.last_save.direct_io is False
    assert "O_DIRECT refused" in caplog.text
    target = {"w": torch.zeros(777, 33), "b": torch.zeros(5, dtype=torch.int64)}
    load(target, ckpt)
    assert torch.equal(target["w"], state["w"]) and torch.equal(target["b"], state["b"])
    with pytest.raises(OSError, match="refuses O_DIRECT and direct_io=True"):
        files.open_file(str(ckpt / "x"), create=True, direct=True)


def test_same_bytes_on_disk_whatever_the_engine(tmp_path):
    """The engines and I/O modes differ in how, never in what they write."""
    state = {"a": torch.randn(300, 301), "b": torch.randn(7), "c": torch.randn(2000, 999)}
    contents = set()
    for i, config in enumerate(
        [
            IOConfig(engine="io_uring" if _cio.HAVE_IO_URING else "threads", direct_io=True),
            IOConfig(engine="threads", direct_io=True),
            IOConfig(engine="threads", direct_io=False),
        ]
    ):
        path = tmp_path / str(i)
        save(state, path, config=config)
        (data_file,) = [p for p in path.iterdir() if p.suffix == ".distcp"]
        contents.add(data_file.read_bytes())
    assert len(contents) == 1


def test_environment_forces_engine(monkeypatch):
    monkeypatch.setenv("FP_DCP_ENGINE", "threads")
    monkeypatch.setenv("FP_DCP_DIRECT_IO", "0")
    config = IOConfig()
    assert config.engine == "threads" and config.direct_io is False
    assert IOConfig(engine="auto").engine == "auto"  # an argument wins
    monkeypatch.setenv("FP_DCP_ENGINE", "fast")
    with pytest.raises(ValueError, match="FP_DCP_ENGINE must be"):
        IOConfig()


def test_engine_info_reports_choice(tmp_path):
    info = fp_dcp.engine_info(str(tmp_path))
    assert info["engine"] in ("io_uring", "threads")
    assert info["direct_io"] in (True, False)
    assert info["alignment"] >= 1
    assert list(tmp_path.iterdir()) == []  # the probe file is gone


@pytest.mark.slow
def test_a_build_without_the_optional_libraries_says_what_it_lacks_and_runs(tmp_path):
    """Build fp_dcp._native._cio without liburing, ISA-L and libxxhash, as on a machine without their headers: the
    build ends by saying so, with each one's cost; engine_info lists them; the first engine of a process warns
    once of each; saves and loads run on the threads engine with the SSE4.2 CRC."""
    tree = tmp_path / "tree"
    for part in ("cio", "cuda", "fp_dcp"):
        shutil.copytree(ROOT / part, tree / part, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    for part in ("setup.py", "pyproject.toml", "README.md", "fp_dcp_default_storage.pth"):
        shutil.copyfile(ROOT / part, tree / part)
    without = {library.opt_out: "1" for library in LIBRARIES}
    build = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
        cwd=tree,
        env={**os.environ, **without, "FP_DCP_WERROR": "1"},
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stderr
    assert "fp-dcp native build: liburing NO, isa-l NO, libxxhash NO" in build.stderr
    for library in LIBRARIES:
        assert f"warning: {library.absence()}" in build.stderr
    script = textwrap.dedent(
        f"""
        import json, logging, warnings, torch, torch.distributed.checkpoint as dcp
        warnings.filterwarnings("ignore")
        import fp_dcp
        from fp_dcp import FastPersistWriter, FastPersistReader
        from fp_dcp._native import _cio
        assert not _cio.HAVE_IO_URING and not hasattr(_cio, "Ring") and not hasattr(_cio, "Hash128")
        said = []
        class Said(logging.Handler):
            def emit(self, record):
                said.append(record.getMessage())
        logging.getLogger("fp_dcp").addHandler(Said())
        state = {{"w": torch.randn(100, 100)}}
        for step in range(2):
            w = FastPersistWriter({str(tmp_path / "ckpt")!r})
            dcp.save(state, storage_writer=w)
            target = {{"w": torch.zeros(100, 100)}}
            dcp.load(target, storage_reader=FastPersistReader({str(tmp_path / "ckpt")!r}))
            assert torch.equal(target["w"], state["w"])
        print(json.dumps({{"saved_with": w.last_save.engine, "said": said, **fp_dcp.engine_info()}}))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "PYTHONPATH": str(tree)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    report = json.loads(out.stdout)
    assert report["saved_with"] == "threads (fp-dcp was built without liburing)" and report["engine"] == "threads"
    assert report["crc32c_engine"] == "sse4.2" and report["crc32c_hardware"]
    assert report["libraries"] == {library.name: False for library in LIBRARIES}
    assert report["missing"] == {library.name: library.absence() for library in LIBRARIES}
    for library in LIBRARIES:
        assert report["said"].count(library.absence()) == 1, report["said"]


def test_the_null_engine_stores_nothing_and_publishes_nothing(tmp_path):
    """``engine="null"`` measures the pipeline: the save runs whole (copies, checksums), its writes complete at
    once, and the directory is left holding no checkpoint at all, not one whose files hold zeros."""
    state = {"w": torch.randn(3 << 20), "b": torch.arange(1000), "meta": {"step": 3}}
    writer = save(state, tmp_path / "null", config=IOConfig(engine="null"))
    summary = writer.last_save
    assert summary is not None and summary.engine.startswith("null") and summary.bytes >= state["w"].nbytes
    writer.close()
    assert sorted(os.listdir(tmp_path / "null")) == [".lock"]
    assert not fp_dcp.FastPersistReader.validate_checkpoint_id(tmp_path / "null")
    real = save(state, tmp_path / "real")  # a published checkpoint is not touched by a null save over it
    save(state, tmp_path / "real", config=IOConfig(engine="null")).close()
    back = empty_like(state)
    load(back, tmp_path / "real")
    assert torch.equal(back["w"], state["w"])
    real.close()
    with pytest.raises(ValueError, match="null"):
        fp_dcp.SafetensorsWriter(tmp_path / "st", config=IOConfig(engine="null"))
    with pytest.raises(BaseException, match="null engine stores nothing"):  # DCP wraps it in CheckpointException
        load(empty_like(state), tmp_path / "real", config=IOConfig(engine="null"))


def _addresses(pool: BufferPool) -> list[int]:
    return [_cio.address(v) for v in pool.views]


def test_a_closed_pools_buffers_serve_the_next_pool_of_its_shape():
    """A reader made for one load and dropped leaves its warm buffers to the next one (``io.buffers``)."""
    pool = BufferPool(3 * 4096, 3)
    pool.views[1][:5] = b"warm!"
    first = _addresses(pool)
    pool.close()
    other = BufferPool(5 * 4096, 3)  # another shape: fresh buffers, and the spare keeps waiting
    assert not set(_addresses(other)) & set(first)
    again = BufferPool(3 * 4096, 3)
    assert _addresses(again) == first and bytes(again.views[1][:5]) == b"warm!"  # the same memory, as it was
    assert len(again.free) == 3 and again.count == 3
    third = BufferPool(3 * 4096, 3)  # the spare went to `again`: new memory
    assert not set(_addresses(third)) & set(first)
    for p in (other, again, third):
        p.close()


def _expired(spare: buffers._Spare) -> bool:
    deadline = time.monotonic() + 10
    while spare in buffers._spares and time.monotonic() < deadline:
        time.sleep(0.05)
    return spare not in buffers._spares and all(m.closed for m in spare.maps)


def test_a_pool_never_used_maps_nothing_and_leaves_nothing_to_park(monkeypatch):
    """A load that reads every byte in place (tmpfs) never asks for a staging buffer: none is faulted in."""
    monkeypatch.setattr(buffers, "SPARE_SECONDS", 30)
    mapped = []
    pool = BufferPool(5 * 4096, 2, on_map=mapped.append)
    assert pool.count == 2 and pool.size == 5 * 4096 and mapped == []
    pool.close()
    del pool
    gc.collect()
    assert not [s for s in buffers._spares if s.size == 5 * 4096] and mapped == []
    pool = BufferPool(5 * 4096, 2, on_map=mapped.append)
    assert len(pool.free) == 2 and mapped == [pool.views]  # told once, with the buffers, when first used
    assert len(pool.views) == 2 and len(mapped) == 1
    pool.close()
    buffers.release_spares()


def test_a_load_that_reads_every_byte_in_place_maps_no_staging_buffer(tmp_path):
    state = {"w": torch.randn(1 << 20), "b": torch.arange(1 << 18)}  # small ones would be gathered: staged
    save(state, tmp_path / "ck", config=IOConfig(direct_io=False))
    for config, staged in ((IOConfig(direct_io=False), False), (IOConfig(direct_reads=False), True)):
        evict(str(tmp_path / "ck"))  # written through the page cache: all there, they would be read from memory
        target = empty_like(state)  # buffered files are read in place (the kernel copies); staged: into buffers
        reader = load(target, tmp_path / "ck", config=config)
        assert all(torch.equal(target[k], v) for k, v in state.items())
        assert (reader._resources.io.context().pool._views is not None) == staged
        reader._resources.close()


def test_a_dropped_pool_is_parked_and_expires(monkeypatch):
    monkeypatch.setattr(buffers, "SPARE_SECONDS", 0.2)
    gc.collect()  # no other pool's finalizer runs below: one set waits, the newest
    pool = BufferPool(7 * 4096, 2)
    assert len(pool.free) == 2  # in use: mapped
    del pool  # nobody closed it: its finalizer parks the buffers
    (spare,) = [s for s in buffers._spares if s.size == 7 * 4096]
    assert _expired(spare)  # past the wait: unmapped


def test_registered_buffers_wait_registered_for_the_next_pool_and_are_undone_before_they_go(monkeypatch):
    """A reader made anew for each GPU load takes page-locked buffers, not fresh memory to register again."""
    monkeypatch.setattr(buffers, "SPARE_SECONDS", 0.5)
    gc.collect()
    undone = []
    pool = BufferPool(9 * 4096, 2)
    pool.register("ledger", "all of them", lambda: undone.append("unregistered"))
    maps = list(pool.maps)
    pool.close()
    assert undone == [] and not any(m.closed for m in maps)  # waiting, still registered
    again = BufferPool(9 * 4096, 2)
    assert again.maps == maps and again.registration("ledger") == "all of them" and again.registration("x") is None
    del again  # nobody closed it: parked again, registration and all
    (spare,) = [s for s in buffers._spares if s.size == 9 * 4096]
    assert undone == [] and _expired(spare)
    assert undone == ["unregistered"]  # undone once, before the unmap
    pool = BufferPool(9 * 4096, 2)
    assert pool.registration("ledger") is None  # fresh memory: nothing registered it
    pool.register("ledger", True, lambda: undone.append("again"))
    pool.close()
    buffers.release_spares()  # at once, not at the end of the wait
    assert undone == ["unregistered", "again"] and not buffers._spares


def test_a_forked_child_forgets_the_registrations_of_waiting_buffers(monkeypatch):
    """A registration belongs to the process that made it (CUDA's context): a child neither undoes nor trusts it."""
    monkeypatch.setattr(buffers, "SPARE_SECONDS", 30)
    undone = []
    pool = BufferPool(17 * 4096, 1)
    pool.register("ledger", True, lambda: undone.append("unregistered"))
    pool.close()
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if it took the buffers unregistered and undid nothing
        child = BufferPool(17 * 4096, 1)
        buffers.release_spares()
        os._exit(0 if child.registration("ledger") is None and undone == [] else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    (spare,) = [s for s in buffers._spares if s.size == 17 * 4096]
    assert "ledger" in spare.registrations  # the parent's stays
    buffers.release_spares()
    assert undone == ["unregistered"]


def test_a_pools_finalizer_starts_no_thread(monkeypatch):
    """The garbage collector runs it anywhere, also inside threading's locked sections, where starting a
    thread deadlocks: the wait is kept by one thread started with the pools, and the finalizer only parks."""
    monkeypatch.setattr(buffers, "SPARE_SECONDS", 0.2)
    pool = BufferPool(15 * 4096, 1)
    assert len(pool.views) == 1  # in use: mapped
    (reaper,) = [t for t in threading.enumerate() if t.name == "fp-dcp-spare-buffers"]

    def no_thread(self):
        raise AssertionError(f"a pool's finalizer started a thread ({self.name})")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    del pool
    (spare,) = [s for s in buffers._spares if s.size == 15 * 4096]
    assert _expired(spare) and reaper.is_alive()  # the one thread unmapped it, and waits on


def test_buffers_still_referenced_or_with_no_wait_are_unmapped_not_parked(monkeypatch):
    pool = BufferPool(11 * 4096, 1)
    undone = []
    pool.register("ledger", True, lambda: undone.append("unregistered"))
    held = pool.views[0][:4]  # a slice someone kept
    held[:] = b"mine"
    pool.close()
    assert not [s for s in buffers._spares if s.size == 11 * 4096]
    assert undone == ["unregistered"]  # it cannot wait for a pool: no registration may outlive the pool's end
    assert bytes(held) == b"mine"  # its memory stays the slice's
    monkeypatch.setattr(buffers, "SPARE_SECONDS", 0)
    pool = BufferPool(13 * 4096, 1)
    maps = list(pool.maps)
    pool.close()
    assert all(m.closed for m in maps) and not [s for s in buffers._spares if s.size == 13 * 4096]


class PuntSpy:
    """A ring that records, for each write and read handed to it, whether it was punted to the kernel's workers."""

    def __init__(self, ring) -> None:
        self.ring, self.punted = ring, []

    def __getattr__(self, name):
        return getattr(self.ring, name)

    def write(self, fd, view, offset, token, punt):
        self.punted.append(punt)
        return self.ring.write(fd, view, offset, token, punt)

    def read(self, fd, view, offset, token, punt):
        self.punted.append(punt)
        return self.ring.read(fd, view, offset, token, punt)


@pytest.mark.skipif(not _cio.HAVE_IO_URING, reason="built without liburing")
def test_buffers_mapped_while_requests_are_in_flight_are_registered_once_the_ring_is_idle(tmp_path):
    """A pool maps its buffers at their first use, which may come while reads into targets are in flight; the
    ring refuses new buffers then, so they are registered at the next moment nothing is in flight."""
    uring = engine.UringEngine(IOConfig())
    registered = []
    real = uring.ring

    class Spy(PuntSpy):
        def register_buffers(self, views):
            registered.append((len(views), real.in_flight))
            return real.register_buffers(views)

    uring.ring = Spy(real)
    r, w = os.pipe()
    waiting = memoryview(mmap.mmap(-1, 4096))
    f = files.open_file(str(tmp_path / "f"), create=True, direct=False)
    pool = BufferPool(1 << 16, 2, on_map=uring.register_buffers)
    try:
        real.read(r, waiting, 0, "pipe", False)  # stays in flight until the pipe has bytes
        assert real.wait(0) == [] and real.in_flight == 1
        pool.views[0][:5] = b"first"  # mapped now
        assert registered == [] and uring.unregistered is not None
        os.write(w, b"go")
        assert real.wait(1) == [("pipe", 2)]
        uring.wait(uring.write(f, pool.views[0], 0))
        assert registered == [(2, 0)] and uring.unregistered is None  # registered before that write went out
        assert (tmp_path / "f").read_bytes()[:5] == b"first"
    finally:
        f.close()
        uring.close()
        pool.close()
        os.close(r)
        os.close(w)


@pytest.mark.skipif(not _cio.HAVE_IO_URING, reason="built without liburing")
def test_transfers_the_kernel_copies_go_to_its_workers_also_on_tmpfs_with_o_direct(tmp_path):
    """A copy the kernel makes at submission runs in the submitting thread unless punted (IOSQE_ASYNC): a
    buffered file's, and a tmpfs file's also where tmpfs takes O_DIRECT (Linux 6.6 on), are punted; a disk's
    O_DIRECT file's are not. Loads from tmpfs, 2 GB into touched targets: 3.49 GB/s unpunted, 4.81 punted."""
    directories = [tmp_path]
    if os.path.isdir("/dev/shm") and files.in_memory("/dev/shm"):
        directories.append(Path(tempfile.mkdtemp(dir="/dev/shm")))
    try:
        for directory, direct in itertools.product(directories, (False, None)):
            uring = engine.UringEngine(IOConfig())
            spy = uring.ring = PuntSpy(uring.ring)
            path = str(directory / f"f-{direct}")
            f = files.open_file(path, create=True, direct=direct)
            data = memoryview(mmap.mmap(-1, 1 << 20))
            try:
                uring.wait(uring.write(f, data, 0))
                back = files.open_file(path, create=False, direct=direct)
                uring.wait(uring.read(back, data, 0))
                back.close()
            finally:
                f.close()
                uring.close()
            assert f.copied == back.copied == (not f.direct or files.in_memory(str(directory)))
            assert spy.punted == [f.copied, f.copied], f
    finally:
        for directory in directories[1:]:
            shutil.rmtree(directory)
