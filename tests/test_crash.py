"""Crash trials, CI-sized: SIGKILL a save in every step, fresh and overwriting, then load.

The harness is fp_dcp.testing.crash (benchmarks/crash_trials.py runs it for the figures).
"""

from __future__ import annotations

import collections
import time

import pytest

from fp_dcp.testing import crash as crash_trials
from fp_dcp.testing.states import digests, make_state

pytestmark = pytest.mark.slow  # its tests start processes

TRIALS = 20  # 16 kills at the start of each step (8 steps x fresh/overwrite) and 4 at random times
SIZE = 8 << 20


def test_no_kill_ever_yields_wrong_data_or_a_hang(tmp_path):
    t0 = time.monotonic()
    results, calibration = crash_trials.run_trials(
        str(tmp_path / "trials"),
        TRIALS,
        SIZE,
        seed=7,
        time_share=0.2,
        aim_min=float("inf"),
        load_timeout=60,
        log=lambda line: print(f"{time.monotonic() - t0:.1f} {line}"),
    )
    assert len(results) == TRIALS and calibration
    bad = [t for t in results if t.outcome not in crash_trials.GOOD]
    assert not bad, crash_trials.summarize(results)
    # every step was hit, when saving fresh and when overwriting, and the outcome matches the step exactly
    killed = collections.Counter((t.killed_in, t.overwrite) for t in results if t.mode == "step")
    assert set(killed) == {(step, ow) for step in crash_trials.STEPS for ow in (False, True)}, killed
    for t in results:
        if t.mode == "step":
            published = crash_trials.ORDER.index(t.killed_in) >= crash_trials.PUBLISHED_AFTER
            assert t.outcome == ("new" if published else "previous" if t.overwrite else "none"), t
    assert {t.outcome for t in results} == set(crash_trials.GOOD)


def test_harness_tells_a_wrong_checkpoint_from_a_right_one(tmp_path):
    """The judge is not vacuous: another save's bytes, a lost checkpoint and a load error are all failures."""
    judge = crash_trials.Harness._judge
    new = crash_trials.Save(2, {"w": "b", "meta.version": "2"}, [("plan", 0.0), ("rename", 1.0)])
    old = crash_trials.Save(1, {"w": "a", "meta.version": "1"}, [])
    loaded = {"verify": "ok"}
    assert judge(new, old, {**loaded, "digests": old.digests})[0] == "previous"
    assert judge(new, old, {**loaded, "digests": {"w": "c", "meta.version": "2"}})[0] == "wrong"
    assert judge(new, None, {**loaded, "digests": old.digests})[0] == "wrong"
    assert judge(new, old, {"none": "holds no checkpoint", "verify": "none"})[0] == "lost"
    assert judge(new, old, {"error": "CorruptCheckpointError: checksum mismatch", "verify": "ok"})[0] == "error"
    assert judge(new, old, {**loaded, "digests": new.digests, "verify": "problems: [...]"})[0] == "verify"
    assert judge(new, old, None)[0] == "hang"
    early = crash_trials.Save(2, new.digests, [("plan", 0.0), ("write", 1.0)])
    assert judge(early, old, {**loaded, "digests": new.digests})[0] == "order"  # published before its rename?
    late = crash_trials.Save(2, new.digests, [("plan", 0.0), ("cleanup", 1.0)])
    assert judge(late, old, {**loaded, "digests": old.digests})[0] == "order"  # the old one after the rename?


def test_states_differ_in_every_tensor_between_versions():
    a, b = (digests(make_state(1 << 20, v)) for v in (1, 2))
    assert a.keys() == b.keys() and all(a[k] != b[k] for k in a)
    assert digests(make_state(1 << 20, 1)) == a  # and are reproducible
