"""Benchmark: fp-dcp against torch's FileSystemWriter/Reader, torch.save/load and the raw disk.

    fp-dcp bench [--size-gb 2] [--dir DIR] [--repeats 3] [--json out.json]

Saves (and loads) an LLM-shaped state dict (bf16 weights in [4096, 11008]-ish
matrices, two [32000, 4096] embeddings, an fp32 master copy of one, many small
fp32 norms, scalars and a pickled object) with each method in turn, A B C A B C
..., every save fsynced, all in one run so the ratios are fair on a noisy
machine. The disk's limit is fio writing then reading a file of the same
size in the same directory with O_DIRECT, 8 MiB requests and 32 in flight
(io_uring), the write ending with an fsync, each timed as a whole process
like the other methods, its buffers in huge pages (``fp_dcp.tools.fio``:
reserved for the run as root and given back; where they cannot be had, fio's
plain buffers, and the report says why); ``dd if=/dev/zero oflag=direct
bs=16M conv=fsync`` (one request at a time) is a second reference. Without
fio (Debian package ``fio``, which ``make`` installs) the dd line is the only
one. Reported per method:
median GB/s, CPU-seconds per GB (user + system, all threads), the growth of
resident memory during the save (over the state dict already held), and load
GB/s with the checkpoint's pages evicted from the page
cache first (posix_fadvise DONTNEED per file, plus drop_caches when root).
Per save and per load also the disk's own view (``fp_dcp.io.diskstats``):
the requests it had in flight on average and the average write (read)
request, so a queue shallower than fio's, or smaller requests, is visible
on any disk.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from .. import FastPersistReader, FastPersistWriter, engine_info
from ..io.device import disk_of
from ..io.diskstats import DiskCounters
from ..io.files import fsync_path
from ..units import MiB
from .fio import Fio, reference

GB = 1e9
DD = "dd oflag=direct"


def llm_state_dict(total_bytes: int, seed: int = 0, device: str = "cpu") -> dict[str, Any]:
    """About ``total_bytes`` of a Llama-shaped model's training state, its tensors made on ``device``."""
    g = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float32, device=device).to(dtype)

    h, ffn, vocab = 4096, 11008, 32000
    sd: dict[str, Any] = {
        "model.embed_tokens.weight": rand(vocab, h),
        "lm_head.weight": rand(vocab, h),
        "master.embed_tokens.weight": rand(vocab, h, dtype=torch.float32),
        "model.norm.weight": rand(h, dtype=torch.float32),
        "train_state": {"step": 1000, "lr": 3e-4, "data_position": list(range(64))},
    }
    used = sum(t.nbytes for t in sd.values() if isinstance(t, torch.Tensor))
    layer = 0
    while used < total_bytes:
        p = f"model.layers.{layer}."
        shapes = {
            "self_attn.q_proj": (h, h),
            "self_attn.k_proj": (h, h),
            "self_attn.v_proj": (h, h),
            "self_attn.o_proj": (h, h),
            "mlp.gate_proj": (ffn, h),
            "mlp.up_proj": (ffn, h),
            "mlp.down_proj": (h, ffn),
        }
        for name, shape in shapes.items():
            if used >= total_bytes:
                break
            sd[p + name + ".weight"] = rand(*shape)
            used += sd[p + name + ".weight"].nbytes
        for name in ("input_layernorm", "post_attention_layernorm"):
            sd[p + name + ".weight"] = rand(h, dtype=torch.float32)
            used += h * 4
        for k in range(24):  # small per-layer state: scales, biases, step counters
            sd[p + f"extra.{k}"] = rand(64, dtype=torch.float32)
        sd[p + "step"] = torch.tensor(float(layer))
        layer += 1
    return sd


def tensor_bytes(sd: dict[str, Any]) -> int:
    return sum(v.nbytes for v in sd.values() if isinstance(v, torch.Tensor))


