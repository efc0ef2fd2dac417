"""What DCP's plan caching saves per save on a many-item state, with fp-dcp and with torch's FileSystemWriter.

    .venv/bin/python benchmarks/plan_caching.py [--items 5000] [--saves 6] [--world 2]

Each of ``--world`` gloo ranks saves the same state dict of ``--items`` small
tensors (1 KiB each, so planning, not the disk, dominates) ``--saves`` times,
each save into a new directory, as a per-iteration checkpointing job does;
once per storage and planner without plan caching and once with it. A save's
time is the slowest rank's; the first save of each run (which fills the
cache) is left out of the median. Runs are interleaved, so that a drifting
machine affects every row alike.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlanner

from fp_dcp import FastPersistSavePlanner, FastPersistWriter
from fp_dcp.testing.ranks import run_node

RUNS = [
    ("FileSystemWriter", "DefaultSavePlanner"),
    ("FastPersistWriter", "DefaultSavePlanner"),
    ("FastPersistWriter", "FastPersistSavePlanner"),
]

PLANNERS = {"DefaultSavePlanner": DefaultSavePlanner, "FastPersistSavePlanner": FastPersistSavePlanner}
CACHES = (
    SavePlanner._cached_save_plan,
    SavePlanner._cached_all_plans,
    SavePlanner._cached_global_plan,
    SavePlanner._cached_metadata,
    SavePlanner._cached_final_save_plan,
)


def _saves(rank: int, world: int, root: str, items: int, saves: int, repeats: int) -> dict[str, list[float]]:
    state = {f"layer{i // 8}.p{i % 8}": torch.full((256,), float(i)) for i in range(items)}
    writer = FastPersistWriter()
    seconds: dict[str, list[float]] = {}
    for _ in range(repeats):
        for storage, planner_name in RUNS:
            for caching in (False, True):
                for cache in (SavePlanner._cached_save_plan, SavePlanner._cached_all_plans):
                    cache.clear()  # every run starts cold; the rest of the cache is keyed the same way
                SavePlanner._cached_global_plan.clear()
                SavePlanner._cached_metadata.clear()
                SavePlanner._cached_final_save_plan.clear()
                times = []
                for step in range(saves):
                    path = os.path.join(root, f"{storage}-{planner_name}-{caching}-{step}")
                    planner_type = (
                        DefaultSavePlanner if planner_name == "DefaultSavePlanner" else FastPersistSavePlanner
                    )
                    planner = planner_type(enable_plan_caching=caching)
                    storage_writer: Any = writer if storage == "FastPersistWriter" else dcp.FileSystemWriter(path)
                    dist.barrier()
                    start = time.perf_counter()
                    dcp.save(state, checkpoint_id=path, storage_writer=storage_writer, planner=planner)
                    elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
                    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                    times.append(float(elapsed))
                    dist.barrier()
                    if rank == 0:
                        shutil.rmtree(path)
                seconds.setdefault(f"{storage}|{planner_name}|{caching}", []).extend(times[1:])
    writer.close()
    return seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--items", type=int, default=5000)
    ap.add_argument("--saves", type=int, default=6, help="saves per run (the first is not counted)")
    ap.add_argument("--repeats", type=int, default=2, help="rounds over all runs, interleaved")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="fp-dcp-plan-caching-", dir=args.dir)
    try:
        result = run_node(args.world, _saves, root, args.items, args.saves, args.repeats)[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{args.world} ranks, {args.items} items of 1 KiB, a new directory per save; median seconds per save")
    print(f"{'storage':<20}{'planner':<24}{'no caching':>12}{'caching':>10}{'saved':>8}")
    for storage, planner_name in RUNS:
        off = statistics.median(result[f"{storage}|{planner_name}|False"])
        on = statistics.median(result[f"{storage}|{planner_name}|True"])
        print(f"{storage:<20}{planner_name:<24}{off:>12.3f}{on:>10.3f}{100 * (off - on) / off:>7.0f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
