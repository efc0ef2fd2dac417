"""Run a function on N rank processes with a gloo process group, with a deadline.

Each call gets its own rendezvous: a FileStore in a temporary directory (no
TCP port to clash on), or with ``tcp=True`` a TCPStore on 127.0.0.1, as
``torchrun`` makes one. Every rank's result or error comes back to the
caller, and a rank that hangs fails the call after ``timeout`` seconds of
silence instead of hanging CI, having first printed every thread's stack to
the caller's stderr (faulthandler), so that a hang seen once in CI says
where it was. A rank that dies (or fails to start) ends the wait at once,
and no rank outlives the call.

The ranks are new processes forked from a server that imported torch once
(``fp_dcp.testing.processes``): a rank starts in a fraction of the seconds
a new interpreter takes to import torch, and still shares nothing with
other calls' ranks. Each takes the caller's environment, stdout and stderr
as they are when the ranks start (fp-dcp, imported in the server, is DCP's
default storage or not as that environment says); ``local=True`` adds ``LOCAL_RANK`` and
``LOCAL_WORLD_SIZE``, as torchrun sets them for the ranks of one node (fp-dcp
divides the node's cores among them: ``IOConfig.host_threads``).
``fresh=True`` starts new interpreters instead, for what happens at
interpreter start-up (``.pth`` files).

Tests take the default deadline. Benchmarks run their ranks with
``run_node``: as torchrun starts the ranks of one node, waiting up to
``BENCHMARK_TIMEOUT_S`` for each result (a rank may measure for minutes).
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
from typing import TYPE_CHECKING, Any, TypedDict

import torch
import torch.distributed as dist

from .processes import Handed, context, environment, free_port, inherit

if TYPE_CHECKING:
    from typing_extensions import Unpack  # annotations only: torch's dependency, not fp-dcp's

__all__ = [
    "TIMEOUT_S",
    "BENCHMARK_TIMEOUT_S",
    "RankError",
    "Launch",
    "SpawnedRanks",
    "spawned_ranks",
    "run_ranks",
    "run_ranks_outcomes",
    "rank_results",
    "run_node",
]

TIMEOUT_S = 120.0  # a test's wait for the next rank's result
BENCHMARK_TIMEOUT_S = 900.0  # a benchmark's: its ranks may measure for minutes before they answer

Outcome = tuple[bool, Any]  # (True, result) or (False, (type name, message, traceback))


class Launch(TypedDict, total=False):
    """How ``run_ranks`` and ``run_ranks_outcomes`` start and wait for the ranks (each optional)."""

    timeout: float  # seconds a rank may be silent before TimeoutError (TIMEOUT_S)
    fresh: bool  # new interpreters instead of forks of the preloaded server
    tcp: bool  # a TCPStore on 127.0.0.1 instead of a FileStore
    local: bool  # LOCAL_RANK and LOCAL_WORLD_SIZE, as torchrun sets them on one node


class RankError(Exception):
    """What a rank raised: its type name, message and traceback."""

    def __init__(self, rank: int, kind: str, message: str, trace: str) -> None:
        super().__init__(f"rank {rank} raised {kind}: {message}\n{trace}")
        self.rank = rank
        self.kind = kind
        self.message = message


def _entry(
    rank: int,
    world: int,
    init: str,
    call: tuple[Callable[..., Any], tuple[Any, ...]],
    handed: Handed,
    local: bool,
    results: Any,
    stacks_after: float | None,
) -> None:
    inherit(handed)
    if local:  # as torchrun sets them for ranks on one node
        os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    fn, args = call
    warnings.filterwarnings("ignore")
    if stacks_after is not None:
        faulthandler.dump_traceback_later(stacks_after)
    torch.set_num_threads(1)  # several ranks share the cores
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
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

    ``init``: the rendezvous (``file://...`` or ``tcp://...``). ``stacks_after``: seconds after which a rank still
    running prints all its threads' stacks (once)."""

    def __init__(
        self,
        world: int,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        init: str,
        stacks_after: float | None = None,
        fresh: bool = False,
        local: bool = False,
    ) -> None:
        ctx = context(fresh)
        self.world = world
        self._results = ctx.Queue()
        handed = environment()
        self.procs = [
            ctx.Process(target=_entry, args=(r, world, init, (fn, args), handed, local, self._results, stacks_after))
            for r in range(world)
        ]
        for p in self.procs:
            p.start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    def outcomes(self, timeout: float) -> list[Outcome]:
        """Per rank (True, result) or (False, (type, message, trace)); TimeoutError if one is silent ``timeout`` s,
        RankError at once for a rank that ended without an outcome (it died, or failed to start)."""
        got: dict[int, Outcome] = {}
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
    world: int,
    fn: Callable[..., Any],
    *args: Any,
    stacks_after: float | None = None,
    fresh: bool = False,
    tcp: bool = False,
    local: bool = False,
) -> Iterator[SpawnedRanks]:
    """``fn(rank, world, *args)`` started on ``world`` ranks; any still running when the block ends are killed
    (whatever ends it: an error, Ctrl-C)."""
    with tempfile.TemporaryDirectory() as tmp:
        init = f"tcp://127.0.0.1:{free_port()}" if tcp else f"file://{os.path.join(tmp, 'store')}"
        ranks = SpawnedRanks(world, fn, args, init, stacks_after, fresh, local)
        try:
            yield ranks
        finally:
            for p in ranks.procs:
                if p.is_alive():
                    p.kill()


def run_ranks_outcomes(world: int, fn: Callable[..., Any], *args: Any, **launch: Unpack[Launch]) -> list[Outcome]:
    """``fn(rank, world, *args)`` on ``world`` ranks: per rank (True, result) or (False, (type, message, trace))."""
    timeout = launch.get("timeout", TIMEOUT_S)
    start: dict[str, Any] = {k: v for k, v in launch.items() if k != "timeout"}  # how spawned_ranks starts them
    # The stacks come a little before the deadline: the ranks are then still there to print them.
    with spawned_ranks(world, fn, *args, stacks_after=max(timeout - 10, 1), **start) as ranks:
        return ranks.outcomes(timeout)


def run_ranks(world: int, fn: Callable[..., Any], *args: Any, **launch: Unpack[Launch]) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` ranks: their results in rank order; RankError if one failed."""
    return rank_results(run_ranks_outcomes(world, fn, *args, **launch))


def rank_results(outcomes: list[Outcome]) -> list[Any]:
    """The results of ``outcomes`` in rank order; RankError for the first rank that failed."""
    out = []
    for rank, (ok, value) in enumerate(outcomes):
        if not ok:
            raise RankError(rank, *value)
        out.append(value)
    return out


def run_node(world: int, fn: Callable[..., Any], *args: Any, tcp: bool = False) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` ranks as torchrun starts the ranks of one node (``local=True``),
    waiting up to ``BENCHMARK_TIMEOUT_S`` for each result: their results in rank order, RankError if one failed.
    How the benchmarks run ranks."""
    return run_ranks(world, fn, *args, timeout=BENCHMARK_TIMEOUT_S, tcp=tcp, local=True)
