#!/usr/bin/env python3
"""One process saving to a disk: fp-dcp against fio, FileSystemWriter (and DeepSpeed FastPersist), with the depth
of the device's queue, side by side.

    sudo .venv/bin/python benchmarks/save_depth_bench.py [--rounds 3] [--dir DIR] [--layers 86] [--fsw]
    python benchmarks/save_depth_bench.py --state small --fsw --fsw-threads 1 --rounds 5 [--dir DIR]

The workload of a user on a slow or high-latency disk (``--state depth``,
the default): 86 layers, each a 4096x4096 ``randn`` weight (float32 and
bfloat16 alternating) and two 4096-element float32 vectors (4.3 GB). With
``--state small``: 20 float32 tensors of 16 MiB (335 MB), where a save's
fixed costs show (this was ``small_state_bench.py``, whose figure was
fp-dcp against ``FileSystemWriter`` with its default single thread:
``--fsw --fsw-threads 1``). A new writer for every save,
``dcp.save(..., no_dist=True)``; ``os.sync()`` and (as root)
``drop_caches`` before each timed step. The disk's limit is fio writing a
file of the same size in the same directory (``--bs=8M --iodepth=16
--ioengine=io_uring --direct=1 --end_fsync=1``) from buffers in huge pages
(``fp_dcp.tools.fio``: reserved as root for the run and given back; where
they cannot be had, fio's plain buffers, and the first line says why),
timed as a whole process; where fio is not installed the run goes on
without it. The methods alternate, ``--rounds`` times, in one run.

Per save it reports GB/s, seconds, CPU-seconds per GB (this process and its
children, user + system), and what the disk saw (``fp_dcp.io.diskstats``):
the requests in flight on average and the average write request; then each
method's median, and fp-dcp's ratio to fio and to ``FileSystemWriter``.

With ``--deepspeed`` it adds DeepSpeed's FastPersist (``torch.save`` into
``FastFileWriter``: libaio, O_DIRECT, 8 MiB blocks, depth 8, a 64 MiB
double buffer), when ``deepspeed`` is importable and its
``AsyncIOBuilder`` builds (``DS_ACCELERATOR=cpu``); ``docs/benchmarks.md``
says how to install it. With ``--fsw`` it adds ``FileSystemWriter``
(``--fsw-threads``, 4 by default).
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import tempfile
import warnings
from collections.abc import Callable

import torch
import torch.distributed.checkpoint as dcp

from fp_dcp import FastPersistWriter
from fp_dcp.io.device import disk_of
from fp_dcp.io.diskstats import DiskCounters
from fp_dcp.io.files import fsync_path
from fp_dcp.testing.measure import GB, quiesce, timed
from fp_dcp.tools.fio import reference

MiB = 1 << 20


def state_dict(layers: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    sd: dict[str, torch.Tensor] = {}
    for i in range(layers):
        dtype = torch.float32 if i % 2 == 0 else torch.bfloat16
        sd[f"layers.{i}.weight"] = torch.randn(4096, 4096, generator=g).to(dtype)
        sd[f"layers.{i}.norm_a"] = torch.randn(4096, generator=g)
        sd[f"layers.{i}.norm_b"] = torch.randn(4096, generator=g)
    return sd


def small_state() -> dict[str, torch.Tensor]:
    """20 float32 tensors of 16 MiB (335 MB)."""
    g = torch.Generator().manual_seed(0)
    return {f"t{i}": torch.randn(4 * MiB, generator=g) for i in range(20)}


def deepspeed_save() -> Callable[[dict, str], None] | None:
    """DeepSpeed FastPersist's save (torch.save into FastFileWriter), or None where it cannot run here."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        from deepspeed.io import FastFileWriter, FastFileWriterConfig
        from deepspeed.ops.op_builder import AsyncIOBuilder
    except ImportError as e:
        print(f"DeepSpeed: not importable ({e})")
        return None
    import deepspeed.io.fast_file_writer as ffw

    class Utils:
        """FastFileWriter loads DeepSpeed's C++ utils, which have no CPU build, for this one helper."""

        @staticmethod
        def cast_to_byte_tensor(t: torch.Tensor | list[torch.Tensor]) -> torch.Tensor | list[torch.Tensor]:
            if isinstance(t, list):
                return [x.reshape(-1).view(torch.uint8) for x in t]
            return t.reshape(-1).view(torch.uint8)

    ffw.UtilsBuilder = lambda: type("Loader", (), {"load": staticmethod(lambda: Utils)})()
    aio = AsyncIOBuilder().load(verbose=False)
    handle = aio.aio_handle(
        block_size=8 * MiB, queue_depth=8, single_submit=False, overlap_events=True, intra_op_parallelism=1
    )
    pinned = torch.zeros(64 * MiB, dtype=torch.uint8)  # page-locking is for device copies

    def save(sd: dict, path: str) -> None:
        config = FastFileWriterConfig(
            dnvme_handle=handle, pinned_tensor=pinned, double_buffer=True, num_parallel_writers=1, writer_rank=0
        )
        writer = FastFileWriter(file_path=path, config=config)
        torch.save(sd, writer)
        writer.close()
        fsync_path(path)

    return save


