"""The dealing rule behind byte-balanced partitioning (ranks) and file striping (lanes)."""

from __future__ import annotations

import random

from fp_dcp.io.dealing import deal


def test_items_with_one_holder_stay_and_the_rest_even_out():
    sizes = [100, 60, 50, 40, 30, 20, 10]
    candidates = [[0], [0, 1, 2], [0, 1, 2], [0, 1, 2], [1, 2], [0, 1, 2], [0, 1, 2]]
    owner, load = deal(sizes, candidates, 3)
    assert owner[0] == 0 and owner[4] in (1, 2)
    assert all(owner[i] in candidates[i] for i in range(len(sizes)))
    assert sum(load) == sum(sizes) and max(load) <= 110  # the fixed 100 bounds it from below


def test_largest_first_keeps_bins_within_the_largest_item():
    rng = random.Random(0)
    for _ in range(50):
        sizes = [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 60))]
        bins = rng.randrange(1, 6)
        owner, load = deal(sizes, [range(bins)] * len(sizes), bins)
        assert sorted(set(owner)) == sorted(set(owner) & set(range(bins)))
        assert max(load) - min(load) <= max(sizes)  # LPT: spread never exceeds one item
