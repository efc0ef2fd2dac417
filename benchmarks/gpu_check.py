"""Measurements behind the GPU bars (run by benchmarks/gpu_check.sh; --device cpu runs what a CPU can).

    python benchmarks/gpu_check.py OUT_DIR [--device cuda|cpu] [--size-gib 4] [--dir DIR] [--budget-s 330]

Sections, in this order; each is skipped once the time budget is spent, and one
that fails is reported in the table without stopping the others:

- ``peaks``: pinned device-to-host and host-to-device copy peaks (1 GiB, side stream);
- ``h2d_streams``: 1 GiB host-to-device in 32 MiB copies (a load's staging
  buffers), waiting for each as a load does per buffer, and left in flight
  on 1, 2 and 4 streams: whether copies into CUDA tensors gain from more
  than one stream (issue 33, item 5);
- ``staging``: the snapshot copy (GPU state to the page-locked arena), timed
  through ``async_save`` until ``staging_completion`` and alone
  (``Snapshot.take``), and streaming saves into a tmpfs directory, against
  the D2H peak;
- ``shm8``: one rank saving a ``--shm-gib`` GPU state with ``data_dirs`` set to 8
  directories on tmpfs, against ``fio --numjobs=8`` writing as many bytes into
  the same directories, and the same save into the null engine (writes
  complete at once, nothing stored): the ceiling of one rank's pipeline; and
  the same bytes saved from host memory, which the host threads write
  themselves (``save.thread_writes``);
- ``disk``: save GB/s from the GPU state to ``--dir``, fp-dcp against
  ``FileSystemWriter(thread_count=1)``, interleaved, median of the repeats;
- ``disk``: cold load of that checkpoint into CUDA tensors, fp-dcp against
  ``FileSystemReader``, fp-dcp into CPU tensors, the disk's direct read of the
  same bytes (fio, else dd) and the pinned H2D peak;
- ``shm_load``: the same state loaded from tmpfs (no disk in the way) into CUDA
  and into CPU tensors through one reader, and into CUDA through a reader made
  anew for each load, as the README loads (the bar's figure: its staging
  buffers come page-locked from the reader before, ``fp_dcp.io.buffers``);
  then, into CUDA through one reader each, what moves that figure: no
  checksums, 16 staging buffers (reads in flight), and the thread-pool engine
  (``pread`` threads instead of io_uring's workers);
- ``async``: how long ``dcp.async_save`` keeps the caller (until
  ``staging_completion``) against ``dcp.save``, both modes, steady state;
- ``crc``: the CRC-32C kernel on device memory against one host core, and
  saves into tmpfs and loads back into CUDA with the device checksums against
  the host's (``benchmarks/gpu_crc.py``);
- ``small``: 10,000 GPU tensors of 4-64 KiB saved with the gather kernel, with
  the gather done by plain copies, and with no gathering, each loaded back and
  checked bit-exact;
- ``incremental``: a ``CheckpointManager(incremental=True)`` on GPU state with
  2 of 16 tensors changed: bytes written, time ``save()`` keeps the caller,
  restore bit-exact;
- ``demo``: examples/train_demo.py, one round of its modes: overhead per iteration.

``--only`` runs the sections it names and skips the rest (``--only crc`` is
what ``gpu_crc.py`` was), ``--skip`` the other way round.

Prints a table at the end, always, and writes ``OUT_DIR/gpu_check.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gpu_crc
import torch
import torch.distributed.checkpoint as dcp

from fp_dcp import CheckpointManager, FastPersistReader, FastPersistWriter, IOConfig, engine_info
from fp_dcp.gpu.kernel import Kernel
from fp_dcp.testing.measure import timed
from fp_dcp.tools.fio import Fio, Jobs, installed
from fp_dcp.tools.workload import copy_peaks, evict, llm_state_dict, tensor_bytes

ROOT = Path(__file__).resolve().parents[1]
GiB = 1 << 30
GB = 1e9
DEMO_ARGS = (
    "--vocab 32768 --dim 1024 --layers 8 --heads 16 --seq 1024 --batch 64 --warmup 1 --iters 3 --rounds 1 "
    "--modes none,fs-async-thread,fp-sync,fp-overlap-streaming,fp-overlap-snapshot"
)

# The issues' bars on CUDA: (name, key in the flat figures, comparison, limit); those of issue 33 (node-scale
# bandwidth) where it raised an earlier one.
BARS = [
    ("snapshot staging / D2H peak", "staging_over_d2h", ">=", 0.8),
    ("snapshot copy alone / D2H peak", "take_over_d2h", ">=", 0.8),
    ("async snapshot blocked / sync save", "snapshot_blocked_over_sync", "<=", 0.05),
    ("overlapped overhead % of iteration (worst mode)", "overlap_overhead_pct", "<=", 5.0),
    ("one rank's GPU state into the null sink, GB/s", "null_gbps", ">=", 20.0),
    ("8-dir tmpfs save / fio numjobs=8", "shm8_over_fio", ">=", 0.9),
    ("cold load into CUDA / disk's direct read", "load_over_direct", ">=", 0.95),
    ("cold load into CUDA / into CPU", "cuda_over_cpu_load", ">=", 0.95),
    ("load from tmpfs into CUDA, GB/s", "shm_load_gbps", ">=", 10.0),
]


def h2d_streams(nbytes: int = GiB, chunk: int = 32 << 20, repeats: int = 3) -> dict[str, float]:
    """Best host-to-device GB/s of ``nbytes`` from page-locked memory in ``chunk``-sized copies: ``wait each``
    (one side stream, each copy waited for before the next is queued, as a load settles each staging buffer)
    and ``N streams`` (the copies dealt round-robin over N side streams, waited for at the end)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    starts = range(0, nbytes, chunk)

    def run(streams: list[torch.cuda.Stream], wait_each: bool) -> float:
        torch.cuda.synchronize()
        began = time.perf_counter()
        for i, at in enumerate(starts):
            with torch.cuda.stream(streams[i % len(streams)]):
                device[at : at + chunk].copy_(host[at : at + chunk], non_blocking=True)
                if wait_each:
                    streams[i % len(streams)].synchronize()
        torch.cuda.synchronize()
        return nbytes / (time.perf_counter() - began) / GB

    variants = {"wait each": (1, True), "1 stream": (1, False), "2 streams": (2, False), "4 streams": (4, False)}
    pools = {name: [torch.cuda.Stream() for _ in range(n)] for name, (n, _) in variants.items()}
    rates: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):  # alternating, so that all meet the same bus
        for name, (_, wait_each) in variants.items():
            rates[name].append(run(pools[name], wait_each))
    return {name: max(r) for name, r in rates.items()}


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def use_carried_fio() -> None:
    """fio from ``.dep/bin``, carried to machines without it (benchmarks/gpu_check.sh), first on the PATH."""
    local = ROOT / ".dep" / "bin"
    if (local / "fio").is_file() and str(local) not in os.environ.get("PATH", "").split(":"):
        os.environ["PATH"] = f"{local}:{os.environ.get('PATH', '')}"


