#!/usr/bin/env python3
"""What opening a checkpoint spends on checking its metadata (``fp_dcp.structure``, ``fp_dcp.tiling``).

    python benchmarks/metadata_checks_bench.py [--count 20000] [--rounds 5] [--dir DIR]

Saves ``--count`` tensors of one chunk each, then times (best of
``--rounds``) the structure check alone, its tiling part, and the whole
``open_checkpoint`` (reading and unpickling ``.metadata`` included); then
the tiling of one tensor cut into ``--count`` chunks, as a 2-D grid and as
rows, the worst case for a tensor being many chunks.
"""

from __future__ import annotations

import argparse
import math
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from fp_dcp import FastPersistWriter
from fp_dcp.checkpoint import open_checkpoint
from fp_dcp.structure import check_structure
from fp_dcp.tiling import tiling_fault


def best(rounds: int, run: Callable[[], object]) -> float:
    seconds = []
    for _ in range(rounds):
        start = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - start)
    return min(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    work = tempfile.mkdtemp(prefix="metadata-checks-", dir=args.dir)
    try:
        path = f"{work}/ck"
        state = {f"layer{i}.w": torch.full((4, 4), float(i)) for i in range(args.count)}
        dcp.save(state, storage_writer=FastPersistWriter(path), no_dist=True)
        checkpoint = open_checkpoint(path)
        files = checkpoint.footer["files"] if checkpoint.footer else None
        tensors = [
            md for md in checkpoint.metadata.state_dict_metadata.values() if isinstance(md, TensorStorageMetadata)
        ]
        structure = best(args.rounds, lambda: check_structure(checkpoint.metadata, path, files))
        tiling = best(
            args.rounds, lambda: [tiling_fault(t.size, [(c.offsets, c.sizes) for c in t.chunks]) for t in tensors]
        )
        whole = best(args.rounds, lambda: open_checkpoint(path))
        print(
            f"{args.count} items of one chunk: structure check {structure * 1e3:.0f} ms (tiling {tiling * 1e3:.0f} ms) "
            f"of {whole * 1e3:.0f} ms for the whole open_checkpoint ({structure / whole:.0%})"
        )
        side = math.isqrt(args.count)
        grid = [((i * 2, j * 3), (2, 3)) for i in range(side) for j in range(args.count // side)]
        rows = [((i * 2, 0), (2, 64)) for i in range(args.count)]
        grid_s = best(args.rounds, lambda: tiling_fault((2 * side, 3 * (args.count // side)), grid))
        rows_s = best(args.rounds, lambda: tiling_fault((2 * args.count, 64), rows))
        print(
            f"one tensor in {len(grid)} chunks: tiling {grid_s * 1e3:.0f} ms as a 2-D grid, "
            f"{rows_s * 1e3:.0f} ms as rows"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
