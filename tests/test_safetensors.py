"""Hugging Face safetensors checkpoints loaded through FastPersistReader, checked against the safetensors package."""

from __future__ import annotations

import hashlib
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import same_bytes
from hf_util import llama_state, load_reference, module_for, safetensors_torch, write_model
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, init_device_mesh

import fp_dcp
from fp_dcp import FastPersistReader, IOConfig
from fp_dcp.safetensors_format import DTYPES
from fp_dcp.testing.ranks import run_ranks
from fp_dcp.tools.convert import convert
from fp_dcp.tools.workload import evict

# torch's own safetensors storage, the reference here, comes with torch 2.8 (fp-dcp's own needs none of it)
HuggingFaceStorageReader = getattr(dcp, "HuggingFaceStorageReader", None)
needs_torch_hf = pytest.mark.skipif(
    HuggingFaceStorageReader is None, reason="torch before 2.8 has no HuggingFaceStorageReader"
)


def load_plain(path, like: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], FastPersistReader]:
    state = {k: torch.zeros_like(v) for k, v in like.items()}
    reader = FastPersistReader(path, thread_count=4)  # HuggingFaceStorageReader's arguments are accepted
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state, reader


@pytest.mark.parametrize("files", [1, 3])
def test_one_file_or_three_shards_with_an_index_load_bit_exact(tmp_path, files):
    write_model(tmp_path, llama_state(layers=1, hidden=128, inter=256, vocab=512), files)
    want = load_reference(tmp_path)
    got, reader = load_plain(tmp_path, want)
    assert set(got) == set(want) and all(same_bytes(got[k], want[k]) for k in want)
    data = sum(v.nbytes for v in want.values())
    assert reader.last_load.needed == data and data <= reader.last_load.read_bytes <= data + files * 2 * 4096


def every_dtype() -> dict[str, torch.Tensor]:
    """A tensor of each dtype safetensors stores and torch has, with bit patterns of every kind (NaNs too)."""
    g = torch.Generator().manual_seed(3)
    state = {}
    for name, dtype in DTYPES.items():
        if name not in safetensors_torch._TYPES:
            continue  # the safetensors package cannot write it (e.g. F8_E8M0 in older releases)
        shape = (7, 5) if dtype.itemsize > 1 else (13, 3)
        raw = torch.randint(0, 256, (7 * 5 * dtype.itemsize if dtype.itemsize > 1 else 39,), generator=g)
        tensor = raw.to(torch.uint8).view(dtype).reshape(shape) if dtype != torch.bool else raw.reshape(shape) % 2 == 1
        state[f"t.{name.lower()}"] = tensor
    return state


def test_every_dtype_safetensors_stores_loads_bit_exact(tmp_path):
    state = every_dtype()
    assert len(state) >= 17
    write_model(tmp_path, state)
    want = load_reference(tmp_path)
    got, _ = load_plain(tmp_path, want)
    assert all(same_bytes(got[k], want[k]) for k in want), [k for k in want if not same_bytes(got[k], want[k])]


@needs_torch_hf
def test_targets_of_another_dtype_are_converted_as_hugging_faces_reader_does(tmp_path):
    write_model(tmp_path, {"w": torch.randn(64, 32).to(torch.bfloat16)})
    want = load_reference(tmp_path)["w"]
    got = {"w": torch.zeros(64, 32)}
    dcp.load(got, storage_reader=FastPersistReader(tmp_path), no_dist=True)
    theirs = {"w": torch.zeros(64, 32)}
    dcp.load(theirs, storage_reader=HuggingFaceStorageReader(str(tmp_path)), no_dist=True)
    assert same_bytes(got["w"], want.float()) and same_bytes(got["w"], theirs["w"])


@needs_torch_hf
@pytest.mark.parametrize("files", [1, 3])
def test_dcp_sees_what_hugging_faces_reader_shows_it(tmp_path, files):
    write_model(tmp_path, llama_state(layers=1, hidden=64, inter=128, vocab=256), files)
    ours = FastPersistReader(tmp_path).read_metadata().state_dict_metadata
    theirs = HuggingFaceStorageReader(str(tmp_path)).read_metadata().state_dict_metadata
    assert ours == theirs


def test_a_hugging_face_cache_snapshot_of_links_into_blobs_loads(tmp_path):
    """``snapshots/<revision>/`` holds relative links into ``blobs/``, named by content hash."""
    staged = tmp_path / "download"
    write_model(staged, llama_state(layers=1, hidden=64, inter=128, vocab=256), 3)
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for name in os.listdir(staged):
        data = (staged / name).read_bytes()
        blob = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        os.symlink(os.path.join("..", "..", "blobs", blob), snapshot / name)
    want = load_reference(staged)
    got, _ = load_plain(snapshot, want)
    assert all(same_bytes(got[k], want[k]) for k in want)


