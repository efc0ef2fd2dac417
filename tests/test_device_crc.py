"""CRC-32C of GPU tensors on their GPU (``cuda/crc32c.cu``): the host CRC's values, and no host pass over their bytes.

Everywhere: the kernel's arithmetic through its numpy model (``crc_model``)
against ``_cio.crc32c``; the save and load plumbing on the CPU route of the
``gpu`` fixture, where the model stands in for the kernel's launch
(``cuda_double.ModelCrc``). On CUDA with cupy the same tests run the kernel.
Its own routines run on the CPU in ``test_cuda_sources.py``.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import random
import types
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import SMALL, Gpu, failure, needs_xxhash, same_bytes, save
from crc_model import CHUNK, PIECE, crc32c_rows, multiply
from cuda_double import ModelCrc

import fp_dcp.gpu.kernel
from fp_dcp import CorruptCheckpointError, FastPersistReader, IOConfig
from fp_dcp._native import _cio
from fp_dcp.checkpoint import open_checkpoint
from fp_dcp.gpu.crc import Checksums, DeviceCrc, powers
from fp_dcp.gpu.kernel import Kernel
from fp_dcp.gpu.memory import SideStream

SIZES = [0, 1, 2, 3, 15, 16, 17, 255, PIECE - 1, PIECE, PIECE + 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5]


# ---------------------------------------------------------------- the arithmetic


def test_model_of_the_kernel_gives_the_host_crc():
    rng = np.random.default_rng(3)
    data = rng.integers(0, 256, 12 << 20, dtype=np.uint8)
    sizes = SIZES + [int(n) for n in rng.integers(1, 4 * CHUNK, 30)] + [(4 << 20) + 1, 7 << 20]
    starts = rng.integers(0, 4096, len(sizes))  # unaligned starts: rows of one launch are anywhere in memory
    rows = [data[s : s + n] for s, n in zip(starts, sizes, strict=True)]
    assert [int(c) for c in crc32c_rows(rows)] == [_cio.crc32c(row.tobytes()) for row in rows]
    assert len(crc32c_rows([])) == 0


def test_kernel_factors_are_powers_of_x():
    # powers[b] = x^(8 * PIECE * 2^b): each the square of the one before, the first x^8 squared log2(PIECE) times.
    x8 = np.uint32(1 << 23)  # x^8 in the reflected domain
    expected = [x8]
    for _ in range(PIECE.bit_length() - 1):
        expected[0] = multiply(expected[0], expected[0])
    for _ in range(len(powers()) - 1):
        expected.append(multiply(expected[-1], expected[-1]))
    assert [int(p) for p in expected] == powers()


# ---------------------------------------------------------------- the kernel (the model on the CPU route)


def device_crc(gpu: Gpu) -> DeviceCrc:
    return ModelCrc() if gpu.double is not None else DeviceCrc()


def side_stream(gpu: Gpu) -> SideStream:
    on_cuda = gpu.device.type == "cuda"
    return SideStream(torch.device("cuda", torch.cuda.current_device()) if on_cuda else gpu.device, 0, False)


class Owner:
    def __init__(self, crc: int = 0) -> None:
        self.crc = crc


@pytest.mark.gpu
def test_gpu_crc_of_device_ranges_continues_each_owners_crc(gpu):
    crc, side = device_crc(gpu), side_stream(gpu)
    if not crc.ready(side):
        pytest.skip(f"needs the CRC kernel: {crc.backend}")
    g = torch.Generator().manual_seed(9)
    host = torch.randint(0, 256, (9 << 20,), dtype=torch.uint8, generator=g)
    data = host.to(gpu.device)
    sizes = [*SIZES, (5 << 20) + 3]
    spans, at = [], 0
    for n in sizes:
        at += 1 + at % 13  # unaligned starts
        spans.append((at, n))
        at += n
    owners = [Owner(_cio.crc32c(b"before")) for _ in spans]
    check = Checksums(crc, side)
    side.wait_for(side.caller_event())  # the data was made on the caller's stream
    keep: list = []
    for owner, (start, n) in zip(owners, spans, strict=True):
        check.add(owner, data[start : start + n])
    check.launch(keep)
    event = side.record()
    if event is not None:
        event.synchronize()
    check.fold()
    raw = host.numpy().tobytes()
    assert [o.crc for o in owners] == [_cio.crc32c(b"before" + raw[s : s + n]) for s, n in spans]
    if gpu.device.type == "cuda":
        assert crc.backend == "cuda/crc32c.cu through cupy"


def test_kernel_falls_back_where_cupy_cannot_build_it(monkeypatch, caplog):
    real_import = importlib.import_module

    def without_cupy(name: str, *args):
        if name == "cupy":
            raise ImportError("No module named 'cupy'")
        return real_import(name, *args)

    monkeypatch.setattr(fp_dcp.gpu.kernel.importlib, "import_module", without_cupy)
    crc = DeviceCrc()
    assert crc.backend == "on the host (cupy is not installed)"
    assert not crc.ready(SideStream(torch.device("cpu"), 0, False))

    class Module:
        def __init__(self, code: str, options: tuple) -> None:
            assert "fp_dcp_crc32c" in code and options == ("--std=c++14",)
            raise RuntimeError("NVRTC is not available")

    cupy = types.SimpleNamespace(RawModule=Module, cuda=types.SimpleNamespace(Device=lambda index: nullcontext()))
    monkeypatch.setattr(fp_dcp.gpu.kernel.importlib, "import_module", lambda name, *args: cupy)
    assert Kernel("no-such.cu", "f", "copies").backend == "copies (cuda/no-such.cu is not in this installation)"
    crc = DeviceCrc()
    assert crc.backend == "cuda/crc32c.cu through cupy"
    side = types.SimpleNamespace(stream=object(), index=0)  # a device's stream, as far as the kernel can tell
    with caplog.at_level(logging.WARNING, logger="fp_dcp"):
        assert not crc.ready(side) and not crc.ready(side)  # tried once
    assert crc.backend == "on the host (cupy could not build cuda/crc32c.cu: NVRTC is not available)"
    assert [r.getMessage() for r in caplog.records] == [f"fp-dcp: {crc.backend}"]


# ---------------------------------------------------------------- saves and loads


def device_state(device: torch.device) -> dict:
    """Contiguous device tensors only: every byte of it may be checksummed on the device."""
    g = torch.Generator(device=device).manual_seed(4)
    state = {
        "big": torch.randn(300, 1100, generator=g, device=device).to(torch.bfloat16),  # several buffers
        "odd": torch.randint(0, 256, (3 * CHUNK + 77,), dtype=torch.uint8, generator=g, device=device),
        "fp32": torch.randn(70_001, generator=g, device=device),
        "int8": torch.randint(-128, 127, (3, 5000), dtype=torch.int8, generator=g, device=device),
        "one": torch.ones(1, dtype=torch.uint8, device=device),
        "scalar": torch.tensor(2.5, device=device),
        "empty": torch.empty(0, 4, device=device),
    }
    state.update({f"small.{i}": torch.full((i % 9 + 1,), float(i), device=device) for i in range(40)})
    return state


def nbytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


@contextmanager
def host_checksums(monkeypatch) -> Iterator[list[tuple[int, int]]]:
    """The (address, length) of every buffer the host checksums meanwhile."""
    spans: list[tuple[int, int]] = []
    crc32c, copy_crc32c = _cio.crc32c, _cio.copy_crc32c

    def seen(*buffers) -> None:
        spans.extend((_cio.address(b), len(memoryview(b).cast("B"))) for b in buffers if len(memoryview(b)))

    def crc(data, *args):
        seen(data)
        return crc32c(data, *args)

    def copy_crc(dst, src, *args):
        seen(dst, src)
        return copy_crc32c(dst, src, *args)

    with monkeypatch.context() as m:
        m.setattr(_cio, "crc32c", crc)
        m.setattr(_cio, "copy_crc32c", copy_crc)
        yield spans


def inside(spans: list[tuple[int, int]], views: list[memoryview]) -> list[tuple[int, int]]:
    """The spans that overlap one of ``views``."""
    areas = [(_cio.address(v), len(v)) for v in views]
    return [(a, n) for a, n in spans if any(a < b + m and b < a + n for b, m in areas)]


@contextmanager
def device_checksums(monkeypatch) -> Iterator[list[int]]:
    """The length of every device range handed to the CRC kernel meanwhile."""
    lengths: list[int] = []
    add = Checksums.add

    def counting(self, owner, data):
        lengths.append(data.numel())
        return add(self, owner, data)

    with monkeypatch.context() as m:
        m.setattr(Checksums, "add", counting)
        yield lengths


def needs_kernel(gpu: Gpu) -> None:
    if gpu.double is None and importlib.util.find_spec("cupy") is None:
        pytest.skip("on CUDA the device checksums need cupy (pip install fp-dcp[cuda13])")


def checksums_where(gpu: Gpu, monkeypatch, kernel: bool) -> None:
    """GPU bytes are checksummed by the kernel (or its model), or, as where it cannot run, by the host."""
    needs_kernel(gpu)
    if not kernel:
        monkeypatch.setattr(type(device_crc(gpu)), "ready", lambda self, side: False)


def locations(path: Path) -> dict:
    return {index.fqn: loc for index, loc in open_checkpoint(path).metadata.storage_data.items()}


def host_bytes(state: dict) -> dict[str, bytes]:
    return {k: t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for k, t in state.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", [True, False], ids=["device-crc", "host-crc"])
def test_gpu_save_checksums_device_tensors_on_the_device(tmp_path, gpu, monkeypatch, kernel):
    checksums_where(gpu, monkeypatch, kernel)
    state = device_state(gpu.device)
    writer = gpu.writer(tmp_path / "ck", config=SMALL)
    with device_checksums(monkeypatch) as on_device, host_checksums(monkeypatch) as on_host:
        dcp.save(state, storage_writer=writer)
    assert writer.last_save is not None
    pool = writer._resources.io.context().pool
    landing = [side.landing.view for side in writer._resources.staging._streams.values() if side._landing is not None]
    if kernel:
        assert sum(on_device) == nbytes(state)  # every byte, on the device...
        assert inside(on_host, [*pool.views, *landing]) == []  # ...and none where it landed on the host
        assert writer.last_save.staging.endswith(f"checksums: {writer._resources.staging.crc_backend}")
    else:
        assert on_device == [] and inside(on_host, [*pool.views, *landing])  # the spy sees host passes
    expected = {k: _cio.crc32c(b) for k, b in host_bytes(state).items()}
    assert {k: loc.crc32c for k, loc in locations(tmp_path / "ck").items()} == expected
    writer.close()


@pytest.mark.gpu
@needs_xxhash
def test_gpu_incremental_save_checksums_on_the_host_with_the_hash(tmp_path, gpu, monkeypatch):
    state = device_state(gpu.device)
    with gpu.writer(tmp_path / "ck", config=SMALL, incremental=True) as writer, device_checksums(monkeypatch) as seen:
        dcp.save(state, storage_writer=writer)
    assert seen == []  # the XXH3-128 reads the bytes on the host anyway: the CRC comes in the same pass
    assert {k: loc.crc32c for k, loc in locations(tmp_path / "ck").items()} == {
        k: _cio.crc32c(b) for k, b in host_bytes(state).items()
    }


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", [True, False], ids=["device-crc", "host-crc"])
def test_gpu_load_checksums_what_landed_on_the_device(tmp_path, gpu, monkeypatch, kernel):
    checksums_where(gpu, monkeypatch, kernel)
    state = device_state(torch.device("cpu"))
    save(state, tmp_path / "ck")
    target = {k: torch.zeros_like(v, device=gpu.device) for k, v in state.items()}
    reader = gpu.reader(tmp_path / "ck", config=SMALL)
    with device_checksums(monkeypatch) as on_device, host_checksums(monkeypatch) as on_host:
        dcp.load(target, storage_reader=reader)
    pool = reader._resources.io.context().pool
    if kernel:
        assert sum(on_device) == nbytes(state) and inside(on_host, pool.views) == []
    else:
        assert on_device == [] and inside(on_host, pool.views)
    assert all(same_bytes(target[k].cpu(), v) for k, v in state.items())
    reader.close()


# ---------------------------------------------------------------- one checksum, wherever it was computed


def flips_are_caught(path: Path, state: dict, load, flips: int = 100) -> None:
    """``flips`` times: one byte of one item changed, ``load`` fails naming that item; the byte is put back."""
    spans = [(loc.file, loc.offset, loc.length, fqn) for fqn, loc in locations(path).items() if loc.length]
    rng = random.Random(11)
    for _ in range(flips):
        name, offset, length, fqn = rng.choice(spans)
        position = offset + rng.randrange(length)
        fd = os.open(path / name, os.O_RDWR)
        try:
            original = os.pread(fd, 1, position)
            os.pwrite(fd, bytes([original[0] ^ rng.randrange(1, 256)]), position)
            with pytest.raises(BaseException) as info:
                load()
            err = failure(info)
            assert isinstance(err, CorruptCheckpointError), err
            assert "checksum mismatch" in str(err) and repr(fqn) in str(err) and name in str(err), err
        finally:
            os.pwrite(fd, original, position)
            os.close(fd)
    load()  # intact again


@pytest.mark.gpu
def test_gpu_checksummed_checkpoint_catches_flips_on_a_cpu_only_load(tmp_path, gpu):
    needs_kernel(gpu)
    state = device_state(gpu.device)
    writer = gpu.writer(tmp_path / "ck", config=SMALL)
    dcp.save(state, storage_writer=writer)
    assert writer.last_save is not None and "crc32c.cu" in writer.last_save.staging  # checksummed on the device
    target = {k: torch.zeros_like(v, device="cpu") for k, v in state.items()}
    reader = FastPersistReader(tmp_path / "ck", config=IOConfig(direct_io=False))
    flips_are_caught(tmp_path / "ck", state, lambda: dcp.load(target, storage_reader=reader))
    assert all(same_bytes(target[k], v.cpu()) for k, v in state.items())
    writer.close()


@pytest.mark.gpu
def test_host_checksummed_checkpoint_catches_flips_on_a_load_into_the_device(tmp_path, gpu, monkeypatch):
    needs_kernel(gpu)
    state = device_state(torch.device("cpu"))
    save(state, tmp_path / "ck")
    target = {k: torch.zeros_like(v, device=gpu.device) for k, v in state.items()}
    reader = gpu.reader(tmp_path / "ck", config=IOConfig(direct_io=False, buffer_size=256 * 1024, num_buffers=3))
    with device_checksums(monkeypatch) as on_device:
        flips_are_caught(tmp_path / "ck", state, lambda: dcp.load(target, storage_reader=reader))
    assert on_device  # checked where the bytes landed
    assert all(same_bytes(target[k].cpu(), v) for k, v in state.items())
    reader.close()
