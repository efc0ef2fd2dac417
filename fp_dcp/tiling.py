"""Whether a tensor's stored chunks tile it: cover every element once, and nothing outside it.

A load fills a target from the chunks that overlap it: a chunk missing
leaves part of the target as it was (a silent partial load), an overlap
means two stored values for one element. ``tiling_fault`` is checked for
every tensor when a checkpoint opens (``fp_dcp.checkpoint``,
``fp_dcp.load.safetensors``), before any byte is read.

How, in time linear in the number of chunks: a chunk is a box
``[o, o + s)`` of the integer grid, and its indicator function is the
signed sum of the orthants at its ``2^d`` corners (``+`` at the corners
with an even number of upper coordinates ``o + s``, ``-`` at the others).
Orthants at distinct corners are linearly independent, so the chunks'
coverage count equals the tensor's indicator at every element exactly when
the signed corner counts of the chunks, less those of the tensor's own
box, are all zero: a dict of corner -> count, ``2^d`` updates per chunk.
Where they are not, the smallest corner with a non-zero count (in C
order) is the first element whose coverage is wrong, and its count says
how: below zero, in no chunk (a gap); above zero, in several (an overlap).
Only the dimensions that some chunk does not span whole are counted
(``d`` is then 1 for row chunks, 2 for the shards of a 2-D device mesh:
the cost is linear in the chunks, exponential only in how many dimensions
they split), chunks with no elements cover nothing and are left out, and a
tensor stored as one whole chunk is one comparison.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Sequence
from operator import add, gt

__all__ = ["Box", "tiling_fault", "region"]

Box = tuple[Sequence[int], Sequence[int]]  # (offsets, sizes) of a chunk


def region(offsets: Sequence[int], sizes: Sequence[int]) -> str:
    """``[4:8, 0:3]``: the elements of a box, as slices."""
    return "[" + ", ".join(f"{o}:{o + n}" for o, n in zip(offsets, sizes, strict=True)) + "]"


def tiling_fault(size: Sequence[int], boxes: Sequence[Box]) -> str | None:
    """Why the chunks ``boxes`` do not tile a tensor of shape ``size`` exactly, or None if they do.

    The reason names the first fault: a chunk of another rank or with a
    negative entry, a chunk reaching outside ``size`` (and where), else the
    first element, in C order, that no chunk or several chunks cover.
    Entries must be ints. Time: O(n * d) for the bounds, plus n * 2^k dict
    updates where k is the number of dimensions the chunks split.
    """
    shape = tuple(size)
    ndim = len(shape)
    if len(boxes) == 1 and len(boxes[0][0]) == ndim and tuple(boxes[0][1]) == shape and not any(boxes[0][0]):
        return None  # one whole chunk: the common case
    for offsets, sizes in boxes:
        if len(offsets) != ndim or len(sizes) != ndim:
            return f"its chunk at {list(offsets)} has {len(offsets)} offsets and {len(sizes)} sizes, not {ndim}"
        if min(offsets, default=0) < 0 or min(sizes, default=0) < 0:
            return f"its chunk at {list(offsets)} (sizes {list(sizes)}) has a negative entry"
        ends = list(map(add, offsets, sizes))
        if any(map(gt, ends, shape)):
            past = ", ".join(
                f"dimension {d} ends at {e}, past {s}"
                for d, (e, s) in enumerate(zip(ends, shape, strict=True))
                if e > s
            )
            return f"its chunk at {list(offsets)} (sizes {list(sizes)}) reaches outside it: {past}"
    if 0 in shape:
        return None  # no elements to cover, and every chunk lies within: each is empty
    filled = [(offsets, sizes) for offsets, sizes in boxes if 0 not in sizes]
    if not filled:
        return f"no chunk holds any of its {math.prod(shape)} elements"
    split = [d for d in range(ndim) if any(o[d] != 0 or n[d] != shape[d] for o, n in filled)]
    # itertools.product of the (low, high) pairs gives the corners in the order of these signs
    signs = [-1 if sum(mask) % 2 else 1 for mask in itertools.product((0, 1), repeat=len(split))]
    counts: defaultdict[tuple[int, ...], int] = defaultdict(int)
    for offsets, sizes in filled:
        for corner, sign in zip(
            itertools.product(*[(offsets[d], offsets[d] + sizes[d]) for d in split]), signs, strict=True
        ):
            counts[corner] += sign
    for corner, sign in zip(itertools.product(*[(0, shape[d]) for d in split]), signs, strict=True):
        counts[corner] -= sign  # less the tensor's own box
    wrong = [corner for corner, count in counts.items() if count]
    if not wrong:
        return None
    first = min(wrong)  # the first element whose coverage is wrong (module doc)
    element = [0] * ndim
    for d, at in zip(split, first, strict=True):
        element[d] = at
    held = [(o, n) for o, n in filled if all(o[d] <= e < o[d] + n[d] for d, e in enumerate(element))]
    if not held:
        volume = sum(math.prod(n) for _, n in filled)
        return f"element {element} is in no chunk (its chunks hold {volume} elements in all, it has {math.prod(shape)})"
    (oa, na), (ob, nb) = held[:2]
    low = [max(a, b) for a, b in zip(oa, ob, strict=True)]
    high = [min(a + m, b + n) for a, m, b, n in zip(oa, na, ob, nb, strict=True)]
    both = region(low, [h - lo for h, lo in zip(high, low, strict=True)])
    return f"its chunks at {list(oa)} and {list(ob)} both hold {both}"
