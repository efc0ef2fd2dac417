"""``tiling_fault``: a tensor's chunks cover it exactly, checked against counting every element."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from fp_dcp.tiling import tiling_fault


def coverage(size, boxes) -> dict[tuple[int, ...], int]:
    """How many chunks hold each element of the tensor, by brute force (chunks assumed inside it)."""
    counts = dict.fromkeys(itertools.product(*map(range, size)), 0)
    for offsets, sizes in boxes:
        for element in itertools.product(*(range(o, o + n) for o, n in zip(offsets, sizes, strict=True))):
            counts[element] += 1
    return counts


def random_boxes(rng: random.Random, size: list[int]) -> list[tuple[list[int], list[int]]]:
    """A grid partition of the tensor, then perhaps damaged: a chunk dropped, moved, grown or duplicated."""
    cuts = [sorted({0, n, *rng.sample(range(n + 1), min(n, rng.randrange(3)))}) for n in size]
    boxes = [
        ([c[i] for c, i in zip(cuts, idx, strict=True)], [c[i + 1] - c[i] for c, i in zip(cuts, idx, strict=True)])
        for idx in itertools.product(*(range(len(c) - 1) for c in cuts))
    ]
    damage = rng.choice(["none", "none", "drop", "shift", "grow", "twice", "empty"])
    if damage == "drop" and boxes:
        boxes.pop(rng.randrange(len(boxes)))
    elif damage in ("shift", "grow") and boxes and size:
        offsets, sizes = boxes[rng.randrange(len(boxes))]
        d = rng.randrange(len(size))
        if damage == "shift" and offsets[d] > 0:
            offsets[d] -= 1
        elif sizes[d] > 1:
            sizes[d] -= 1
    elif damage == "twice" and boxes:
        boxes.append(rng.choice(boxes))
    elif damage == "empty":
        boxes.append(([rng.randrange(n + 1) for n in size], [0] * len(size)))
    rng.shuffle(boxes)
    return boxes


def test_agrees_with_counting_every_element():
    rng = random.Random(35)
    seen = {"tiles": 0, "gap": 0, "overlap": 0}
    for _ in range(3000):
        size = [rng.randrange(1, 6) for _ in range(rng.randrange(4))]
        boxes = random_boxes(rng, size)
        counts = coverage(size, boxes)
        fault = tiling_fault(size, boxes)
        wrong = sorted(element for element, n in counts.items() if n != 1)
        if not wrong:
            assert fault is None, (size, boxes, fault)
            seen["tiles"] += 1
            continue
        first = wrong[0]  # the fault named is the first element, in C order, that is held wrongly
        if counts[first] == 0:
            if not any(counts.values()):
                assert fault == f"no chunk holds any of its {len(counts)} elements", (size, boxes, fault)
            else:
                assert fault is not None and fault.startswith(f"element {list(first)} is in no chunk"), (size, boxes)
            seen["gap"] += 1
        else:
            assert fault is not None and " both hold [" in fault, (size, boxes, fault)
            start = fault.index("both hold [") + len("both hold [")
            region = [tuple(map(int, s.split(":"))) for s in fault[start:-1].split(", ")] if size else []
            assert [lo for lo, _ in region] == list(first)  # the overlap named starts at that element
            seen["overlap"] += 1
    assert all(n > 100 for n in seen.values()), seen


@pytest.mark.parametrize(
    ("size", "boxes", "fault"),
    [
        ([8, 4], [([0, 0], [8, 4])], None),
        ([8, 4], [([4, 0], [4, 4]), ([0, 0], [4, 4])], None),
        ([10, 4], [([0, 0], [8, 4])], "element [8, 0] is in no chunk (its chunks hold 32 elements in all, it has 40)"),
        ([8, 4], [([0, 0], [8, 4]), ([4, 0], [4, 4])], "its chunks at [0, 0] and [4, 0] both hold [4:8, 0:4]"),
        (
            [8, 4],
            [([2, 0], [8, 4])],
            "its chunk at [2, 0] (sizes [8, 4]) reaches outside it: dimension 0 ends at 10, past 8",
        ),
        ([8, 4], [], "no chunk holds any of its 32 elements"),
        ([8, 4], [([8, 0], [0, 4])], "no chunk holds any of its 32 elements"),
        ([0, 4], [], None),  # nothing to cover
        ([0, 4], [([0, 0], [0, 4]), ([0, 0], [0, 4])], None),  # every rank's empty shard
        ([], [([], [])], None),  # a 0-d tensor
        ([], [], "no chunk holds any of its 1 elements"),
        ([], [([], []), ([], [])], "its chunks at [] and [] both hold []"),
        ([8, 4], [([0, 0], [8])], "its chunk at [0, 0] has 2 offsets and 1 sizes, not 2"),
        ([8, 4], [([-1, 0], [9, 4])], "its chunk at [-1, 0] (sizes [9, 4]) has a negative entry"),
    ],
)
def test_faults_are_named(size, boxes, fault):
    assert tiling_fault(size, boxes) == fault


def test_many_chunks_of_many_dimensions():
    """A 4-D tensor cut along every dimension: 2^4 corners per chunk, still exact."""
    size = [6, 4, 4, 6]
    cuts = [range(0, n, 2) for n in size]
    boxes = [(list(o), [2] * 4) for o in itertools.product(*cuts)]
    assert len(boxes) == math.prod(n // 2 for n in size) and tiling_fault(size, boxes) is None
    boxes[-1] = ([4, 2, 2, 4], [2, 2, 2, 1])
    assert (
        tiling_fault(size, boxes)
        == "element [4, 2, 2, 5] is in no chunk (its chunks hold 568 elements in all, it has 576)"
    )
