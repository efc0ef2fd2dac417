#!/usr/bin/env python3
"""A small state (20 tensors of 16 MiB, 335 MB): fp-dcp's save against FileSystemWriter, side by side.

    python benchmarks/small_state_bench.py [--rounds 5] [--dir DIR]

As a user saves it: a new writer for every save, ``dcp.save(..., no_dist=True)``,
``os.sync()`` and (as root) ``drop_caches`` before each timed save; the two
writers alternate. Prints each round and the medians.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp

from fp_dcp import FastPersistWriter

MiB = 1 << 20


def quiesce() -> None:
    os.sync()
    if os.geteuid() == 0:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    state = {f"t{i}": torch.randn(4 * MiB) for i in range(20)}
    size = sum(v.numel() * v.element_size() for v in state.values())
    base = tempfile.mkdtemp(prefix="fp-dcp-small-", dir=args.dir)
    writers = {
        "fp-dcp": lambda path: FastPersistWriter(path),
        "FileSystemWriter": lambda path: dcp.FileSystemWriter(path),
    }
    times: dict[str, list[float]] = {name: [] for name in writers}
    try:
        for r in range(args.rounds):
            for name, make in writers.items():
                path = os.path.join(base, f"{name}-{r}")
                quiesce()
                start = time.perf_counter()
                dcp.save(state, storage_writer=make(path), no_dist=True)
                times[name].append(time.perf_counter() - start)
                shutil.rmtree(path)
            print(f"round {r + 1}: " + ", ".join(f"{n} {t[-1]:.3f} s" for n, t in times.items()), flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    fp, fs = statistics.median(times["fp-dcp"]), statistics.median(times["FileSystemWriter"])
    print(
        f"{size / 1e6:.0f} MB, median of {args.rounds}: fp-dcp {fp:.3f} s ({size / fp / 1e9:.2f} GB/s), "
        f"FileSystemWriter {fs:.3f} s ({size / fs / 1e9:.2f} GB/s): fp-dcp {fs / fp:.2f}x FileSystemWriter"
    )


if __name__ == "__main__":
    main()
