"""The staging engine and the async-save protocol: the CPU half runs everywhere, the GPU half on CUDA machines.

The pipeline GPU tensors take (pool buffers, ordering, back-pressure, failure
and cancellation, the release signal) is the one CPU tensors take, so most of
it is tested here on CPU. The GPU tests run on every machine: the ``gpu``
fixture routes CPU tensors through the very code GPU tensors take (chunked
copies, gathers, landing areas, the snapshot arena, page-locking through the
CUDA runtime double of ``cuda_double.py``), with synchronous copies instead
of side streams, and runs them on CUDA too where there is a device. Only
what needs a device (stream ordering, the kernel) is checked on CUDA alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import importlib.util
import os
import threading
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import SMALL, Gpu, empty_like, failure, load, needs_torch, needs_xxhash, same_bytes
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.staging import AsyncStager

from fp_dcp import FastPersistSavePlanner, FastPersistWriter, IOConfig, SaveCancelledError, compat
from fp_dcp.checkpoint import open_checkpoint
from fp_dcp.gpu.streaming import Staging, StreamingCopier
from fp_dcp.io.engine import Engine, ThreadEngine, UringEngine
from fp_dcp.io.extents import Window
from fp_dcp.names import METADATA_NAME
from fp_dcp.save import commit
from fp_dcp.testing.ranks import run_ranks

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ROUTED = IOConfig(
    buffer_size=64 * 1024,
    num_buffers=3,
    block_size=16 * 1024,
    queue_depth=4,
    direct_min=8192,
    staging_chunk=16 * 1024,
    gather_max=4096,
)
ALL_STAGED = IOConfig(
    buffer_size=64 * 1024,
    num_buffers=3,
    block_size=16 * 1024,
    queue_depth=4,
    direct_min=4 << 20,
    staging_chunk=16 * 1024,
    gather_max=4096,
)


def mixed_state() -> dict:
    g = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randn(n, generator=g) for i, n in enumerate([1, 70001, 3, 250_000, 12_345, 0, 99_999])}
    state.update({f"small.{i}": torch.full((i % 7 + 1,), float(i)) for i in range(300)})
    state["bf16"] = torch.randn(300, 257, generator=g).to(torch.bfloat16)
    state["transposed"] = torch.randn(50, 60, generator=g).t()
    state["conj"] = torch.randn(9, 4, dtype=torch.complex64, generator=g).conj()
    state["objects"] = {"step": 3, "lr": [0.1, 0.01]}
    return state


def pool_of(writer: FastPersistWriter):
    return writer._resources.io.context().pool


# ---------------------------------------------------------------- the GPU code path, on CPU


@pytest.mark.parametrize(
    ("config", "paths"),
    [(ROUTED, {"gather"}), (ALL_STAGED, {"gather", "copy"})],
    ids=["direct-and-staged", "all-staged"],
)
def test_device_path_writes_the_bytes_the_host_path_writes(tmp_path, monkeypatch, config, paths, cuda_double):
    gpu = Gpu(torch.device("cpu"), cuda_double)
    calls = {"gather": 0, "copy": 0}
    for name in calls:
        original = getattr(StreamingCopier, f"_{name}")

        def spy(self, *args, _original=original, _name=name):
            calls[_name] += 1
            return _original(self, *args)

        monkeypatch.setattr(StreamingCopier, f"_{name}", spy)
    state = mixed_state()
    dcp.save(state, storage_writer=FastPersistWriter(tmp_path / "host", config=config))
    assert calls == {"gather": 0, "copy": 0}
    dcp.save(state, storage_writer=gpu.writer(tmp_path / "device", config=config))
    # Gathers of small parts, chunked copies of large ones (where heads and tails fall depends on addresses).
    assert paths <= {name for name, n in calls.items() if n}
    # The same bytes per item (the files' layouts differ: host memory is written in place, co-aligned).
    host, device = locations(tmp_path / "host"), locations(tmp_path / "device")
    assert {k: (v.length, v.crc32c) for k, v in device.items()} == {k: (v.length, v.crc32c) for k, v in host.items()}
    target = empty_like(state)
    load(target, tmp_path / "device", config=config)
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert same_bytes(value.resolve_conj(), target[key]), key


# ---------------------------------------------------------------- the async protocol


@needs_torch(compat.ASYNC_STAGING)
def test_writer_is_a_stager_only_when_passed_as_one(ckpt):
    writer = FastPersistWriter(ckpt)
    assert not isinstance(writer, AsyncStager)  # plain async_save keeps torch's default stager and Future
    future = dcp.async_save({"w": torch.ones(3)}, storage_writer=writer)
    future.result()
    response = dcp.async_save({"w": torch.ones(3)}, storage_writer=writer, async_stager=writer)
    response.staging_completion.result()
    response.upload_completion.result()


@pytest.mark.parametrize(
    ("direct_writes", "order"),
    [
        (True, ["writes done", "released", "publish"]),  # the big tensor is read by writes until they complete
        (False, ["released", "writes done", "publish"]),  # every byte copied: released once the last is staged
    ],
)
@needs_torch(compat.ASYNC_STAGING)
def test_streaming_releases_after_the_last_read_and_before_publishing(ckpt, monkeypatch, direct_writes, order):
    events: list[str] = []
    finish, publish = Window.finish, commit.publish

    def finish_spy(self):
        finish(self)
        events.append("writes done")

    def publish_spy(*args):
        events.append("publish")
        publish(*args)

    monkeypatch.setattr(Window, "finish", finish_spy)
    monkeypatch.setattr(commit, "publish", publish_spy)
    state = {"big": torch.randn(512, 1024), "small": torch.arange(10)}
    writer = FastPersistWriter(ckpt, config=dataclasses.replace(SMALL, direct_writes=direct_writes), mode="streaming")
    response = dcp.async_save(state, storage_writer=writer, async_stager=writer)
    response.staging_completion.add_done_callback(lambda _: events.append("released"))
    response.upload_completion.result()
    assert events == order


@needs_torch(compat.ASYNC_STAGING)
@pytest.mark.parametrize("mode", ["streaming", "snapshot"])
def test_parameters_may_change_once_staging_completes(ckpt, mode):
    state = {"w": torch.randn(256, 1024), "b": torch.randn(7), "t": torch.randn(40, 30).t(), "meta": {"step": 1}}
    expected = {k: v.clone() if isinstance(v, torch.Tensor) else dict(v) for k, v in state.items()}
    writer = FastPersistWriter(ckpt, config=SMALL, mode=mode)
    response = dcp.async_save(state, storage_writer=writer, async_stager=writer)
    response.staging_completion.result()
    for value in ("w", "b", "t"):
        state[value].add_(1000)  # what the optimizer step does
    state["meta"]["step"] = 2
    response.upload_completion.result()
    target = empty_like(state)
    target["meta"] = {"step": 0}
    load(target, ckpt)
    for key in ("w", "b", "t"):
        assert torch.equal(target[key], expected[key]), key
    assert target["meta"]["step"] == 1


@needs_torch(compat.ASYNC_STAGING)
def test_snapshot_keeps_conjugate_views(ckpt):
    state = {"c": torch.randn(9, 4, dtype=torch.complex64).conj(), "n": torch.randn(5)._neg_view()}
    writer = FastPersistWriter(ckpt, mode="snapshot")
    response = dcp.async_save(state, storage_writer=writer, async_stager=writer)
    response.upload_completion.result()
    target = {"c": torch.zeros(9, 4, dtype=torch.complex64), "n": torch.zeros(5)}
    load(target, ckpt)
    assert torch.equal(target["c"], state["c"].resolve_conj()) and torch.equal(target["n"], state["n"].resolve_neg())


def _dtensor_snapshot(rank: int, world: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    state = {"w": distribute_tensor(torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8), mesh, [Shard(0)])}
    writer = FastPersistWriter(root, mode="snapshot")
    response = dcp.async_save(state, storage_writer=writer, async_stager=writer)
    response.staging_completion.result()
    state["w"].to_local().add_(1000)  # the next step changes this rank's shard
    response.upload_completion.result()


@needs_torch(compat.ASYNC_STAGING)
def test_snapshot_of_dtensor_shards(ckpt):
    run_ranks(2, _dtensor_snapshot, str(ckpt), timeout=120)
    target = {"w": torch.zeros(64, 8)}
    load(target, ckpt)
    assert torch.equal(target["w"], torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8))


def test_snapshot_arena_is_reused_while_shapes_stay():
    snapshot = Staging(IOConfig(buffer_size=64 * 1024, gather_max=4096)).snapshot
    state = {"a": torch.randn(1000, 100), "b": [torch.arange(5), torch.tensor(2.5)], "c": "text"}
    first = snapshot.take(state, {})
    arena = snapshot.arena
    state["a"].add_(1)
    second = snapshot.take(state, {})
    assert snapshot.arena is arena and second["a"].data_ptr() == first["a"].data_ptr()
    assert torch.equal(second["a"], state["a"]) and torch.equal(second["b"][0], state["b"][0])
    assert second["c"] == "text" and second["a"].data_ptr() % 4096 == 0  # large tensors page-aligned
    state["a"] = torch.randn(10, 10)
    third = snapshot.take(state, {})
    assert snapshot.arena is not arena and torch.equal(third["a"], state["a"])
    snapshot.close()


# ---------------------------------------------------------------- failures and cancellation


def no_leftovers(path) -> bool:
    return not os.path.exists(os.path.join(path, METADATA_NAME)) and not glob.glob(os.path.join(path, "*.distcp"))


@needs_torch(compat.ASYNC_STAGING)
@pytest.mark.parametrize("mode", ["streaming", "snapshot"])
def test_io_error_mid_pipeline_fails_cleanly(ckpt, monkeypatch, mode):
    state = {"w": torch.randn(64, 1024), "t": torch.randn(64, 100).t(), **{f"s{i}": torch.ones(9) for i in range(50)}}
    writer = FastPersistWriter(ckpt, config=SMALL, mode=mode)
    monkeypatch.setenv("FP_DCP_FAULT_AT", "5")  # the 5th request of the writer's engine fails with EIO
    response = dcp.async_save(state, storage_writer=writer, async_stager=writer)
    with pytest.raises(BaseException) as info:
        response.upload_completion.result(timeout=60)
    assert isinstance(failure(info), OSError) and "injected fault" in str(failure(info))
    if mode == "streaming":  # the save failed before it had read everything
        with pytest.raises(OSError):
            response.staging_completion.result(timeout=10)
    else:
        response.staging_completion.result(timeout=10)  # the snapshot itself was complete
    assert no_leftovers(ckpt)
    pool = pool_of(writer)
    assert len(pool.free) == pool.count  # every buffer back in the pool
    monkeypatch.delenv("FP_DCP_FAULT_AT")
    writer.close()  # a new engine without the fault; the next save works
    dcp.save(state, storage_writer=writer)
    target = empty_like(state)
    load(target, ckpt)
    assert torch.equal(target["t"], state["t"])


class FailingPlanner(FastPersistSavePlanner):
    def create_local_plan(self) -> SavePlan:
        raise ValueError("planning failed")


@needs_torch(compat.ASYNC_STAGING)
def test_a_save_that_fails_before_writing_does_not_leave_staging_pending(ckpt):
    writer = FastPersistWriter(ckpt)
    response = dcp.async_save(
        {"w": torch.ones(4)}, storage_writer=writer, async_stager=writer, planner=FailingPlanner()
    )
    with pytest.raises(RuntimeError, match="ended before writing"):
        response.staging_completion.result(timeout=30)
    with pytest.raises(BaseException, match="planning failed"):
        response.upload_completion.result(timeout=30)
    response = dcp.async_save({"w": torch.ones(4)}, storage_writer=writer, async_stager=writer)
    response.upload_completion.result(timeout=30)


@pytest.fixture
def slow_writes(monkeypatch) -> threading.Event:
    """Every write request first sleeps a little, so a save is still in progress when the test acts.

    The event is set once a save has issued its third write.
    """
    original = Engine.write
    writing = threading.Event()
    count = [0]

    def write(self, file, data, offset):
        count[0] += 1
        if count[0] >= 3:
            writing.set()
        time.sleep(0.01)
        return original(self, file, data, offset)

    monkeypatch.setattr(Engine, "write", write)
    return writing


@needs_torch(compat.ASYNC_STAGING)
def test_cancel_stops_the_save_and_publishes_nothing(ckpt, slow_writes):
    state = {"w": torch.randn(1024, 1024).t()}  # 4 MiB, staged: 64 writes of SMALL's 64 KiB buffers
    writer = FastPersistWriter(ckpt, config=SMALL)
    writer.cancel()  # idle: a no-op, the next save is not affected
    response = dcp.async_save(state, storage_writer=writer, async_stager=writer)
    assert slow_writes.wait(30)
    assert not response.upload_completion.done()
    writer.cancel()
    with pytest.raises(BaseException) as info:
        response.upload_completion.result(timeout=60)
    assert isinstance(failure(info), SaveCancelledError)
    with pytest.raises(SaveCancelledError):
        response.staging_completion.result(timeout=10)
    assert no_leftovers(ckpt)
    pool = pool_of(writer)
    assert len(pool.free) == pool.count
    dcp.save(state, storage_writer=writer)
    target = {"w": torch.zeros(1024, 1024)}
    load(target, ckpt)
    assert torch.equal(target["w"], state["w"])


@pytest.mark.usefixtures("slow_writes")
def test_back_pressure_never_reuses_a_buffer_in_flight(ckpt, monkeypatch):
    """A state far larger than the pool: the producer waits for buffers instead of overwriting one in flight."""
    in_flight: dict[int, tuple[int, int]] = {}  # id(ticket) -> staged memory range
    worst = {"bytes": 0, "writes": 0}
    write = Engine.write
    lock = threading.Lock()

    def write_spy(self, file, data, offset):
        from fp_dcp._native import _cio

        start = _cio.address(data)
        with lock:
            for lo, hi in in_flight.values():
                assert start + len(data) <= lo or hi <= start, "a buffer was refilled while its write was in flight"
        ticket = write(self, file, data, offset)
        with lock:
            in_flight[id(ticket)] = (start, start + len(data))
            worst["bytes"] = max(worst["bytes"], sum(hi - lo for lo, hi in in_flight.values()))
            worst["writes"] += 1
        return ticket

    def wait_spy(wait):
        def spy(self, ticket):
            wait(self, ticket)
            with lock:
                in_flight.pop(id(ticket), None)

        return spy

    monkeypatch.setattr(Engine, "write", write_spy)
    for engine_class in (UringEngine, ThreadEngine):
        monkeypatch.setattr(engine_class, "wait", wait_spy(engine_class.wait))
    state = {f"t{i}": torch.randn(100, 160).t() for i in range(12)}  # non-contiguous: every byte staged
    dcp.save(state, storage_writer=FastPersistWriter(ckpt, config=SMALL))
    assert worst["writes"] > 3 * SMALL.num_buffers  # the pool was recycled many times over
    assert worst["bytes"] <= SMALL.num_buffers * SMALL.buffer_size
    target = empty_like(state)
    load(target, ckpt)
    assert all(torch.equal(target[k], v) for k, v in state.items())


# ---------------------------------------------------------------- the GPU path (everywhere; CUDA where there is one)


def gpu_state(device: torch.device) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    state = {
        "big_bf16": torch.randn(1024, 1100, generator=g, device=device).to(torch.bfloat16),  # > one buffer
        "fp32": torch.randn(70_001, generator=g, device=device),
        "transposed": torch.randn(300, 200, generator=g, device=device).t(),
        "conj": torch.randn(64, 33, dtype=torch.complex64, generator=g, device=device).conj(),
        "scalar": torch.tensor(3.5, device=device),
        "empty": torch.empty(0, 5, device=device),
        "cpu_too": torch.arange(1000),
        "objects": {"step": 7},
    }
    state.update({f"small.{i}": torch.full((i % 13 + 1,), float(i), device=device) for i in range(500)})
    return state


def host_copy(state: dict) -> dict:
    return {k: v.detach().resolve_conj().cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def locations(path) -> dict:
    return {index.fqn: location for index, location in open_checkpoint(path).metadata.storage_data.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("config", [ROUTED, IOConfig()], ids=["small-buffers-and-chunks", "default"])
def test_gpu_state_round_trips_with_the_checksums_of_its_host_copy(tmp_path, gpu, config):
    state = gpu_state(gpu.device)
    writer = gpu.writer(tmp_path / "gpu", config=config)
    dcp.save(state, storage_writer=writer)
    assert writer.last_save.staging.startswith(f"side streams on {gpu.device}")
    dcp.save(host_copy(state), storage_writer=FastPersistWriter(tmp_path / "cpu", config=config))
    crcs = {fqn: loc.crc32c for fqn, loc in locations(tmp_path / "gpu").items()}
    assert crcs == {fqn: loc.crc32c for fqn, loc in locations(tmp_path / "cpu").items()}
    target = empty_like(host_copy(state))
    target["objects"] = {"step": 0}
    load(target, tmp_path / "gpu")
    for key, value in host_copy(state).items():
        if isinstance(value, torch.Tensor):
            assert same_bytes(value, target[key]), key
    assert target["objects"]["step"] == 7
    pool = pool_of(writer)
    assert all(gpu.page_locked(view) for view in pool.views)


@needs_torch(compat.ASYNC_STAGING)
@pytest.mark.gpu
@needs_xxhash
@pytest.mark.parametrize("mode", ["streaming", "snapshot"])
def test_gpu_incremental_saves_hash_device_tensors_as_their_host_copies(tmp_path, gpu, mode):
    # Same bytes, same hashes (samples of contiguous device tensors included) whatever the staging mode;
    # the second save references every tensor that did not change.
    state = gpu_state(gpu.device)
    saved = {}
    with gpu.writer(incremental=True, config=ROUTED, mode=mode) as writer:
        for step in (1, 2):
            writer.base = str(tmp_path / "step-1") if step == 2 else None
            saved[step] = host_copy(state)
            response = dcp.async_save(
                state, checkpoint_id=str(tmp_path / f"step-{step}"), storage_writer=writer, async_stager=writer
            )
            response.upload_completion.result()
            state["fp32"].add_(1)
        second = writer.last_save
    dcp.save(saved[1], storage_writer=FastPersistWriter(tmp_path / "cpu", incremental=True))
    device_saved, host_saved = locations(tmp_path / "step-1"), locations(tmp_path / "cpu")
    assert {k: (v.crc32c, v.xxh3_128) for k, v in device_saved.items()} == {
        k: (v.crc32c, v.xxh3_128) for k, v in host_saved.items()
    }
    # Samples exist where the source is cheap to sample (contiguous): where both have one, they agree.
    assert all(
        v.xxh3_sample == host_saved[k].xxh3_sample
        for k, v in device_saved.items()
        if v.xxh3_sample and host_saved[k].xxh3_sample
    )
    assert device_saved["big_bf16"].xxh3_sample is not None
    first_files = {loc.file for loc in device_saved.values()}
    tensors = {k for k, v in saved[2].items() if isinstance(v, torch.Tensor) and v.numel()}
    rewritten = {k for k, loc in locations(tmp_path / "step-2").items() if k in tensors and loc.file not in first_files}
    assert rewritten == {"fp32"}
    assert second.referenced > 0 and second.bytes < 70_001 * 4 + 4096
    target = empty_like(saved[2])
    target["objects"] = {"step": 0}
    load(target, tmp_path / "step-2")
    for key in tensors:
        assert same_bytes(target[key], saved[2][key]), key


@pytest.mark.gpu
def test_gpu_gather_copies_segments_to_their_offsets(gpu):
    staging = Staging(IOConfig())
    on_cuda = gpu.device.type == "cuda"
    side = staging.side_stream(torch.device("cuda", torch.cuda.current_device()) if on_cuda else gpu.device)
    g = torch.Generator(device=gpu.device).manual_seed(1)
    sizes = (1, 15, 16, 17, 4096, 12_345)
    sources = [torch.randint(0, 256, (n,), dtype=torch.uint8, device=gpu.device, generator=g) for n in sizes]
    sources.append(torch.randint(0, 256, (1000,), dtype=torch.uint8, device=gpu.device, generator=g)[3:700])
    offsets, cursor = [], 0
    for s in sources:
        offsets.append(cursor + 5)
        cursor += s.numel() + 5 + cursor % 7
    out = torch.zeros(cursor, dtype=torch.uint8, device=gpu.device)
    keep: list = []
    side.wait_for(side.caller_event())  # the inputs were made on the caller's stream
    with side.context():
        staging.gather()(side, list(zip(sources, offsets, strict=True)), out, keep)
        event = side.record()
    if event is not None:
        event.synchronize()
    expected = torch.zeros_like(out)
    for s, o in zip(sources, offsets, strict=True):
        expected[o : o + s.numel()] = s
    assert torch.equal(out, expected)
    if on_cuda and importlib.util.find_spec("cupy") is not None:
        assert staging.gather_backend.startswith("cuda/gather.cu"), staging.gather_backend  # the kernel did it
    staging.close()


@pytest.mark.gpu
def test_gpu_side_stream_waits_for_the_values(tmp_path, gpu):
    """Values produced on the caller's stream right before the save are the ones saved."""
    x = torch.zeros(4 << 20, device=gpu.device)
    on_cuda = gpu.device.type == "cuda"
    producer = torch.cuda.Stream() if on_cuda else None
    if producer is not None:
        producer.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(producer) if producer is not None else contextlib.nullcontext():
        if on_cuda:
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the fill
        x.fill_(7.0)
        writer = gpu.writer(tmp_path, config=SMALL)
        dcp.save({"x": x}, storage_writer=writer)
    target = {"x": torch.zeros(4 << 20)}
    load(target, tmp_path)
    assert torch.all(target["x"] == 7.0)
    side = writer._resources.staging.side_stream(x.device)
    if on_cuda:
        assert side.stream != producer and side.stream != torch.cuda.default_stream()


