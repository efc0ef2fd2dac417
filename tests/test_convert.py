"""Conversions between fp-dcp, stock DCP, torch.save and safetensors, checked against the original state."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import same_bytes, save
from torch.distributed.checkpoint import format_utils
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from fp_dcp import FastPersistReader, FastPersistWriter, SafetensorsWriter, verify_checkpoint
from fp_dcp.errors import CheckpointExistsError, CorruptCheckpointError, NotACheckpointError
from fp_dcp.tools.convert import FORMATS, convert, detect_format, parse_size, read_state_dict, shard_mapping
from fp_dcp.tools.inspect import inspect_checkpoint

safetensors_torch = pytest.importorskip("safetensors.torch", reason="safetensors is in the test extra")

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def original() -> dict:
    embed = torch.randn(40, 16)
    return {
        "model": {
            "embed": embed,
            "head": embed,  # tied weights, as in many LLMs
            "w": torch.randn(33, 7).to(torch.bfloat16),
            "ids": torch.arange(11, dtype=torch.int32),
            "scalar": torch.tensor(2.5),
        },
        "optim": {"step": 7, "lrs": [1e-3, torch.full((3,), 0.5)]},
    }


def tensors_of(state) -> dict[str, torch.Tensor]:
    """Every tensor of a nested state dict by its DCP fqn (``a.b.0``)."""
    out = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, torch.Tensor):
            out[prefix] = value
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(value, list):
            for i, v in enumerate(value):
                walk(f"{prefix}.{i}", v)

    walk("", state)
    return out


def assert_same_state(got, want) -> None:
    assert isinstance(got, dict) and isinstance(want, dict)
    assert got.keys() == want.keys()
    for k in want:
        g, w = got[k], want[k]
        if isinstance(w, torch.Tensor):
            assert isinstance(g, torch.Tensor) and same_bytes(g, w), k
        elif isinstance(w, dict):
            assert_same_state(g, w)
        elif isinstance(w, list):
            assert len(g) == len(w)
            assert_same_state(dict(enumerate(g)), dict(enumerate(w)))
        else:
            assert g == w, k


@pytest.fixture
def fp_ckpt(tmp_path):
    state = original()
    save(state, tmp_path / "fp")
    return tmp_path / "fp", state


@pytest.fixture
def stock_ckpt(tmp_path):
    state = original()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path / "stock"))
    return tmp_path / "stock", state


def test_detects_every_format(tmp_path, fp_ckpt, stock_ckpt):
    torch.save({"x": torch.ones(2)}, tmp_path / "a.pt")
    safetensors_torch.save_file({"x": torch.ones(2)}, tmp_path / "a.bin")  # by contents, not by name
    assert [detect_format(p) for p in (fp_ckpt[0], stock_ckpt[0], tmp_path / "a.pt", tmp_path / "a.bin")] == [
        "fp",
        "dcp",
        "torch",
        "safetensors",
    ]
    (tmp_path / "empty").mkdir()
    with pytest.raises(NotACheckpointError, match="metadata"):
        detect_format(tmp_path / "empty")
    with pytest.raises(NotACheckpointError):
        detect_format(tmp_path / "missing")


def test_fp_to_torch_keeps_nesting_objects_and_bytes(tmp_path, fp_ckpt):
    src, state = fp_ckpt
    summary = convert(src, tmp_path / "out.pt", to="torch")
    assert_same_state(torch.load(tmp_path / "out.pt", weights_only=False), state)
    assert summary.tensors == len(tensors_of(state))  # tied weights count twice: the checkpoint stores both
    assert summary.bytes == sum(t.nbytes for t in tensors_of(state).values())
    assert (summary.source_format, summary.target_format, summary.dropped) == ("fp", "torch", ())
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("out.pt")] == ["out.pt"]  # no temporary left


def test_stock_to_torch_matches_dcps_own_converter(tmp_path, stock_ckpt):
    src, state = stock_ckpt
    convert(src, tmp_path / "ours.pt", to="torch")
    format_utils.dcp_to_torch_save(src, tmp_path / "theirs.pt")
    ours = torch.load(tmp_path / "ours.pt", weights_only=False)
    assert_same_state(ours, torch.load(tmp_path / "theirs.pt", weights_only=False))
    assert_same_state(ours, state)


@pytest.mark.parametrize("to", ["fp", "dcp"])
def test_torch_file_to_checkpoint_loads_back(tmp_path, to):
    state = original()
    torch.save(state, tmp_path / "model.pt")
    summary = convert(tmp_path / "model.pt", tmp_path / "ckpt", to=to)
    assert detect_format(tmp_path / "ckpt") == to
    assert_same_state(read_state_dict(tmp_path / "ckpt"), state)
    assert summary.source_format == "torch" and summary.tensors == len(tensors_of(state))


@pytest.mark.parametrize(("start", "to"), [("fp", "dcp"), ("dcp", "fp"), ("fp", "fp")])
def test_between_checkpoint_kinds(tmp_path, fp_ckpt, stock_ckpt, start, to):
    src, state = fp_ckpt if start == "fp" else stock_ckpt
    convert(src, tmp_path / "out", to=to)
    assert detect_format(tmp_path / "out") == to
    target = {
        "model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
        "optim": {"step": 0, "lrs": [0.0, torch.zeros(3)]},
    }
    # Each kind loads through its own library's reader.
    reader = dcp.FileSystemReader(tmp_path / "out") if to == "dcp" else FastPersistReader(tmp_path / "out")
    dcp.load(target, storage_reader=reader)
    assert_same_state(target, state)


def test_safetensors_refuses_objects_unless_dropped(tmp_path, fp_ckpt):
    src, state = fp_ckpt
    with pytest.raises(ValueError, match=r"optim\.step.*drop_non_tensors"):
        convert(src, tmp_path / "m.safetensors", to="safetensors")
    assert not os.path.exists(tmp_path / "m.safetensors")
    summary = convert(src, tmp_path / "m.safetensors", to="safetensors", drop_non_tensors=True)
    assert set(summary.dropped) == {"optim.step", "optim.lrs.0"}
    loaded = safetensors_torch.load_file(tmp_path / "m.safetensors")
    want = tensors_of(state)
    assert loaded.keys() == want.keys()
    for k in want:
        assert same_bytes(loaded[k], want[k]), k


def test_safetensors_with_tied_torch_tensors_and_back(tmp_path):
    embed = torch.randn(8, 4)
    state = {"embed": embed, "head": embed, "half": torch.randn(5, 3).to(torch.float16)}
    torch.save(state, tmp_path / "tied.pt")  # shared storage survives torch.save/load; safetensors refuses it
    convert(tmp_path / "tied.pt", tmp_path / "tied.safetensors", to="safetensors")
    for to in ("fp", "dcp", "torch"):
        convert(tmp_path / "tied.safetensors", tmp_path / f"back-{to}", to=to)
        assert_same_state(read_state_dict(tmp_path / f"back-{to}"), state)


def shard_names(count: int) -> list[str]:
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def test_safetensors_directory_in_shards_loads_everywhere(tmp_path, fp_ckpt):
    src, state = fp_ckpt
    dst = tmp_path / "hf"
    # 2 KB a file: the 2560-byte embed and its tied copy each alone (too big to share), the rest together.
    summary = convert(src, dst, to="safetensors", drop_non_tensors=True, max_shard_size="2KB")
    want = tensors_of(state)
    assert (summary.tensors, summary.bytes) == (len(want), sum(t.nbytes for t in want.values()))
    assert sorted(os.listdir(dst)) == [*shard_names(3), "model.safetensors.index.json"]
    weight_map = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    names = shard_names(3)
    assert weight_map == {"model.embed": names[0], "model.head": names[1]} | dict.fromkeys(
        ["model.w", "model.ids", "model.scalar", "optim.lrs.1"], names[2]
    )
    for name in names:  # each shard is a file the safetensors package reads, holding what the index says
        loaded = safetensors_torch.load_file(dst / name)
        assert set(loaded) == {k for k, f in weight_map.items() if f == name}
        assert all(same_bytes(loaded[k], want[k]) for k in loaded)
    target = {k: torch.empty_like(v) for k, v in want.items()}
    dcp.load(target, storage_reader=FastPersistReader(dst), no_dist=True)
    assert all(same_bytes(target[k], want[k]) for k in want)
    assert verify_checkpoint(dst).ok
    assert detect_format(dst) == "safetensors"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".hf.")]  # no staging directory left


def test_shards_follow_hugging_faces_rule():
    tensors = {"a": torch.zeros(100, dtype=torch.uint8), "b": torch.zeros(60, dtype=torch.uint8)}
    tensors |= {"big": torch.zeros(500, dtype=torch.uint8), "c": torch.zeros(40, dtype=torch.uint8)}
    assert shard_mapping(tensors, 160) == {"a": 1, "b": 1, "big": 2, "c": 3}  # in order, at most 160 a file
    assert shard_mapping(tensors, 10**9) == dict.fromkeys(tensors, 1)


@pytest.mark.parametrize(
    ("text", "size"),
    [("5GB", 5 * 10**9), ("2GiB", 2 << 30), ("500mb", 5 * 10**8), (" 1.5 GB ", 15 * 10**8), ("4096", 4096), (7, 7)],
)
def test_shard_sizes_as_hugging_face_writes_them(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("bad", ["5 parsecs", "GB", "0", -1])
def test_bad_shard_sizes_are_refused(bad):
    with pytest.raises(ValueError, match="size"):
        parse_size(bad)


def test_safetensors_directory_replaced_keeping_other_files(tmp_path, fp_ckpt):
    src, state = fp_ckpt
    dst = tmp_path / "hf"
    dst.mkdir()
    (dst / "config.json").write_text("{}")
    with pytest.raises(CheckpointExistsError, match="--force"):
        convert(src, dst, to="safetensors", drop_non_tensors=True)
    assert os.listdir(dst) == ["config.json"]
    convert(src, dst, to="safetensors", drop_non_tensors=True, max_shard_size=1000, overwrite=True)
    assert len(os.listdir(dst)) == 5  # config, three shards, index
    convert(src, dst, to="safetensors", drop_non_tensors=True, overwrite=True)  # 5GB: one file
    assert sorted(os.listdir(dst)) == ["config.json", *shard_names(1), "model.safetensors.index.json"]
    loaded = safetensors_torch.load_file(dst / shard_names(1)[0])
    assert all(same_bytes(loaded[k], v) for k, v in tensors_of(state).items())


def test_replacing_removes_nothing_outside_the_directory(tmp_path, fp_ckpt):
    src, _ = fp_ckpt
    dst = tmp_path / "hf"
    dst.mkdir()
    (tmp_path / "victim.safetensors").write_bytes(b"not the checkpoint's")
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../victim.safetensors"}}))
    convert(src, dst, to="safetensors", drop_non_tensors=True, overwrite=True)
    assert (tmp_path / "victim.safetensors").read_bytes() == b"not the checkpoint's"
    assert sorted(os.listdir(dst)) == [*shard_names(1), "model.safetensors.index.json"]


def test_failed_safetensors_directory_leaves_nothing(tmp_path, fp_ckpt, monkeypatch):
    src, _ = fp_ckpt

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(SafetensorsWriter, "finish", fail)
    with pytest.raises(OSError, match="No space left"):
        convert(src, tmp_path / "hf", to="safetensors", drop_non_tensors=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fp"]  # neither the destination nor the staging


class RowHalves(DefaultSavePlanner):
    """Stores each matrix as two row chunks, as two ranks holding half each would (in one process: fast)."""

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = []
        for item in plan.items:
            data = item.tensor_data
            if data is None or len(data.size) != 2:
                items.append(item)
                continue
            half = data.size[0] // 2
            for start, rows in ((0, half), (half, data.size[0] - half)):
                chunk = ChunkStorageMetadata(torch.Size([start, 0]), torch.Size([rows, data.size[1]]))
                items.append(
                    WriteItem(
                        index=MetadataIndex(item.index.fqn, chunk.offsets),
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(chunk, data.properties, data.size),
                    )
                )
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        if write_item.type != WriteItemType.SHARD:
            return super().resolve_data(write_item)
        chunk = write_item.tensor_data.chunk
        return self.state_dict[write_item.index.fqn].narrow(0, chunk.offsets[0], chunk.sizes[0])


def test_chunked_checkpoints_become_whole_tensors(tmp_path):
    """Both kinds, with a tensor stored in chunks (as by several ranks): inspected, then converted whole."""
    state = {"w": torch.randn(9, 6), "step": 3}
    dcp.save(state, storage_writer=FastPersistWriter(tmp_path / "fp", lanes_per_dir=2), planner=RowHalves())
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path / "stock"), planner=RowHalves())
    for kind, src in (("fp", tmp_path / "fp"), ("dcp", tmp_path / "stock")):
        (w,) = [item for item in inspect_checkpoint(src)["items"] if item["fqn"] == "w"]
        assert (w["chunks"], w["shape"], w["bytes"] >= state["w"].nbytes) == (2, [9, 6], True)
        convert(src, tmp_path / f"{kind}.pt", to="torch")
        assert_same_state(torch.load(tmp_path / f"{kind}.pt"), state)


def test_progress_counts_every_tensor_byte(tmp_path, fp_ckpt):
    src, state = fp_ckpt
    calls: list[tuple[int, int]] = []
    convert(src, tmp_path / "out.pt", to="torch", progress=lambda done, total: calls.append((done, total)))
    total = sum(t.nbytes for t in tensors_of(state).values())
    assert calls[0] == (0, total) and calls[-1] == (total, total)
    assert all(a[0] <= b[0] for a, b in itertools.pairwise(calls))


def test_destination_rules(tmp_path, fp_ckpt):
    src, _ = fp_ckpt
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointExistsError, match="--force"):
        convert(src, tmp_path / "busy", to="dcp")
    convert(src, tmp_path / "busy", to="dcp", overwrite=True)
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"  # only checkpoint files are replaced
    convert(src, tmp_path / "busy", to="fp", overwrite=True)  # a stock checkpoint replaced by an fp-dcp one
    assert detect_format(tmp_path / "busy") == "fp"
    assert not (tmp_path / "busy" / "__0_0.distcp").exists()  # the stock checkpoint's data file went with it
    with pytest.raises(IsADirectoryError):
        convert(src, tmp_path / "busy", to="torch", overwrite=True)
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(NotADirectoryError):
        convert(src, tmp_path / "file", to="fp", overwrite=True)
    with pytest.raises(ValueError, match="same path"):
        convert(src, src, to="fp", overwrite=True)
    with pytest.raises(ValueError, match="unknown target format"):
        convert(src, tmp_path / "x", to="onnx")  # type: ignore[arg-type]
    assert set(FORMATS) == {"fp", "dcp", "torch", "safetensors"}


def test_damaged_source_is_refused_naming_the_damage(tmp_path, fp_ckpt):
    src, _ = fp_ckpt
    meta = src / ".metadata"
    data = bytearray(meta.read_bytes())
    data[10] ^= 0xFF
    meta.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        convert(src, tmp_path / "out.pt", to="torch")
    assert not os.path.exists(tmp_path / "out.pt")


def test_reads_fp_checkpoint_with_data_dirs(tmp_path):
    state = {"w": torch.randn(20, 20), "b": torch.arange(3)}
    dirs = [tmp_path / "d0", tmp_path / "d1"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save(state, tmp_path / "ckpt", data_dirs=dirs, lanes_per_dir=2)
    with pytest.raises(NotACheckpointError, match="data_dirs"):
        convert(tmp_path / "ckpt", tmp_path / "out.pt", to="torch", data_dirs=dirs[:1])
    convert(tmp_path / "ckpt", tmp_path / "out.pt", to="torch")  # found where the save put them
    assert_same_state(torch.load(tmp_path / "out.pt"), state)
    convert(tmp_path / "ckpt", tmp_path / "out.pt", to="torch", data_dirs=dirs, overwrite=True)
    assert_same_state(torch.load(tmp_path / "out.pt"), state)
