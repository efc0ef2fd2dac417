"""Saves whose every byte the kernel copies (into tmpfs, or a disk's page cache): this checkout against another,
and fio writing as many bytes there, alternating.

    sudo .venv/bin/python benchmarks/copied_save_bench.py [--baseline ../other-checkout] [--gb 2] [--rounds 4]
        [--dir /dev/shm]

``--dir`` on a tmpfs: saves with each checkout's defaults (the kernel copies
into tmpfs also with O_DIRECT). Elsewhere: saves with ``direct_io=False``,
through the page cache, as on a filesystem that refuses O_DIRECT; every
save and fio run ends with an fsync, and the page cache is dropped after
each (as root). Each round runs every checkout (built in place) in a
process of its own, which saves the same Llama-shaped CPU state
(``fp_dcp.tools.workload``) ``SAVES`` times (environment, default 4) and
reports all but the first (which maps buffers and starts threads); then
fio, with ``--numjobs`` as many as fp-dcp's ``host_threads``, buffered,
writes as many bytes in all, as often. On tmpfs, before every save and
every fio run the directory takes the pages just given back by a removed
file of the state's size (``workload.recycle``), so that no writer pays for
memory its VM's host took back. fio's huge-page buffers are reserved as
root (``fp_dcp.tools.fio``). Printed: each run's GB/s as the rounds go, then
each writer's median GB/s and CPU-s/GB and its ratio to fio's. Run it with
this checkout's fp-dcp importable (``PYTHONPATH=.``, or installed in
place); the checkouts' children run as ``fp_dcp.testing.checkouts`` says.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

SAVES = int(os.environ.get("SAVES", "4"))

# The child runs with each checkout's fp-dcp: what it uses must be in the baseline too (not fp_dcp.testing).


def fresh_directory(directory: str, nbytes: int, memory: bool) -> None:
    """An empty ``directory``; on tmpfs holding the pages ``nbytes`` just gave back (``workload.recycle``), elsewhere
    with the page cache dropped (as root)."""
    from fp_dcp.tools.workload import recycle

    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    if memory:
        recycle(directory, nbytes)
    else:
        with contextlib.suppress(OSError), open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")


def timed(run: Callable[[], float | None], who: int) -> tuple[float, float]:
    """(seconds, CPU-seconds of ``who``, ``resource.RUSAGE_SELF`` or ``RUSAGE_CHILDREN``) of ``run``; the
    seconds ``run`` returns, where it does (fio's own clock), else the call's."""
    usage = resource.getrusage(who)
    cpu = usage.ru_utime + usage.ru_stime
    start = time.perf_counter()
    seconds = run()
    elapsed = time.perf_counter() - start
    usage = resource.getrusage(who)
    return seconds if seconds is not None else elapsed, usage.ru_utime + usage.ru_stime - cpu


def child(gb: float, directory: str, memory: bool) -> None:
    """Saves with the fp_dcp found first on sys.path; prints a JSON list of (GB/s, CPU-s/GB)."""
    import torch.distributed.checkpoint as dcp

    from fp_dcp import FastPersistWriter, IOConfig
    from fp_dcp.tools.workload import llm_state_dict

    warnings.filterwarnings("ignore")
    sd = llm_state_dict(int(gb * 1e9))
    size = sum(v.nbytes for v in sd.values() if hasattr(v, "nbytes"))
    config = IOConfig() if memory else IOConfig(direct_io=False)

    def save() -> None:
        dcp.save(sd, storage_writer=FastPersistWriter(directory, config=config), no_dist=True)

    runs = []
    for _ in range(SAVES):
        fresh_directory(directory, size, memory)
        seconds, cpu = timed(save, resource.RUSAGE_SELF)
        runs.append((size / seconds / 1e9, cpu / (size / 1e9)))
    shutil.rmtree(directory, ignore_errors=True)
    print(json.dumps(runs[1:]))


def fio_runs(gb: float, directory: str, jobs_count: int, memory: bool) -> list[tuple[float, float]]:
    from fp_dcp.tools.fio import DEPTH, Jobs, reference

    size = int(gb * 1e9)
    runs = []
    with reference(depth=(DEPTH + 1) * jobs_count) as limit:  # a block more per job: fio's alignment page
        if limit is None:
            return []
        jobs = Jobs(
            DEPTH, limit.block, limit.huge_page, limit.why_plain, jobs_count, direct=False, allocate_first=not memory
        )
        for _ in range(SAVES - 1):
            fresh_directory(directory, size, memory)
            seconds, cpu = timed(
                lambda: jobs.run(directory, "write", -(-size // jobs_count)).seconds, resource.RUSAGE_CHILDREN
            )
            runs.append((size / seconds / 1e9, cpu / (size / 1e9)))
    shutil.rmtree(directory, ignore_errors=True)
    return runs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", type=Path, help="another fp-dcp checkout, built in place")
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--dir", default="/dev/shm", help="a tmpfs, or a disk's directory (saved through its cache)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    from fp_dcp import IOConfig
    from fp_dcp.io.device import filesystem_of

    memory = filesystem_of(args.dir) == "tmpfs"
    directory = os.path.join(args.dir, "fp-dcp-copied-save-bench")
    if args.child:
        child(args.gb, directory, memory)
        return 0
    from fp_dcp.testing.checkouts import checkouts as both
    from fp_dcp.testing.checkouts import run_child

    jobs_count = IOConfig().threads()
    checkouts = both(args.baseline)
    fio_name = f"fio --numjobs={jobs_count}"
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in [*checkouts, fio_name]}
    for r in range(args.rounds):
        order = list(checkouts) if r % 2 == 0 else list(checkouts)[::-1]
        for name in order:
            argv = [__file__, "--child", "--gb", str(args.gb), "--dir", args.dir]
            runs[name] += [tuple(x) for x in run_child(name, checkouts[name], argv)]
        runs[fio_name] += fio_runs(args.gb, directory, jobs_count, memory)
        for name, results in runs.items():
            shown = " ".join(f"{g:.2f}" for g, _ in results[-(SAVES - 1) :])
            print(f"  round {r + 1} {name:<22} GB/s {shown}", file=sys.stderr)
    med = statistics.median
    where = "tmpfs" if memory else f"{filesystem_of(args.dir)} through the page cache (direct_io=False)"
    print(f"\nsaves into {where}, {args.gb:g} GB Llama-shaped CPU state, {args.rounds} rounds alternating, medians")
    print(f"{'writer':<24}{'GB/s':>8}{'CPU-s/GB':>10}{'x fio':>8}")
    fio = med(g for g, _ in runs[fio_name]) if runs[fio_name] else None
    for name, results in runs.items():
        if not results:
            print(f"{name:<24}{'(not installed)':>26}")
            continue
        gbps = med(g for g, _ in results)
        ratio = f"{gbps / fio:8.2f}" if fio else ""
        print(f"{name:<24}{gbps:>8.2f}{med(c for _, c in results):>10.3f}{ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