def run_rounds(
    methods: dict[str, Callable[[str], object]], rounds: int, size: int, base: str, disk: str | None
) -> dict[str, list[float]]:
    """Every method's save, in turn, ``rounds`` times; GB/s of each, printed with the disk's view as they come."""
    gbps: dict[str, list[float]] = {name: [] for name in methods}
    try:
        for r in range(rounds):
            for name, save in methods.items():
                path = os.path.join(base, f"r{r}-{name.split()[0]}")
                quiesce()
                before = DiskCounters.read(disk)
                took = timed(functools.partial(save, path), children=True)
                after = DiskCounters.read(disk)
                depth = ""
                if before and after:
                    flight, kib = after.since(before, took.seconds)
                    depth = f", in flight {flight:.1f}, req {kib:.0f} KiB"
                gbps[name].append(took.gbps(size))
                line = (
                    f"{gbps[name][-1]:.3f} GB/s ({took.seconds:.3f} s), {took.cpu_s_per_gb(size):.3f} CPU-s/GB{depth}"
                )
                print(f"round {r + 1} {name}: {line}", flush=True)
                shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return gbps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--state", choices=["depth", "small"], default="depth", help="the state saved (above)")
    parser.add_argument("--layers", type=int, default=86, help="layers of the depth state")
    parser.add_argument("--fsw", action="store_true", help="add FileSystemWriter")
    parser.add_argument("--fsw-threads", type=int, default=4, help="FileSystemWriter's thread_count (default 4)")
    parser.add_argument("--deepspeed", action="store_true", help="add DeepSpeed FastPersist")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    sd = state_dict(args.layers) if args.state == "depth" else small_state()
    size = sum(t.nbytes for t in sd.values())

    def fp(path: str) -> None:
        dcp.save(sd, storage_writer=FastPersistWriter(path), no_dist=True)

    fsw = f"FileSystemWriter t={args.fsw_threads}"
    with reference(depth=16) as limit:  # huge pages, where reserved, are given back when the rounds end
        base = tempfile.mkdtemp(prefix="fp-dcp-depth-", dir=args.dir)  # removed by run_rounds
        disk = disk_of(base)
        methods: dict[str, Callable[[str], object]] = {"fp-dcp": fp}
        if limit is not None:
            methods["fio"] = lambda path: limit.run(path, "write", size)
        if args.fsw:
            methods[fsw] = lambda path: dcp.save(
                sd, storage_writer=dcp.FileSystemWriter(path, thread_count=args.fsw_threads), no_dist=True
            )
        if args.deepspeed and (ds := deepspeed_save()) is not None:
            methods["DeepSpeed FastPersist"] = lambda path: ds(sd, path)
        fio = f"fio from {limit.buffers}" if limit else "no fio (apt-get install fio)"
        print(f"{size / GB:.2f} GB, {len(sd)} tensors, disk {disk}, {args.rounds} rounds, {fio}")
        gbps = run_rounds(methods, args.rounds, size, base, disk)
    medians = {name: statistics.median(v) for name, v in gbps.items()}
    print("medians: " + ", ".join(f"{n} {m:.3f} GB/s ({size / GB / m:.3f} s)" for n, m in medians.items()))
    for reference_name in ("fio", fsw):
        if reference_name in medians:
            print(f"fp-dcp: {medians['fp-dcp'] / medians[reference_name]:.2f}x {reference_name}")


if __name__ == "__main__":
    main()