class PeakRSS:
    """Samples this process's resident set every few milliseconds while active."""

    def __init__(self) -> None:
        self.start = self.peak = 0
        self._stop = threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE")

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._rss())

    @contextlib.contextmanager
    def watch(self) -> Iterator[PeakRSS]:
        self.start = self.peak = self._rss()
        thread = threading.Thread(target=self._run, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            thread.join()
            self._stop.clear()
            self.peak = max(self.peak, self._rss())


def cpu_seconds(who: int = resource.RUSAGE_SELF) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def evict(path: str) -> None:
    """Drop ``path``'s pages (a file or every file under a directory) from the page cache."""
    files = [path] if os.path.isfile(path) else [os.path.join(d, n) for d, _, ns in os.walk(path) for n in ns]
    for name in files:
        fd = os.open(name, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    if os.geteuid() == 0:
        with contextlib.suppress(OSError), open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")


class Method:
    def __init__(
        self,
        name: str,
        save: Callable[[str], None],
        load: Callable[[str], None] | None,
        check: Callable[[], None] | None = None,
        *,
        child: bool = False,
    ) -> None:
        self.name = name
        self.save = save
        self.load = load
        self.check = check  # run after a load, untimed
        self.child = child  # runs as a child process: its CPU time is the children's
        self.save_gbps: list[float] = []
        self.cpu_per_gb: list[float] = []
        self.peak_rss: list[int] = []
        self.load_gbps: list[float] = []
        self.in_flight: list[float] = []  # write requests the disk had in flight, on average over the save
        self.request_kib: list[float] = []  # average write request the disk saw
        self.load_in_flight: list[float] = []  # the same for the load's read requests
        self.load_request_kib: list[float] = []


def build_methods(
    sd: dict[str, Any], size: int, target: dict[str, Any], threads: list[int], workdir: str, fio: Fio | None
) -> list[Method]:
    writer = FastPersistWriter(workdir)  # reused across saves, as in a training loop
    reader = FastPersistReader(workdir)

    def fp_save(path: str) -> None:
        writer.reset(path)
        dcp.save(sd, storage_writer=writer, no_dist=True)

    def fp_load(path: str) -> None:
        reader.reset(path)
        dcp.load(target, storage_reader=reader, no_dist=True)

    def fp_check() -> None:
        bad = [k for k, v in sd.items() if isinstance(v, torch.Tensor) and not torch.equal(v, target[k])]
        if bad:
            raise AssertionError(f"fp-dcp loaded wrong data for {bad[:3]}")

    def fs_save(n: int) -> Callable[[str], None]:
        return lambda path: dcp.save(sd, storage_writer=dcp.FileSystemWriter(path, thread_count=n), no_dist=True)

    def fs_load(path: str) -> None:
        dcp.load(target, storage_reader=dcp.FileSystemReader(path), no_dist=True)

    def torch_save(path: str) -> None:
        torch.save(sd, path)
        fsync_path(path)

    def torch_load(path: str) -> None:
        torch.load(path, weights_only=False)

    def fio_run(limit: Fio, rw: str) -> Callable[[str], None]:
        def run(path: str) -> None:
            limit.run(path, rw, size)

        return run

    def dd(path: str) -> None:
        blocks = -(-size // (16 * MiB))
        subprocess.run(
            ["dd", "if=/dev/zero", f"of={path}", "oflag=direct", "bs=16M", f"count={blocks}", "conv=fsync"],
            check=True,
            capture_output=True,
        )

    methods = [Method("fp-dcp", fp_save, fp_load, check=fp_check)]
    methods += [Method(f"FileSystemWriter t={n}", fs_save(n), fs_load if n == 1 else None) for n in threads]
    methods += [Method("torch.save", torch_save, torch_load)]
    if fio is not None:
        methods.append(Method(fio.label, fio_run(fio, "write"), fio_run(fio, "read"), child=True))
    methods.append(Method(DD, dd, None, child=True))
    return methods


def run(size_gb: float, directory: str, repeats: int, threads: list[int]) -> dict[str, Any]:
    warnings.filterwarnings("ignore")  # DCP warns that no process group is initialised
    sd = llm_state_dict(int(size_gb * GB))
    size = tensor_bytes(sd)
    target = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else v) for k, v in sd.items()}
    workdir = tempfile.mkdtemp(prefix="fp-dcp-bench-", dir=directory)
    rss = PeakRSS()
    disk = disk_of(workdir)
    try:
        with reference() as fio:  # huge pages, where reserved, are given back when the run ends
            methods = build_methods(sd, size, target, threads, workdir, fio)
            for rep in range(repeats):
                for i, m in enumerate(methods):
                    path = os.path.join(workdir, f"{rep}-{i}")
                    who = resource.RUSAGE_CHILDREN if m.child else resource.RUSAGE_SELF
                    cpu0 = cpu_seconds(who)
                    with rss.watch():
                        seconds = _watched(disk, m.save, path, m.in_flight, m.request_kib)
                    m.save_gbps.append(size / seconds / GB)
                    m.cpu_per_gb.append((cpu_seconds(who) - cpu0) / (size / GB))
                    m.peak_rss.append(rss.peak - rss.start)
                    if m.load is not None:
                        evict(path)
                        seconds = _watched(disk, m.load, path, m.load_in_flight, m.load_request_kib, reads=True)
                        m.load_gbps.append(size / seconds / GB)
                        if m.check is not None:
                            m.check()
                    shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)
                    print(
                        f"  run {rep + 1}/{repeats} {m.name:<24} {m.save_gbps[-1]:6.2f} GB/s",
                        file=sys.stderr,
                        flush=True,
                    )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return report(methods, size, directory, fio)


