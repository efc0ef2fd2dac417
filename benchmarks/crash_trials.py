#!/usr/bin/env python3
"""Crash trials: kill a save with SIGKILL at a random moment, then see what loads.

    python benchmarks/crash_trials.py --trials 100 --size 1GiB --dir /disk/to/test

Each trial saves a state dict (``--size``, 1 GiB by default) with
``FastPersistWriter`` in a child process and SIGKILLs it while it saves: at
a random time (``--time-share`` of the trials), or in a chosen step of the
save, every (step, fresh or overwriting) pair in turn. A fresh process then
loads the directory, hashes every tensor and runs ``verify_checkpoint``.
Only the new checkpoint, the previous one (when overwriting) or none (when
not) may load; anything else fails the run (exit status 1). The harness,
its steps and the outcomes it tells apart are ``fp_dcp.testing.crash``'s
docstring; tests/test_crash.py runs 20 trials of 8 MiB.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time

from fp_dcp.testing.crash import AIM_MIN, BAD, STEPS, run_trials, summarize


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B?)?\s*", text, re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1GiB, 64MiB)")
    unit = (m.group(2) or "B")[0].upper()
    return int(float(m.group(1)) * {"B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[unit])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--size", type=parse_size, default=1 << 30, help="state dict size (default 1GiB)")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where to save (in a new scratch directory)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engines", default=None, help="comma-separated: io_uring,threads (default: those available)")
    parser.add_argument("--time-share", type=float, default=0.5, help="fraction of trials killed at a random time")
    parser.add_argument(
        "--aim-min",
        type=float,
        default=AIM_MIN,
        help=f"a step lasting at least this many seconds is killed within it, a shorter one at its start "
        f"(default {AIM_MIN}; inf: every step at its start)",
    )
    parser.add_argument("--load-timeout", type=float, default=120.0, help="seconds before a load counts as a hang")
    args = parser.parse_args(argv)
    scratch = tempfile.mkdtemp(prefix="crash-trials-", dir=args.dir)
    start = time.monotonic()
    results, _ = run_trials(
        scratch,
        args.trials,
        args.size,
        seed=args.seed,
        engines=args.engines.split(",") if args.engines else None,
        time_share=args.time_share,
        aim_min=args.aim_min,
        load_timeout=args.load_timeout,
    )
    print(f"\n{args.trials} crash trials of a {args.size / (1 << 30):.2f} GiB save in {time.monotonic() - start:.0f} s")
    print(summarize(results))
    print("steps: " + "; ".join(f"{step}: {what}" for step, what in STEPS.items()))
    return 1 if any(t.outcome in BAD for t in results) else 0


if __name__ == "__main__":
    sys.exit(main())
