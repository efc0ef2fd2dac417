#!/usr/bin/env python3
"""Crash trials of checkpoint tiers: kill -9 one of 4 ranks (2 nodes) during replication or the drain, then restore.

    python benchmarks/tier_crash_trials.py --trials 20 [--phase replication|drain|both] [--seed N]

Each trial runs a fresh 4-rank job saving step after step through
``CheckpointManager`` (``replicas=2``, or a durable directory slower than
the saves), kills a random rank with SIGKILL a random delay after the
first step is saved, and the rest half a second later; then deletes what a
lost node held and restores in a fresh 4-rank job. A trial passes when
every rank restores the same step, bit-exact, no older than the newest
step logged as complete before the kill (exit status 1 otherwise). The
harness is ``fp_dcp.testing.tier_crash`` (its docstring has the details);
tests/test_tier_crash.py runs one trial of each phase. Each trial's result
is printed as a JSON line as it comes, then a summary per phase.
"""

from __future__ import annotations

import argparse
import sys
import time

from fp_dcp.testing.tier_crash import GOOD, PHASES, run_trials


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20, help="kills per phase")
    parser.add_argument("--phase", choices=[*PHASES, "both"], default="both")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-delay", type=float, default=0.0, help="seconds after the first step is saved")
    parser.add_argument("--max-delay", type=float, default=8.0)
    parser.add_argument("--keep", default=None, help="where the trials' directories go (a failed one's is kept)")
    args = parser.parse_args()
    phases = PHASES if args.phase == "both" else (args.phase,)
    start = time.monotonic()
    results = run_trials(args.trials, phases, args.seed, (args.min_delay, args.max_delay), keep=args.keep)
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
