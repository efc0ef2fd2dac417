"""Run a function on N spawned ranks with a gloo process group, with a deadline.

Each test gets its own FileStore rendezvous (no TCP port to clash on), every
rank's result or error comes back to the test, and a rank that hangs fails
the test after ``timeout`` seconds instead of hanging CI.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import tempfile
import traceback
import warnings
from collections.abc import Callable, Iterator
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


class SpawnedRanks:
    """``world`` ranks started on ``fn``: their process ids (for signals), then their outcomes."""

    def __init__(self, world: int, fn: Callable[..., Any], args: tuple, store: str) -> None:
        ctx = mp.get_context("spawn")
        self.world = world
        self._results = ctx.Queue()
        self.procs = [ctx.Process(target=_entry, args=(r, world, store, fn, args, self._results)) for r in range(world)]
        for p in self.procs:
            p.start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    def outcomes(self, timeout: float) -> list[tuple[bool, Any]]:
        """Per rank (True, result) or (False, (type, message, trace)); TimeoutError if one is silent ``timeout`` s."""
        got: dict[int, tuple[bool, Any]] = {}
        while len(got) < self.world:
            try:
                rank, ok, value = self._results.get(timeout=timeout)
            except queue.Empty:
                missing = sorted(set(range(self.world)) - set(got))
                raise TimeoutError(f"ranks {missing} did not finish within {timeout} s (hang?)") from None
            got[rank] = (ok, pickle.loads(value) if ok else value)
        for p in self.procs:
            p.join(timeout=30)
        return [got[rank] for rank in range(self.world)]


@contextlib.contextmanager
def spawned_ranks(world: int, fn: Callable[..., Any], *args: Any) -> Iterator[SpawnedRanks]:
    """``fn(rank, world, *args)`` started on ``world`` ranks; any still running when the block ends are killed."""
    with tempfile.TemporaryDirectory() as tmp:
        ranks = SpawnedRanks(world, fn, args, os.path.join(tmp, "store"))
        try:
            yield ranks
        finally:
            for p in ranks.procs:
                if p.is_alive():
                    p.kill()


def run_ranks_outcomes(world: int, fn: Callable[..., Any], *args: Any, timeout: float = 120) -> list[tuple[bool, Any]]:
    """``fn(rank, world, *args)`` on ``world`` ranks: per rank (True, result) or (False, (type, message, trace))."""
    with spawned_ranks(world, fn, *args) as ranks:
        return ranks.outcomes(timeout)


def run_ranks(world: int, fn: Callable[..., Any], *args: Any, timeout: float = 120) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` ranks: their results in rank order; RankError if one failed."""
    return rank_results(run_ranks_outcomes(world, fn, *args, timeout=timeout))


def rank_results(outcomes: list[tuple[bool, Any]]) -> list[Any]:
    """The results of ``outcomes`` in rank order; RankError for the first rank that failed."""
    out = []
    for rank, (ok, value) in enumerate(outcomes):
        if not ok:
            raise RankError(rank, *value)
        out.append(value)
    return out
