"""Benchmark: fp-dcp against torch's FileSystemWriter/Reader, torch.save/load and the raw disk.

    fp-dcp bench [--size-gb 2] [--dir DIR] [--repeats 3] [--json out.json]

Saves (and loads) an LLM-shaped state dict (bf16 weights in [4096, 11008]-ish
matrices, two [32000, 4096] embeddings, an fp32 master copy of one, many small
fp32 norms, scalars and a pickled object; ``fp_dcp.tools.workload``) with each
method in turn, A B C A B C ..., every save fsynced, all in one run so the
ratios are fair on a noisy machine. The disk's limit is fio writing then
reading a file of the same size in the same directory with O_DIRECT, 8 MiB
requests and 32 in flight (io_uring), the write ending with an fsync, each
timed as a whole process like the other methods, its buffers in huge pages
(``fp_dcp.tools.fio``: reserved for the run as root and given back; where they
cannot be had, fio's plain buffers, and the report says why); ``dd
if=/dev/zero oflag=direct bs=16M conv=fsync`` (one request at a time) is a
second reference. Without fio (Debian package ``fio``, which ``make``
installs) the dd line is the only one.

Loads are cold (the checkpoint's pages evicted: posix_fadvise DONTNEED per
file, plus drop_caches when root), each through a reader made anew, as the
README's example does, into both kinds of target a user has: *fresh* ones
(``torch.empty_like`` just before the load, as a meta-device model's
``to_empty()`` makes them: nobody has written them, every page's first write
a fault) and *touched* ones (written before, as a model that trained).
Right after each fp-dcp load into fresh targets, while they are still held,
as many bytes of fresh memory are faulted in the way a load's helpers do it
(``io.prefault``): the rate at which this machine hands out memory nobody
has written, a limit of every load into fresh targets beside the disk's. On
a VM whose host takes back the guest's free memory (free page reporting, a
balloon), memory the guest has not used lately faults in several times
slower than memory it has (``docs/benchmarks.md``).

A save into fp-dcp's null sink (``IOConfig(engine="null")``: writes complete
at once and store nothing, and no checkpoint is published) shows what the
pipeline itself can do, with the disk out of the way. Where ``--tmpfs`` names
a memory filesystem (default ``/dev/shm``, if it is one with room for the
state), fp-dcp also saves there and loads back into fresh and into touched
targets (from memory: no cache to drop), against ``fio
--numjobs=host_threads`` (buffered, its files not preallocated) writing and
reading as many bytes there; every
writer into tmpfs starts right after as many bytes were written there and
removed (``workload.recycle``: on a VM, memory unused for a few seconds
costs the host a fault at its next touch, and the two would otherwise meet
different memory).

Reported per method: median GB/s, CPU-seconds per GB (user + system, all
threads), the growth of resident memory during the save (over the state dict
already held), and per save and load the disk's own view
(``fp_dcp.io.diskstats``): the requests it had in flight on average and
their average size, so a queue shallower than fio's, or smaller requests,
is visible on any disk.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import mmap
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from .. import FastPersistReader, FastPersistWriter, IOConfig
from ..io.device import disk_of, filesystem_of
from ..io.diskstats import DiskCounters
from ..io.files import fsync_path
from ..io.prefault import Prefaulter, populate_supported
from ..units import MiB
from .bench_method import Method, Runs, Step
from .bench_report import DD, DISK, GB, MEMORY, NULL, TARGETS, TMPFS, print_report, report, tmpfs_fio_name
from .fio import DEPTH, Fio, Jobs, reference
from .workload import PeakRSS, cpu_seconds, evict, fresh_allocations, llm_state_dict, recycle, targets, tensor_bytes


def build_methods(
    sd: dict[str, Any], size: int, threads: list[int], workdir: str, fio: Fio | None, tmpfs: str | None = None
) -> list[Method]:
    writer = FastPersistWriter(workdir)  # reused across saves, as in a training loop
    null_writer = FastPersistWriter(workdir, config=IOConfig(engine="null"))
    touched = targets(sd, "touched")  # one model, written before, loaded into again and again
    last: dict[str, Any] = {}  # what the last load filled, for the check

    def fp_save(path: str) -> None:
        writer.reset(path)
        dcp.save(sd, storage_writer=writer, no_dist=True)

    def null_save(path: str) -> None:
        null_writer.reset(path)
        dcp.save(sd, storage_writer=null_writer, no_dist=True)

    def load_into(kind: str, make_reader: Callable[[str], Any]) -> Callable[[str], None]:
        def load(path: str) -> None:
            target = targets(sd, "fresh") if kind == "fresh" else touched
            dcp.load(target, storage_reader=make_reader(path), no_dist=True)  # a reader made anew, as users do
            last["target"] = target

        return load

    def check() -> None:
        target = last.pop("target")
        bad = [k for k, v in sd.items() if isinstance(v, torch.Tensor) and not torch.equal(v, target[k])]
        if bad:
            raise AssertionError(f"fp-dcp loaded wrong data for {bad[:3]}")

    def fs_save(n: int) -> Callable[[str], None]:
        return lambda path: dcp.save(sd, storage_writer=dcp.FileSystemWriter(path, thread_count=n), no_dist=True)

    def torch_save(path: str) -> None:
        torch.save(sd, path)
        fsync_path(path)

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

    fp_loads = {kind: load_into(kind, FastPersistReader) for kind in TARGETS}
    memory = Method(MEMORY, None, {"fresh": first_touch(size)}) if populate_supported() else None
    beside = {"fresh": memory} if memory is not None else None
    methods = [Method("fp-dcp", fp_save, fp_loads, check=check, beside=beside)]
    methods += [memory] if memory is not None else []
    methods.append(Method(NULL, null_save))
    for n in threads:
        fs_loads = {kind: load_into(kind, dcp.FileSystemReader) for kind in TARGETS} if n == threads[0] else None
        methods.append(Method(f"FileSystemWriter t={n}", fs_save(n), fs_loads))
    methods.append(Method("torch.save", torch_save, {"fresh": lambda path: torch.load(path, weights_only=False)}))
    if fio is not None:
        methods.append(Method(fio.label, fio_run(fio, "write"), {DISK: fio_run(fio, "read")}, child=True))
    methods.append(Method(DD, dd, child=True))
    if tmpfs is not None:
        methods += tmpfs_methods(sd, size, tmpfs, fio, fp_loads, check)
    return methods


def tmpfs_fio_jobs() -> int:
    """fio's jobs on tmpfs: as many as fp-dcp's host threads, which copy there in parallel."""
    return IOConfig().threads()


def tmpfs_methods(
    sd: dict[str, Any],
    size: int,
    tmpfs: str,
    fio: Fio | None,
    loads: dict[str, Callable[[str], None]],
    check: Callable[[], None],
) -> list[Method]:
    """fp-dcp saving into ``tmpfs`` and loading into each kind of target (``loads``), and fio doing the same
    there."""
    writer = FastPersistWriter(tmpfs)

    def place(path: str) -> str:
        return os.path.join(tmpfs, os.path.basename(path))

    def save(path: str) -> None:
        writer.reset(path)
        dcp.save(sd, storage_writer=writer, no_dist=True)

    def recycled(path: str) -> None:
        os.makedirs(path)
        recycle(path, size)

    methods = [Method(TMPFS, save, loads, check=check, place=place, prepare=recycled)]
    if fio is not None:
        n = tmpfs_fio_jobs()
        jobs = Jobs(fio.depth, fio.block, fio.huge_page, fio.why_plain, jobs=n, direct=False, allocate_first=False)
        each = -(-size // jobs.jobs)

        def fio_step(rw: str) -> Step:
            return lambda path: jobs.run(path, rw, each).seconds  # fio's clock: its start-up left out

        fio_loads = {DISK: fio_step("read")}
        methods.append(
            Method(tmpfs_fio_name(n), fio_step("write"), fio_loads, child=True, place=place, prepare=recycled)
        )
    return methods


def faulted_in(size: int, prefaulter: Prefaulter) -> mmap.mmap:
    """A fresh anonymous mapping of ``size`` bytes, faulted in as a load's prefaulter faults in its targets."""
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = memoryview(memory)
    try:
        prefaulter.prepare(view).wait(size)
    finally:
        view.release()
    return memory


