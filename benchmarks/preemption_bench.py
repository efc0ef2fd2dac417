#!/usr/bin/env python3
"""What preemption handling costs a training loop, and how long the preemption save takes.

    python benchmarks/preemption_bench.py [--ranks 4] [--step-ms 100] [--steps 300] [--mib 256] [--every 20]
                                          [--trials 3] [--dir DIR]

1. **Per-step cost of the agreement** while no signal comes: ``--ranks``
   gloo ranks meeting through a TCPStore on 127.0.0.1 (as under torchrun),
   a loop of ``--steps`` steps of ``--step-ms`` ms (a sleep, then an
   ``all_reduce`` as in data-parallel training), ``should_save(step)`` timed
   at every step, with ``save_on_preemption=True`` and without, in
   alternating rounds. The difference is the one store round trip each rank
   makes per step; the bar is under 1% of a 100 ms step.
2. **From signal to published**: the same loop saves ``--mib`` MiB per rank
   asynchronously every ``--every`` steps; at a random step rank 0 sends
   SIGTERM to another rank. That rank reports how long the loop took to
   reach the agreed step, the wait for the save in flight, and the
   preemption save, against fio writing the same bytes (every rank's state)
   from huge-page buffers: one save at the disk's limit.

On a 2-core machine the ranks share two cores: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import shutil
import signal
import statistics
import tempfile
import time
from typing import Any

from fp_dcp.testing.ranks import run_node

MiB = 1 << 20


def check_cost(rank: int, world: int, tmp: str, steps: int, step_ms: float, rounds: int) -> dict[str, list[float]]:
    """Seconds ``should_save`` took at each step, with preemption handling and without."""
    import torch
    import torch.distributed as dist

    from fp_dcp import CheckpointManager

    times: dict[str, list[float]] = {"off": [], "on": []}
    for r in range(rounds * 2):
        kind = ("off", "on")[r % 2]
        root = os.path.join(tmp, f"cost-{r}")
        with CheckpointManager(root, every_n_steps=10**9, save_on_preemption=kind == "on") as mgr:
            for step in range(1, steps + 1):
                time.sleep(step_ms / 1000)
                dist.all_reduce(torch.ones(1))
                start = time.perf_counter()
                mgr.should_save(step)
                times[kind].append(time.perf_counter() - start)
    return times


def signal_to_published(rank: int, world: int, tmp: str, mib: int, every: int, step_ms: float, seed: int) -> Any:
    """One preemption: rank 0 signals a random other rank at a random step; what the save did there."""
    import torch
    import torch.distributed as dist

    from fp_dcp import CheckpointManager

    pids: list[Any] = [None] * world
    dist.all_gather_object(pids, os.getpid())
    rng = random.Random(seed)
    at, victim = rng.randrange(every + 1, 3 * every), rng.randrange(1, world) if world > 1 else 0
    state = {f"w{rank}": torch.randn(mib * MiB // 4)}
    group = dist.new_group(backend="gloo")  # the saves' own: training's all_reduce goes on beside them
    root = os.path.join(tmp, f"run-{seed}")
    with CheckpointManager(root, every_n_steps=every, keep_last=2, save_on_preemption=True, process_group=group) as mgr:
        for step in range(1, 10**6):
            time.sleep(step_ms / 1000)
            dist.all_reduce(torch.ones(1))
            if rank == 0 and step == at:
                os.kill(pids[victim], signal.SIGTERM)
            if mgr.should_save(step):
                state[f"w{rank}"].add_(1.0)
                mgr.save(step, state)
            if mgr.preempted:
                break
        report = mgr.preemption
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root)
    assert report is not None
    return {"at": at, "victim": victim, **dataclasses.asdict(report)} if rank == victim else None


def fio_write_seconds(directory: str, nbytes: int) -> tuple[float | None, str]:
    """Seconds fio takes to write ``nbytes`` (the disk's limit), and how it ran."""
    from fp_dcp.tools.fio import reference

    with reference() as fio:
        if fio is None:
            return None, "fio not installed"
        path = os.path.join(directory, "fio-limit")
        try:
            done = fio.run(path, "write", nbytes)
        finally:
            if os.path.exists(path):
                os.remove(path)
        return done.seconds, f"fio write depth {fio.depth}, {fio.buffers}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--step-ms", type=float, default=100.0)
    ap.add_argument("--steps", type=int, default=300, help="steps per round of the per-step cost")
    ap.add_argument("--rounds", type=int, default=2, help="rounds with and without preemption handling each")
    ap.add_argument("--mib", type=int, default=256, help="state per rank in MiB for the preemption save")
    ap.add_argument("--every", type=int, default=20, help="an asynchronous save every this many steps")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="fp-dcp-preemption-", dir=args.dir) as tmp:
        per_rank = run_node(args.ranks, check_cost, tmp, args.steps, args.step_ms, args.rounds, tcp=True)
        print(f"per-step cost of the agreement: {args.ranks} ranks, TCPStore, {args.step_ms:g} ms steps, ", end="")
        print(f"{args.steps} steps x {args.rounds} rounds each")
        medians = {}
        for kind, label in (("off", "without preemption handling"), ("on", "with preemption handling")):
            seconds = sorted(t for times in per_rank for t in times[kind])
            medians[kind] = statistics.median(seconds)
            p99 = seconds[int(0.99 * (len(seconds) - 1))]
            print(f"  should_save {label:28s} median {medians[kind] * 1e6:7.1f} us, p99 {p99 * 1e6:7.1f} us")
        extra = medians["on"] - medians["off"]
        print(f"  agreement: {extra * 1e6:.1f} us per step = {extra / (args.step_ms / 1000) * 100:.3f}% of a step")

        total = args.ranks * args.mib * MiB
        print(f"signal to published: {args.ranks} ranks x {args.mib} MiB ({total / 1e9:.2f} GB), ", end="")
        print(f"asynchronous saves every {args.every} steps")
        saves = []
        for trial in range(args.trials):
            seed = args.seed + trial
            results = run_node(args.ranks, signal_to_published, tmp, args.mib, args.every, args.step_ms, seed, tcp=True)
            r = next(x for x in results if x is not None)
            saves.append(r["seconds_saving"])
            published = r["seconds_to_step"] + r["seconds_waiting"] + r["seconds_saving"]
            print(
                f"  trial {trial + 1}: SIGTERM at step {r['at']} to rank {r['victim']}; step {r['step']} reached "
                f"{r['seconds_to_step']:.2f} s later; waited {r['seconds_waiting']:.2f} s for the save in flight; "
                f"saved in {r['seconds_saving']:.2f} s; published {published:.2f} s after the signal"
            )
        limit, how = fio_write_seconds(tmp, total)
        save = statistics.median(saves)
        line = f"  preemption save (median) {save:.2f} s, {total / save / 1e9:.2f} GB/s"
        if limit is not None:
            line += f"; {how}: {limit:.2f} s, {total / limit / 1e9:.2f} GB/s; save / fio time {save / limit:.2f}"
        else:
            line += f" ({how})"
        print(line)


if __name__ == "__main__":
    main()
