#!/usr/bin/env python3
"""Crash trials of ``CheckpointManager``: kill -9 a training loop at random moments, then restore.

    python benchmarks/manager_crash_trials.py --trials 100 [--dir DIR] [--mib 8] [--preemption]

One run root; each trial starts a child that restores from it (as a job
resuming after a crash would), then saves step after step (asynchronously,
``keep_last=2``, so saves, retention's renames and removals, and the
cleanup of earlier kills' leftovers all happen) until it is killed with
SIGKILL at a random moment, uniform over ``--max-delay`` seconds. Half the
state is frozen (the same at every step) and every other pair of trials
saves incrementally, so references to earlier steps, retirements and their
cleanup are killed too. Then a
fresh process restores the root, with a deadline, and checks what it got:

- ``ok``: a step whose tensors are bit-exact what was saved for it (each
  step's values follow from its number), not older than the last trial's;
- ``none``: nothing restorable yet (only before the first step is published).

Anything else fails the run (exit status 1): ``wrong`` (other bytes),
``older`` (a step older than one restored before: a published step was
lost), ``error`` (the restore raised), ``hang`` (past the deadline). Trials
alternate between the io_uring and thread engines.

``--preemption``: the child runs with ``save_on_preemption=True`` and is
sent SIGTERM at the random moment, then SIGKILL a random grace period
later (uniform up to ``--max-grace`` seconds; the preemption save of a
few MiB is published 0.1-0.2 s after the signal on this project's
machines): the kill lands before the preemption save, in the middle of
it (or of the async save it waits for), or after it. Besides the above,
a step the child said it saved for the preemption must be the one
restored (``lost`` otherwise).

The children are processes forked from a server that has imported torch
once (``fp_dcp.testing.processes``): a trial costs its saves and its
restore, not two interpreters' start-up.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import signal
import sys
import tempfile
import time
import warnings
from multiprocessing.connection import Connection
from typing import Any

import torch

from fp_dcp import CheckpointManager, IOConfig
from fp_dcp.testing.processes import context


def state_at(step: int, rows: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    frozen = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(rows // 2, 1024, generator=g),
        "frozen": torch.randn(rows // 2, 1024, generator=frozen),
        "step": torch.tensor(step),
    }


def _quiet() -> None:
    """A child's output is its own: what a killed training loop or a restore logs is no part of the report."""
    warnings.filterwarnings("ignore")
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 1)
        os.dup2(null.fileno(), 2)


def _train(conn: Connection, root: str, engine: str, rows: int, incremental: bool, preemption: bool) -> None:
    """The job: restore from ``root``, then save step after step until killed; says "ready", and which step it
    saved for a preemption."""
    _quiet()
    mgr = CheckpointManager(
        root, keep_last=2, incremental=incremental, config=IOConfig(engine=engine), save_on_preemption=preemption
    )
    start = (mgr.restore({k: torch.zeros_like(v) for k, v in state_at(0, rows).items()}) or 0) + 1
    conn.send(("ready", None))
    for step in range(start, start + 100000):
        if mgr.should_save(step):
            mgr.save(step, state_at(step, rows))
        if mgr.preempted:
            conn.send(("preempted", step))
            time.sleep(3600)  # the grace period runs out: SIGKILL comes


def _check(conn: Connection, root: str, engine: str, rows: int) -> None:
    """A fresh process restores ``root``: the step and whether its tensors are exactly that step's."""
    _quiet()  # the steps it skips are logged: an error is what it sends
    try:
        state = {k: torch.full_like(v, -1) for k, v in state_at(0, rows).items()}
        with CheckpointManager(root, config=IOConfig(engine=engine)) as mgr:
            step = mgr.restore(state)
        exact = None
        if step is not None:
            expected = state_at(step, rows)
            exact = all(torch.equal(state[k], expected[k]) for k in expected)
        conn.send({"step": step, "exact": exact})
    except BaseException as e:
        conn.send({"outcome": "error", "why": f"{type(e).__name__}: {e}"})


