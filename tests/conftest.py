"""Shared helpers: every test saves and loads in its own temporary directory."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from cuda_double import CpuAsDevice, CpuTargetsAsDevice, CudaRuntimeDouble
from torch.distributed.checkpoint.api import CheckpointException

import fp_dcp.io.buffers
import fp_dcp.io.files
import fp_dcp.load.resources
import fp_dcp.save.resources
from fp_dcp import FastPersistReader, FastPersistWriter, IOConfig, compat
from fp_dcp._native import _cio
from fp_dcp.gpu import cudart

needs_xxhash = pytest.mark.skipif(
    not hasattr(_cio, "Hash128"), reason="fp_dcp._native._cio built without libxxhash (make system-deps installs it)"
)
"""For tests of incremental saves, which need the content hash (like io_uring, an optional part of the build)."""

STORABLE_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.complex32,
    torch.complex64,
    torch.complex128,
    torch.bool,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    *(getattr(torch, name) for name in dir(torch) if name.startswith(("float8_", "float4_"))),
]
"""Every dtype a checkpoint holds, the float8 and float4 ones of the torch at hand included."""


def random_of(dtype: torch.dtype, *shape: int, seed: int | None = None) -> torch.Tensor:
    """Random bit patterns of any dtype (NaNs, and bools other than 0 and 1): equal only if read bit-exact.
    ``seed``: the same bits for the same seed (None: torch's global generator, other bits each call)."""
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    raw = torch.randint(0, 256, (math.prod(shape) * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


SMALL = IOConfig(buffer_size=64 * 1024, num_buffers=3, block_size=16 * 1024, queue_depth=4, direct_min=8192)
"""Tiny buffers and requests, so small tensors exercise splitting, direct runs and buffer reuse."""


def save(state: dict[str, Any], path, **kwargs: Any) -> FastPersistWriter:
    writer = FastPersistWriter(path, **kwargs)
    dcp.save(state, storage_writer=writer)
    return writer


def load(state: dict[str, Any], path, **kwargs: Any) -> FastPersistReader:
    reader = FastPersistReader(path, **kwargs)
    dcp.load(state, storage_reader=reader)
    return reader


def empty_like(state: Any) -> Any:
    """A state dict shaped like ``state`` with every tensor zeroed, for loading into."""
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: empty_like(v) for k, v in state.items()}
    if isinstance(state, list):
        return [empty_like(v) for v in state]
    return None


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaNs and every exotic dtype included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)))


def flip_byte(path: str, at: int | None = None) -> None:
    """Flip a bit of the byte of the file ``path`` at ``at`` (default: its middle one)."""
    with open(path, "r+b") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(size // 2 if at is None else at)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))


def failure(exc_info: pytest.ExceptionInfo) -> BaseException:
    """The exception a rank raised inside a CheckpointException."""
    err = exc_info.value
    if isinstance(err, CheckpointException):
        return next(iter(err.failures.values()))[0]
    return err


def metadata_failure(exc_info: pytest.ExceptionInfo, caplog: pytest.LogCaptureFixture) -> str:
    """What a load whose ``read_metadata`` failed tells the user: the rank's error, and what fp-dcp logged.

    torch 2.9 to 2.11 catch ``read_metadata``'s error and fail on ``assert metadata is not None`` alone; there
    the reader logs the error itself (``compat.DCP_HIDES_METADATA_ERRORS``). The others raise it, or name it.
    """
    return f"{failure(exc_info)}\n{caplog.text}"


@contextlib.contextmanager
def tmpfs(mnt: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``mnt`` (needs root), unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs")
    mnt.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "fp-dcp-test", str(mnt)], capture_output=True, text=True
    )
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)]).returncode:
            subprocess.run(["umount", "-l", str(mnt)], check=True)  # something still open: detach anyway


@pytest.fixture
def ckpt(tmp_path):
    return tmp_path / "ckpt"