def staging(state: dict[str, Any], size: int, memory_dir: str, device: str) -> dict[str, Any]:
    """Staging alone: snapshot copies (until staging_completion) and streaming saves into tmpfs."""
    path = tempfile.mkdtemp(prefix="staging-", dir=memory_dir)
    snapshots, streaming, takes = [], [], []
    try:
        with FastPersistWriter(path, mode="snapshot") as writer:
            for _ in range(3):  # the first allocates and page-locks the arena
                responses = []

                def snapshot(w: FastPersistWriter = writer, into: list[Any] = responses) -> None:
                    into.append(dcp.async_save(state, storage_writer=w, async_stager=w))
                    into[-1].staging_completion.result()

                snapshots.append(timed(snapshot, device=device).gbps(size))
                responses[-1].upload_completion.result()
            arena = writer._resources.staging.snapshot  # the copy alone, as the staging thread runs it
            for _ in range(3):
                takes.append(timed(lambda a=arena: a.take(state, {}), device=device).gbps(size))
        with FastPersistWriter(path) as writer:
            for _ in range(3):
                streaming.append(timed(lambda w=writer: dcp.save(state, storage_writer=w), device=device).gbps(size))
            how = writer.last_save.staging if writer.last_save else "?"
    finally:
        shutil.rmtree(path, ignore_errors=True)
    return {
        "snapshot_gbps": max(snapshots[1:]),
        "snapshot_take_gbps": max(takes),
        "streaming_gbps": max(streaming[1:]),
        "staging": how,
    }


