"""Loads into GPU tensors: reads land in page-locked staging buffers and cross on side streams, nothing else.

They run everywhere: on CPU targets routed through the device path (``CpuTargetsAsDevice``,
page-locking through the CUDA runtime double), and on CUDA where there is a device.
"""

from __future__ import annotations

import contextlib
import gc
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import SMALL, failure, flip_byte, same_bytes, save
from cuda_double import CpuTargetsAsDevice, CudaRuntimeDouble, HostCrc, ModelCrc

import fp_dcp.io.buffers
import fp_dcp.load.resources
from fp_dcp import IOConfig
from fp_dcp._native import _cio
from fp_dcp.errors import CorruptCheckpointError
from fp_dcp.gpu import cudart
from fp_dcp.gpu.crc import DeviceCrc
from fp_dcp.gpu.loading import DeviceLoads
from fp_dcp.io.host_threads import MIN_SLICE, HostThreads
from fp_dcp.testing.ranks import run_ranks

pytestmark = pytest.mark.gpu


def host_state() -> dict:
    g = torch.Generator().manual_seed(5)
    state = {
        "big": torch.randn(1500, 1100, generator=g).to(torch.bfloat16),  # several staging buffers
        "fp32": torch.randn(70_001, generator=g),
        "int8": torch.randint(-128, 127, (3, 5000), dtype=torch.int8, generator=g),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
    }
    state.update({f"small.{i}": torch.full((i % 9 + 1,), float(i)) for i in range(200)})
    return state


def test_gpu_load_lands_in_page_locked_buffers_and_is_bit_exact(tmp_path, gpu, monkeypatch):
    state = host_state()
    state["transposed"] = state["big"]
    save(state, tmp_path / "ck")
    copies = []
    original = DeviceLoads.copy

    def counting(self, region, target, checksum, host_threads):
        copies.append(len(region))
        return original(self, region, target, checksum, host_threads)

    monkeypatch.setattr(DeviceLoads, "copy", counting)
    target = {k: torch.zeros_like(v, device=gpu.device) for k, v in state.items()}
    target["transposed"] = torch.zeros(1100, 1500, dtype=torch.bfloat16, device=gpu.device).t()  # the host path
    reader = gpu.reader(tmp_path / "ck", config=SMALL)
    dcp.load(target, storage_reader=reader)
    assert all(same_bytes(target[k].cpu(), v) for k, v in state.items())
    contiguous = sum(v.nbytes for k, v in state.items() if k != "transposed")
    assert sum(copies) == contiguous  # every contiguous target's bytes crossed as copies...
    assert max(copies) <= SMALL.buffer_size  # ...out of staging buffers, no whole-item intermediate
    pool = reader._resources.io.context().pool
    assert all(gpu.page_locked(view) for view in pool.views)


def test_readers_made_anew_for_each_gpu_load_take_page_locked_buffers(tmp_path, gpu):
    """As the README loads: a reader per load. The second and third find the first one's buffers page-locked,
    instead of faulting in fresh memory and registering it again."""
    state = host_state()
    save(state, tmp_path / "ck")
    seen = []
    for _ in range(3):
        target = {k: torch.zeros_like(v, device=gpu.device) for k, v in state.items()}
        reader = gpu.reader(tmp_path / "ck", config=SMALL)
        dcp.load(target, storage_reader=reader)
        assert all(same_bytes(target[k].cpu(), v) for k, v in state.items())
        pool = reader._resources.io.context().pool
        assert all(gpu.page_locked(view) for view in pool.views)
        seen.append([_cio.address(view) for view in pool.views])
        del reader, pool
        gc.collect()
    assert seen[0] == seen[1] == seen[2]
    if gpu.double is not None:
        assert gpu.double.registrations == SMALL.num_buffers  # registered once, by the first load


def test_gpu_load_checks_checksums_on_the_device_path(tmp_path, gpu):
    state = host_state()
    save(state, tmp_path / "ck", config=IOConfig(direct_io=False))
    (name,) = [n for n in os.listdir(tmp_path / "ck") if n.endswith(".distcp")]
    flip_byte(str(tmp_path / "ck" / name))
    target = {k: torch.zeros_like(v, device=gpu.device) for k, v in state.items()}
    with pytest.raises(BaseException) as info:
        dcp.load(target, storage_reader=gpu.reader(tmp_path / "ck", config=SMALL))
    assert isinstance(failure(info), CorruptCheckpointError) and "checksum mismatch" in str(failure(info))


