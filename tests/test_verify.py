"""``verify_checkpoint`` finds every damaged byte, file and metadata, and names what it hit."""

from __future__ import annotations

import itertools
import os
import random
import shutil
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import SMALL, empty_like, failure, load, save
from test_bad_input import rewrite_footer
from test_distributed import SHAPES
from test_distributed import _save as distributed_save
from test_format_rules import edit
from test_roundtrip import ENGINES, check_equal, mixed_state
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.tensor import Shard

from fp_dcp import (
    CorruptCheckpointError,
    FastPersistReader,
    FastPersistWriter,
    IncompatibleCheckpointError,
    NotACheckpointError,
    format,
    verify_checkpoint,
)
from fp_dcp.format import HASHING
from fp_dcp.testing.ranks import run_ranks

FLIPS = 60


def state() -> dict:
    """Large and small items, so a data file has item bytes, alignment gaps and tail padding; the same every call."""
    g = torch.Generator().manual_seed(0)
    return {
        "big": torch.randn(300, 400, generator=g),
        "small": {f"s{i}": torch.randn(7 + i, generator=g) for i in range(12)},
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
        "view": torch.arange(3000.0).reshape(60, 50).t(),
        "extra": {"step": 11, "name": "run"},
    }


def data_files(path) -> list:
    return sorted(p for p in path.iterdir() if p.suffix == ".distcp")


def spans(path) -> list[tuple[str, int, int, str]]:
    """(file, start, stop, fqn) of every stored item."""
    storage = FastPersistReader(path).read_metadata().storage_data
    return [(file, offset, offset + length, index.fqn) for index, (file, offset, length, *_) in storage.items()]


@pytest.fixture
def three_files(ckpt):
    save(state(), ckpt, lanes_per_dir=3, config=SMALL)
    assert len(data_files(ckpt)) == 3
    return ckpt


CONFIGS = {**ENGINES, "small-buffers": SMALL}


@pytest.mark.parametrize("config", CONFIGS)
def test_intact_checkpoint_passes_and_counts_everything(ckpt, config):
    save(mixed_state(), ckpt, lanes_per_dir=2, config=CONFIGS[config])
    (ckpt / "__0_0.0123456789abcdef.distcp").write_bytes(b"leftover of a save that died")  # not listed: ignored
    calls: list[tuple[int, int]] = []
    report = verify_checkpoint(ckpt, progress=lambda done, total: calls.append((done, total)))
    assert report.ok and report.problems == [] and report.checksums, report.problems
    stored = spans(ckpt)
    assert report.items == len(stored)
    assert report.bytes == sum(stop - start for _, start, stop, _ in stored)
    assert report.files == 2
    total = sum(p.stat().st_size for p in data_files(ckpt)) - len(b"leftover of a save that died")
    assert calls[0] == (0, total) and calls[-1] == (total, total)
    assert all(a[0] <= b[0] for a, b in itertools.pairwise(calls)) and {t for _, t in calls} == {total}


def test_random_single_byte_flips_are_all_detected(three_files):
    """Any byte of any file: verify always notices; a load notices every flip in the bytes it uses."""
    ckpt = three_files
    files = [*data_files(ckpt), ckpt / ".metadata"]
    items = spans(ckpt)
    expected = state()
    rng = random.Random(1234)
    kinds = {"item": 0, "padding": 0, "metadata": 0}
    detected = 0
    for _ in range(FLIPS):
        path = rng.choice(files)
        original = path.read_bytes()
        pos = rng.randrange(len(original))
        damaged = bytearray(original)
        damaged[pos] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(damaged))
        hit = [fqn for file, start, stop, fqn in items if file == path.name and start <= pos < stop]
        kind = "metadata" if path.name == ".metadata" else ("item" if hit else "padding")
        kinds[kind] += 1

        report = verify_checkpoint(ckpt)
        assert not report.ok, (path.name, pos)
        assert any(path.name in problem for problem in report.problems), report.problems
        if hit:
            assert any(repr(hit[0]) in problem and "checksum mismatch" in problem for problem in report.problems)
        detected += not report.ok

        target = empty_like(expected)
        if kind == "padding":  # bytes no item uses: the load is right, and verify was the one to notice
            load(target, ckpt)
            check_equal(expected, target)
        else:
            with pytest.raises(CheckpointException) as e:
                load(target, ckpt)
            err = failure(e)
            # DCP (from torch 2.8) re-raises a failed metadata read as its own AssertionError, keeping our message
            assert isinstance(err, CorruptCheckpointError if hit else (AssertionError, CorruptCheckpointError)), err
            assert path.name in str(err) and (not hit or repr(hit[0]) in str(err)), err
        path.write_bytes(original)
    print(f"{detected}/{FLIPS} flips detected: {kinds}")  # shown with -s
    assert detected == FLIPS
    assert all(kinds.values()), kinds  # the trials did reach item bytes, padding and .metadata
    assert verify_checkpoint(ckpt).ok


