"""Write parallelism, measured honestly on one machine: K throttled devices, N ranks.

    sudo .venv/bin/python benchmarks/scaling_bench.py [--limit-mbps 100] [--per-device-mb 300] [--repeats 2]

Needs root. Creates K loop devices (direct I/O to their backing files) with
ext4 on each, caps each device's writes with the cgroup-v1 blkio throttle
(``blkio.throttle.write_bps_device``), and times ``dcp.save`` of a state dict
sharded over N spawned gloo ranks into ``data_dirs`` on the K devices, for
K = 1, 2, 4 and N = 1, 2. A perfect result is K x the per-device limit; the
bar is 0.9 of that. Every device, mount and throttle is removed afterwards,
also when a run fails.

A second table (no root needed) shows what a resharding load reads: the
checkpoint is saved by 2 ranks sharded by rows and loaded by 3 ranks sharded
by columns; each rank reports the bytes it read against the bytes it needed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

from fp_dcp import FastPersistReader, FastPersistWriter
from fp_dcp.testing.measure import timed
from fp_dcp.testing.ranks import run_node

THROTTLE = "/sys/fs/cgroup/blkio/blkio.throttle.{}_bps_device"  # read or write
MB = 10**6


def sh(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()


@contextlib.contextmanager
def throttled_devices(
    k: int, workdir: str, size_mb: int, limit_bps: int, direction: str = "write"
) -> Iterator[list[str]]:
    """K ext4 mounts on loop devices, each capped at ``limit_bps`` of ``direction``; torn down on exit."""
    throttle = THROTTLE.format(direction)
    loops: list[str] = []
    mounts: list[str] = []
    throttled: list[str] = []
    try:
        for i in range(k):
            backing = os.path.join(workdir, f"dev{i}.img")
            with open(backing, "wb") as f:
                f.truncate(size_mb * MB)
            loop = sh("losetup", "--direct-io=on", "--find", "--show", backing)
            loops.append(loop)
            sh("mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", loop)
            mnt = os.path.join(workdir, f"mnt{i}")
            os.makedirs(mnt)
            sh("mount", loop, mnt)
            mounts.append(mnt)
            majmin = sh("lsblk", "-dno", "MAJ:MIN", loop).strip()
            with open(throttle, "w") as f:
                f.write(f"{majmin} {limit_bps}\n")
            throttled.append(majmin)
        yield mounts
    finally:
        for majmin in throttled:
            with contextlib.suppress(OSError), open(throttle, "w") as f:
                f.write(f"{majmin} 0\n")
        for mnt in mounts:
            subprocess.run(["umount", mnt], capture_output=True)
        for loop in loops:
            subprocess.run(["losetup", "-d", loop], capture_output=True)


def dd_limit(mount: str, mb: int) -> float:
    """Direct-write bandwidth of one throttled device, in bytes/s."""
    path = os.path.join(mount, "dd.bin")
    t0 = time.perf_counter()
    sh("dd", "if=/dev/zero", f"of={path}", "oflag=direct", "bs=4M", f"count={mb * MB // (4 << 20)}", "conv=fsync")
    rate = mb * MB // (4 << 20) * (4 << 20) / (time.perf_counter() - t0)
    os.unlink(path)
    return rate


def sharded_state(nbytes: int, world: int, seed: int = 0) -> dict[str, Any]:
    """About ``nbytes`` of bf16 matrices, sharded by rows over the ranks."""
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(seed)
    rows, cols = 4096, 2048  # 16 MiB per bf16 matrix
    count = max(1, nbytes // (rows * cols * 2))
    return {
        f"layer{i}.weight": distribute_tensor(torch.randn(rows, cols, generator=g).to(torch.bfloat16), mesh, [Shard(0)])
        for i in range(count)
    }


def _scaling_rank(rank: int, world: int, mounts: list[str], ks: list[int], per_device: int, repeats: int) -> list[dict]:
    rows = []
    for k in ks:
        state = sharded_state(k * per_device, world)
        nbytes = sum(t.to_local().nbytes for t in state.values())
        total = torch.tensor([nbytes])
        dist.all_reduce(total)
        writer = FastPersistWriter(
            os.path.join(mounts[0], "ckpt"), data_dirs=[os.path.join(m, "data") for m in mounts[:k]]
        )
        rates = []
        for rep in range(repeats):
            writer.reset(os.path.join(mounts[0], f"ckpt-{k}-{rep}"))
            rates.append(
                int(total) / timed(lambda w=writer, s=state: dcp.save(s, storage_writer=w), barrier=True).seconds
            )
            if rank == 0:
                shutil.rmtree(os.path.join(mounts[0], f"ckpt-{k}-{rep}"))
                for m in mounts[:k]:
                    shutil.rmtree(os.path.join(m, "data"), ignore_errors=True)
            dist.barrier()
        writer.close()
        rows.append({"k": k, "ranks": world, "bytes": int(total), "rates": rates})
    return rows


def _reshard_rank(rank: int, world: int, path: str, phase: str) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(3)
    full = {f"w{i}": torch.randn(2048, 4096, generator=g) for i in range(4)}
    if phase == "save":
        state = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
        dcp.save(state, storage_writer=FastPersistWriter(path))
        return {}
    state = {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(1)]) for k, v in full.items()}
    reader = FastPersistReader(path)
    dcp.load(state, storage_reader=reader)
    exact = all(torch.equal(state[k].full_tensor(), full[k]) for k in full)
    summary = reader.last_load
    return {"rank": rank, "read": summary.bytes, "needed": summary.needed, "exact": exact}


def scaling(args: argparse.Namespace) -> list[dict]:
    ks = [1, 2, 4]
    workdir = tempfile.mkdtemp(prefix="fp-dcp-scaling-", dir=args.dir)
    try:
        size_mb = args.per_device_mb * args.repeats * 2 + 512
        with throttled_devices(max(ks), workdir, size_mb, args.limit_mbps * MB) as mounts:
            limit = statistics.median(dd_limit(mounts[0], min(200, args.per_device_mb)) for _ in range(2))
            rows = []
            for world in (1, 2):
                rows += run_node(world, _scaling_rank, mounts, ks, args.per_device_mb * MB, args.repeats)[0]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"\nper-device write limit set {args.limit_mbps} MB/s, measured with dd oflag=direct: {limit / MB:.0f} MB/s")
    print(f"{'lanes K':>8}{'ranks N':>8}{'GB saved':>10}{'MB/s (median)':>15}{'K x limit':>11}{'ratio':>7}  bar 0.9")
    for r in rows:
        rate = statistics.median(r["rates"])
        ideal = r["k"] * limit
        r.update(median=rate, ideal=ideal, ratio=rate / ideal)
        print(
            f"{r['k']:>8}{r['ranks']:>8}{r['bytes'] / 1e9:>10.2f}{rate / MB:>15.0f}{ideal / MB:>11.0f}"
            f"{r['ratio']:>7.2f}  {'ok' if r['ratio'] >= 0.9 else 'MISSED'}"
        )
    return rows


def resharding(args: argparse.Namespace) -> list[dict]:
    path = tempfile.mkdtemp(prefix="fp-dcp-reshard-", dir=args.dir)
    try:
        run_node(2, _reshard_rank, path, "save")
        rows = run_node(3, _reshard_rank, path, "load")
    finally:
        shutil.rmtree(path, ignore_errors=True)
    print("\nresharding load: saved by 2 ranks as Shard(0), loaded by 3 ranks as Shard(1) (4 x [2048, 4096] fp32);")
    print("each rank needs one run per row; O_DIRECT rounds every run out to the device block")
    print(f"{'rank':>5}{'needed MB':>11}{'read MB':>9}{'read/needed':>13}  bit-exact")
    for r in rows:
        print(
            f"{r['rank']:>5}{r['needed'] / MB:>11.1f}{r['read'] / MB:>9.1f}"
            f"{r['read'] / r['needed']:>13.3f}  {r['exact']}"
        )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit-mbps", type=int, default=100, help="write limit per device, MB/s (default 100)")
    ap.add_argument("--per-device-mb", type=int, default=300, help="MB saved per device and run (default 300)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where backing files go")
    ap.add_argument("--skip-scaling", action="store_true", help="only the resharding table (no root needed)")
    args = ap.parse_args()
    if not args.skip_scaling:
        if os.geteuid() != 0 or not os.path.exists(THROTTLE.format("write")):
            print(
                "the scaling table needs root and the cgroup-v1 blkio controller; use --skip-scaling", file=sys.stderr
            )
            return 2
        scaling(args)
    resharding(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
