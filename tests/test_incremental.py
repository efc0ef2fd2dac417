"""Incremental saves: unchanged tensors are referenced in the base, never written twice, and load back exactly."""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import SMALL, empty_like, failure, load, needs_xxhash, same_bytes

import fp_dcp.save.incremental
from fp_dcp import FastPersistWriter, IOConfig, verify_checkpoint
from fp_dcp._native import _cio
from fp_dcp.checkpoint import open_checkpoint
from fp_dcp.errors import CorruptCheckpointError
from fp_dcp.testing.ranks import run_ranks
from fp_dcp.tools.convert import convert
from fp_dcp.tools.inspect import inspect_checkpoint

pytestmark = needs_xxhash

FROZEN, TRAINED = (256, 1024), (64, 512)  # 1 MiB of float32 that never changes, 128 KiB that does


def state_at(step: int) -> dict:
    """A fine-tuning-shaped state: frozen weights, a trained layer and its optimizer moment, the step."""
    frozen = torch.Generator().manual_seed(1234)
    trained = torch.Generator().manual_seed(step)
    return {
        "model": {
            "frozen": torch.randn(FROZEN, generator=frozen),
            "frozen_t": torch.randn(FROZEN[::-1], generator=frozen).t(),  # not contiguous: hashed slab by slab
            "trained": torch.randn(TRAINED, generator=trained),
        },
        "optim": {"exp_avg": torch.randn(TRAINED, generator=trained), "step": step},
    }


TRAINED_BYTES = 2 * 4 * TRAINED[0] * TRAINED[1]
FROZEN_BYTES = 2 * 4 * FROZEN[0] * FROZEN[1]


def save_step(root, step: int, writer: FastPersistWriter, base: int | None, state: dict | None = None):
    writer.base = None if base is None else str(root / f"step-{base}")
    dcp.save(
        state_at(step) if state is None else state, checkpoint_id=str(root / f"step-{step}"), storage_writer=writer
    )
    return writer.last_save


def assert_loads(path, expected: dict, **kwargs) -> None:
    out = empty_like(expected)
    load(out, path, **kwargs)
    for key in ("frozen", "frozen_t", "trained"):
        assert same_bytes(out["model"][key], expected["model"][key]), key
    assert same_bytes(out["optim"]["exp_avg"], expected["optim"]["exp_avg"])
    assert out["optim"]["step"] == expected["optim"]["step"]


@pytest.mark.parametrize(
    "config",
    [IOConfig(), SMALL, IOConfig(engine="threads", direct_io=False)],
    ids=["default", "small-buffers", "threads-page-cache"],
)
def test_unchanged_tensors_are_referenced_in_the_first_writer_and_load_bit_exact(tmp_path, config):
    with FastPersistWriter(incremental=True, config=config) as writer:
        first = save_step(tmp_path, 1, writer, None)
        second = save_step(tmp_path, 2, writer, 1)
        third = save_step(tmp_path, 3, writer, 2)
    assert first.referenced == 0 and first.bytes >= FROZEN_BYTES + TRAINED_BYTES
    for later in (second, third):
        assert later.referenced == FROZEN_BYTES
        # what was written: the changed tensors and the pickled step, nothing of the frozen ones
        assert TRAINED_BYTES <= later.bytes <= 1.1 * TRAINED_BYTES + 2048
    for step in (1, 2, 3):
        assert_loads(tmp_path / f"step-{step}", state_at(step), config=config)
        assert verify_checkpoint(tmp_path / f"step-{step}").ok
    checkpoint = open_checkpoint(tmp_path / "step-3")
    # references point at the checkpoint that wrote the bytes, never through step-2
    assert set(checkpoint.owners.values()) == {str(tmp_path / "step-1")}
    assert {e.get("owner") for e in checkpoint.footer["files"].values()} == {None, "../step-1"}
    assert checkpoint.footer["format_version"] == 3
    assert open_checkpoint(tmp_path / "step-1").footer["format_version"] == 2  # no references: readable by older fp-dcp
    own = sum(os.path.getsize(p) for p in checkpoint.own_files().values())
    assert own <= 1.1 * TRAINED_BYTES + 4096


def test_each_stored_hash_is_the_xxh3_128_of_the_items_bytes(tmp_path):
    state = state_at(1)
    with FastPersistWriter(incremental=True) as writer:
        save_step(tmp_path, 1, writer, None, state)
    checkpoint = open_checkpoint(tmp_path / "step-1")
    hashed = 0
    for index, location in checkpoint.metadata.storage_data.items():
        with open(checkpoint.files[location.file], "rb") as f:
            f.seek(location.offset)
            raw = f.read(location.length)
        h = _cio.Hash128()
        h.update(raw)
        assert location.xxh3_128 == h.hexdigest(), index.fqn
        hashed += 1
    assert hashed == 5


