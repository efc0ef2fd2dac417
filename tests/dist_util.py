"""Run a function on N spawned ranks with a gloo process group, with a deadline.

Each test gets its own FileStore rendezvous (no TCP port to clash on), every
rank's result or error comes back to the test, and a rank that hangs fails
the test after ``timeout`` seconds instead of hanging CI.
"""

from __future__ import annotations

import os
import pickle
import queue
import tempfile
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RankError(Exception):
    """What a rank raised: its type name, message and traceback."""

    def __init__(self, rank: int, kind: str, message: str, trace: str) -> None:
        super().__init__(f"rank {rank} raised {kind}: {message}\n{trace}")
        self.rank = rank
        self.kind = kind
        self.message = message


def _entry(rank: int, world: int, store: str, fn: Callable[..., Any], args: tuple, results: Any) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)  # several ranks share two cores
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        # Plain pickle: torch's multiprocessing reducers would share tensors through
        # this process's memory, which is gone once it exits.
        results.put((rank, True, pickle.dumps(fn(rank, world, *args))))
    except BaseException as e:  # CheckpointException is a BaseException
        results.put((rank, False, (type(e).__name__, str(e), traceback.format_exc())))
    finally:
        dist.destroy_process_group()


def run_ranks_outcomes(world: int, fn: Callable[..., Any], *args: Any, timeout: float = 120) -> list[tuple[bool, Any]]:
    """``fn(rank, world, *args)`` on ``world`` ranks: per rank (True, result) or (False, (type, message, trace))."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_entry, args=(r, world, store, fn, args, results)) for r in range(world)]
        for p in procs:
            p.start()
        got: dict[int, tuple[bool, Any]] = {}
        try:
            while len(got) < world:
                try:
                    rank, ok, value = results.get(timeout=timeout)
                except queue.Empty:
                    missing = sorted(set(range(world)) - set(got))
                    raise TimeoutError(f"ranks {missing} did not finish within {timeout} s (hang?)") from None
                got[rank] = (ok, pickle.loads(value) if ok else value)
            for p in procs:
                p.join(timeout=30)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
    return [got[rank] for rank in range(world)]


def run_ranks(world: int, fn: Callable[..., Any], *args: Any, timeout: float = 120) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` ranks: their results in rank order; RankError if one failed."""
    out = []
    for rank, (ok, value) in enumerate(run_ranks_outcomes(world, fn, *args, timeout=timeout)):
        if not ok:
            raise RankError(rank, *value)
        out.append(value)
    return out