@pytest.mark.parametrize("cut", ["half", "to_zero", "last_byte"])
def test_truncated_data_file_is_reported(three_files, cut):
    for f in data_files(three_files):
        original = f.read_bytes()
        keep = {"half": len(original) // 2, "to_zero": 0, "last_byte": len(original) - 1}[cut]
        f.write_bytes(original[:keep])
        report = verify_checkpoint(three_files)
        assert not report.ok
        assert any(f"{f.name} is truncated: {keep} bytes, written as {len(original)}" in p for p in report.problems)
        cut_items = [fqn for file, _, stop, fqn in spans(three_files) if file == f.name and stop > keep]
        for fqn in cut_items:
            assert any(repr(fqn) in p and "before the end of the item" in p for p in report.problems), report.problems
        assert not any("outside every item" in p for p in report.problems)  # a cut is not mistaken for damage
        f.write_bytes(original)


def test_deleted_data_file_is_reported_with_its_items(three_files):
    for f in data_files(three_files):
        original = f.read_bytes()
        f.unlink()
        report = verify_checkpoint(three_files)
        assert not report.ok
        (problem,) = report.problems
        held = {fqn for file, _, _, fqn in spans(three_files) if file == f.name}
        assert f"{f.name} is missing; it holds {len(held)} item(s)" in problem
        assert any(repr(fqn) in problem for fqn in held)
        f.write_bytes(original)
    assert verify_checkpoint(three_files).ok


@pytest.mark.parametrize("content", [b"", b"garbage" * 100, b"\x80\x05N."], ids=["empty", "garbage", "pickle_none"])
def test_unreadable_metadata_is_a_problem_not_a_crash(ckpt, content):
    save(state(), ckpt)
    (ckpt / ".metadata").write_bytes(content)
    report = verify_checkpoint(ckpt)
    assert not report.ok and report.items == 0
    (problem,) = report.problems
    assert ".metadata" in problem and "not fp-dcp metadata" in problem


def test_what_is_not_a_checkpoint_raises(tmp_path, ckpt):
    with pytest.raises(NotACheckpointError, match="is not a directory"):
        verify_checkpoint(tmp_path / "nowhere")
    (tmp_path / "plain").mkdir()
    with pytest.raises(NotACheckpointError, match=r"holds no checkpoint: \.metadata is missing"):
        verify_checkpoint(tmp_path / "plain")
    save(state(), ckpt)
    rewrite_footer(ckpt, format_version=format.FORMAT_VERSION + 1)
    with pytest.raises(IncompatibleCheckpointError, match="upgrade fp-dcp"):
        verify_checkpoint(ckpt)


def test_checkpoint_with_data_dirs(tmp_path):
    dirs = [tmp_path / "ssd0", tmp_path / "ssd1"]
    ckpt = tmp_path / "ckpt"
    save(state(), ckpt, data_dirs=dirs, config=SMALL)
    assert verify_checkpoint(ckpt, dirs).ok
    assert verify_checkpoint(ckpt).ok  # found where the save put them
    with pytest.raises(NotACheckpointError, match="pass that many directories as data_dirs="):
        verify_checkpoint(ckpt, dirs[:1])
    shutil.rmtree(dirs[1])
    report = verify_checkpoint(ckpt, dirs)
    assert not report.ok and "data_dirs[1]" in report.problems[0]


def test_stock_checkpoint_has_no_checksums_but_files_are_checked(ckpt):
    dcp.save(state(), storage_writer=FileSystemWriter(str(ckpt)))
    report = verify_checkpoint(ckpt)
    assert report.ok and not report.checksums and report.bytes == 0 and report.items > 0
    (f,) = data_files(ckpt)
    original = f.read_bytes()
    f.write_bytes(original[:100])
    report = verify_checkpoint(ckpt)
    assert not report.ok and all(f.name in p and "before the item's end" in p for p in report.problems)
    f.unlink()
    report = verify_checkpoint(ckpt)
    assert not report.ok and f"{f.name} is missing" in report.problems[0]


def test_checkpoint_saved_by_three_ranks(ckpt):
    """Sharded tensors: chunks at non-zero offsets, one data file per rank."""
    run_ranks(3, distributed_save, str(ckpt), (3,), {name: [Shard(0)] for name in SHAPES}, {})
    report = verify_checkpoint(ckpt)
    assert report.ok and report.files == 3 and report.items == 3 * len(SHAPES)
    f = data_files(ckpt)[1]
    damaged = bytearray(f.read_bytes())
    damaged[0] ^= 0x40  # the first byte of rank 1's first chunk
    f.write_bytes(bytes(damaged))
    (problem,) = verify_checkpoint(ckpt).problems
    assert "checksum mismatch" in problem and "(chunk at [" in problem and f.name in problem


def test_a_nodes_copy_lacking_other_nodes_files_is_partial_and_what_it_holds_is_checked(three_files, capsys):
    """A tiered step's copy on one node (``.node``) holds that node's files: the others are no damage."""
    from fp_dcp.tools.cli import main

    files = data_files(three_files)
    files[0].unlink()
    files[2].unlink()
    assert not verify_checkpoint(three_files).ok  # without .node, a missing file is damage
    (three_files / ".node").write_text("n1\n")
    report = verify_checkpoint(three_files)
    assert report.ok and report.problems == [] and report.files == 3, report
    assert report.bytes == sum(stop - start for file, start, stop, _ in spans(three_files) if file == files[1].name)
    assert report.partial == "partial: node n1's files only (1 of 3 data files), complete with the other tiers' roots"
    assert main(["verify", str(three_files)]) == 0
    assert f"{three_files}: partial: node n1's files only" in capsys.readouterr().out
    damaged = bytearray(files[1].read_bytes())
    damaged[-1] ^= 1  # its padding
    files[1].write_bytes(bytes(damaged))
    report = verify_checkpoint(three_files)
    assert not report.ok and report.partial and len(report.problems) == 1 and "not zero" in report.problems[0]
    assert main(["verify", str(three_files)]) == 1
    assert "DAMAGED (1 problem), partial: node n1's files only" in capsys.readouterr().out
    files[1].write_bytes(bytes(damaged[:4096]))  # a file of this node's cut short: damage, not partial
    report = verify_checkpoint(three_files)
    assert any(f"{files[1].name} is truncated" in p for p in report.problems), report.problems


def test_a_node_marker_that_is_a_fifo_marks_no_copy_and_is_not_waited_on(three_files):
    """Only a regular file named .node marks a node's copy (runs.md): a FIFO there does not, and is not read."""
    from fp_dcp.runs.steps import inspect_step

    missing = data_files(three_files)[0]
    missing.unlink()
    os.mkfifo(three_files / ".node")
    outcome: list = []
    checks = threading.Thread(
        target=lambda: outcome.extend([verify_checkpoint(three_files), inspect_step(1, str(three_files), False)]),
        daemon=True,
    )
    checks.start()
    checks.join(20)
    if checks.is_alive():  # opened for reading, a FIFO waits for a writer: let it go
        os.close(os.open(three_files / ".node", os.O_WRONLY | os.O_NONBLOCK))
    assert not checks.is_alive(), "verify waited on the FIFO"
    report, info = outcome
    assert not report.ok and not report.partial  # a missing file is damage, as in any checkpoint
    assert any(missing.name in p and "missing" in p for p in report.problems), report.problems
    assert info.status == "corrupt" and missing.name in info.problem


@pytest.mark.skipif(not HASHING, reason="fp_dcp._native._cio was built without libxxhash")
def test_an_incremental_saves_hashes_are_checked_where_the_crc_agrees(ckpt):
    with FastPersistWriter(ckpt, incremental=True) as writer:
        dcp.save(state(), storage_writer=writer, no_dist=True)
    assert verify_checkpoint(ckpt).ok
    for index, location in FastPersistReader(ckpt).read_metadata().storage_data.items():
        assert location.xxh3_128 is not None, index  # every item of an incremental save has its hash

    def spoil(md, footer):
        info = md.storage_data[MetadataIndex("big", [0, 0])]
        info.xxh3_128, info.xxh3_sample = "0" * 32, "f" * 32

    edit(ckpt, metadata=spoil)
    (problem,) = verify_checkpoint(ckpt).problems
    assert problem.startswith("hash mismatch for 'big' (chunk at [0, 0])") and "(its CRC-32C matches)" in problem
    assert f"xxh3_128 stored {'0' * 32}, read " in problem and f"xxh3_sample stored {'f' * 32}, read " in problem
    target = empty_like(state())
    load(target, ckpt)  # the loader checks the CRC-32C, which holds
    check_equal(state(), target)
