"""The extent planner and the byte-range reads built on it."""

from __future__ import annotations

import mmap
import random

import pytest
import torch
from conftest import SMALL, save
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from fp_dcp import FastPersistReader
from fp_dcp._native import _cio
from fp_dcp.format import layout
from fp_dcp.io.extents import Piece, plan_extents
from fp_dcp.load.targets import byte_runs


def random_layout(rng: random.Random, n: int) -> list[Piece]:
    """Items of random sizes, half of them with page-congruent memory (direct-eligible)."""
    lengths = [rng.choice([0, 1, 63, 4096, 5000, 70_000, 300_000]) for _ in range(n)]
    memory = mmap.mmap(-1, sum(lengths) + 4096 * (n + 1))
    mems, cursor = [], 0
    for length in lengths:
        cursor = -(-cursor // 4096) * 4096 + (rng.randrange(64) * 64 if rng.random() < 0.5 else 0)
        mems.append(memoryview(memory)[cursor : cursor + length])
        cursor += length
    offsets, _ = layout([(ln, _cio.address(m)) for ln, m in zip(lengths, mems, strict=True)], large=4096)
    return [Piece(o, ln, i, 0, m) for i, (o, ln, m) in enumerate(zip(offsets, lengths, mems, strict=True))]


@pytest.mark.parametrize("seed", range(20))
def test_write_extents_tile_the_file_aligned(seed):
    rng = random.Random(seed)
    pieces = random_layout(rng, rng.randrange(1, 30))
    align = rng.choice([512, 4096])
    capacity = align * rng.choice([2, 16, 64])
    covered = [0] * len(pieces)
    previous_end = None
    for ext in plan_extents(pieces, align, capacity, direct_min=align, max_waste=None):
        assert ext.file_offset % align == 0 and ext.length % align == 0 and ext.length > 0
        if previous_end is not None:
            assert ext.file_offset >= previous_end  # writes never overlap
        previous_end = ext.file_offset + ext.length
        if ext.direct is not None:
            assert (_cio.address(ext.direct.memory) - ext.file_offset) % align == 0
            assert len(ext.direct.memory) == ext.length
            covered[ext.direct.owner] += ext.length
        else:
            assert ext.length <= capacity
            for owner, owner_offset, buf_offset, length in ext.parts:
                assert 0 <= buf_offset and buf_offset + length <= ext.length
                piece = pieces[owner]
                assert ext.file_offset + buf_offset == piece.file_offset + owner_offset
                covered[owner] += length
    assert covered == [p.length for p in pieces]


@pytest.mark.parametrize("seed", range(10))
def test_read_extents_skip_holes_and_allow_overlap(seed):
    rng = random.Random(seed)
    spans = sorted((rng.randrange(0, 1 << 20), rng.randrange(1, 20000)) for _ in range(rng.randrange(1, 20)))
    pieces = [Piece(start, length, i, 0, None) for i, (start, length) in enumerate(spans)]
    got = dict.fromkeys(range(len(pieces)), 0)
    read = count = 0
    for ext in plan_extents(pieces, 512, 1 << 16, 1 << 30, max_waste=0.05):
        assert ext.file_offset % 512 == 0 and ext.length % 512 == 0
        read += ext.length
        count += 1
        for owner, owner_offset, buf_offset, length in ext.parts:
            assert ext.file_offset + buf_offset == pieces[owner].file_offset + owner_offset
            got[owner] += length
    assert got == {i: p.length for i, p in enumerate(pieces)}
    needed = sum(p.length for p in pieces)
    assert read <= 1.05 * needed + 2 * 512 * count  # holes read through: at most 5%, plus alignment


def test_layout_packs_small_items_and_coaligns_large_ones():
    offsets, size = layout(
        [(10, None), (100, 4096 * 7 + 64), (5000, 4096 * 3 + 192), (1, None), (5000, None)], large=4096
    )
    assert offsets[0] == 0 and offsets[1] == 64  # small: packed at 64 bytes
    assert offsets[2] % 4096 == 192  # large: congruent to its address modulo a page
    assert offsets[3] % 64 == 0 and offsets[3] >= offsets[2] + 5000
    assert offsets[4] % 4096 == 0  # large, address unknown: page aligned
    assert size % 4096 == 0 and size >= offsets[4] + 5000


def test_byte_runs_of_boxes():
    # a dim-0 slice is one run; full trailing dims merge
    assert byte_runs(torch.Size([10, 4]), torch.Size([3, 0]), torch.Size([5, 4]), 2) == [(24, 40)]
    # a column block: one run per row
    assert byte_runs(torch.Size([3, 4]), torch.Size([0, 1]), torch.Size([3, 2]), 1) == [(1, 2), (5, 2), (9, 2)]
    assert byte_runs(torch.Size([]), torch.Size([]), torch.Size([]), 8) == [(0, 8)]
    assert byte_runs(torch.Size([5]), torch.Size([2]), torch.Size([0]), 4) == []


class _Planner:
    """The two LoadPlanner calls read_data makes, recording what arrives."""

    def __init__(self, targets: dict[int, torch.Tensor]) -> None:
        self.targets = targets
        self.committed: list[int] = []

    def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
        return self.targets[item.dest_index.index]

    def commit_tensor(self, item: ReadItem, tensor: torch.Tensor) -> None:
        assert tensor.data_ptr() == self.targets[item.dest_index.index].data_ptr()  # filled in place
        self.committed.append(item.dest_index.index)


@pytest.mark.parametrize("config", [None, SMALL], ids=["default", "small-buffers"])
def test_byte_range_reads_load_slices(ckpt, config):
    """Load parts of a stored tensor, as resharding does, reading only what they need."""
    full = torch.randn(2048, 512)
    save({"w": full}, ckpt, **({"config": config} if config else {}))
    reader = FastPersistReader(ckpt, **({"config": config} if config else {}))
    reader.set_up_storage_reader(reader.read_metadata(), True)
    boxes = {0: ((100, 0), (300, 512)), 1: ((0, 128), (2048, 256)), 2: ((2047, 511), (1, 1))}
    targets = {i: torch.zeros(lengths) for i, (_, lengths) in boxes.items()}
    items = [
        ReadItem(
            LoadItemType.TENSOR,
            MetadataIndex("w", [0, 0], i),
            torch.Size([0, 0]),
            MetadataIndex("w", [0, 0], 0),
            torch.Size(off),
            torch.Size(lengths),
        )
        for i, (off, lengths) in boxes.items()
    ]
    planner = _Planner(targets)
    reader.read_data(LoadPlan([items[0]]), planner).wait()
    assert reader.last_load.bytes < full.nbytes // 4  # the slice, not the 4 MiB tensor
    reader.read_data(LoadPlan(items[1:]), planner).wait()
    for i, (off, lengths) in boxes.items():
        assert torch.equal(targets[i], full[off[0] : off[0] + lengths[0], off[1] : off[1] + lengths[1]]), i
    assert sorted(planner.committed) == [0, 1, 2]
