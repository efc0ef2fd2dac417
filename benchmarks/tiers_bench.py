#!/usr/bin/env python3
"""Figures of checkpoint tiers on this machine: what replication costs a save, and how fast it copies.

    python benchmarks/tiers_bench.py [--mib 64] [--steps 6] [--dir DIR]

1. **Blocking time per save**, 4 gloo ranks as 2 nodes (``FP_DCP_NODE``),
   asynchronous saves of ``--mib`` MiB per rank, ``replicas=2`` against
   ``replicas=1``, rounds interleaved; the median of each save's ``save()``
   time after the first, and of the whole loop. Replication runs on its own
   thread and process group while the next saves go on.
2. **Replication throughput** between 2 ranks: ``Transport`` copying a
   ``--mib`` x 4 MiB file (read, sent, checked item by item, fsynced,
   renamed), against the loopback copy limit: the same bytes through gloo
   ``send``/``recv`` from memory to memory, and through a plain TCP socket;
   and against the receiving disk: the same bytes written and fsynced.

On a 2-core machine 4 ranks and their background threads share two cores:
read the ratios with that in mind.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import tempfile
import threading
import time

from fp_dcp.testing.measure import timed
from fp_dcp.testing.ranks import run_node

MiB = 1 << 20


def saves(rank: int, world: int, tmp: str, mib: int, steps: int, replicas: int) -> dict[str, float]:
    import torch

    from fp_dcp.testing.tiers import manager

    state = {f"w{rank}": torch.randn(mib * MiB // 4)}
    times = []
    with manager(tmp, rank, replicas=replicas, asynchronous=True, keep_last=2) as mgr:
        start = time.perf_counter()
        for step in range(1, steps + 1):
            state[f"w{rank}"].add_(1.0)
            t = time.perf_counter()
            mgr.save(step, state)
            times.append(time.perf_counter() - t)
        loop = time.perf_counter() - start
        mgr.wait_for_copies()
        total = time.perf_counter() - start
    return {"blocking": statistics.median(times[1:]), "loop": loop, "total": total}


def transport(rank: int, world: int, tmp: str, mib: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    from fp_dcp.checkpoint import open_checkpoint
    from fp_dcp.net.group import Group
    from fp_dcp.net.transport import FileSink, Transfer, Transport
    from fp_dcp.tiers.layout import StepLayout

    size = 4 * mib * MiB
    source = os.path.join(tmp, "src", "step-1")
    target = os.path.join(tmp, "dst")
    layout = StepLayout(open_checkpoint(source))
    key = layout.own()[0]
    group = Group(None)
    t = Transfer(key, 0, 1, layout.files()[key])
    out: dict[str, float] = {}

    def copy() -> None:
        Transport(group).run(
            [t],
            source=lambda tr: os.path.join(source, os.path.basename(tr.key)),
            sink=lambda tr: FileSink(os.path.join(target, tr.key), layout.check(tr.key)),
        )

    for _ in range(2):  # the second round is timed: the source file is in the page cache, as just written
        out["transport"] = timed(copy, barrier=True).gbps(size)
        if rank == 1:
            shutil.rmtree(target)
    buf = torch.empty(8 * MiB, dtype=torch.uint8)

    def send() -> None:
        for _ in range(size // buf.numel()):
            if rank == 0:
                dist.send(buf, 1)
            else:
                dist.recv(buf, 0)

    out["gloo"] = timed(send, barrier=True).gbps(size)
    return out


def tcp_loopback(nbytes: int) -> float:
    """GB/s of a plain TCP socket on 127.0.0.1, 8 MiB at a time, memory to memory."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    data = memoryview(bytearray(8 * MiB))

    def receive() -> None:
        conn, _ = server.accept()
        buf = memoryview(bytearray(8 * MiB))
        got = 0
        while got < nbytes:
            n = conn.recv_into(buf)
            if not n:
                break
            got += n
        conn.close()

    thread = threading.Thread(target=receive)
    thread.start()
    client = socket.create_connection(("127.0.0.1", port))
    start = time.perf_counter()
    for _ in range(nbytes // len(data)):
        client.sendall(data)
    client.close()
    thread.join()
    server.close()
    return nbytes / (time.perf_counter() - start) / 1e9


def disk_write(directory: str, nbytes: int) -> float:
    """GB/s of writing ``nbytes`` through the page cache and fsyncing them: what a received copy costs the disk."""
    chunk = os.urandom(8 * MiB)
    path = os.path.join(directory, "disk-limit")
    start = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(nbytes // len(chunk)):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    os.unlink(path)
    return nbytes / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=64, help="MiB per rank per save")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    base = tempfile.mkdtemp(prefix="fp-dcp-tiers-bench-", dir=args.dir)
    try:
        rows: dict[int, list[dict[str, float]]] = {1: [], 2: []}
        for _ in range(args.rounds):
            for replicas in (1, 2):
                tmp = tempfile.mkdtemp(dir=base)
                results = run_node(4, saves, tmp, args.mib, args.steps, replicas)
                rows[replicas].append({k: max(r[k] for r in results) for k in results[0]})
                shutil.rmtree(tmp)
        print(
            f"4 ranks as 2 nodes, {args.mib} MiB per rank per save, {args.steps} async saves, "
            f"medians of {args.rounds} interleaved rounds:"
        )
        med = {r: {k: statistics.median(x[k] for x in rows[r]) for k in rows[r][0]} for r in rows}
        for replicas in (1, 2):
            m = med[replicas]
            print(
                f"  replicas={replicas}: save() blocks {m['blocking']:.3f} s; loop {m['loop']:.2f} s; "
                f"with copies done {m['total']:.2f} s"
            )
        print(f"  blocking time ratio replicas=2 / replicas=1: {med[2]['blocking'] / med[1]['blocking']:.2f}x")

        import torch
        import torch.distributed.checkpoint as dcp

        from fp_dcp import FastPersistWriter

        src = os.path.join(base, "xfer", "src", "step-1")
        dcp.save({"w": torch.randn(args.mib * MiB)}, storage_writer=FastPersistWriter(src), no_dist=True)
        figures = run_node(2, transport, os.path.join(base, "xfer"), args.mib)
        tcp = tcp_loopback(4 * args.mib * MiB)
        disk = disk_write(os.path.join(base, "xfer"), 4 * args.mib * MiB)
        xfer, gloo = figures[1]["transport"], figures[1]["gloo"]
        print(f"replication transport, {4 * args.mib} MiB file, 2 ranks: {xfer:.2f} GB/s (checked, fsynced)")
        print(f"  loopback limit: gloo send/recv memory to memory {gloo:.2f} GB/s, TCP socket {tcp:.2f} GB/s")
        print(f"  the receiving disk: buffered write + fsync of the same bytes {disk:.2f} GB/s")
        print(f"  transport / gloo: {xfer / gloo:.2f}x; / TCP: {xfer / tcp:.2f}x; / the disk: {xfer / disk:.2f}x")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