def shm8(nbytes: int, memory_dir: str, device: str) -> dict[str, Any]:
    root = tempfile.mkdtemp(prefix="shm8-", dir=memory_dir)
    dirs = [os.path.join(root, f"d{i}") for i in range(8)]
    for d in dirs:
        os.makedirs(d)
    try:
        state = llm_state_dict(nbytes, seed=1, device=device)
        size = tensor_bytes(state)
        fio = installed()
        fio_rates: list[float] = []
        fp_rates: list[float] = []
        with FastPersistWriter(os.path.join(root, "ckpt"), data_dirs=dirs) as writer:
            dcp.save(state, storage_writer=writer)  # warm-up: pool, page-locking
            for rep in range(2):
                fp_rates.append(size / save_once(writer, state, root, dirs, f"ckpt-{rep}", device) / GB)
                if fio:
                    fio_rates.append(size / fio_write(dirs, size) / GB)
            how = writer.last_save.staging if writer.last_save else "?"
        # the same bytes from host memory, which the host threads write into tmpfs themselves (save.thread_writes)
        host_rates = []
        if device != "cpu":
            host = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
            with FastPersistWriter(os.path.join(root, "host"), data_dirs=dirs) as writer:
                for rep in range(3):  # the first warms the pool
                    host_rates.append(size / save_once(writer, host, root, dirs, f"host-{rep}", "cpu") / GB)
            del host
        # the pipeline with no device in the way: the null engine completes every write at once and stores nothing
        null_rates = []
        with FastPersistWriter(os.path.join(root, "null"), data_dirs=dirs, config=IOConfig(engine="null")) as writer:
            for _ in range(3):  # the first warms the pool and page-locking
                null_rates.append(timed(lambda: dcp.save(state, storage_writer=writer), device=device).gbps(size))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    fp, ref = max(fp_rates), max(fio_rates) if fio_rates else None
    return {
        "bytes": size,
        "fp_dcp_gbps": fp,
        "fio_gbps": ref,
        "over_fio": fp / ref if ref else None,
        "null_gbps": max(null_rates[1:]),
        "host_gbps": max(host_rates[1:]) if host_rates else None,
        "staging": how,
    }


def save_once(
    writer: FastPersistWriter, state: dict[str, Any], root: str, dirs: list[str], name: str, device: str
) -> float:
    """Seconds ``writer`` takes to save ``state`` as a new checkpoint ``name`` in ``root`` (its data in ``dirs``),
    which is removed afterwards, as fio's files are: no replaced files to unlink."""
    path = os.path.join(root, name)
    seconds = timed(lambda: dcp.save(state, storage_writer=writer, checkpoint_id=path), device=device).seconds
    for leftover in [path, *(os.path.join(d, n) for d in dirs for n in os.listdir(d) if n.startswith(f"{name}-"))]:
        shutil.rmtree(leftover)
    return seconds