@needs_torch(compat.ASYNC_STAGING)
@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["streaming", "snapshot"])
def test_gpu_async_save_captures_the_values_of_its_step(tmp_path, gpu, mode):
    state = gpu_state(gpu.device)
    expected = host_copy(state)
    writer = gpu.writer(tmp_path, config=ROUTED, mode=mode)
    on_cuda = gpu.device.type == "cuda"
    producer = torch.cuda.Stream() if on_cuda else None
    if producer is not None:
        producer.wait_stream(torch.cuda.current_stream())  # the training stream, after the state was made
    with torch.cuda.stream(producer) if producer is not None else contextlib.nullcontext():
        response = dcp.async_save(state, storage_writer=writer, async_stager=writer)
        response.staging_completion.result(timeout=60)
        state["big_bf16"].add_(1)  # the next optimizer step, on the training stream
        state["small.3"].mul_(-1)
    response.upload_completion.result(timeout=120)
    target = empty_like(expected)
    target["objects"] = {"step": 0}
    load(target, tmp_path)
    assert same_bytes(target["big_bf16"], expected["big_bf16"]) and torch.equal(target["small.3"], expected["small.3"])


@pytest.mark.gpu
def test_gpu_streaming_host_memory_is_bounded_by_the_pool(tmp_path, gpu, monkeypatch):
    from cuda_double import CpuAsDevice, HostCrc

    from fp_dcp.tools.workload import PeakRSS

    monkeypatch.setattr(CpuAsDevice, "crc_kernel", HostCrc)  # (the CPU route's CRC model holds temporaries)

    n = 64 << 20 if gpu.device.type == "cuda" else 16 << 20  # 1 GiB on a GPU, 256 MiB on the CPU route
    state = {f"w{i}": torch.randn(n, device=gpu.device) for i in range(4)}
    config = IOConfig(buffer_size=16 << 20, num_buffers=4)
    writer = gpu.writer(tmp_path, config=config)
    dcp.save({"w0": state["w0"][:1024]}, storage_writer=writer)  # pool, landing and CUDA context exist now
    rss = PeakRSS()
    with rss.watch():
        dcp.save(state, storage_writer=writer)
    assert rss.peak - rss.start < n, (rss.peak - rss.start) >> 20  # a quarter of the state