def test_the_same_bytes_under_another_dtype_or_shape_are_written_again(tmp_path):
    w = torch.randn(64, 64)
    with FastPersistWriter(incremental=True) as writer:
        writer.base = None
        dcp.save({"w": w, "v": w.clone()}, checkpoint_id=str(tmp_path / "a"), storage_writer=writer)
        writer.base = str(tmp_path / "a")
        dcp.save(
            {"w": w.view(torch.int32), "v": w.reshape(32, 128)},
            checkpoint_id=str(tmp_path / "b"),
            storage_writer=writer,
        )
        assert writer.last_save.referenced == 0
        out = {"w": torch.zeros(64, 64, dtype=torch.int32), "v": torch.zeros(32, 128)}
    load(out, tmp_path / "b")
    assert same_bytes(out["w"], w.view(torch.int32)) and same_bytes(out["v"], w.reshape(32, 128))


def test_only_items_whose_sample_is_unchanged_are_hashed_before_writing(tmp_path, monkeypatch):
    hashed: list[int] = []
    real = fp_dcp.save.incremental.digest
    monkeypatch.setattr(fp_dcp.save.incremental, "digest", lambda source: hashed.append(source.nbytes) or real(source))
    frozen_bytes = FROZEN_BYTES // 2
    with FastPersistWriter(incremental=True) as writer:
        save_step(tmp_path, 1, writer, None)
        assert hashed == []  # no base: nothing to compare with
        save_step(tmp_path, 2, writer, 1)
        assert hashed == [frozen_bytes] * 2  # the trained ones' samples differ: written at once
        # A change outside the sample (element [7, 7]) is caught by the full hash; one inside it ([0, 0]) by the
        # sample, before any hashing. frozen_t is not contiguous: it has no sample and is always hashed.
        state = state_at(3)
        state["model"]["frozen"][7, 7] += 1
        hashed.clear()
        assert save_step(tmp_path, 3, writer, 2, state).referenced == frozen_bytes
        assert hashed == [frozen_bytes] * 2
        state = state_at(4)
        state["model"]["frozen"][7, 7] += 1
        state["model"]["frozen"][0, 0] += 1
        hashed.clear()
        assert save_step(tmp_path, 4, writer, 3, state).referenced == frozen_bytes
        assert hashed == [frozen_bytes]
    assert_loads(tmp_path / "step-4", state)
    samples = {i.fqn: loc.xxh3_sample for i, loc in open_checkpoint(tmp_path / "step-4").metadata.storage_data.items()}
    assert samples["model.frozen"] and samples["model.trained"] and samples["optim.step"] is None
    assert samples["model.frozen_t"] is None


def test_a_sample_is_the_hash_of_16_windows_spread_over_the_item(tmp_path):
    t = torch.randn(300_000)
    with FastPersistWriter(incremental=True) as writer:
        dcp.save({"t": t}, checkpoint_id=str(tmp_path / "a"), storage_writer=writer)
    location = next(iter(open_checkpoint(tmp_path / "a").metadata.storage_data.values()))
    raw = t.numpy().tobytes()
    step = (len(raw) - 4096) // 15
    offsets = [i * (len(raw) - 4096) // 15 for i in range(16)]
    assert offsets[1] == step and offsets[-1] == len(raw) - 4096
    h = _cio.Hash128()
    h.update(b"".join(raw[o : o + 4096] for o in offsets))
    assert location.xxh3_sample == h.hexdigest()


def test_a_save_over_its_own_base_keeps_the_files_it_references(tmp_path):
    path = tmp_path / "ckpt"
    with FastPersistWriter(path, incremental=True) as writer:
        dcp.save(state_at(1), storage_writer=writer)
        writer.base = str(path)
        dcp.save(state_at(2), storage_writer=writer)
        assert writer.last_save.referenced == FROZEN_BYTES
    checkpoint = open_checkpoint(path)
    assert set(checkpoint.owners.values()) == {str(path)} and len(checkpoint.files) == 2
    assert checkpoint.referenced_checkpoints() == set()
    assert sorted(n for n in os.listdir(path) if n.endswith(".distcp")) == sorted(checkpoint.files)
    assert_loads(path, state_at(2))
    assert verify_checkpoint(path).ok


def test_references_reach_the_base_files_in_data_dirs_also_after_the_run_moved(tmp_path):
    run = tmp_path / "run"
    data = [str(run / "nvme0"), str(run / "nvme1")]
    with FastPersistWriter(incremental=True, data_dirs=data, lanes_per_dir=2) as writer:
        save_step(run, 1, writer, None)
        assert save_step(run, 2, writer, 1).referenced == FROZEN_BYTES
    checkpoint = open_checkpoint(run / "step-2")
    subdir = open_checkpoint(run / "step-1").footer["data_subdir"]
    assert {e.get("data_subdir") for n, e in checkpoint.footer["files"].items() if n in checkpoint.owners} == {subdir}
    shutil.move(str(run), str(tmp_path / "moved"))
    assert_loads(tmp_path / "moved" / "step-2", state_at(2))
    assert verify_checkpoint(tmp_path / "moved" / "step-2").ok


def test_inspect_and_convert_follow_references(tmp_path):
    with FastPersistWriter(incremental=True) as writer:
        save_step(tmp_path, 1, writer, None)
        save_step(tmp_path, 2, writer, 1)
    about = inspect_checkpoint(tmp_path / "step-2")
    frozen = next(item for item in about["items"] if item["fqn"] == "model.frozen")
    assert frozen["bytes"] == FROZEN_BYTES // 2 and about["paths"][frozen["files"][0]].startswith(
        str(tmp_path / "step-1")
    )
    convert(tmp_path / "step-2", tmp_path / "whole.pt", to="torch")
    whole = torch.load(tmp_path / "whole.pt", weights_only=False)
    assert same_bytes(whole["model"]["frozen"], state_at(2)["model"]["frozen"])
    assert same_bytes(whole["model"]["trained"], state_at(2)["model"]["trained"])