def _watched(
    disk: str | None,
    step: Callable[[str], None],
    path: str,
    in_flight: list[float],
    kib: list[float],
    *,
    reads: bool = False,
) -> float:
    """Run ``step(path)`` and return its seconds; append the disk's requests in flight and their size (writes,
    or ``reads``) over it, where ``/proc/diskstats`` has the disk."""
    before = DiskCounters.read(disk)
    start = time.perf_counter()
    step(path)
    seconds = time.perf_counter() - start
    after = DiskCounters.read(disk)
    if before is not None and after is not None:
        depth, size = after.since(before, seconds, reads=reads)
        in_flight.append(depth)
        kib.append(size)
    return seconds


def report(methods: list[Method], size: int, directory: str, fio: Fio | None) -> dict[str, Any]:
    med = statistics.median
    rows = {
        m.name: {
            "save_gbps": med(m.save_gbps),
            "cpu_s_per_gb": med(m.cpu_per_gb),
            "peak_rss_growth_mib": max(m.peak_rss) / MiB,
            "load_gbps": med(m.load_gbps) if m.load_gbps else None,
            "in_flight": med(m.in_flight) if m.in_flight else None,
            "request_kib": med(m.request_kib) if m.request_kib else None,
            "load_in_flight": med(m.load_in_flight) if m.load_in_flight else None,
            "load_request_kib": med(m.load_request_kib) if m.load_request_kib else None,
            "runs_save_gbps": m.save_gbps,
        }
        for m in methods
    }
    by_name = {m.name: m for m in methods}
    fp, dd, torch_save = by_name["fp-dcp"], by_name[DD], by_name["torch.save"]
    limit = by_name[fio.label] if fio is not None else None
    stock = [m for m in methods if m.name.startswith("FileSystemWriter")]
    fs1 = stock[0]
    fs_best = max(stock, key=lambda m: med(m.save_gbps))
    ratios: dict[str, float | None] = {
        "save_vs_dd": med(fp.save_gbps) / med(dd.save_gbps),
        "save_vs_filesystemwriter_t1": med(fp.save_gbps) / med(fs1.save_gbps),
        "save_vs_filesystemwriter_best": med(fp.save_gbps) / med(fs_best.save_gbps),
        "save_vs_torch_save": med(fp.save_gbps) / med(torch_save.save_gbps),
        "cpu_vs_filesystemwriter_t1": med(fp.cpu_per_gb) / med(fs1.cpu_per_gb),
        "load_vs_filesystemreader": med(fp.load_gbps) / med(fs1.load_gbps),
        "peak_rss_growth_mib": max(fp.peak_rss) / MiB,
        "save_vs_fio": med(fp.save_gbps) / med(limit.save_gbps) if limit else None,
        "load_vs_fio": med(fp.load_gbps) / med(limit.load_gbps) if limit else None,
    }
    q = {k: v for k, v in ratios.items() if v is not None}
    # fio from huge-page buffers is the disk's limit; dd, one request at a time, only a floor
    reference_name, save_bar = ("fio", 1.0) if limit else ("dd", 0.85)
    bars = {
        f"save >= {save_bar} x {reference_name}": q[f"save_vs_{reference_name}"] >= save_bar,
        "save >= 3.5 x FileSystemWriter t=1": q["save_vs_filesystemwriter_t1"] >= 3.5,
        "save >= 2 x FileSystemWriter best": q["save_vs_filesystemwriter_best"] >= 2,
        "CPU-s/GB <= 1/3 FileSystemWriter t=1": q["cpu_vs_filesystemwriter_t1"] <= 1 / 3,
        "peak RSS <= state + 512 MiB": q["peak_rss_growth_mib"] <= 512,
        "load >= 2 x FileSystemReader": q["load_vs_filesystemreader"] >= 2,
    }
    if limit:
        bars["load >= 0.95 x fio"] = q["load_vs_fio"] >= 0.95
    return {
        "state_dict_bytes": size,
        "directory_fs": _filesystem(directory),
        "cache_eviction": "posix_fadvise DONTNEED" + (" + drop_caches" if os.geteuid() == 0 else ""),
        "engine": engine_info(directory),
        "cpus": os.cpu_count(),
        "fio": {"method": fio.label, "buffers": fio.buffers, "huge_pages": bool(fio.huge_page)} if fio else None,
        "methods": rows,
        "ratios": ratios,
        "bars": bars,
    }