def test_fp_dcp_install_loads_a_safetensors_directory_by_checkpoint_id(tmp_path):
    """Path-only dcp.load: torch's default reader wants .metadata; with fp-dcp installed the directory loads."""
    write_model(tmp_path, llama_state(layers=1, hidden=64, inter=128, vocab=256), 3)
    want = load_reference(tmp_path)
    with fp_dcp.installed():
        state = {k: torch.zeros_like(v) for k, v in want.items()}
        dcp.load(state, checkpoint_id=str(tmp_path), no_dist=True)
    assert all(same_bytes(state[k], want[k]) for k in want)


def load_fsdp2(rank: int, world: int, path: str) -> dict:
    os.environ["FP_DCP_NODE"] = f"node{rank // 2}"  # 2 nodes of 2 ranks
    want = load_reference(path)
    model = module_for(want)
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    state = model.state_dict()
    assert all(isinstance(v, DTensor) for v in state.values())
    reader = FastPersistReader(path)
    dcp.load(state, storage_reader=reader)
    exact = all(same_bytes(v.full_tensor(), want[k]) for k, v in model.state_dict().items())
    return {"exact": exact, "read": reader.last_load.read_bytes, "needed": reader.last_load.needed}


@pytest.mark.parametrize("files", [1, 3])
def test_fsdp2_on_four_ranks_as_two_nodes_loads_bit_exact_reading_each_byte_about_once(tmp_path, files):
    state = llama_state()
    write_model(tmp_path, state, files)
    results = run_ranks(4, load_fsdp2, str(tmp_path))
    assert all(r["exact"] for r in results), results
    needed = sum(r["needed"] for r in results)
    assert needed == sum(v.nbytes for v in state.values()), results  # every byte needed by one rank
    # a rank reads whole pages: where its part of a tensor starts or ends inside one, a neighbour reads it too
    assert sum(r["read"] for r in results) <= 1.1 * needed, results


def load_replicated(rank: int, world: int, path: str, want: dict[str, torch.Tensor], config: IOConfig | None) -> dict:
    os.environ["FP_DCP_NODE"] = f"node{rank // 2}"
    state = {k: torch.zeros_like(v) for k, v in want.items()}
    reader = FastPersistReader(path, config=config)
    dcp.load(state, storage_reader=reader)
    exact = all(same_bytes(state[k], want[k]) for k in want)
    summary = reader.last_load
    return {
        "exact": exact,
        "read": summary.read_bytes,
        "received": summary.received_bytes,
        "staged": summary.staged_bytes,
    }


# read in place wherever the file's alignment allows, runs from a page up (the default stages reads on disks whose
# requests scattered memory caps, this one's included)
IN_PLACE = IOConfig(direct_reads=True, direct_min=4096)


@pytest.mark.parametrize("config", [None, IN_PLACE], ids=["default", "in place"])
def test_every_rank_loading_the_whole_model_reads_it_from_storage_once(tmp_path, config):
    """Each item is read by one rank into memory of the load's own, which starts where the item starts in its
    file modulo a page: read in place where the configuration allows, though no safetensors tensor starts on a
    page (staged, the bytes of the items' first and last 512-byte blocks only)."""
    state = llama_state(layers=1, hidden=128, inter=256, vocab=512)
    write_model(tmp_path, state, 3)
    os.sync()
    evict(str(tmp_path))  # files in the page cache would be copied out of it, not read by the engine
    results = run_ranks(4, load_replicated, str(tmp_path), state, config)
    assert all(r["exact"] for r in results), results
    data = sum(v.nbytes for v in state.values())
    assert data <= sum(r["read"] for r in results) <= 1.1 * data, results
    assert sum(r["received"] for r in results) >= 3 * data, results
    if config is IN_PLACE:
        assert sum(r["staged"] for r in results) < 0.1 * data, results


def test_fp_dcp_convert_takes_a_hugging_face_directory(tmp_path):
    write_model(tmp_path / "hf", llama_state(layers=1, hidden=64, inter=128, vocab=256), 3)
    want = load_reference(tmp_path / "hf")
    summary = convert(tmp_path / "hf", tmp_path / "fp", to="fp")
    assert summary.source_format == "safetensors" and summary.tensors == len(want)
    got, _ = load_plain(tmp_path / "fp", want)
    assert all(same_bytes(got[k], want[k]) for k in want)
