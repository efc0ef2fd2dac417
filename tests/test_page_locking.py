"""Page-locked memory has one owner and one lifetime, whatever ends it; fp-dcp never leaves a CUDA error behind.

On machines without a GPU these run through the CUDA runtime double (``cuda_double.py``),
which keeps the runtime's ledger of registered ranges and its rules; on CUDA machines the
``gpu`` tests run against the real runtime too.
"""

from __future__ import annotations

import gc
import logging
import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import empty_like, load, same_bytes
from cuda_double import ALREADY_REGISTERED, INVALID_VALUE, MEMORY_ALLOCATION, NOT_REGISTERED, CpuAsDevice

import fp_dcp.io.buffers
import fp_dcp.log
import fp_dcp.save.resources
from fp_dcp import CheckpointManager, FastPersistWriter, IOConfig, compat
from fp_dcp._native import _cio
from fp_dcp.gpu.memory import page_lock
from fp_dcp.io.buffers import BufferPool

pytestmark = pytest.mark.gpu

SMALL_POOL = IOConfig(buffer_size=64 * 1024, num_buffers=3, block_size=16 * 1024, staging_chunk=16 * 1024)


def test_the_double_keeps_the_runtimes_rules(cuda_double, monkeypatch):
    monkeypatch.setattr(fp_dcp.io.buffers, "SPARE_SECONDS", 0)  # closed buffers are unmapped at once
    rt = cuda_double
    pool = BufferPool(8192, 2)
    first, second = (_cio.address(v) for v in pool.views)
    assert rt.cudaHostRegister(first, 8192, 1) == 0
    assert rt.cudaHostRegister(first + 4096, 4096, 1) == ALREADY_REGISTERED  # overlaps: error 712
    assert rt.last_error == ALREADY_REGISTERED  # kept until read
    assert rt.cudaHostRegister(second, 4096, 1) == 0  # a later success does not clear it
    assert rt.cudaGetLastError() == ALREADY_REGISTERED and rt.cudaGetLastError() == 0
    assert rt.cudaHostUnregister(first + 4096) == NOT_REGISTERED  # not the start of a registered range
    assert rt.cudaHostRegister(id(rt), 64, 1) == INVALID_VALUE  # not memory a pool mapped
    assert rt.cudaHostUnregister(second) == 0
    pool.close()  # its buffers go with the first still registered: the double sees it
    assert any("unmapped while registered" in p for p in rt.problems())
    assert any("left registered" in p for p in rt.problems())
    rt.registered.clear(), rt.unmapped.clear(), rt.failed.clear(), rt.cudaGetLastError()


def test_buffers_are_page_locked_once_and_unlocked_before_they_are_unmapped(cuda_double):
    pool = BufferPool(65536, 3)
    assert page_lock(pool) and page_lock(pool)  # the second call finds it locked: nothing registered twice
    assert cuda_double.registrations == 3 and all(cuda_double.is_registered(v) for v in pool.views)
    del pool
    gc.collect()  # nobody closed it: its buffers wait for the next pool, still page-locked
    again = BufferPool(65536, 3)
    assert page_lock(again) and cuda_double.registrations == 3  # taken locked: not registered again
    assert all(cuda_double.is_registered(v) for v in again.views)
    again.close()
    fp_dcp.io.buffers.release_spares()  # the wait cut short: unlocked, then unmapped
    assert cuda_double.registered == {} and cuda_double.unmapped == []


@pytest.mark.slow
def test_buffers_waiting_page_locked_are_unlocked_at_interpreter_exit():
    """Before torch's exit handlers, and before module teardown unmaps them: no registration outlives its memory."""
    script = textwrap.dedent(
        """
        import atexit
        seen = {}
        # Registered first, so it runs last: after fp-dcp's handler.
        atexit.register(lambda: print("problems:", seen["double"].problems(), flush=True))
        from cuda_double import CudaRuntimeDouble
        import fp_dcp.io.buffers as buffers
        from fp_dcp.gpu import cudart
        from fp_dcp.gpu.memory import page_lock
        seen["double"] = double = CudaRuntimeDouble()
        buffers._allocate = double.tracking(buffers._allocate)
        using = cudart.use(double)  # kept: the runtime stays the double until exit
        using.__enter__()
        pool = buffers.BufferPool(65536, 2)
        assert page_lock(pool)
        pool.close()
        kept = buffers.BufferPool(8192, 1)  # alive at exit: its finalizer runs after fp-dcp's handler
        assert page_lock(kept)
        print("waiting:", len(double.registered), flush=True)
        """
    )
    tests = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "waiting: 3" in done.stdout and "problems: []" in done.stdout, done.stdout + done.stderr


