#!/usr/bin/env python3
"""Crash trials of checkpoint tiers: kill -9 one of 4 ranks (2 nodes) during replication or the drain, then restore.

    python benchmarks/tier_crash_trials.py --trials 20 [--phase replication|drain|both] [--seed N]

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
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

WORLD = 4
PHASES = ("replication", "drain")


def _options(phase: str, tmp: str) -> dict:
    if phase == "replication":
        return {"replicas": 2, "keep_last": 2}
    from tiers_util import SlowStore

    return {"durable": SlowStore(os.path.join(tmp, "durable"), 0.2), "keep_last": 2, "keep_durable": 2}


def worker(rank: int, tmp: str, phase: str, role: str) -> None:
    import torch
    import torch.distributed as dist
    from tiers_util import empty_state, manager, same_state, state_of

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


def _start(tmp: str, phase: str, role: str) -> list[subprocess.Popen]:
    procs = []
    for rank in range(WORLD):
        command = [sys.executable, __file__, "--worker", str(rank), tmp, phase, role]
        procs.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=open(f"{tmp}/err-{role}-{rank}", "w")))
    return procs


def _kill_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()


def trial(tmp: str, phase: str, rng: random.Random, window: tuple[float, float]) -> dict:
    """One kill and one restore; returns what happened."""
    procs = _start(tmp, phase, "save")
    try:
        deadline = time.monotonic() + 120
        while not Path(tmp, "ready").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        delay = rng.uniform(*window)
        time.sleep(delay)
        victim = rng.randrange(WORLD)
        procs[victim].send_signal(signal.SIGKILL)
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
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        hung = any(p.poll() is None for p in procs)
    finally:
        _kill_all(procs)
    results = []
    for rank in range(WORLD):
        path = os.path.join(tmp, f"restored-{rank}.json")
        results.append(json.load(open(path)) if os.path.exists(path) else None)
    if hung:
        outcome = "hang"
    elif None in results:
        outcome = "error"
    elif len({r["step"] for r in results}) != 1:
        outcome = "disagree"
    elif results[0]["step"] is None:
        outcome = "none" if complete == 0 else "older"
    elif not all(r["ok"] for r in results):
        outcome = "wrong"
    elif results[0]["step"] < complete:
        outcome = "older"
    else:
        outcome = "ok"
    return {
        "phase": phase,
        "delay": round(delay, 2),
        "victim": victim,
        "complete": complete,
        "restored": results[0] and results[0]["step"],
        "outcome": outcome,
    }


GOOD = ("ok", "none")


def run_trials(
    trials: int, phases: tuple[str, ...], seed: int, window: tuple[float, float], keep: str | None = None
) -> list[dict]:
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


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        rank, tmp, phase, role = int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
        worker(rank, tmp, phase, role)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20, help="kills per phase")
    parser.add_argument("--phase", choices=[*PHASES, "both"], default="both")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-delay", type=float, default=0.0, help="seconds after the first step is saved")
    parser.add_argument("--max-delay", type=float, default=8.0)
    args = parser.parse_args()
    phases = PHASES if args.phase == "both" else (args.phase,)
    start = time.monotonic()
    results = run_trials(args.trials, phases, args.seed, (args.min_delay, args.max_delay))
    for phase in phases:
        mine = [r for r in results if r["phase"] == phase]
        counts = {o: sum(r["outcome"] == o for r in mine) for o in sorted({r["outcome"] for r in mine})}
        print(
            f"{phase}: {len(mine)} kills: {counts}; restored step - newest complete step before the kill: "
            f"{sorted((r['restored'] or 0) - r['complete'] for r in mine)}"
        )
    print(f"{time.monotonic() - start:.0f} s")
    return 0 if all(r["outcome"] in GOOD for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
