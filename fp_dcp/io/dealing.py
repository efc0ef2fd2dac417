"""The one dealing rule: items of given sizes into bins, evening out the bytes per bin.

It serves the planner (replicated chunks to ranks) and the write pipeline
(a rank's items to its data files).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["deal"]


def deal(sizes: Sequence[int], candidates: Sequence[Sequence[int]], bins: int) -> tuple[list[int], list[int]]:
    """Give item ``i`` (of ``sizes[i]`` bytes) to one of the bins ``candidates[i]``, evening out the bytes.

    Items with a single candidate go first, where they must; then the rest,
    largest first, each to its least loaded candidate (the longest-processing-
    time rule). Returns the bin of each item and the bytes per bin.
    """
    load = [0] * bins
    owner = [0] * len(sizes)
    order = sorted(range(len(sizes)), key=lambda i: (len(candidates[i]) > 1, -sizes[i]))
    for i in order:
        owner[i] = min(candidates[i], key=lambda b: (load[b], b))
        load[owner[i]] += sizes[i]
    return owner, load
