"""Crash trials of checkpoint tiers, CI-sized: kill -9 a rank during replication and during the drain, then restore.

The harness is fp_dcp.testing.tier_crash (benchmarks/tier_crash_trials.py runs it: ``--trials 20`` or more).
"""

from __future__ import annotations

import pytest

from fp_dcp.testing import tier_crash as tier_crash_trials

pytestmark = pytest.mark.slow  # its tests start processes


def test_killing_a_rank_during_replication_or_the_drain_never_restores_a_wrong_or_older_step(tmp_path):
    results = tier_crash_trials.run_trials(2, tier_crash_trials.PHASES, seed=3, window=(0.5, 6.0), keep=str(tmp_path))
    bad = [r for r in results if r["outcome"] not in tier_crash_trials.GOOD]
    assert not bad, results
    for phase in tier_crash_trials.PHASES:  # the kills came after steps were saved and copied, not before
        assert any(r["outcome"] == "ok" and r["complete"] > 0 for r in results if r["phase"] == phase), results