def _filesystem(directory: str) -> str:
    out = subprocess.run(["df", "-T", directory], capture_output=True, text=True).stdout.splitlines()
    return out[-1].split()[1] if len(out) > 1 else "unknown"


def print_report(r: dict[str, Any], repeats: int) -> None:
    e = r["engine"]
    print(
        f"\nfp-dcp benchmark: {r['state_dict_bytes'] / GB:.2f} GB LLM-shaped state dict, "
        f"{r['directory_fs']} directory, "
        f"{r['cpus']} CPUs, median of {repeats} runs, every save fsynced"
    )
    print(
        f"engine: {e['engine']}{' (' + e['fallback_reason'] + ')' if e['fallback_reason'] else ''}, "
        f"O_DIRECT: {e.get('direct_io')}, alignment {e.get('alignment')}, CRC32C hardware: {e['crc32c_hardware']}"
    )
    print(f"loads read cold: {r['cache_eviction']}\n")
    print(
        f"{'method':<26}{'save GB/s':>10}{'CPU-s/GB':>10}{'+RSS MiB':>10}{'load GB/s':>11}"
        f"{'wr depth':>10}{'wr KiB':>8}{'rd depth':>10}{'rd KiB':>8}"
    )

    def cell(value: float | None, spec: str) -> str:
        return format(value, spec) if value is not None else "-"

    for name, row in r["methods"].items():
        disk = (
            f"{cell(row['in_flight'], '.1f'):>10}{cell(row['request_kib'], '.0f'):>8}"
            f"{cell(row['load_in_flight'], '.1f'):>10}{cell(row['load_request_kib'], '.0f'):>8}"
        )
        print(
            f"{name:<26}{row['save_gbps']:>10.2f}{row['cpu_s_per_gb']:>10.3f}{row['peak_rss_growth_mib']:>10.0f}"
            f"{cell(row['load_gbps'], '.2f'):>11}{disk}"
        )
    q = r["ratios"]
    if r["fio"] is not None:
        fio = r["fio"]
        limit = "the disk's limit" if fio["huge_pages"] else "below the disk's limit where 4 KiB pages cap requests"
        print(
            f"\nfp-dcp save = {q['save_vs_fio']:.2f} x fio, load = {q['load_vs_fio']:.2f} x fio "
            f"(fio from {fio['buffers']}: {limit})"
        )
    else:
        print("\nfio is not installed: dd is the only reference for the disk (apt-get install fio)")
    print(
        f"fp-dcp save = {q['save_vs_dd']:.2f} x dd, {q['save_vs_filesystemwriter_t1']:.2f} x FileSystemWriter t=1, "
        f"{q['save_vs_filesystemwriter_best']:.2f} x its best thread count, {q['save_vs_torch_save']:.2f} x torch.save"
    )
    print(
        f"fp-dcp CPU-s/GB = {q['cpu_vs_filesystemwriter_t1']:.2f} x FileSystemWriter t=1; "
        f"load = {q['load_vs_filesystemreader']:.2f} x FileSystemReader; "
        f"peak RSS during save = state dict + {q['peak_rss_growth_mib']:.0f} MiB"
    )
    print("(+RSS: growth of this process's resident memory during the save, over the state dict it already holds;")
    print(" wr depth, wr KiB: write requests the disk had queued on average during the save, and their average size;")
    print(" rd depth, rd KiB: the same for the load's reads; from /proc/diskstats: a shallow queue or small requests")
    print(" where fio keeps the disk busier is lost speed)")
    for bar, ok in r["bars"].items():
        print(f"  [{'ok' if ok else 'MISSED'}] {bar}")


def main(argv: list[str] | None = None, prog: str = "fp-dcp bench") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=2.0, help="state dict size in GB (default 2)")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="directory to write in (default: the temp dir)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each method, interleaved (default 3)")
    ap.add_argument("--threads", default="1,2,4", help="FileSystemWriter thread counts; the first is the baseline")
    ap.add_argument("--json", help="also write the results as JSON to this file")
    ap.add_argument("--plot", metavar="PNG", help="also draw the GB/s bars into this PNG file (needs matplotlib)")
    args = ap.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]
    if args.plot:
        from .plot import plot_bench, require_matplotlib

        require_matplotlib()  # before the run, not after minutes of it
    result = run(args.size_gb, args.dir, args.repeats, threads)
    print_report(result, args.repeats)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if args.plot:
        plot_bench(result, args.plot)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