def first_touch(size: int) -> Callable[[str], None]:
    """Fault in ``size`` bytes of fresh anonymous memory as a load's prefaulter faults in its targets (the same
    threads, the same huge-page choice), then unmap them."""
    threads = IOConfig().threads()

    def touch(path: str) -> None:
        prefaulter = Prefaulter(threads)
        try:
            faulted_in(size, prefaulter).close()
        finally:
            prefaulter.close()

    return touch


def run(size_gb: float, directory: str, repeats: int, threads: list[int], tmpfs: str | None = None) -> dict[str, Any]:
    warnings.filterwarnings("ignore")  # DCP warns that no process group is initialised
    sd = llm_state_dict(int(size_gb * GB))
    size = tensor_bytes(sd)
    workdir = tempfile.mkdtemp(prefix="fp-dcp-bench-", dir=directory)
    memdir = tempfile.mkdtemp(prefix="fp-dcp-bench-", dir=tmpfs) if tmpfs else None
    rss = PeakRSS()
    disk = disk_of(workdir)
    try:
        # Huge pages, where reserved, are given back when the run ends; with tmpfs, for each of fio's jobs there
        # and a block more each for the page of alignment fio adds.
        with reference(depth=(DEPTH + 1) * tmpfs_fio_jobs() if memdir else DEPTH) as limit:
            fio = dataclasses.replace(limit, depth=DEPTH) if limit else None
            methods = build_methods(sd, size, threads, workdir, fio, memdir)
            for rep in range(repeats):
                for i, m in enumerate(methods):
                    if m.save is None:
                        continue  # a reference, timed beside a load
                    path = os.path.join(workdir, f"{rep}-{i}")
                    path, on = (m.place(path), None) if m.place else (path, disk)
                    if m.prepare is not None:
                        m.prepare(path)
                    with rss.watch():
                        _measure(m, m.save, path, m.saved, size, on)
                    m.peak_rss.append(rss.peak - rss.start)
                    for kind, load in m.loads.items():
                        evict(path)
                        _measure(m, load, path, m.loaded[kind], size, on, reads=True)
                        if kind in m.beside:
                            ref = m.beside[kind]
                            _measure(ref, ref.loads[kind], path, ref.loaded[kind], size, None, reads=True)
                        if m.check is not None:
                            m.check()
                    if os.path.exists(path):
                        shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)
                    print(
                        f"  run {rep + 1}/{repeats} {m.name:<26} {m.saved.gbps[-1]:6.2f} GB/s",
                        file=sys.stderr,
                        flush=True,
                    )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        if memdir:
            shutil.rmtree(memdir, ignore_errors=True)
    return report(methods, size, directory, fio)