def fio_write(dirs: list[str], size: int) -> float:
    """Seconds for fio to write ``size`` bytes, one job per directory, buffered, 8 MiB requests 16 deep, fsync at
    the end, timed as a whole process."""
    each = -(-size // len(dirs) // (1 << 20)) << 20
    jobs = Jobs(depth=16, block=8 << 20, jobs=len(dirs), direct=False)
    seconds = timed(lambda: jobs.run(":".join(dirs), "write", each)).seconds
    for d in dirs:
        for name in os.listdir(d):
            if name.startswith("fio."):
                os.unlink(os.path.join(d, name))
    return seconds


def save_and_load(state: dict[str, Any], size: int, directory: str, repeats: int, device: str) -> dict[str, Any]:
    """Save: fp-dcp against FileSystemWriter t=1. Cold load into the device: fp-dcp, FileSystemReader, direct read."""
    writer = FastPersistWriter(directory)
    fp_path, fs_path = os.path.join(directory, "fp"), os.path.join(directory, "fs")
    saves: dict[str, list[float]] = {"fp-dcp": [], "FileSystemWriter t=1": []}
    for _ in range(repeats):
        for path in (fp_path, fs_path):
            shutil.rmtree(path, ignore_errors=True)
        saves["fp-dcp"].append(
            timed(lambda: dcp.save(state, storage_writer=writer, checkpoint_id=fp_path), device=device).gbps(size)
        )
        fs = dcp.FileSystemWriter(fs_path, thread_count=1)
        saves["FileSystemWriter t=1"].append(
            timed(lambda w=fs: dcp.save(state, storage_writer=w), device=device).gbps(size)
        )
    writer.close()
    target = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    host = {k: torch.empty_like(v, device="cpu") if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    loads: dict[str, list[float]] = {"fp-dcp": [], "fp-dcp into CPU": [], "FileSystemReader": [], "direct read": []}
    reader = FastPersistReader(fp_path)
    fio = installed()
    data = [os.path.join(fp_path, n) for n in os.listdir(fp_path) if n.endswith(".distcp")]
    for _ in range(repeats):
        for name, path, load in (
            ("fp-dcp", fp_path, lambda: dcp.load(target, storage_reader=reader)),
            ("fp-dcp into CPU", fp_path, lambda: dcp.load(host, storage_reader=reader)),
            ("FileSystemReader", fs_path, lambda: dcp.load(target, storage_reader=dcp.FileSystemReader(fs_path))),
            ("direct read", fp_path, lambda: direct_read(fio, data)),
        ):
            evict(path)
            loads[name].append(timed(load, device=device).gbps(size))
    bad = [k for k, v in state.items() if isinstance(v, torch.Tensor) and not torch.equal(v, target[k])]
    return {
        "save_fp_gbps": statistics.median(saves["fp-dcp"]),
        "save_fs_gbps": statistics.median(saves["FileSystemWriter t=1"]),
        "load_fp_gbps": statistics.median(loads["fp-dcp"]),
        "load_fp_cpu_gbps": statistics.median(loads["fp-dcp into CPU"]),
        "load_fs_gbps": statistics.median(loads["FileSystemReader"]),
        "direct_read_gbps": statistics.median(loads["direct read"]),
        "direct_read_tool": "fio" if fio else "dd",
        "load_requests": reader.last_load.requests if reader.last_load else None,
        "bit_exact": not bad,
        "runs": {"save": saves, "load": loads},
    }


# Readers that each change one thing a load from memory into CUDA may be waiting on (``shm_load``).
SHM_LOAD_VARIANTS: dict[str, dict[str, Any]] = {
    "no checksums": {"verify_checksums": False},
    "16 staging buffers": {"config": IOConfig(num_buffers=16)},
    "thread-pool engine": {"config": IOConfig(engine="threads")},
}


def shm_load(state: dict[str, Any], size: int, memory_dir: str, device: str) -> dict[str, Any]:
    """Loads of a checkpoint held in tmpfs (memory: no disk in the way) into device and into CPU tensors."""
    path = tempfile.mkdtemp(prefix="shm-load-", dir=memory_dir)
    try:
        with FastPersistWriter(path) as writer:
            dcp.save(state, storage_writer=writer)
        target = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
        host = {k: torch.empty_like(v, device="cpu") if isinstance(v, torch.Tensor) else v for k, v in state.items()}
        rates: dict[str, list[float]] = {"device": [], "cpu": [], "device_new_reader": []}
        with FastPersistReader(path) as reader:
            for _ in range(3):
                rates["device"].append(timed(lambda: dcp.load(target, storage_reader=reader), device=device).gbps(size))
                rates["cpu"].append(timed(lambda: dcp.load(host, storage_reader=reader), device=device).gbps(size))
        exact = all(torch.equal(target[k], v) for k, v in state.items() if isinstance(v, torch.Tensor))

        def load_anew(into: dict[str, Any]) -> None:
            dcp.load(into, storage_reader=FastPersistReader(path))  # as the README loads

        for _ in range(3):
            fresh = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
            rates["device_new_reader"].append(timed(functools.partial(load_anew, fresh), device=device).gbps(size))
            exact = exact and all(torch.equal(fresh[k], v) for k, v in state.items() if isinstance(v, torch.Tensor))
        for name, kwargs in SHM_LOAD_VARIANTS.items():
            for t in target.values():
                if isinstance(t, torch.Tensor):
                    t.zero_()
            with FastPersistReader(path, **kwargs) as reader:
                rates[name] = [
                    timed(lambda r=reader: dcp.load(target, storage_reader=r), device=device).gbps(size)
                    for _ in range(2)
                ]
            exact = exact and all(torch.equal(target[k], v) for k, v in state.items() if isinstance(v, torch.Tensor))
    finally:
        shutil.rmtree(path, ignore_errors=True)
    return {
        "device_gbps": max(rates["device"]),
        "cpu_gbps": max(rates["cpu"]),
        "device_new_reader_gbps": max(rates["device_new_reader"]),
        "variants_gbps": {name: max(rates[name]) for name in SHM_LOAD_VARIANTS},
        "bit_exact": exact,
        "runs": rates,
    }


def direct_read(fio: bool, files: list[str]) -> None:
    """The disk's direct read of ``files`` (fio at queue depth 16, 8 MiB requests; dd where there is no fio)."""
    for path in files:
        if fio:
            Fio(depth=16, block=8 << 20).run(path, "read", os.path.getsize(path))
        else:
            subprocess.run(
                ["dd", f"if={path}", "of=/dev/null", "bs=16M", "iflag=direct"], check=True, capture_output=True
            )


def async_vs_sync(state: dict[str, Any], directory: str, mode: str, repeats: int, device: str) -> dict[str, Any]:
    path = os.path.join(directory, f"async-{mode}")
    sync: list[float] = []
    blocked: list[float] = []
    with FastPersistWriter(path, mode=mode) as writer:
        for rep in range(repeats + 1):  # sync and async alternate; the first round is a warm-up (arena, pool)
            seconds = timed(lambda: dcp.save(state, storage_writer=writer), device=device).seconds
            synchronize(device)
            start = time.perf_counter()
            response = dcp.async_save(state, storage_writer=writer, async_stager=writer)
            response.staging_completion.result()
            waited = time.perf_counter() - start
            response.upload_completion.result()
            if rep:
                sync.append(seconds)
                blocked.append(waited)
    shutil.rmtree(path, ignore_errors=True)
    sync_s, blocked_s = statistics.median(sync), statistics.median(blocked)
    return {"sync_save_s": sync_s, "blocked_s": blocked_s, "blocked_over_sync": blocked_s / sync_s}


@contextlib.contextmanager
def gather_kernel(enabled: bool) -> Iterator[None]:
    """Save with the gather kernel, or with its fallback (one copy per segment on the side stream)."""
    original = Kernel.function

    def without_gather(self: Kernel, side: Any) -> Any:
        return None if self.file == "gather.cu" else original(self, side)

    if not enabled:
        Kernel.function = without_gather  # type: ignore[method-assign]
    try:
        yield
    finally:
        Kernel.function = original  # type: ignore[method-assign]


def small_tensors(count: int, directory: str, device: str) -> dict[str, Any]:
    g = torch.Generator(device=device).manual_seed(2)
    sizes = torch.randint(1024, 16 * 1024 + 1, (count,), generator=g, device=device).tolist()  # fp32: 4-64 KiB
    state = {f"t{i}": torch.randn(n, generator=g, device=device) for i, n in enumerate(sizes)}
    size = tensor_bytes(state)
    variants = {"kernel": (True, None), "copies": (False, None), "no gather": (True, 0)}
    result: dict[str, Any] = {"tensors": count, "bytes": size}
    for name, (kernel, gather_max) in variants.items():
        config = IOConfig() if gather_max is None else IOConfig(gather_max=gather_max)
        path = os.path.join(directory, "small-" + name.replace(" ", "-"))
        with gather_kernel(kernel), FastPersistWriter(path, config=config) as writer:
            dcp.save(state, storage_writer=writer)  # warm-up: pool, kernel compiled
            wall = timed(lambda w=writer: dcp.save(state, storage_writer=w), device=device).seconds
            summary = writer.last_save
        target = {k: torch.empty_like(v) for k, v in state.items()}
        dcp.load(target, storage_reader=FastPersistReader(path))
        exact = all(torch.equal(target[k], v) for k, v in state.items())
        shutil.rmtree(path, ignore_errors=True)
        assert summary is not None
        result[name] = {"save_s": wall, "write_data_s": summary.seconds, "staging": summary.staging, "bit_exact": exact}
    return result


def incremental(directory: str, device: str) -> dict[str, Any]:
    g = torch.Generator(device=device).manual_seed(4)
    state = {f"layer{i}": torch.randn(32 << 20, generator=g, device=device) for i in range(16)}  # 16 x 128 MiB
    root = os.path.join(directory, "manager")
    manager = CheckpointManager(root, incremental=True)
    manager.save(1, state)
    manager.wait()
    state["layer3"].add_(1)
    state["layer11"].mul_(2)
    synchronize(device)
    start = time.perf_counter()
    manager.save(2, state)
    returned = time.perf_counter() - start
    manager.wait()
    written = manager.writer.last_save
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    restored = manager.restore(target)
    exact = all(torch.equal(target[k], v) for k, v in state.items())
    manager.close()
    shutil.rmtree(root, ignore_errors=True)
    assert written is not None
    return {
        "state_bytes": tensor_bytes(state),
        "written_bytes": written.bytes,
        "referenced_bytes": written.referenced,
        "save_returned_s": returned,
        "restored_step": restored,
        "bit_exact": exact,
    }


def demo(args: argparse.Namespace, out: Path, timeout: float) -> dict[str, Any]:
    target = out / "train_demo.json"
    cmd = [sys.executable, str(ROOT / "examples" / "train_demo.py"), "--device", args.device, "--json", str(target)]
    cmd += ["--dir", args.dir, *args.demo_args.split()]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, timeout=timeout)
    result: dict[str, Any] = json.loads(target.read_text())
    return result


def flat_figures(r: dict[str, Any]) -> dict[str, float]:
    """The figures the bars compare, where their sections ran."""
    f: dict[str, float] = {}
    d2h = r.get("peaks", {}).get("d2h_gbps")
    if d2h and "staging" in r:
        f["staging_over_d2h"] = r["staging"]["snapshot_gbps"] / d2h
        f["take_over_d2h"] = r["staging"]["snapshot_take_gbps"] / d2h
    if "async_snapshot" in r:
        f["snapshot_blocked_over_sync"] = r["async_snapshot"]["blocked_over_sync"]
    if r.get("shm8", {}).get("over_fio"):
        f["shm8_over_fio"] = r["shm8"]["over_fio"]
    if "shm8" in r:
        f["null_gbps"] = r["shm8"]["null_gbps"]
    if "disk" in r:
        f["load_over_direct"] = r["disk"]["load_fp_gbps"] / r["disk"]["direct_read_gbps"]
        f["cuda_over_cpu_load"] = r["disk"]["load_fp_gbps"] / r["disk"]["load_fp_cpu_gbps"]
    if "shm_load" in r:
        f["shm_load_gbps"] = r["shm_load"]["device_new_reader_gbps"]
    if "demo" in r:
        overlapped = [m["overhead_pct"] for n, m in r["demo"]["modes"].items() if n.startswith("fp-overlap")]
        if overlapped and None not in overlapped:
            f["overlap_overhead_pct"] = max(overlapped)
    return f


def table(r: dict[str, Any]) -> list[tuple[str, str]]:
    """(what, measured) rows of every section that ran, then the bars."""
    rows: list[tuple[str, str]] = []
    if "peaks" in r:
        rows.append(
            ("pinned copy peaks D2H / H2D", f"{r['peaks']['d2h_gbps']:.1f} / {r['peaks']['h2d_gbps']:.1f} GB/s")
        )
    if "h2d_streams" in r:
        rates = " / ".join(f"{gbps:.1f}" for gbps in r["h2d_streams"].values())
        rows.append((f"H2D in 32 MiB copies: {' / '.join(r['h2d_streams'])}", f"{rates} GB/s"))
    if "staging" in r:
        s = r["staging"]
        rows.append(("staging: async_save until staging_completion", f"{s['snapshot_gbps']:.1f} GB/s"))
        rows.append(("staging: the snapshot copy alone (Snapshot.take)", f"{s['snapshot_take_gbps']:.1f} GB/s"))
        rows.append(("staging: streaming save into tmpfs (one dir)", f"{s['streaming_gbps']:.2f} GB/s"))
        rows.append(("staging: how", s["staging"]))
    if "shm8" in r:
        s = r["shm8"]
        ref = f"{s['fio_gbps']:.2f}" if s["fio_gbps"] else "no fio"
        rows.append(
            (
                f"8 tmpfs dirs, {s['bytes'] / GiB:.1f} GiB: fp-dcp / fio numjobs=8",
                f"{s['fp_dcp_gbps']:.2f} / {ref} GB/s",
            )
        )
        rows.append(("the same save into the null sink (stores nothing)", f"{s['null_gbps']:.2f} GB/s"))
        if s.get("host_gbps"):
            rows.append(("the same bytes from host memory (host threads write)", f"{s['host_gbps']:.2f} GB/s"))
    if "disk" in r:
        s = r["disk"]
        rows.append(
            ("save to disk: fp-dcp / FileSystemWriter t=1", f"{s['save_fp_gbps']:.2f} / {s['save_fs_gbps']:.2f} GB/s")
        )
        rows.append(
            (
                "cold load into CUDA: fp-dcp / FileSystemReader",
                f"{s['load_fp_gbps']:.2f} / {s['load_fs_gbps']:.2f} GB/s",
            )
        )
        rows.append((f"disk's direct read ({s['direct_read_tool']})", f"{s['direct_read_gbps']:.2f} GB/s"))
        rows.append(("cold load into CPU tensors: fp-dcp", f"{s['load_fp_cpu_gbps']:.2f} GB/s"))
        rows.append(("cold load bit-exact", str(s["bit_exact"])))
    if "shm_load" in r:
        s = r["shm_load"]
        rows.append(("load from tmpfs into CUDA / into CPU", f"{s['device_gbps']:.2f} / {s['cpu_gbps']:.2f} GB/s"))
        rows.append(("load from tmpfs into CUDA, a reader made anew each", f"{s['device_new_reader_gbps']:.2f} GB/s"))
        for name, gbps in s.get("variants_gbps", {}).items():
            rows.append((f"load from tmpfs into CUDA, {name}", f"{gbps:.2f} GB/s"))
        rows.append(("load from tmpfs bit-exact", str(s["bit_exact"])))
    for mode in ("snapshot", "streaming"):
        if f"async_{mode}" in r:
            a = r[f"async_{mode}"]
            rows.append(
                (
                    f"async {mode}: blocked / sync save",
                    f"{a['blocked_s'] * 1000:.0f} / {a['sync_save_s'] * 1000:.0f} ms",
                )
            )
    if "crc" in r:
        rows += gpu_crc.rows(r["crc"])
    if "small" in r:
        s = r["small"]
        for name in ("kernel", "copies", "no gather"):
            v = s[name]
            rows.append(
                (
                    f"{s['tensors']} small tensors, {name}: save / write_data",
                    f"{v['save_s']:.2f} / {v['write_data_s']:.2f} s, exact {v['bit_exact']}",
                )
            )
    if "incremental" in r:
        s = r["incremental"]
        rows.append(
            (
                "incremental manager: written / state",
                f"{s['written_bytes'] / 1e6:.0f} / {s['state_bytes'] / 1e6:.0f} MB",
            )
        )
        rows.append(
            (
                "incremental manager: save() returned; restore exact",
                f"{s['save_returned_s'] * 1000:.0f} ms; {s['bit_exact']}",
            )
        )
    if "demo" in r:
        for mode, row in r["demo"]["modes"].items():
            if mode != "none" and row["overhead_pct"] is not None:
                rows.append((f"demo: {mode} overhead per iteration", f"{row['overhead_pct']:.1f} %"))
    for name in r.get("errors", {}):
        rows.append((f"{name}: FAILED", r["errors"][name].splitlines()[-1][:60]))
    for name in r.get("skipped", []):
        rows.append((f"{name}: skipped", "time budget spent"))
    figures = flat_figures(r)
    for name, key, op, limit in BARS:
        if key in figures:
            value = figures[key]
            ok = value >= limit if op == ">=" else value <= limit
            rows.append((f"bar: {name} {op} {limit}", f"{value:.2f} {'ok' if ok else 'MISSED'}"))
        else:
            rows.append((f"bar: {name} {op} {limit}", "not measured"))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="directory for gpu_check.json (created)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--size-gib", type=float, default=4.0, help="state for staging, save, load and async (GiB)")
    ap.add_argument("--shm-gib", type=float, default=8.0, help="state for the 8-directory tmpfs save (GiB)")
    ap.add_argument("--small-count", type=int, default=10_000, help="tensors of the small-tensor section")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dir", default=str(ROOT), help="checkpoint directory's parent (default: the repository)")
    ap.add_argument("--memory-dir", default="/dev/shm", help="tmpfs directory for the staging-only saves")
    ap.add_argument("--budget-s", type=float, default=330, help="skip sections once this much time is spent")
    ap.add_argument("--demo-args", default=DEMO_ARGS, help="arguments for examples/train_demo.py")
    ap.add_argument("--skip", default="", help="comma-separated sections to skip (names above)")
    ap.add_argument("--only", default="", help="comma-separated sections to run, the others skipped")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    use_carried_fio()
    began = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    only = set(filter(None, args.only.split(",")))
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    args.dir = tempfile.mkdtemp(prefix="fp-dcp-check-", dir=args.dir)
    engine = engine_info(args.dir)
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else f"cpu ({os.cpu_count()} cores)",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "engine": engine,
        "fio": shutil.which("fio"),
    }
    print(f"device: {results['device']}, torch {results['torch']}, engine {engine['engine']}", flush=True)

    def wanted(name: str) -> bool:
        return name not in skip and (not only or name in only)

    def section(name: str, seconds_needed: float, run: Callable[[], Any]) -> None:
        left = args.budget_s - (time.perf_counter() - began)
        if not wanted(name):
            return
        if left < seconds_needed:
            print(f"[{name}] skipped: {left:.0f} s left of the budget", flush=True)
            results.setdefault("skipped", []).append(name)
            return
        print(f"[{name}] ...", flush=True)
        start = time.perf_counter()
        try:
            results[name] = run()
        except BaseException:  # one section's failure must not cost the others or the table
            results.setdefault("errors", {})[name] = traceback.format_exc()
            print(f"[{name}] failed:\n{traceback.format_exc()}", flush=True)
        print(f"[{name}] {time.perf_counter() - start:.0f} s", flush=True)

    device = args.device
    try:
        if device == "cuda":
            section("peaks", 10, copy_peaks)
            section("h2d_streams", 10, h2d_streams)
        held: dict[str, Any] = {}  # the state of the sections that share it, dropped before the rest
        if any(wanted(name) for name in ("staging", "disk", "shm_load", "async_snapshot", "async_streaming")):
            held["state"] = llm_state_dict(int(args.size_gib * GiB), device=device)
        size = results["state_bytes"] = tensor_bytes(held["state"]) if held else 0
        section("staging", 30, lambda: staging(held["state"], size, args.memory_dir, device))
        section("shm8", 40, lambda: shm8(int(args.shm_gib * GiB), args.memory_dir, device))
        section("disk", 60, lambda: save_and_load(held["state"], size, args.dir, args.repeats, device))
        section("shm_load", 35, lambda: shm_load(held["state"], size, args.memory_dir, device))
        for mode in ("snapshot", "streaming"):
            section(f"async_{mode}", 30, lambda m=mode: async_vs_sync(held["state"], args.dir, m, args.repeats, device))
        held.clear()
        if device == "cuda":
            section("crc", 30, lambda: gpu_crc.measure(llm_state_dict(GiB, seed=3, device=device), args.memory_dir))
        section("small", 30, lambda: small_tensors(args.small_count, args.dir, device))
        section("incremental", 20, lambda: incremental(args.dir, device))
        left = args.budget_s - (time.perf_counter() - began)
        section("demo", 45, lambda: demo(args, out, timeout=max(left, 1)))
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
        rows = table(results)
        results["table"] = [{"what": w, "measured": m} for w, m in rows]
        (out / "gpu_check.json").write_text(json.dumps(results, indent=2, default=str))
        width = max(len(w) for w, _ in rows)
        print(
            f"\nfp-dcp GPU check on {results['device']} (engine {engine['engine']}), "
            f"{results.get('state_bytes', 0) / GiB:.2f} GiB state, {time.perf_counter() - began:.0f} s"
        )
        for what, measured in rows:
            print(f"  {what:<{width}}  {measured}")
        print(f"JSON: {out / 'gpu_check.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
