"""Run a function on N spawned ranks with a gloo process group (for the benchmark scripts beside this one)."""

from __future__ import annotations

import os
import pickle
import tempfile
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world: int, store: str, fn: Any, args: tuple, out: Any) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        out.put((rank, pickle.dumps(fn(rank, world, *args))))
    finally:
        dist.destroy_process_group()


def spawn(world: int, fn: Any, *args: Any) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` spawned ranks; their results in rank order."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(target=_entry, args=(r, world, os.path.join(tmp, "store"), fn, args, out)) for r in range(world)
        ]
        for p in procs:
            p.start()
        results = dict(out.get(timeout=900) for _ in procs)
        for p in procs:
            p.join()
            if p.exitcode:
                raise RuntimeError(f"a rank exited with {p.exitcode}")
    return [pickle.loads(results[r]) for r in range(world)]
