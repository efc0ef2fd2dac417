"""Run a function on N rank processes with a gloo process group, with a deadline.

Each test gets its own FileStore rendezvous (no TCP port to clash on), every
rank's result or error comes back to the test, and a rank that hangs fails
the test after ``timeout`` seconds instead of hanging CI, having first
printed every thread's stack to the test's captured stderr (faulthandler),
so that a hang seen once in CI says where it was.

The ranks are new processes forked from a server that imported torch once
(multiprocessing's forkserver): a rank starts in a fraction of the seconds a
new interpreter takes to import torch, and still shares nothing with other
tests' ranks. Each takes the test's environment as it is when the ranks
start (the server's is the one it started with). ``fresh=True`` starts new
interpreters instead, for what happens at interpreter start-up (``.pth``
files).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import pickle
import queue
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from multiprocessing import reduction
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


# What the server imports once, before any rank: the costly part of starting one. Not fp_dcp, which reads the
# environment at import (FP_DCP_DEFAULT_STORAGE), and which each rank imports with the test's environment.
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint"]


def _context(fresh: bool) -> Any:
    if fresh:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


class _Inherited:
    """One of the test's file descriptors, handed to a rank as it starts: a forked rank's stdout and stderr would
    otherwise be the server's, never the test's, where pytest captures what a rank prints (a hung rank's stacks)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Callable[[Any], int], tuple[Any]]:
        return _detach, (reduction.DupFd(self.fd),)


def _detach(duplicate: Any) -> int:
    return int(duplicate.detach())


def _entry(
    rank: int,
    world: int,
    store: str,
    call: tuple[Callable[..., Any], tuple],
    inherited: tuple[dict[str, str], int, int],
    results: Any,
    stacks_after: float | None,
) -> None:
    environ, stdout, stderr = inherited
    os.environ.clear()
    os.environ.update(environ)
    for fd, target in ((stdout, 1), (stderr, 2)):
        os.dup2(fd, target)
        os.close(fd)
    fn, args = call
    warnings.filterwarnings("ignore")
    if stacks_after is not None:
        faulthandler.dump_traceback_later(stacks_after)
    torch.set_num_threads(1)  # several ranks share two cores
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        # Plain pickle: torch's multiprocessing reducers would share tensors through
        # this process's memory, which is gone once it exits.
        results.put((rank, True, pickle.dumps(fn(rank, world, *args))))
    except BaseException as e:  # CheckpointException is a BaseException
        results.put((rank, False, (type(e).__name__, str(e), traceback.format_exc())))
    finally:
        # The outcome leaves before the group is torn down. torch 2.7's gloo group holds the GIL in its
        # destructor while it waits for its worker threads (pytorch#154976 releases it), and a worker that
        # needs the GIL then never ends, with this rank's outcome still in the queue's feeder thread,
        # which needs the GIL too (3 runs in 57 of test_2d_mesh_4_ranks_to_1d_2_ranks here).
        results.close()
        results.join_thread()
        dist.destroy_process_group()


class SpawnedRanks:
    """``world`` ranks started on ``fn``: their process ids (for signals), then their outcomes.

    ``stacks_after``: seconds after which a rank still running prints all its threads' stacks (once)."""

    def __init__(
        self,
        world: int,
        fn: Callable[..., Any],
        args: tuple,
        store: str,
        stacks_after: float | None = None,
        fresh: bool = False,
    ) -> None:
        ctx = _context(fresh)
        self.world = world
        self._results = ctx.Queue()
        inherited = (dict(os.environ), _Inherited(1), _Inherited(2))
        self.procs = [
            ctx.Process(target=_entry, args=(r, world, store, (fn, args), inherited, self._results, stacks_after))
            for r in range(world)
        ]
        for p in self.procs:
            p.start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    def outcomes(self, timeout: float) -> list[tuple[bool, Any]]:
        """Per rank (True, result) or (False, (type, message, trace)); TimeoutError if one is silent ``timeout`` s,
        RankError at once for a rank that ended without an outcome (it died, or failed to start)."""
        got: dict[int, tuple[bool, Any]] = {}
        silent_since = time.monotonic()
        while len(got) < self.world:
            missing = sorted(set(range(self.world)) - set(got))
            # A rank's outcome is in the pipe before it ends: one that had ended before this wait sent none.
            ended = [r for r in missing if self.procs[r].exitcode is not None]
            try:
                rank, ok, value = self._results.get(timeout=1)
            except queue.Empty:
                if ended:
                    code = self.procs[ended[0]].exitcode
                    raise RankError(ended[0], "exit", f"ended with code {code} and no outcome", "") from None
                if time.monotonic() - silent_since >= timeout:
                    raise TimeoutError(f"ranks {missing} did not finish within {timeout} s (hang?)") from None
                continue
            got[rank] = (ok, pickle.loads(value) if ok else value)
            silent_since = time.monotonic()
        for p in self.procs:
            p.join(timeout=30)
        return [got[rank] for rank in range(self.world)]


@contextlib.contextmanager
def spawned_ranks(
    world: int, fn: Callable[..., Any], *args: Any, stacks_after: float | None = None, fresh: bool = False
) -> Iterator[SpawnedRanks]:
    """``fn(rank, world, *args)`` started on ``world`` ranks; any still running when the block ends are killed."""
    with tempfile.TemporaryDirectory() as tmp:
        ranks = SpawnedRanks(world, fn, args, os.path.join(tmp, "store"), stacks_after, fresh)
        try:
            yield ranks
        finally:
            for p in ranks.procs:
                if p.is_alive():
                    p.kill()


def run_ranks_outcomes(
    world: int, fn: Callable[..., Any], *args: Any, timeout: float = 120, fresh: bool = False
) -> list[tuple[bool, Any]]:
    """``fn(rank, world, *args)`` on ``world`` ranks: per rank (True, result) or (False, (type, message, trace))."""
    # The stacks come a little before the deadline: the ranks are then still there to print them.
    with spawned_ranks(world, fn, *args, stacks_after=max(timeout - 10, 1), fresh=fresh) as ranks:
        return ranks.outcomes(timeout)


def run_ranks(world: int, fn: Callable[..., Any], *args: Any, timeout: float = 120, fresh: bool = False) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` ranks: their results in rank order; RankError if one failed."""
    return rank_results(run_ranks_outcomes(world, fn, *args, timeout=timeout, fresh=fresh))


def rank_results(outcomes: list[tuple[bool, Any]]) -> list[Any]:
    """The results of ``outcomes`` in rank order; RankError for the first rank that failed."""
    out = []
    for rank, (ok, value) in enumerate(outcomes):
        if not ok:
            raise RankError(rank, *value)
        out.append(value)
    return out
