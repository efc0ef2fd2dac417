"""What ``fp-dcp bench`` reports: each method's medians, the ratios between methods, the bars, the printed table."""

from __future__ import annotations

import os
import subprocess
from typing import Any

from .. import engine_info
from .._native import _cio
from ..units import MiB
from .bench_method import Method
from .fio import Fio

__all__ = ["GB", "DD", "NULL", "MEMORY", "DISK", "TARGETS", "TMPFS", "tmpfs_fio_name", "report", "print_report"]

GB = 1e9
DD = "dd oflag=direct"
NULL = "fp-dcp, null sink"
MEMORY = "fresh memory, first touch"
DISK = "disk"  # a load that fills no targets: fio's read
TARGETS = ("fresh", "touched")
TMPFS = "fp-dcp, tmpfs"


def tmpfs_fio_name(jobs: int) -> str:
    return f"fio --numjobs={jobs}, tmpfs"


def report(methods: list[Method], size: int, directory: str, fio: Fio | None) -> dict[str, Any]:
    rows = {}
    for m in methods:
        saved = m.saved.summary()
        rows[m.name] = {
            "save_gbps": saved["gbps"],
            "cpu_s_per_gb": saved["cpu_s_per_gb"],
            "peak_rss_growth_mib": max(m.peak_rss) / MiB if m.save is not None else None,
            "save_in_flight": saved["in_flight"],
            "save_request_kib": saved["request_kib"],
            "runs_save_gbps": saved["runs_gbps"],
            "loads": {kind: runs.summary() for kind, runs in m.loaded.items()},
        }

    def save(name: str) -> float:
        return float(rows[name]["save_gbps"])

    def load(name: str, kind: str) -> float:
        return float(rows[name]["loads"][kind]["gbps"])

    fp = rows["fp-dcp"]
    limit = fio.label if fio is not None else None
    stock = [m.name for m in methods if m.name.startswith("FileSystemWriter")]
    fs1, fs_best = stock[0], max(stock, key=save)
    ratios: dict[str, float | None] = {
        "save_vs_dd": save("fp-dcp") / save(DD),
        "save_vs_filesystemwriter_t1": save("fp-dcp") / save(fs1),
        "save_vs_filesystemwriter_best": save("fp-dcp") / save(fs_best),
        "save_vs_torch_save": save("fp-dcp") / save("torch.save"),
        "cpu_vs_filesystemwriter_t1": fp["cpu_s_per_gb"] / rows[fs1]["cpu_s_per_gb"],
        "peak_rss_growth_mib": fp["peak_rss_growth_mib"],
        "save_vs_fio": save("fp-dcp") / save(limit) if limit else None,
        "null_sink_vs_save": save(NULL) / save("fp-dcp"),
    }
    for kind in TARGETS:
        ratios[f"load_{kind}_vs_filesystemreader"] = load("fp-dcp", kind) / load(fs1, kind)
        ratios[f"load_{kind}_vs_fio"] = load("fp-dcp", kind) / load(limit, DISK) if limit else None
        ratios[f"load_{kind}_cpu_s_per_gb"] = fp["loads"][kind]["cpu_s_per_gb"]
    tmpfs_fio = next((name for name in rows if name.startswith("fio --numjobs=")), None)
    if TMPFS in rows and tmpfs_fio is not None:  # a memory filesystem: the pipeline against fio, no disk between
        ratios["tmpfs_save_vs_fio"] = save(TMPFS) / save(tmpfs_fio)
        for kind in TARGETS:
            ratios[f"tmpfs_load_{kind}_vs_fio"] = load(TMPFS, kind) / load(tmpfs_fio, DISK)
    if MEMORY in rows:  # fresh targets are bounded by the memory's first touch as well as by the disk
        first_touch = load(MEMORY, "fresh")
        ratios["load_fresh_vs_first_touch"] = load("fp-dcp", "fresh") / first_touch
        slower = min(first_touch, load(limit, DISK)) if limit else first_touch
        ratios["load_fresh_vs_slower_limit"] = load("fp-dcp", "fresh") / slower
        if TMPFS in rows and tmpfs_fio is not None:
            ratios["tmpfs_load_fresh_vs_slower_limit"] = load(TMPFS, "fresh") / min(first_touch, load(tmpfs_fio, DISK))
    q = {k: v for k, v in ratios.items() if v is not None}
    # fio from huge-page buffers is the disk's limit; dd, one request at a time, only a floor
    reference_name, save_bar = ("fio", 1.0) if limit else ("dd", 0.85)
    bars = {
        f"save >= {save_bar} x {reference_name}": q[f"save_vs_{reference_name}"] >= save_bar,
        "save >= 3.5 x FileSystemWriter t=1": q["save_vs_filesystemwriter_t1"] >= 3.5,
        "save >= 2 x FileSystemWriter best": q["save_vs_filesystemwriter_best"] >= 2,
        "CPU-s/GB <= 1/3 FileSystemWriter t=1": q["cpu_vs_filesystemwriter_t1"] <= 1 / 3,
        "peak RSS <= state + 512 MiB": q["peak_rss_growth_mib"] <= 512,
    }
    for kind in TARGETS:
        bars[f"load ({kind} targets) >= 2 x FileSystemReader"] = q[f"load_{kind}_vs_filesystemreader"] >= 2
        if limit:
            bars[f"load ({kind} targets) >= 0.95 x fio"] = q[f"load_{kind}_vs_fio"] >= 0.95
        bars[f"load ({kind} targets) CPU-s/GB <= 0.15"] = q[f"load_{kind}_cpu_s_per_gb"] <= 0.15
    if "tmpfs_save_vs_fio" in q:
        bars[f"tmpfs save >= 0.9 x {tmpfs_fio}"] = q["tmpfs_save_vs_fio"] >= 0.9
        bars[f"tmpfs load (touched targets) >= 0.9 x {tmpfs_fio}"] = q["tmpfs_load_touched_vs_fio"] >= 0.9
        if "tmpfs_load_fresh_vs_slower_limit" in q:
            bars[f"tmpfs load (fresh targets) >= 0.9 x min({tmpfs_fio}, first touch)"] = (
                q["tmpfs_load_fresh_vs_slower_limit"] >= 0.9
            )
    if "load_fresh_vs_slower_limit" in q:
        bars[f"load (fresh targets) >= 0.95 x {'min(fio, first touch)' if limit else 'first touch'}"] = (
            q["load_fresh_vs_slower_limit"] >= 0.95
        )
    return {
        "state_dict_bytes": size,
        "directory_fs": _filesystem(directory),
        "cache_eviction": "posix_fadvise DONTNEED" + (" + drop_caches" if os.geteuid() == 0 else ""),
        "engine": engine_info(directory) | {"crc32c_copy": _cio.COPY_CRC32C_ENGINE},
        "cpus": os.cpu_count(),
        "fio": {"method": fio.label, "buffers": fio.buffers, "huge_pages": bool(fio.huge_page)} if fio else None,
        "methods": rows,
        "ratios": ratios,
        "bars": bars,
    }


