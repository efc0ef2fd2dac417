#!/usr/bin/env python3
"""Loads of a replicated state on 4 gloo ranks: fp-dcp sharing on, sharing off, and torch's FileSystemReader.

    python benchmarks/load_sharing_bench.py [--gb 2] [--dir DIR] [--rounds 2] [--read-limit-mbps N]

A state of ``--gb`` GB (float32 tensors of 64 MiB) is saved once, by one
process, with fp-dcp and with torch's ``FileSystemWriter``. Then 4 ranks
each load all of it (what a new data-parallel job or an inference fleet
does), cold: the page cache is dropped before each load. Reported per
reader: wall time, the bytes the disk served (``/proc/diskstats`` of the
device holding the directory, summed over the load), and fp-dcp's own
counts (read from storage, received from peers). Rounds alternate.

With ``--read-limit-mbps`` (root) the checkpoints live on an ext4 loop
device whose reads the cgroup-v1 blkio throttle caps at that rate
(``scaling_bench.throttled_devices``): a disk, or a share of a filesystem,
slower than the machine can move bytes between ranks, where sharing is
meant to pay.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import tempfile

from scaling_bench import throttled_devices

from fp_dcp.io.device import disk_of
from fp_dcp.io.diskstats import DiskCounters
from fp_dcp.testing.measure import quiesce, timed
from fp_dcp.testing.ranks import run_node

MiB = 1 << 20


def state(gb: float):
    import torch

    n = max(1, int(gb * 1e9 / (64 * MiB)))
    return {f"layer{i}.w": torch.full((16 * MiB,), float(i)) for i in range(n)}


def load(rank: int, world: int, path: str, gb: float, reader: str) -> dict:
    import torch
    import torch.distributed.checkpoint as dcp

    from fp_dcp import FastPersistReader

    target = {k: torch.empty_like(v) for k, v in state(gb).items()}
    for v in target.values():
        v.zero_()  # touched: the load measures the disk and the network, not page faults
    r = FastPersistReader(path, share=reader == "shared") if reader != "stock" else dcp.FileSystemReader(path)
    seconds = timed(lambda: dcp.load(target, storage_reader=r), barrier=True).seconds
    ok = all(torch.equal(target[k], v) for k, v in state(gb).items())
    last = getattr(r, "last_load", None)
    return {
        "seconds": seconds,
        "ok": ok,
        "read": last.read_bytes if last else 0,
        "received": last.received_bytes if last else 0,
    }


def disk_read(disk: str | None) -> int:
    """Bytes read so far from ``disk`` (``fp_dcp.io.device.disk_of``)."""
    counters = DiskCounters.read(disk)
    if counters is None:
        raise RuntimeError(f"the disk {disk} is not in /proc/diskstats")
    return counters.sectors_read * 512


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--read-limit-mbps", type=int, default=0, help="cap the disk's reads (root)")
    args = parser.parse_args()
    import torch.distributed.checkpoint as dcp

    from fp_dcp import FastPersistWriter

    workdir = tempfile.mkdtemp(prefix="fp-dcp-share-bench-", dir=args.dir)
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, workdir, ignore_errors=True)
        base = workdir
        if args.read_limit_mbps:
            size_mb = int(2.2 * args.gb * 1000) + 256  # both checkpoints
            base = stack.enter_context(
                throttled_devices(1, workdir, size_mb, args.read_limit_mbps * 1_000_000, "read")
            )[0]
        fp, stock = os.path.join(base, "fp"), os.path.join(base, "stock")
        dcp.save(state(args.gb), storage_writer=FastPersistWriter(fp), no_dist=True)
        dcp.save(state(args.gb), storage_writer=dcp.FileSystemWriter(stock), no_dist=True)
        size = sum(os.path.getsize(os.path.join(fp, n)) for n in os.listdir(fp))
        disk_name = disk_of(base)
        rows: dict[str, list[tuple[float, int, list[dict]]]] = {"shared": [], "unshared": [], "stock": []}
        for _ in range(args.rounds):
            for reader, path in (("shared", fp), ("unshared", fp), ("stock", stock)):
                quiesce()
                before = disk_read(disk_name)
                results = run_node(4, load, path, args.gb, reader)
                disk = disk_read(disk_name) - before
                assert all(r["ok"] for r in results), (reader, results)
                rows[reader].append((max(r["seconds"] for r in results), disk, results))
        print(
            f"4 ranks each loading all of a {size / 1e9:.2f} GB replicated state, cold cache, "
            f"median of {args.rounds} alternating rounds:"
        )
        for reader, label in (
            ("shared", "fp-dcp, sharing on"),
            ("unshared", "fp-dcp, sharing off"),
            ("stock", "torch FileSystemReader"),
        ):
            seconds = statistics.median(r[0] for r in rows[reader])
            disk = statistics.median(r[1] for r in rows[reader])
            received = statistics.median(sum(x["received"] for x in r[2]) for r in rows[reader])
            print(
                f"  {label:<24} {seconds:6.2f} s  disk read {disk / size:4.2f}x the checkpoint  "
                f"received from peers {received / 1e9:5.2f} GB"
            )
        on = statistics.median(r[0] for r in rows["shared"])
        print(
            f"  wall time sharing on / off: {on / statistics.median(r[0] for r in rows['unshared']):.2f}x; "
            f"on / FileSystemReader: {on / statistics.median(r[0] for r in rows['stock']):.2f}x"
        )


if __name__ == "__main__":
    main()