def trial(
    root: str, engine: str, incremental: bool, rows: int, delay: float, grace: float | None, deadline: float
) -> dict[str, Any]:
    """One kill, ``delay`` s after start-up: SIGKILL; with ``grace``, SIGTERM and SIGKILL ``grace`` s later."""
    ctx: Any = context()
    receiver, sender = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_train, args=(sender, root, engine, rows, incremental, grace is not None))
    child.start()
    sender.close()
    try:
        if not receiver.poll(deadline) or receiver.recv()[0] != "ready":
            return {"outcome": "error", "why": "the child did not start (its restore failed?)"}
        time.sleep(delay)
        if grace is not None:
            os.kill(child.pid, signal.SIGTERM)
            time.sleep(grace)
    except EOFError:
        return {"outcome": "error", "why": f"the child died before it was killed (exit code {child.exitcode})"}
    finally:
        child.kill()
        child.join()
    preempted = None
    while receiver.poll():
        try:
            said, step = receiver.recv()
        except EOFError:
            break
        if said == "preempted":
            preempted = step
    receiver.close()
    receiver, sender = ctx.Pipe(duplex=False)
    check = ctx.Process(target=_check, args=(sender, root, engine, rows))
    check.start()
    sender.close()
    try:
        if not receiver.poll(deadline):
            return {"outcome": "hang"}
        result: dict[str, Any] = receiver.recv()
    except EOFError:
        return {"outcome": "error", "why": f"the restoring process died (exit code {check.exitcode})"}
    finally:
        check.kill()
        check.join()
        receiver.close()
    return {**result, "preempted": preempted}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--mib", type=int, default=8, help="state size in MiB (default 8)")
    ap.add_argument("--max-delay", type=float, default=1.0, help="kill within this many seconds of start-up")
    ap.add_argument("--deadline", type=float, default=120.0, help="seconds a restore may take before it is a hang")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--preemption", action="store_true", help="SIGTERM first, SIGKILL a random grace period later")
    ap.add_argument("--max-grace", type=float, default=0.3, help="with --preemption: the longest grace period")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    rows = args.mib * 256  # rows of 1024 float32
    outcomes: collections.Counter[str] = collections.Counter()
    newest = None
    saved_first = 0  # trials whose preemption save was published before the SIGKILL
    with tempfile.TemporaryDirectory(prefix="fp-dcp-manager-trials-", dir=args.dir) as tmp:
        root = os.path.join(tmp, "run")
        for i in range(args.trials):
            engine = ("io_uring", "threads")[i % 2]
            incremental = bool(i // 2 % 2)
            grace = rng.uniform(0.0, args.max_grace) if args.preemption else None
            result = trial(root, engine, incremental, rows, rng.uniform(0.0, args.max_delay), grace, args.deadline)
            step = result.get("step")
            saved_first += result.get("preempted") is not None
            if "outcome" in result:
                outcome = result["outcome"]
            elif result["preempted"] is not None and step != result["preempted"]:
                outcome = "lost"
            elif step is None:
                outcome = "none" if newest is None else "older"
            elif not result["exact"]:
                outcome = "wrong"
            elif newest is not None and step < newest:
                outcome = "older"
            else:
                outcome, newest = "ok", step
            outcomes[outcome] += 1
            if outcome not in ("ok", "none"):
                kind = "incremental" if incremental else "full"
                print(f"trial {i + 1} ({engine}, {kind}): {outcome} {result}", flush=True)
    what = f"{args.trials} kills, {args.mib} MiB state" + (", SIGTERM first" if args.preemption else "")
    print(f"{what}: " + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())))
    print(f"newest step restored: {newest}")
    if args.preemption:
        print(f"kills after the preemption save was published: {saved_first} of {args.trials}")
    return 0 if set(outcomes) <= {"ok", "none"} else 1


if __name__ == "__main__":
    sys.exit(main())
