#!/usr/bin/env python3
"""Many small items: what opening a checkpoint of 20,000 tensors spends on checking its metadata, and a cold
``dcp.load`` of them (16 KiB each, 328 MB), checked bit-exact.

    python benchmarks/many_items_bench.py [--count 20000] [--rounds 5] [--dir DIR] [--part metadata,load]

Saves ``--count`` tensors of one chunk each once, then:

- ``metadata`` (was ``metadata_checks_bench.py``): times, best of
  ``--rounds``, the structure check alone (``fp_dcp.structure``), its
  tiling part (``fp_dcp.tiling``), and the whole ``open_checkpoint``
  (reading and unpickling ``.metadata`` included); then the tiling of one
  tensor cut into ``--count`` chunks, as a 2-D grid and as rows, the worst
  case for a tensor being many chunks;
- ``load`` (was ``many_items_load_bench.py``): loads the state ``--rounds``
  times into zeroed targets, each time with its pages evicted from the page
  cache (``drop_caches`` as root), and prints each load's seconds and the
  median.

Run it from two checkouts, one after the other, to compare two versions of
fp-dcp.
"""

from __future__ import annotations

import argparse
import math
import shutil
import statistics
import tempfile
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from fp_dcp import FastPersistReader, FastPersistWriter
from fp_dcp.checkpoint import open_checkpoint
from fp_dcp.structure import check_structure
from fp_dcp.testing.measure import timed
from fp_dcp.tiling import tiling_fault
from fp_dcp.tools.workload import evict

PARTS = ("metadata", "load")


def best(rounds: int, run: Any) -> float:
    return min(timed(run).seconds for _ in range(rounds))


def metadata(path: str, count: int, rounds: int) -> None:
    checkpoint = open_checkpoint(path)
    files = checkpoint.footer["files"] if checkpoint.footer else None
    tensors = [md for md in checkpoint.metadata.state_dict_metadata.values() if isinstance(md, TensorStorageMetadata)]
    structure = best(rounds, lambda: check_structure(checkpoint.metadata, path, files))
    tiling = best(rounds, lambda: [tiling_fault(t.size, [(c.offsets, c.sizes) for c in t.chunks]) for t in tensors])
    whole = best(rounds, lambda: open_checkpoint(path))
    print(
        f"{count} items of one chunk: structure check {structure * 1e3:.0f} ms (tiling {tiling * 1e3:.0f} ms) "
        f"of {whole * 1e3:.0f} ms for the whole open_checkpoint ({structure / whole:.0%})"
    )
    side = math.isqrt(count)
    grid = [((i * 2, j * 3), (2, 3)) for i in range(side) for j in range(count // side)]
    rows = [((i * 2, 0), (2, 64)) for i in range(count)]
    grid_s = best(rounds, lambda: tiling_fault((2 * side, 3 * (count // side)), grid))
    rows_s = best(rounds, lambda: tiling_fault((2 * count, 64), rows))
    print(
        f"one tensor in {len(grid)} chunks: tiling {grid_s * 1e3:.0f} ms as a 2-D grid, {rows_s * 1e3:.0f} ms as rows"
    )


def load(path: str, state: dict[str, torch.Tensor], rounds: int) -> None:
    seconds = []
    for _ in range(rounds):
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        evict(path)
        seconds.append(
            timed(lambda t=target: dcp.load(t, storage_reader=FastPersistReader(path), no_dist=True)).seconds
        )
        if not all(torch.equal(target[k], v) for k, v in state.items()):
            raise AssertionError("a load was not bit-exact")
        print(f"load {seconds[-1]:.2f} s", flush=True)
    print(f"{len(state)} x 16 KiB, cold load: median {statistics.median(seconds):.2f} s, bit-exact")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--count", type=int, default=20_000)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--part", default=",".join(PARTS), help="metadata, load or both (default)")
    args = parser.parse_args()
    parts = args.part.split(",")
    if not parts or set(parts) - set(PARTS):
        parser.error(f"--part: a comma-separated list of {', '.join(PARTS)}")
    warnings.filterwarnings("ignore")
    g = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randn(4096, generator=g) for i in range(args.count)}  # 16 KiB each
    work = tempfile.mkdtemp(prefix="many-items-", dir=args.dir)
    try:
        path = f"{work}/ck"
        dcp.save(state, storage_writer=FastPersistWriter(path), no_dist=True)
        if "metadata" in parts:
            metadata(path, args.count, args.rounds)
        if "load" in parts:
            load(path, state, args.rounds)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
