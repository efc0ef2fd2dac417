#!/usr/bin/env python3
"""Saves into tmpfs as a training loop makes them, minutes apart: with the pruned step's files reused, and without.

    .venv/bin/python benchmarks/spare_bench.py [--gb 1] [--saves 6] [--idle 15] [--dir /dev/shm] [--json OUT]

Two ``CheckpointManager``s in one process (one rank), ``keep_last=1``,
synchronous saves of the same state (``fp-dcp bench``'s Llama-shaped one),
each into its own root in ``--dir``: one with ``reuse_files=True`` (the
default: from its third save on, a save overwrites the files of the step
pruned at the save before, ``fp_dcp.save.spare``), one with False (every
save makes new files; the pruned step's are removed). Before every save the
process sleeps ``--idle`` seconds, as training runs between checkpoints:
on a VM that hands free memory back to its host (free page reporting), a
freed tmpfs page unused for a few seconds costs a host fault at its next
write, and on any machine a new file's pages are cleared before they are
written. The two alternate (which goes first swaps every round). A save is
timed from the call to its return, pruning included; CPU-s/GB is the
process's user + system time over the same span.

References after the same idle time, from ``fio`` (one job, buffered, 8 MiB
requests, 32 in flight through io_uring, from huge pages where it gets them)
writing as many bytes: into a new file each time (the previous one removed
first, as the manager without reuse does) and over the same file each time
(as the one with reuse does).

Medians over the saves from the third on (the reusing manager's first
spare is there from the third save).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

from fp_dcp import CheckpointManager
from fp_dcp.testing.llama import GiB
from fp_dcp.testing.measure import timed
from fp_dcp.tools.fio import Jobs, reference
from fp_dcp.tools.workload import llm_state_dict, tensor_bytes


def timed_save(manager: CheckpointManager, step: int, state: dict, nbytes: int) -> dict:
    took = timed(lambda: manager.save(step, state))
    return {"gbps": took.gbps(nbytes), "cpu_s_per_gb": took.cpu_s_per_gb(nbytes)}


def fio_write(fio: Jobs, directory: str, nbytes: int, new_file: bool) -> dict:
    """fio writing ``nbytes`` into its file in ``directory``: a new one (the old one removed first) or over the
    one there."""
    if new_file:
        shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory, exist_ok=True)
    return {"gbps": fio.run(directory, "write", nbytes).gbps}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=1.0, help="GiB of state")
    parser.add_argument("--saves", type=int, default=6, help="saves per manager (medians from the third on)")
    parser.add_argument("--idle", type=float, default=15.0, help="seconds between saves, as training runs")
    parser.add_argument("--dir", default="/dev/shm", help="where the roots go (a tmpfs to show the effect)")
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args()
    if args.saves < 3:
        parser.error("--saves must be at least 3: a manager's first spare is taken at its third save")
    state = llm_state_dict(int(args.gb * GiB))
    nbytes = tensor_bytes(state)
    base = tempfile.mkdtemp(prefix="fp-dcp-spare-bench-", dir=args.dir)
    rows: dict[str, list[dict]] = {"reused": [], "new files": [], "fio, new file": [], "fio, same file": []}
    try:
        managers = {
            "reused": CheckpointManager(os.path.join(base, "reused"), keep_last=1, asynchronous=False),
            "new files": CheckpointManager(
                os.path.join(base, "new"), keep_last=1, asynchronous=False, reuse_files=False
            ),
        }
        fio_dirs = {"fio, new file": os.path.join(base, "fio-new"), "fio, same file": os.path.join(base, "fio-same")}
        with managers["reused"], managers["new files"], reference() as ref:
            fio = (
                Jobs(ref.depth, ref.block, ref.huge_page, ref.why_plain, direct=False, allocate_first=False)
                if ref
                else None
            )
            for step in range(1, args.saves + 1):
                order = list(managers) if step % 2 else list(reversed(managers))
                for name in order:
                    time.sleep(args.idle)
                    rows[name].append(timed_save(managers[name], step, state, nbytes))
                for name, directory in fio_dirs.items() if fio else ():
                    time.sleep(args.idle)
                    rows[name].append(fio_write(fio, directory, nbytes, new_file=name == "fio, new file"))
                print(f"save {step}: " + ", ".join(f"{n} {r[-1]['gbps']:.2f} GB/s" for n, r in rows.items() if r))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(
        f"\n{nbytes / 1e9:.2f} GB per save into {args.dir} ({os.uname().release}), {args.idle:.0f} s idle before each; "
        f"medians of saves 3-{args.saves}:"
    )
    print(f"| writer | GB/s | CPU-s/GB | saves 3-{args.saves}, GB/s |\n|---|---|---|---|")
    summary = {}
    for name, runs in rows.items():
        later = runs[2:]
        if not later:
            continue
        gbps = statistics.median(r["gbps"] for r in later)
        cpu = statistics.median(r["cpu_s_per_gb"] for r in later) if "cpu_s_per_gb" in later[0] else None
        summary[name] = {"gbps": gbps, "cpu_s_per_gb": cpu, "runs": runs}
        cpu_text = f"{cpu:.3f}" if cpu is not None else ""
        each = " ".join(f"{r['gbps']:.2f}" for r in later)
        print(f"| {name} | {gbps:.2f} | {cpu_text} | {each} |")
    if "reused" in summary and "new files" in summary:
        print(f"\nreused / new files: {summary['reused']['gbps'] / summary['new files']['gbps']:.2f} x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bytes": nbytes, "idle_s": args.idle, "dir": args.dir, "writers": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
