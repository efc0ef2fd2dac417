"""Crash trials of checkpoint tiers: kill -9 one of 4 ranks (2 nodes) during replication or the drain, then restore.

Each trial runs a fresh 4-rank job (gloo, ranks 0-1 node "a", 2-3 node "b")
that saves step after step through ``CheckpointManager``:

- ``replication``: ``replicas=2``, 8 MiB per rank per step, so a good part
  of each step's time is the copy to the other node;
- ``drain``: a durable directory that takes 0.2 s more per file, so a drain
  is nearly always running.

Once the first step is saved, after a random further delay, one random
rank is killed with SIGKILL and, half a second later, the rest (as a scheduler ends a job that lost a rank). Rank 0
logs, after each save, the newest step whose replication or drain had
finished everywhere. Then the node that could be lost is deleted (node b
for replication; both nodes for the drain, leaving only the durable root),
and a fresh 4-rank job restores. A trial passes when every rank restores the
same step, bit-exact, and not older than the newest step logged as complete
before the kill. The job of each trial starts from empty roots.

``benchmarks/tier_crash_trials.py`` runs them (``--trials 20`` or more),
tests/test_tier_crash.py one of each. The ranks are processes forked from a
server that has imported torch once (``fp_dcp.testing.processes``): a
trial's eight ranks start at once, and a SIGKILL ends one as it would end a
rank of its own interpreter.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import tempfile
import time
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .processes import context
from .tiers import SlowStore, empty_state, manager, same_state, state_of

__all__ = ["WORLD", "PHASES", "GOOD", "worker", "trial", "run_trials"]

WORLD = 4
PHASES = ("replication", "drain")
GOOD = ("ok", "none")


def _options(phase: str, tmp: str) -> dict[str, Any]:
    if phase == "replication":
        return {"replicas": 2, "keep_last": 2}
    return {"durable": SlowStore(os.path.join(tmp, "durable"), 0.2), "keep_last": 2, "keep_durable": 2}


def worker(rank: int, tmp: str, phase: str, role: str) -> None:
    """One rank of a trial's job: ``role`` "save" saves step after step until it is killed, "restore" restores."""
    # a rank's own output, as a job's log: stdout dropped, stderr kept for a trial that fails
    with open(os.devnull, "w") as null, open(os.path.join(tmp, f"err-{role}-{rank}"), "w") as err:
        os.dup2(null.fileno(), 1)
        os.dup2(err.fileno(), 2)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store-{role}", rank=rank, world_size=WORLD)
    mgr = manager(tmp, rank, **_options(phase, tmp))
    if role == "restore":
        state = empty_state(rank)
        step = mgr.restore(state)
        ok = step is not None and same_state(state, step, rank)
        with open(os.path.join(tmp, f"restored-{rank}.json"), "w") as f:
            json.dump({"step": step, "ok": ok}, f)
        mgr.close()
        dist.destroy_process_group()
        return
    big = torch.randn(2 << 20)  # 8 MiB more per rank: copies that take a while
    for step in range(1, 1000):
        state = state_of(step, rank)
        state[f"big{rank}"] = big + step
        mgr.save(step, state)
        if rank == 0 and step == 1:
            Path(tmp, "ready").touch()
        tiers = mgr.tiers
        if rank == 0 and tiers is not None:
            done = tiers.last_replication if phase == "replication" else tiers.last_drain
            if done is not None and done.ok:
                with open(os.path.join(tmp, "complete.log"), "a") as f:
                    f.write(f"{done.step}\n")
                    f.flush()
                    os.fsync(f.fileno())


def _start(tmp: str, phase: str, role: str) -> list[BaseProcess]:
    ctx = context()
    procs: list[BaseProcess] = [ctx.Process(target=worker, args=(rank, tmp, phase, role)) for rank in range(WORLD)]
    for p in procs:
        p.start()
    return procs


def _kill_all(procs: list[BaseProcess]) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join()


def trial(tmp: str, phase: str, rng: random.Random, window: tuple[float, float]) -> dict[str, Any]:
    """One kill and one restore; returns what happened."""
    procs = _start(tmp, phase, "save")
    try:
        deadline = time.monotonic() + 120
        while not Path(tmp, "ready").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        delay = rng.uniform(*window)
        time.sleep(delay)
        victim = rng.randrange(WORLD)
        pid = procs[victim].pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)
    finally:
        _kill_all(procs)
    log = Path(tmp, "complete.log")
    complete = max((int(line) for line in log.read_text().split()), default=0) if log.exists() else 0
    lost = ["b"] if phase == "replication" else ["a", "b"]
    for node in lost:
        shutil.rmtree(os.path.join(tmp, f"local-{node}"), ignore_errors=True)
    procs = _start(tmp, phase, "restore")
    deadline = time.monotonic() + 120
    try:
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        hung = any(p.is_alive() for p in procs)
    finally:
        _kill_all(procs)
    results: list[dict[str, Any] | None] = []
    for rank in range(WORLD):
        path = Path(tmp, f"restored-{rank}.json")
        results.append(json.loads(path.read_text()) if path.exists() else None)
    if hung:
        outcome = "hang"
    else:
        outcome = _verdict([r for r in results if r is not None], complete)
    return {
        "phase": phase,
        "delay": round(delay, 2),
        "victim": victim,
        "complete": complete,
        "restored": results[0] and results[0]["step"],
        "outcome": outcome,
    }


def _verdict(results: list[dict[str, Any]], complete: int) -> str:
    if len(results) < WORLD:
        return "error"
    if len({r["step"] for r in results}) != 1:
        return "disagree"
    if results[0]["step"] is None:
        return "none" if complete == 0 else "older"
    if not all(r["ok"] for r in results):
        return "wrong"
    if results[0]["step"] < complete:
        return "older"
    return "ok"


def run_trials(
    trials: int,
    phases: tuple[str, ...],
    seed: int,
    window: tuple[float, float],
    keep: str | None = None,
) -> list[dict[str, Any]]:
    """``trials`` kills per phase; each trial's result is also printed as a JSON line as it comes (a failed
    trial's directory is kept, under ``keep`` if given, and named in its result)."""
    rng = random.Random(seed)
    out = []
    for phase in phases:
        for _ in range(trials):
            tmp = tempfile.mkdtemp(prefix="fp-dcp-tier-trial-", dir=keep)
            result = trial(tmp, phase, rng, window)
            out.append(result)
            if result["outcome"] in GOOD:
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                result["dir"] = tmp
            print(json.dumps(result), flush=True)
    return out