@pytest.fixture
def cuda_double(monkeypatch) -> Iterator[CudaRuntimeDouble]:
    """fp-dcp's CUDA runtime calls go to a double; once the test's objects are gone it must have nothing to report."""
    double = CudaRuntimeDouble()
    monkeypatch.setattr(fp_dcp.io.buffers, "_allocate", double.tracking(fp_dcp.io.buffers._allocate))
    monkeypatch.setattr(fp_dcp.io.buffers, "_spares", [])  # no buffers parked before the double watched them
    with cudart.use(double):
        yield double
    gc.collect()  # pools the test dropped park their buffers, and these wait page-locked: let them go
    fp_dcp.io.buffers.release_spares()
    assert double.problems() == []


@dataclasses.dataclass
class Gpu:
    """Where a GPU test runs: a CUDA device, or CPU tensors taking the GPU path through the runtime double."""

    device: torch.device
    double: CudaRuntimeDouble | None

    def writer(self, *args: Any, **kwargs: Any) -> FastPersistWriter:
        """A writer whose staging takes this route (the same as any writer's on CUDA)."""
        return self._routed(FastPersistWriter, fp_dcp.save.resources, "Staging", CpuAsDevice, args, kwargs)

    def reader(self, *args: Any, **kwargs: Any) -> FastPersistReader:
        """A reader whose device loads take this route (the same as any reader's on CUDA)."""
        return self._routed(FastPersistReader, fp_dcp.load.resources, "DeviceLoads", CpuTargetsAsDevice, args, kwargs)

    def _routed(self, make: Any, module: Any, name: str, route: type, args: Any, kwargs: Any) -> Any:
        """``make(*args, **kwargs)``, built with ``route`` in place of ``module.name`` on the CPU route."""
        if self.double is None:
            return make(*args, **kwargs)
        with pytest.MonkeyPatch.context() as m:
            m.setattr(module, name, route)
            return make(*args, **kwargs)

    def page_locked(self, view: memoryview) -> bool:
        if self.double is not None:
            return self.double.is_registered(view)
        return bool(torch.frombuffer(view, dtype=torch.uint8).is_pinned())


GPU_ROUTES = ["cpu-as-device", *(["cuda"] if torch.cuda.is_available() else [])]


@pytest.fixture(params=GPU_ROUTES)
def gpu(request) -> Iterator[Gpu]:
    """GPU tests run everywhere on CPU tensors through the double, and on CUDA where there is a device.

    On CUDA, no error may be left pending for torch to report at its next launch.
    """
    if request.param == "cpu-as-device":
        yield Gpu(torch.device("cpu"), request.getfixturevalue("cuda_double"))
        return
    yield Gpu(torch.device("cuda"), None)
    torch.cuda.synchronize()
    assert cudart.runtime().cudaGetLastError() == 0


@pytest.fixture
def disk_with_page_cache(tmp_path) -> Path:
    """``tmp_path``, where it is on a disk filesystem that takes O_DIRECT and the kernel says what the page cache
    holds (cachestat, Linux 6.5): what a test of reading cached files through the cache, not the disk, needs."""
    if fp_dcp.io.files.in_memory(str(tmp_path)) or not fp_dcp.io.files.probe_file(str(tmp_path), None).direct:
        pytest.skip("needs a disk filesystem that takes O_DIRECT")
    probe = tmp_path / ".cachestat-probe"
    probe.write_bytes(b"x")
    with open(probe, "rb") as f:
        told = _cio.cached_pages(f.fileno(), 0, 1) is not None
    probe.unlink()
    if not told:
        pytest.skip("the kernel has no cachestat (Linux 6.5)")
    return tmp_path


def needs_torch(feature: compat.TorchFeature) -> pytest.MarkDecorator:
    """For a test of what ``feature`` needs from torch: skipped, by name, with an older torch.

    tests/test_compat.py asserts what fp-dcp does there instead (a refusal or a fallback, named).
    """
    return pytest.mark.skipif(not compat.has(feature), reason=f"{feature.refusal()} (see tests/test_compat.py)")
