#!/usr/bin/env python3
"""Many small items: a cold ``dcp.load`` of 20,000 tensors of 16 KiB (328 MB), checked bit-exact.

    python benchmarks/many_items_load_bench.py [--rounds 5] [--dir DIR] [--count 20000]

Saves the state once, then loads it ``--rounds`` times into zeroed targets,
each time with its pages evicted from the page cache (``drop_caches`` as
root), and prints each load's seconds and the median. Run it from two
checkouts, one after the other, to compare two versions of fp-dcp.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp

from fp_dcp import FastPersistReader, FastPersistWriter
from fp_dcp.tools.workload import evict


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--count", type=int, default=20_000)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    g = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randn(4096, generator=g) for i in range(args.count)}  # 16 KiB each
    work = tempfile.mkdtemp(prefix="many-items-", dir=args.dir)
    try:
        path = f"{work}/ck"
        dcp.save(state, storage_writer=FastPersistWriter(path), no_dist=True)
        seconds = []
        for _ in range(args.rounds):
            target = {k: torch.zeros_like(v) for k, v in state.items()}
            evict(path)
            start = time.perf_counter()
            dcp.load(target, storage_reader=FastPersistReader(path), no_dist=True)
            seconds.append(time.perf_counter() - start)
            if not all(torch.equal(target[k], v) for k, v in state.items()):
                raise AssertionError("a load was not bit-exact")
            print(f"load {seconds[-1]:.2f} s", flush=True)
        print(f"{args.count} x 16 KiB, cold load: median {statistics.median(seconds):.2f} s, bit-exact")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
