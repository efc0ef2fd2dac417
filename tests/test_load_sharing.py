"""Loads that read each stored byte once: shared items read by one rank and sent to the others (gloo)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import same_bytes, save
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.tensor import DTensor, Shard, distribute_tensor, init_device_mesh

from fp_dcp import FastPersistReader, FastPersistWriter
from fp_dcp.checkpoint import open_checkpoint
from fp_dcp.load import reader as reader_module
from fp_dcp.load.catalog import FastPersistCatalog
from fp_dcp.load.sharing import plan_exchange
from fp_dcp.testing.ranks import run_ranks

pytestmark = pytest.mark.slow  # its tests start processes


def replicated_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    state = {f"layer{i}.w": torch.randn(256, 257, generator=g) for i in range(6)}
    state["step"] = torch.tensor(7)
    state["small"] = torch.arange(10, dtype=torch.float64)
    return state


def load_all(rank: int, world: int, path: str, share: bool) -> dict:
    state = {k: torch.zeros_like(v) for k, v in replicated_state().items()}
    reader = FastPersistReader(path, share=share)
    dcp.load(state, storage_reader=reader)
    summary = reader.last_load
    exact = all(same_bytes(state[k], v) for k, v in replicated_state().items())
    groups = len(reader_module._GROUPS)  # gloo groups made for exchanges in this process
    return {"exact": exact, "read": summary.read_bytes, "received": summary.received_bytes, "groups": groups}


def data_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if n.endswith(".distcp"))


def items_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(v.numel() * v.element_size() for v in state.values())


def test_four_ranks_loading_a_replicated_state_read_it_from_storage_once(tmp_path):
    path = str(tmp_path / "ck")
    save(replicated_state(), path)
    results = run_ranks(4, load_all, path, True)
    assert all(r["exact"] for r in results), results
    read = sum(r["read"] for r in results)
    assert items_bytes(replicated_state()) <= read <= data_bytes(path), results  # 1x the checkpoint
    assert sum(r["received"] for r in results) >= 3 * items_bytes(replicated_state()) * 0.9, results
    assert all(r["groups"] == 1 for r in results), results


@pytest.mark.parametrize("share", [False, "auto"])
def test_with_sharing_off_or_on_one_node_every_rank_reads_everything_itself(tmp_path, share):
    path = str(tmp_path / "ck")
    save(replicated_state(), path)
    results = run_ranks(4, load_all, path, share)  # "auto": all 4 ranks on this host, so no exchange
    assert all(r["exact"] and r["received"] == 0 for r in results), results
    assert all(r["groups"] == 0 for r in results), results  # and no group of its own made for one
    assert sum(r["read"] for r in results) >= 4 * items_bytes(replicated_state()), results


def mixed(mesh, zeros: bool = False) -> dict:
    """Half the state sharded (FSDP2-style, Shard(0)), half replicated plain tensors."""
    g = torch.Generator().manual_seed(5)
    full = {f"s{i}": torch.randn(480, 257, generator=g) for i in range(3)}
    full |= {f"r{i}": torch.randn(400, 170, generator=g) for i in range(3)}
    state = {}
    for k, v in full.items():
        v = torch.zeros_like(v) if zeros else v
        state[k] = distribute_tensor(v, mesh, [Shard(0)]) if k.startswith("s") else v
    return state


def save_mixed(rank: int, world: int, path: str) -> None:
    dcp.save(mixed(init_device_mesh("cpu", (world,))), storage_writer=FastPersistWriter(path))


def load_mixed(rank: int, world: int, path: str) -> dict:
    os.environ["FP_DCP_NODE"] = f"node{rank // 2}"  # 2 nodes of 2 ranks: sharing is on by default ("auto")
    mesh = init_device_mesh("cpu", (world,))
    state = mixed(mesh, zeros=True)
    reader = FastPersistReader(path)
    dcp.load(state, storage_reader=reader)
    want = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in mixed(mesh).items()}
    got = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}
    return {"exact": all(same_bytes(got[k], want[k]) for k in want), "read": reader.last_load.read_bytes}


def test_half_sharded_half_replicated_saved_on_2_ranks_loads_on_4(tmp_path):
    path = str(tmp_path / "ck")
    run_ranks(2, save_mixed, path)
    results = run_ranks(4, load_mixed, path)
    assert all(r["exact"] for r in results), results
    # each byte read about once: the shards by the ranks needing their parts, the replicated half shared
    # (a page of alignment at the edges of each rank's part is read by both neighbours)
    assert sum(r["read"] for r in results) <= 1.05 * data_bytes(path), (data_bytes(path), results)


def load_expecting_damage(rank: int, world: int, path: str) -> str:
    state = {k: torch.zeros_like(v) for k, v in replicated_state().items()}
    try:
        dcp.load(state, storage_reader=FastPersistReader(path, share=True))
    except BaseException as e:  # CheckpointException is a BaseException
        return str(e)
    return "loaded"


def test_a_damaged_replicated_item_fails_the_load_on_every_rank_naming_it(tmp_path):
    path = str(tmp_path / "ck")
    writer = save(replicated_state(), path)
    reader = FastPersistReader(path)
    location = reader.read_metadata().storage_data
    target = next(loc for index, loc in location.items() if index.fqn == "layer3.w")
    data = os.path.join(path, writer.last_save.files[0])
    with open(data, "r+b") as f:
        f.seek(target.offset + 100)
        byte = f.read(1)
        f.seek(target.offset + 100)
        f.write(bytes([byte[0] ^ 1]))
    outcomes = run_ranks(4, load_expecting_damage, path)
    for rank, message in enumerate(outcomes):
        assert "layer3.w" in message and "checksum mismatch" in message, (rank, message)


def test_twenty_thousand_small_items_are_read_with_few_requests(tmp_path):
    path = str(tmp_path / "ck")
    state = {f"t{i}": torch.full((16,), float(i)) for i in range(20_000)}
    save(state, path)
    loaded = {k: torch.zeros_like(v) for k, v in state.items()}
    reader = FastPersistReader(path)
    dcp.load(loaded, storage_reader=reader, no_dist=True)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    assert 0 < reader.last_load.requests <= len(state) // 10, reader.last_load


def test_shared_items_are_read_by_a_rank_that_sees_their_file(tmp_path):
    path = str(tmp_path / "ck")
    save(replicated_state(), path)
    metadata = FastPersistReader(path).read_metadata()
    planner = DefaultLoadPlanner()
    planner.set_up_planner({k: torch.zeros_like(v) for k, v in replicated_state().items()}, metadata, True)
    plan = planner.create_local_plan()
    catalog = FastPersistCatalog(open_checkpoint(path))
    (name,) = {loc.file for loc in catalog.locations.values()}
    balanced = plan_exchange([plan, plan, plan], catalog, [{name}] * 3)
    assert set(balanced.readers.values()) == {0, 1, 2}  # the bytes spread over every rank that can read them
    only_rank_2 = plan_exchange([plan, plan, plan], catalog, [set(), set(), {name}])
    assert set(only_rank_2.readers.values()) == {2}  # a file on rank 2's node alone: rank 2 reads every item
    assert all(needers == [0, 1, 2] for needers in only_rank_2.needers.values())