def _filesystem(directory: str) -> str:
    out = subprocess.run(["df", "-T", directory], capture_output=True, text=True).stdout.splitlines()
    return out[-1].split()[1] if len(out) > 1 else "unknown"


def _cell(value: float | None, spec: str) -> str:
    return format(value, spec) if value is not None else "-"


def print_report(r: dict[str, Any], repeats: int) -> None:
    e = r["engine"]
    print(
        f"\nfp-dcp benchmark: {r['state_dict_bytes'] / GB:.2f} GB LLM-shaped state dict, "
        f"{r['directory_fs']} directory, "
        f"{r['cpus']} CPUs, median of {repeats} runs, every save fsynced"
    )
    print(
        f"engine: {e['engine']}{' (' + e['fallback_reason'] + ')' if e['fallback_reason'] else ''}, "
        f"O_DIRECT: {e.get('direct_io')}, alignment {e.get('alignment')}, CRC32C hardware: {e['crc32c_hardware']}, "
        f"copies checksummed by {e.get('crc32c_copy')}"
    )
    print(f"loads read cold ({r['cache_eviction']}), each through a reader made anew\n")
    print(f"{'save':<28}{'GB/s':>8}{'CPU-s/GB':>10}{'+RSS MiB':>10}{'wr depth':>10}{'wr KiB':>8}")
    for name, row in r["methods"].items():
        if row["save_gbps"] is None:
            continue  # a reference for loads only
        print(
            f"{name:<28}{row['save_gbps']:>8.2f}{row['cpu_s_per_gb']:>10.3f}{row['peak_rss_growth_mib']:>10.0f}"
            f"{_cell(row['save_in_flight'], '.1f'):>10}{_cell(row['save_request_kib'], '.0f'):>8}"
        )
    print(f"\n{'load (cold)':<28}{'targets':>8}{'GB/s':>8}{'CPU-s/GB':>10}{'rd depth':>10}{'rd KiB':>8}")
    for name, row in r["methods"].items():
        for kind, load in row["loads"].items():
            print(
                f"{name:<28}{kind:>8}{load['gbps']:>8.2f}{load['cpu_s_per_gb']:>10.3f}"
                f"{_cell(load['in_flight'], '.1f'):>10}{_cell(load['request_kib'], '.0f'):>8}"
            )
    q = r["ratios"]
    if r["fio"] is not None:
        fio = r["fio"]
        limit = "the disk's limit" if fio["huge_pages"] else "below the disk's limit where 4 KiB pages cap requests"
        print(
            f"\nfp-dcp save = {q['save_vs_fio']:.2f} x fio; load = {q['load_fresh_vs_fio']:.2f} x fio into fresh "
            f"targets, {q['load_touched_vs_fio']:.2f} x into touched ones (fio from {fio['buffers']}: {limit})"
        )
    else:
        print("\nfio is not installed: dd is the only reference for the disk (apt-get install fio)")
    if "load_fresh_vs_first_touch" in q:
        print(
            f"fresh memory faults in at {r['methods'][MEMORY]['loads']['fresh']['gbps']:.2f} GB/s here (first touch): "
            f"fp-dcp's load into fresh targets = {q['load_fresh_vs_first_touch']:.2f} x that, "
            f"{q['load_fresh_vs_slower_limit']:.2f} x the slower of it and the disk"
        )
    print(
        f"fp-dcp save = {q['save_vs_dd']:.2f} x dd, {q['save_vs_filesystemwriter_t1']:.2f} x FileSystemWriter t=1, "
        f"{q['save_vs_filesystemwriter_best']:.2f} x its best thread count, {q['save_vs_torch_save']:.2f} x torch.save"
    )
    print(
        f"fp-dcp load = {q['load_fresh_vs_filesystemreader']:.2f} x FileSystemReader into fresh targets, "
        f"{q['load_touched_vs_filesystemreader']:.2f} x into touched ones"
    )
    print(
        f"fp-dcp save CPU-s/GB = {q['cpu_vs_filesystemwriter_t1']:.2f} x FileSystemWriter t=1's; "
        f"peak RSS during save = state dict + {q['peak_rss_growth_mib']:.0f} MiB"
    )
    print(
        f"the pipeline alone (null sink: stores nothing) saves at {q['null_sink_vs_save']:.2f} x fp-dcp's save "
        "to this disk"
    )
    if "tmpfs_save_vs_fio" in q:
        print(
            f"into tmpfs (memory; each writer after the pages were recycled): save = {q['tmpfs_save_vs_fio']:.2f} x "
            f"fio, load into touched targets = {q['tmpfs_load_touched_vs_fio']:.2f} x fio, into fresh ones = "
            f"{q['tmpfs_load_fresh_vs_fio']:.2f} x fio"
            + (
                f", {q['tmpfs_load_fresh_vs_slower_limit']:.2f} x the slower of it and the first touch"
                if "tmpfs_load_fresh_vs_slower_limit" in q
                else ""
            )
        )
    print("(+RSS: growth of this process's resident memory during the save, over the state dict it already holds;")
    print(" fresh targets: made just before the load and never written (torch.empty_like, to_empty()); touched:")
    print(" written before; first touch: as many bytes of fresh memory faulted in by the load's helper threads")
    print(" right after fp-dcp's load, its targets held; wr/rd depth, KiB: requests the disk had queued on average,")
    print(" and their average size, from /proc/diskstats: a shallow queue or small requests where fio keeps the")
    print(" disk busier is lost speed)")
    for bar, ok in r["bars"].items():
        print(f"  [{'ok' if ok else 'MISSED'}] {bar}")