def test_gpu_load_without_the_crc_kernel_checksums_over_the_host_threads(tmp_path, gpu, monkeypatch):
    """Where the device cannot checksum (no cupy), the host does, while the bytes cross: through the load's
    threads, which split a staging buffer's bytes between them, not on one core."""
    for kernel in (DeviceCrc, ModelCrc):
        monkeypatch.setattr(kernel, "ready", lambda self, side: False)
    summed: list[int] = []
    original = HostThreads.crc32c

    def spy(self, data, crc=0, hasher=None):
        summed.append(data.nbytes)
        return original(self, data, crc, hasher)

    monkeypatch.setattr(HostThreads, "crc32c", spy)
    state = {"big": torch.randn(3 * MIN_SLICE // 4), "small": torch.arange(100)}
    save(state, tmp_path / "ck")
    config = IOConfig(host_threads=2)
    target = {k: torch.zeros_like(v, device=gpu.device) for k, v in state.items()}
    dcp.load(target, storage_reader=gpu.reader(tmp_path / "ck", config=config))
    assert all(same_bytes(target[k].cpu(), v) for k, v in state.items())
    assert sum(summed) == sum(v.nbytes for v in state.values()) and max(summed) >= 2 * MIN_SLICE
    flip_byte(str(max((tmp_path / "ck").glob("*.distcp"), key=lambda p: p.stat().st_size)))  # in "big"
    target = {k: torch.zeros_like(v, device=gpu.device) for k, v in state.items()}
    with pytest.raises(BaseException) as info:
        dcp.load(target, storage_reader=gpu.reader(tmp_path / "ck", config=config))
    assert isinstance(failure(info), CorruptCheckpointError) and "checksum mismatch" in str(failure(info))


def test_gpu_load_host_memory_is_bounded_by_the_pool(tmp_path, gpu, monkeypatch):
    from fp_dcp.tools.workload import PeakRSS

    monkeypatch.setattr(CpuTargetsAsDevice, "crc_kernel", HostCrc)  # (the CPU route's CRC model holds temporaries)

    n = 64 << 20 if gpu.device.type == "cuda" else 16 << 20  # 1 GiB on a GPU, 256 MiB on the CPU route
    state = {f"w{i}": torch.randn(n) for i in range(4)}
    save(state, tmp_path / "ck")
    target = {k: torch.zeros_like(v, device=gpu.device) for k, v in state.items()}
    del state
    reader = gpu.reader(tmp_path / "ck", config=IOConfig(buffer_size=16 << 20, num_buffers=4))
    dcp.load({"w0": target["w0"]}, storage_reader=reader)  # the pool exists now
    rss = PeakRSS()
    with rss.watch():
        dcp.load(target, storage_reader=reader)
    assert rss.peak - rss.start < n, (rss.peak - rss.start) >> 20  # a quarter of the state
    assert all(torch.isfinite(t.float()).all() for t in target.values())


def test_gpu_load_waits_for_what_the_caller_queued_on_the_targets(tmp_path, gpu):
    """A target zeroed on the caller's stream right before the load still ends up holding the checkpoint."""
    x = torch.full((4 << 20,), 7.0)
    save({"x": x}, tmp_path / "ck")
    target = torch.empty(4 << 20, device=gpu.device)
    on_cuda = gpu.device.type == "cuda"
    producer = torch.cuda.Stream() if on_cuda else None
    with torch.cuda.stream(producer) if producer is not None else contextlib.nullcontext():
        if on_cuda:
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the fill
        target.zero_()
        dcp.load({"x": target}, storage_reader=gpu.reader(tmp_path / "ck", config=SMALL))
        assert torch.equal(target.cpu(), x)


def _load_shared_into_device(rank: int, world: int, path: str) -> bool:
    os.environ["FP_DCP_NODE"] = f"node{rank % 2}"
    double = CudaRuntimeDouble()
    fp_dcp.io.buffers._allocate = double.tracking(fp_dcp.io.buffers._allocate)
    fp_dcp.load.resources.DeviceLoads = CpuTargetsAsDevice
    g = torch.Generator().manual_seed(9)
    expected = {f"w{i}": torch.randn(300, 301, generator=g) for i in range(4)}
    target = {k: torch.zeros_like(v) for k, v in expected.items()}
    with cudart.use(double):
        reader = fp_dcp.FastPersistReader(path, share=True, config=SMALL)
        dcp.load(target, storage_reader=reader)
        exact = all(torch.equal(target[k], v) for k, v in expected.items())
        reader.close()
        fp_dcp.io.buffers.release_spares()  # its buffers wait page-locked for the next reader: let them go
    return exact and reader.last_load.received_bytes > 0 and double.problems() == []


def test_gpu_load_of_shared_items_fills_device_targets(tmp_path):
    g = torch.Generator().manual_seed(9)
    save({f"w{i}": torch.randn(300, 301, generator=g) for i in range(4)}, tmp_path / "ck")
    assert run_ranks(2, _load_shared_into_device, str(tmp_path / "ck"), timeout=120) == [True, True]