def _cycle(i: int, root, state: dict, config: IOConfig, monkeypatch) -> None:
    """One writer's life, ended without close(): the ways a program drops one."""
    path = str(root / f"c{i}")
    kind = i % 6
    if kind == 0:  # dcp.save with the mission's one-liner
        dcp.save(state, storage_writer=FastPersistWriter(path, config=config))
    elif kind in (1, 2):  # async saves, snapshot and streaming
        writer = FastPersistWriter(path, config=config, mode="snapshot" if kind == 1 else "streaming")
        if compat.has(compat.ASYNC_STAGING):
            dcp.async_save(state, storage_writer=writer, async_stager=writer).upload_completion.result(timeout=60)
        else:  # the writer as storage only: torch stages (fp_dcp.compat.ASYNC_STAGING)
            dcp.async_save(state, storage_writer=writer).result(timeout=60)
    elif kind == 3:  # the copies DCP's process executor unpickles, one per save, sharing their resources
        pickled = pickle.dumps(FastPersistWriter(path, config=config))
        first, second = pickle.loads(pickled), pickle.loads(pickled)
        assert first._resources is second._resources
        dcp.save(state, storage_writer=first)
        dcp.save(state, storage_writer=second)
    elif kind == 4:  # a manager's writer, async, never closed
        manager = CheckpointManager(root / f"m{i}", config=config)
        manager.save(1, state)
        manager.wait()
    else:  # an exception in the middle of a save
        monkeypatch.setenv("FP_DCP_FAULT_AT", "1")  # its first request: a small state may make only one
        with pytest.raises(BaseException, match="injected fault"):
            dcp.save(state, storage_writer=FastPersistWriter(path, config=config))
        monkeypatch.delenv("FP_DCP_FAULT_AT")
        return
    target = empty_like({k: v.cpu() for k, v in state.items()})
    load(target, root / f"m{i}" / "step-1" if kind == 4 else path)
    assert all(same_bytes(target[k], v.cpu()) for k, v in state.items()), i


def test_dropped_writers_leave_nothing_registered_and_no_error_behind(tmp_path, gpu, monkeypatch):
    """Writers dropped without close(), in one process, each way a program drops one several times: then nothing
    registered, nothing pending, CUDA healthy. 100 on a real device; 24 through the double, where a registration
    left behind by any of the six ways would already show 4 times over."""
    if gpu.double is not None:
        monkeypatch.setattr(fp_dcp.save.resources, "Staging", CpuAsDevice)  # also in copies and the manager
    g = torch.Generator(device=gpu.device).manual_seed(3)
    state = {"w": torch.randn(300, 1000, generator=g, device=gpu.device), "b": torch.randn(77, device=gpu.device)}
    state.update({f"s{i}": torch.full((i + 1,), float(i), device=gpu.device) for i in range(20)})
    config = SMALL_POOL if gpu.double is not None else IOConfig()  # the default pool where it is real
    cycles = 100 if gpu.double is None else 24
    for i in range(cycles):
        _cycle(i, tmp_path, state, config, monkeypatch)
        gc.collect()
    if gpu.double is not None:
        assert gpu.double.registrations >= cycles  # page-locking happened, through the double
        assert len(gpu.double.registered) <= SMALL_POOL.num_buffers  # only the one set waiting for a pool
        fp_dcp.io.buffers.release_spares()
        assert gpu.double.problems() == []
    else:
        x = torch.randn(1 << 20, device="cuda")  # the launch that tripped over fp-dcp's error before
        assert torch.isfinite(x.sum()).item()


def test_a_refused_page_lock_saves_unpinned_with_one_warning(tmp_path, cuda_double, monkeypatch, caplog):
    monkeypatch.setattr(fp_dcp.log, "_logged", set())
    cuda_double.refuse = MEMORY_ALLOCATION
    state = {"w": torch.randn(200, 500), "s": torch.arange(10)}
    with caplog.at_level(logging.WARNING, logger="fp_dcp"):
        for _ in range(3):
            with pytest.MonkeyPatch.context() as m:
                m.setattr(fp_dcp.save.resources, "Staging", CpuAsDevice)
                writer = FastPersistWriter(tmp_path, config=SMALL_POOL)
            dcp.save(state, storage_writer=writer)
    warnings = [r.getMessage() for r in caplog.records if "pageable" in r.getMessage()]
    assert len(warnings) == 1 and "out of memory" in warnings[0] and "cudaHostRegister" in warnings[0], warnings
    assert "page-locking was refused" in writer.last_save.staging
    assert cuda_double.last_error == 0  # cleared at once, never left for torch
    assert cuda_double.failed and cuda_double.registered == {}
    target = empty_like(state)
    load(target, tmp_path)
    assert all(torch.equal(target[k], v) for k, v in state.items())
    cuda_double.failed.clear()  # refused on purpose