def test_a_missing_or_damaged_referenced_file_is_reported_not_loaded(tmp_path):
    with FastPersistWriter(incremental=True) as writer:
        save_step(tmp_path, 1, writer, None)
        save_step(tmp_path, 2, writer, 1)
    checkpoint = open_checkpoint(tmp_path / "step-2")
    location = next(loc for index, loc in checkpoint.metadata.storage_data.items() if index.fqn == "model.frozen")
    path = tmp_path / "step-1" / location.file
    data = bytearray(path.read_bytes())
    data[location.offset + 10] ^= 1  # inside model.frozen, which step-2 references
    path.write_bytes(bytes(data))
    report = verify_checkpoint(tmp_path / "step-2")
    assert not report.ok and "model.frozen" in report.problems[0] and "checksum mismatch" in report.problems[0]
    with pytest.raises(BaseException) as e:
        load(empty_like(state_at(2)), tmp_path / "step-2")
    assert isinstance(failure(e), CorruptCheckpointError) and "model.frozen" in str(failure(e))
    path.unlink()
    report = verify_checkpoint(tmp_path / "step-2")
    assert not report.ok and f"{path} is missing" in report.problems[0]


def test_an_unreadable_base_or_one_saved_elsewhere_means_a_full_save(tmp_path, caplog):
    with FastPersistWriter(incremental=True) as writer:
        save_step(tmp_path, 1, writer, None)
        with caplog.at_level(logging.WARNING, logger="fp_dcp"):
            assert save_step(tmp_path, 2, writer, 9).referenced == 0
        assert "step-9 cannot be read, saving in full" in caplog.text
    with FastPersistWriter(incremental=True, data_dirs=[str(tmp_path / "disk")]) as writer:
        with caplog.at_level(logging.WARNING, logger="fp_dcp"):
            assert save_step(tmp_path, 3, writer, 1).referenced == 0
        assert "was saved with data_dirs []" in caplog.text
    assert_loads(tmp_path / "step-3", state_at(3))


def test_base_needs_incremental_and_incremental_needs_the_hash(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="needs incremental=True"):
        FastPersistWriter(tmp_path, base=tmp_path)
    monkeypatch.setattr(fp_dcp.save.incremental, "HASHING", False)
    with pytest.raises(RuntimeError, match="libxxhash"):
        FastPersistWriter(tmp_path, incremental=True)


def _ranks_incremental(rank: int, world: int, root: str) -> list[int]:
    # Replicated tensors are split between ranks by DCP's planner; "own" ones are per rank.
    referenced = []
    with FastPersistWriter(incremental=True) as writer:
        for step in (1, 2, 3):
            state = state_at(step)
            state[f"own{rank}"] = torch.full((1000,), float(rank))
            writer.base = f"{root}/step-{step - 1}" if step > 1 else None
            dcp.save(state, checkpoint_id=f"{root}/step-{step}", storage_writer=writer)
            referenced.append(writer.last_save.referenced)
    return referenced


def test_every_rank_references_its_own_unchanged_items_and_one_process_loads_them(tmp_path):
    root = str(tmp_path)
    results = run_ranks(2, _ranks_incremental, root)
    assert all(r[0] == 0 and r[1] > 0 and r[1] == r[2] for r in results)
    assert sum(r[1] for r in results) == FROZEN_BYTES + 2 * 4000  # the frozen tensors and both "own" ones
    expected = state_at(3)
    expected.update({"own0": torch.zeros(1000), "own1": torch.ones(1000)})
    out = empty_like(expected)
    load(out, tmp_path / "step-3")  # one process reads what two wrote
    assert same_bytes(out["model"]["frozen"], expected["model"]["frozen"])
    assert same_bytes(out["own1"], expected["own1"]) and same_bytes(
        out["model"]["trained"], expected["model"]["trained"]
    )
    assert verify_checkpoint(tmp_path / "step-3").ok
