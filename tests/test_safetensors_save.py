"""SafetensorsWriter: HuggingFaceStorageWriter's arguments, fp-dcp's engine; read back by the safetensors package,
torch's HuggingFaceStorageReader and FastPersistReader."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import failure, needs_torch, same_bytes
from hf_util import INDEX, llama_state, load_reference, module_for, safetensors_torch
from test_safetensors import HuggingFaceStorageReader, every_dtype, needs_torch_hf
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import init_device_mesh

from fp_dcp import FastPersistReader, IOConfig, SafetensorsWriter, compat
from fp_dcp.testing.ranks import run_ranks
from fp_dcp.units import PAGE


def small_state() -> dict[str, torch.Tensor]:
    return llama_state(layers=1, hidden=64, inter=128, vocab=256)


def loaded_by(reader, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    state = {k: torch.zeros_like(v) for k, v in like.items()}
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def all_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return set(got) == set(want) and all(same_bytes(got[k], want[k]) for k in want)


@needs_torch_hf
@pytest.mark.parametrize("direct", [True, False])
def test_one_file_loads_with_the_safetensors_package_and_both_readers(tmp_path, direct):
    state = small_state() | every_dtype()
    with SafetensorsWriter(tmp_path, config=IOConfig(direct_io=direct)) as writer:
        dcp.save(state, storage_writer=writer, no_dist=True)
    assert writer.last_save.direct_io is direct and writer.last_save.bytes == sum(v.nbytes for v in state.values())
    assert sorted(os.listdir(tmp_path)) == sorted([INDEX, "model-00001-of-00001.safetensors"])
    assert all_same(load_reference(tmp_path), state)
    if compat.TORCH >= (2, 9):  # torch 2.8's reader views an odd-length item as 4-byte elements and fails
        assert all_same(loaded_by(HuggingFaceStorageReader(str(tmp_path)), state), state)
    assert all_same(loaded_by(FastPersistReader(tmp_path), state), state)
    with open(tmp_path / "model-00001-of-00001.safetensors", "rb") as f:
        assert (8 + int.from_bytes(f.read(8), "little")) % PAGE == 0  # the data starts on a page


@pytest.mark.skipif(not hasattr(torch, "float8_e8m0fnu"), reason="torch before 2.7 has no float8_e8m0fnu")
def test_a_dtype_the_safetensors_package_cannot_write_round_trips_through_fp_dcp(tmp_path):
    scales = torch.randint(0, 256, (4, 8), dtype=torch.uint8).view(torch.float8_e8m0fnu)
    dcp.save({"scales": scales}, storage_writer=SafetensorsWriter(tmp_path), no_dist=True)
    with open(tmp_path / "model-00001-of-00001.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert header["scales"]["dtype"] == "F8_E8M0"  # the name the safetensors format gives it
    assert all_same(loaded_by(FastPersistReader(tmp_path), {"scales": scales}), {"scales": scales})


@needs_torch_hf
def test_fqn_to_index_mapping_writes_the_files_and_the_index_hugging_face_does(tmp_path):
    state = small_state()
    mapping = {name: 1 + position % 3 for position, name in enumerate(state)}
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    dcp.save(state, storage_writer=SafetensorsWriter(ours, fqn_to_index_mapping=mapping), no_dist=True)
    dcp.save(
        state, storage_writer=dcp.HuggingFaceStorageWriter(str(theirs), fqn_to_index_mapping=mapping), no_dist=True
    )
    assert sorted(os.listdir(ours)) == sorted(os.listdir(theirs))
    index = json.loads((ours / INDEX).read_text())
    assert index == json.loads((theirs / INDEX).read_text())
    for name in os.listdir(ours):
        if name != INDEX:
            want = safetensors_torch.load_file(theirs / name)
            assert all_same(safetensors_torch.load_file(ours / name), want)
            assert all(index["weight_map"][k] == name for k in want)
    assert all_same(loaded_by(HuggingFaceStorageReader(str(ours)), state), state)


def save_sharded(rank: int, world: int, root: str) -> dict:
    """FSDP2 state saved on every rank: ours, ours consolidated, HuggingFaceStorageWriter's; and one refused."""
    model = module_for(small_state())
    model.load_state_dict(small_state())
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    sd = model.state_dict()
    dcp.save(sd, storage_writer=SafetensorsWriter(os.path.join(root, "ours"), save_distributed=True))
    dcp.save(
        sd,
        storage_writer=SafetensorsWriter(
            os.path.join(root, "whole"), save_distributed=True, enable_consolidation=True, thread_count_consolidation=2
        ),
    )
    dcp.save(sd, storage_writer=dcp.HuggingFaceStorageWriter(os.path.join(root, "theirs"), save_distributed=True))
    try:
        dcp.save(sd, storage_writer=SafetensorsWriter(os.path.join(root, "refused")))
    except BaseException as e:  # CheckpointException is a BaseException
        return {"refused": str(e)}
    return {"refused": ""}