def _measure(m: Method, step: Step, path: str, runs: Runs, size: int, disk: str | None, *, reads: bool = False) -> None:
    who = resource.RUSAGE_CHILDREN if m.child else resource.RUSAGE_SELF
    cpu = cpu_seconds(who)
    seconds = _watched(disk, step, path, runs.in_flight, runs.request_kib, reads=reads)
    runs.gbps.append(size / seconds / GB)
    runs.cpu_per_gb.append((cpu_seconds(who) - cpu) / (size / GB))


def _watched(
    disk: str | None,
    step: Step,
    path: str,
    in_flight: list[float],
    kib: list[float],
    *,
    reads: bool = False,
) -> float:
    """Run ``step(path)`` and return its seconds (a float it returns, else the call's); append the disk's requests
    in flight and their size (writes, or ``reads``) over it, where ``/proc/diskstats`` has the disk."""
    before = DiskCounters.read(disk)
    start = time.perf_counter()
    own = step(path)
    seconds = time.perf_counter() - start
    after = DiskCounters.read(disk)
    if before is not None and after is not None:
        depth, size = after.since(before, seconds, reads=reads)
        in_flight.append(depth)
        kib.append(size)
    return own if isinstance(own, float) else seconds  # other steps may return what they loaded or saved


def memory_directory(nbytes: float, candidate: str = "/dev/shm") -> str | None:
    """``candidate`` if it is a tmpfs with room for 2.5 x ``nbytes`` (a checkpoint, the pages recycled before a
    write, and slack), else None, saying why on stderr."""
    if not os.path.isdir(candidate) or filesystem_of(candidate) != "tmpfs":
        print(f"fp-dcp bench: no tmpfs row ({candidate} is not a tmpfs)", file=sys.stderr)
        return None
    st = os.statvfs(candidate)
    if st.f_bavail * st.f_frsize < 2.5 * nbytes:
        print(f"fp-dcp bench: no tmpfs row ({candidate} has less room than 2.5 x the state)", file=sys.stderr)
        return None
    return candidate


def main(argv: list[str] | None = None, prog: str = "fp-dcp bench") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=2.0, help="state dict size in GB (default 2)")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="directory to write in (default: the temp dir)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each method, interleaved (default 3)")
    ap.add_argument("--threads", default="1,2,4", help="FileSystemWriter thread counts; the first is the baseline")
    ap.add_argument(
        "--tmpfs",
        default="auto",
        help="a memory filesystem to save into and load from too, against fio there; '' for none "
        "(default auto: /dev/shm where it is a tmpfs with room for 2.5 times the state)",
    )
    ap.add_argument("--json", help="also write the results as JSON to this file")
    ap.add_argument("--plot", metavar="PNG", help="also draw the GB/s bars into this PNG file (needs matplotlib)")
    args = ap.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]
    if args.plot:
        from .plot import plot_bench, require_matplotlib

        require_matplotlib()  # before the run, not after minutes of it
    tmpfs = memory_directory(args.size_gb * GB) if args.tmpfs == "auto" else args.tmpfs or None
    fresh_allocations()  # every fresh target mapped afresh, as in a new process
    result = run(args.size_gb, args.dir, args.repeats, threads, tmpfs)
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
