"""Two checkouts of fp-dcp side by side: a benchmark runs its child part once with each, alternating.

Whether a change made fp-dcp faster is a ratio taken under the same
conditions: the benchmark runs the same child (its own script with
``--child``) with this checkout's fp-dcp and with a baseline's (another
checkout, built in place: ``python setup.py build_ext --inplace``), each in
a process of its own, rounds alternating. The child finds its checkout's
fp-dcp first on ``PYTHONPATH``, and prints its figures as the JSON of its
last line. It must use only what the baseline has: not this module, which
older checkouts lack.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import fp_dcp

__all__ = ["THIS", "checkouts", "run_child"]

THIS = "this checkout"


def checkouts(baseline: Path | None) -> dict[str, Path]:
    """``{"this checkout": the checkout this process imported fp-dcp from, "baseline": baseline}`` (the latter
    only where given)."""
    found = {THIS: Path(fp_dcp.__file__).resolve().parents[1]}
    if baseline is not None:
        found["baseline"] = baseline.resolve()
    return found


def run_child(name: str, checkout: Path, argv: Sequence[str], env: Mapping[str, str] | None = None) -> Any:
    """``argv`` run by this interpreter with ``checkout``'s fp-dcp (``PYTHONPATH``, and the checkout as the
    working directory), ``env`` added to the environment: the JSON of the last line it prints. A child that fails
    ends the benchmark with its last line of stderr, naming the checkout ``name``."""
    environ = {**os.environ, **(env or {}), "PYTHONPATH": str(checkout)}
    out = subprocess.run([sys.executable, *argv], env=environ, cwd=checkout, capture_output=True, text=True)
    if out.returncode:
        last = out.stderr.strip().splitlines()[-1:] or [f"exit status {out.returncode}"]
        raise SystemExit(f"{name} ({checkout}): {last[0]}")
    return json.loads(out.stdout.strip().splitlines()[-1])