@needs_torch(compat.CONSOLIDATION)
def test_save_distributed_on_two_ranks_loads_resharded_and_consolidates(tmp_path):
    results = run_ranks(2, save_sharded, str(tmp_path))
    state = small_state()
    ours = tmp_path / "ours"
    assert sorted(os.listdir(ours)) == [f"shard-0000{r}-model-00001-of-00001.safetensors" for r in (1, 2)]
    # each file holds every tensor's chunk from one rank, whole tensors nowhere: read back resharded
    assert all_same(loaded_by(FastPersistReader(ours), state), state)
    assert all_same(loaded_by(HuggingFaceStorageReader(str(ours)), state), state)
    assert all_same(loaded_by(FastPersistReader(tmp_path / "theirs"), state), state)
    theirs = HuggingFaceStorageReader(str(tmp_path / "theirs")).read_metadata()
    assert described(FastPersistReader(ours).read_metadata()) == described(theirs)
    (tmp_path / "merged").mkdir()
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files

    consolidate_safetensors_files(str(ours), str(tmp_path / "merged"), dict.fromkeys(state, 1))
    assert all_same(load_reference(tmp_path / "merged"), state)
    whole = tmp_path / "whole"
    assert all_same(safetensors_torch.load_file(whole / "model-00001-of-00001.safetensors"), state)
    assert all("ranks [0, 1] all hold tensors for model-00001-of-00001.safetensors" in r["refused"] for r in results)
    assert not os.path.exists(tmp_path / "refused" / "model-00001-of-00001.safetensors")


def described(metadata) -> dict:
    """Each tensor's dtype, size and chunks, the chunks in order (HuggingFaceStorageReader lists files unsorted)."""
    return {
        fqn: (md.properties.dtype, md.size, sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks))
        for fqn, md in metadata.state_dict_metadata.items()
    }


def save_error(tmp_path, state, **options) -> str:
    with pytest.raises(BaseException) as e:
        dcp.save(state, storage_writer=SafetensorsWriter(tmp_path, **options), no_dist=True)
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".safetensors")]  # refused before writing
    return str(failure(e))


def test_non_tensor_entries_are_refused_by_name(tmp_path):
    assert "safetensors stores tensors only; 'step' is not one" in save_error(tmp_path, {"w": torch.ones(3), "step": 7})


def test_a_tensor_missing_from_the_mapping_is_refused_by_name(tmp_path):
    message = save_error(tmp_path, {"a": torch.ones(3), "b": torch.ones(3)}, fqn_to_index_mapping={"a": 1})
    assert "'b' is not in fqn_to_index_mapping" in message


@needs_torch(compat.CONSOLIDATION)
def test_consolidation_of_tensors_torch_cannot_consolidate_is_refused_before_writing(tmp_path):
    message = save_error(
        tmp_path, {"w": torch.ones(3), "ids": torch.arange(3)}, save_distributed=True, enable_consolidation=True
    )
    assert "handles floating-point tensors only; 'ids' is torch.int64" in message


def test_consolidation_needs_save_distributed(tmp_path):
    with pytest.raises(ValueError, match="enable_consolidation=True\\) needs save_distributed=True"):
        SafetensorsWriter(tmp_path, enable_consolidation=True)


@pytest.mark.gpu
def test_gpu_tensors_cross_through_the_staging_path(tmp_path, gpu, monkeypatch):
    from cuda_double import CpuAsDevice

    import fp_dcp.save.resources

    state = {k: v.to(gpu.device) for k, v in small_state().items()}
    if gpu.double is not None:
        monkeypatch.setattr(fp_dcp.save.resources, "Staging", CpuAsDevice)
    with SafetensorsWriter(tmp_path, config=IOConfig(buffer_size=64 * 1024, num_buffers=3)) as writer:
        dcp.save(state, storage_writer=writer, no_dist=True)
        assert writer.last_save.staging.startswith(f"side streams on {gpu.device}")
    assert all_same(load_reference(tmp_path), {k: v.cpu() for k, v in state.items()})
