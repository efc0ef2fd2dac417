"""Damaged safetensors checkpoints: each is a clear error naming the file and the tensor, never wrong data.

safetensors stores no checksums, so every structural fault gets a test of its own.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import failure
from hf_util import INDEX, llama_state, raw_file, safetensors_torch, write_model
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

import fp_dcp
from fp_dcp import FastPersistReader
from fp_dcp.errors import CorruptCheckpointError, IncompatibleCheckpointError

F32x4 = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}


def load_error(path, state: dict[str, torch.Tensor], planner=None) -> str:
    """The message of the error ``dcp.load`` raises for this rank."""
    with pytest.raises(BaseException) as e:  # CheckpointException is a BaseException
        dcp.load(state, storage_reader=FastPersistReader(path), planner=planner, no_dist=True)
    return str(failure(e))


def two_tensors(directory) -> str:
    path = os.path.join(directory, "model.safetensors")
    safetensors_torch.save_file({"a": torch.arange(8.0), "b": torch.arange(8.0, 16.0)}, path)
    return path


def state_ab() -> dict[str, torch.Tensor]:
    return {"a": torch.zeros(8), "b": torch.zeros(8)}


def test_a_truncated_file_names_the_file_and_the_tensor_cut_short(tmp_path):
    path = two_tensors(tmp_path)
    os.truncate(path, os.path.getsize(path) - 10)
    message = load_error(tmp_path, state_ab())
    assert path in message and "'b'" in message and "runs past the end of the file" in message


def test_a_header_length_past_the_end_of_the_file(tmp_path):
    path = two_tensors(tmp_path)
    with open(path, "r+b") as f:
        f.write(struct.pack("<Q", os.path.getsize(path)))
    with pytest.raises(CorruptCheckpointError, match=r"header length .* runs past the end of the file") as e:
        FastPersistReader(tmp_path).read_metadata()
    assert path in str(e.value)


def test_a_file_shorter_than_its_header_length(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00")
    with pytest.raises(CorruptCheckpointError, match="truncated: 3 bytes, too short for the 8-byte header length"):
        FastPersistReader(tmp_path).read_metadata()


def test_header_json_that_does_not_parse(tmp_path):
    raw_file(tmp_path / "model.safetensors", b'{"a": {"dtype": "F32", "shape": [4], ', bytes(16))
    message = load_error(tmp_path, {"a": torch.zeros(4)})
    assert str(tmp_path / "model.safetensors") in message and "the header is not valid JSON" in message
    assert "char 37" in message  # where it stops parsing: no tensor can be named


def test_byte_ranges_that_overlap(tmp_path):
    raw_file(tmp_path / "model.safetensors", {"a": F32x4, "b": {**F32x4, "data_offsets": [8, 24]}}, bytes(24))
    message = load_error(tmp_path, {"a": torch.zeros(4), "b": torch.zeros(4)})
    assert "tensors 'a' (bytes 0..16) and 'b' (bytes 8..24) overlap" in message
    assert str(tmp_path / "model.safetensors") in message


def test_byte_ranges_that_leave_a_hole(tmp_path):
    raw_file(tmp_path / "model.safetensors", {"a": F32x4, "b": {**F32x4, "data_offsets": [20, 36]}}, bytes(36))
    with pytest.raises(CorruptCheckpointError) as e:
        FastPersistReader(tmp_path).read_metadata()
    assert "bytes 16..20 of the data, after tensor 'a' and before tensor 'b', belong to no tensor" in str(e.value)


def test_bytes_after_the_last_tensor_belong_to_no_tensor(tmp_path):
    raw_file(tmp_path / "model.safetensors", {"a": F32x4}, bytes(20))
    with pytest.raises(CorruptCheckpointError, match="4 bytes after the last tensor, 'a', belong to no tensor"):
        FastPersistReader(tmp_path).read_metadata()


def test_a_byte_range_past_the_end_of_the_file(tmp_path):
    raw_file(tmp_path / "model.safetensors", {"a": F32x4, "b": {**F32x4, "data_offsets": [16, 32]}}, bytes(16))
    message = load_error(tmp_path, {"a": torch.zeros(4), "b": torch.zeros(4)})
    assert "tensor 'b' (bytes 16..32 of the data) runs past the end of the file, whose data holds 16 bytes" in message


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        ({**F32x4, "data_offsets": [0, 12]}, "is F32 of shape [4] (16 bytes), but its byte range 0..12 holds 12"),
        ({**F32x4, "shape": [5]}, "is F32 of shape [5] (20 bytes), but its byte range 0..16 holds 16"),
        ({**F32x4, "dtype": "BF16"}, "is BF16 of shape [4] (8 bytes), but its byte range 0..16 holds 16"),
        ({**F32x4, "dtype": "Q7"}, "has unknown dtype 'Q7'"),
        ({**F32x4, "shape": [-4]}, "its shape [-4] is not a list of non-negative integers"),
        ({**F32x4, "data_offsets": [16, 0]}, "its data_offsets [16, 0] are not [begin, end]"),
    ],
)
def test_a_dtype_or_shape_that_disagrees_with_the_byte_range(tmp_path, entry, problem):
    raw_file(tmp_path / "model.safetensors", {"a": entry}, bytes(16))
    message = load_error(tmp_path, {"a": torch.zeros(4)})
    assert f"{tmp_path / 'model.safetensors'}: tensor 'a'" in message and problem in message, message


def test_a_sub_byte_dtype_torch_cannot_hold_is_refused_by_name(tmp_path):
    raw_file(tmp_path / "model.safetensors", {"a": {"dtype": "F4", "shape": [32], "data_offsets": [0, 16]}}, bytes(16))
    with pytest.raises(IncompatibleCheckpointError, match="tensor 'a' has dtype F4, which no torch dtype holds"):
        FastPersistReader(tmp_path).read_metadata()


def three_shards(directory) -> dict[str, str]:
    write_model(directory, llama_state(layers=1, hidden=64, inter=128, vocab=256), 3)
    return json.loads((directory / INDEX).read_text())["weight_map"]


def test_a_tensor_listed_in_the_index_but_missing_from_its_shard(tmp_path):
    weight_map = three_shards(tmp_path)
    shard = weight_map["model.norm.weight"]
    other = next(f for f in weight_map.values() if f != shard)
    weight_map["model.norm.weight"] = other  # listed under the wrong shard
    (tmp_path / INDEX).write_text(json.dumps({"weight_map": weight_map}))
    message = load_error(tmp_path, {"model.norm.weight": torch.zeros(64)})
    assert f"tensor 'model.norm.weight' is listed in {INDEX} under {other}, not in it" in message


def test_a_shard_the_index_names_that_is_missing(tmp_path):
    weight_map = three_shards(tmp_path)
    shard = weight_map["lm_head.weight"]
    os.unlink(tmp_path / shard)
    first = next(name for name, file in weight_map.items() if file == shard)
    missing = re.escape(f"{shard} is missing (the index lists {first!r} in it)")
    with pytest.raises(CorruptCheckpointError, match=missing):
        FastPersistReader(tmp_path).read_metadata()


@pytest.mark.parametrize("what", ["shard", "index"])
def test_a_fifo_where_a_shard_or_the_index_should_be_is_damage_and_not_waited_on(tmp_path, what):
    """Opened without blocking: a FIFO there would otherwise wait for a writer that never comes."""
    weight_map = three_shards(tmp_path)
    name = weight_map["lm_head.weight"] if what == "shard" else INDEX
    os.unlink(tmp_path / name)
    os.mkfifo(tmp_path / name)
    problem = re.escape(f"{name} is not a regular file, not a")
    with pytest.raises(CorruptCheckpointError, match=problem):
        FastPersistReader(tmp_path).read_metadata()
    report = fp_dcp.verify_checkpoint(str(tmp_path))
    assert not report.ok and any(re.search(problem, p) for p in report.problems), report.problems


def test_a_cache_snapshot_link_whose_blob_is_missing(tmp_path):
    """An interrupted Hugging Face download: ``snapshots/<revision>/`` links into ``blobs/`` to nothing."""
    safetensors_torch.save_file({"w": torch.zeros(4)}, tmp_path / "model-00001-of-00002.safetensors")
    os.symlink(os.path.join("..", "..", "blobs", "0f1e2d"), tmp_path / "model-00002-of-00002.safetensors")
    message = re.escape("model-00002-of-00002.safetensors, a link to ../../blobs/0f1e2d, which is missing")
    with pytest.raises(CorruptCheckpointError, match=message):
        FastPersistReader(tmp_path).read_metadata()


def test_a_tensor_stored_in_two_files_without_an_index(tmp_path):
    safetensors_torch.save_file({"w": torch.zeros(4)}, tmp_path / "a.safetensors")
    safetensors_torch.save_file({"w": torch.ones(4)}, tmp_path / "b.safetensors")
    twice = re.escape("tensor 'w' is stored twice: in a.safetensors and in b.safetensors")
    with pytest.raises(CorruptCheckpointError, match=twice):
        FastPersistReader(tmp_path).read_metadata()


def test_a_target_whose_shape_differs_from_the_stored_one(tmp_path):
    two_tensors(tmp_path)
    # DCP's default planner compares the target's size with the stored one before any read
    message = load_error(tmp_path, {"a": torch.zeros(8), "b": torch.zeros(9)})
    assert "Size mismatch" in message and "for b" in message


class WrongTargets(DefaultLoadPlanner):
    """A planner that hands out a target of another shape than it planned (DCP's own check passed)."""

    def resolve_tensor(self, read_item):
        return torch.zeros(9) if read_item.dest_index.fqn == "b" else super().resolve_tensor(read_item)


def test_a_target_of_another_shape_than_planned_names_the_file_and_tensor(tmp_path):
    two_tensors(tmp_path)
    message = load_error(tmp_path, state_ab(), planner=WrongTargets())
    assert "target for 'b' (chunk at [0]) in model.safetensors bytes" in message and "has shape [9]" in message


def sharded(directory, shards: list[tuple[str, list[int], list[int]]]) -> None:
    """One safetensors file per (name, saved_offsets, shape) chunk of tensor 'w', as save_distributed writes them."""
    for name, offsets, shape in shards:
        n = math.prod(shape)
        info = json.dumps({"w": {"saved_offsets": offsets}})
        header = {
            "__metadata__": {"DCP_SHARDING_INFO": info},
            "w": {"dtype": "F32", "shape": shape, "data_offsets": [0, 4 * n]},
        }
        raw_file(os.path.join(directory, name), header, bytes(4 * n))


@pytest.mark.parametrize(
    ("shards", "fault"),
    [
        (
            [("a.safetensors", [0, 0], [4, 4]), ("b.safetensors", [6, 0], [2, 4])],
            "tensor 'w' of size [8, 4], stored in a.safetensors, b.safetensors: element [4, 0] is in no chunk",
        ),
        (
            [("a.safetensors", [0, 0], [4, 4]), ("b.safetensors", [2, 0], [6, 4])],
            "tensor 'w' of size [8, 4], stored in a.safetensors, b.safetensors: its chunks at [0, 0] and [2, 0] both "
            "hold [2:4, 0:4]",
        ),
        (
            [("a.safetensors", [4, 0], [4, 4])],  # a lone shard of a larger tensor: its rows 0..3 are elsewhere
            "tensor 'w' of size [8, 4], stored in a.safetensors: element [0, 0] is in no chunk",
        ),
    ],
    ids=["gap", "overlap", "one-shard-of-two"],
)
def test_sharded_chunks_that_do_not_tile_their_tensor(tmp_path, shards, fault):
    sharded(tmp_path, shards)
    with pytest.raises(CorruptCheckpointError) as e:
        FastPersistReader(tmp_path).read_metadata()
    assert fault in str(e.value)
    target = {"w": torch.full((8, 4), -1.0)}
    assert fault in load_error(tmp_path, target)
    assert torch.equal(target["w"], torch.full((8, 4), -1.0))  # refused before anything was read into it
