"""Multi-rank saves and resharding loads, on spawned gloo ranks (CPU)."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from conftest import load, save
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh

from fp_dcp import FastPersistReader, FastPersistSavePlanner, FastPersistWriter, compat
from fp_dcp.testing.ranks import RankError, run_ranks, run_ranks_outcomes

pytestmark = pytest.mark.slow  # its tests start processes

SHAPES = {"emb": (37, 24), "proj": (24, 19), "bias": (19,)}


def reference() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return {k: torch.randn(*shape, generator=g) for k, shape in SHAPES.items()}


def sharded(world_shape: tuple[int, ...], placements_of: dict, zeros: bool = False) -> dict:
    """The reference state as DTensors on a mesh, placements per key (dims beyond a tensor's rank fall back)."""
    mesh = init_device_mesh("cpu", world_shape)
    out = {}
    for k, full in reference().items():
        placements = [p if not isinstance(p, Shard) or p.dim < full.dim() else Replicate() for p in placements_of[k]]
        out[k] = distribute_tensor(torch.zeros_like(full) if zeros else full, mesh, placements)
    return out


def full_equal(state: dict) -> list[str]:
    """Keys whose gathered value differs from the reference (collective)."""
    ref = reference()
    bad = []
    for k, v in state.items():
        value = v.full_tensor() if isinstance(v, DTensor) else v
        if not torch.equal(value, ref[k]):
            bad.append(k)
    return bad


def _save(rank: int, world: int, path: str, mesh_shape: tuple, placements: dict, extra: dict) -> dict:
    state = sharded(mesh_shape, placements)
    writer = FastPersistWriter(path, **extra)
    dcp.save(state, storage_writer=writer)
    return {"files": list(writer.last_save.files), "bytes": writer.last_save.bytes}


def _load(rank: int, world: int, path: str, mesh_shape: tuple, placements: dict, extra: dict) -> dict:
    state = sharded(mesh_shape, placements, zeros=True)
    reader = FastPersistReader(path, **extra)
    dcp.load(state, storage_reader=reader)
    needed = sum(v.to_local().nbytes for v in state.values())
    assert reader.last_load.needed == needed
    return {"bad": full_equal(state), "read": reader.last_load.bytes, "needed": needed}


def _all(p) -> dict:
    return dict.fromkeys(SHAPES, p)


def check_loads(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        assert r["bad"] == [], (rank, r)
        # every rank reads about what it needs: holes at most 5%, plus alignment per run
        assert r["read"] <= 1.05 * r["needed"] + 64 * 1024, (rank, r)


def test_1_to_2_ranks(ckpt):
    save(reference(), ckpt)
    check_loads(run_ranks(2, _load, str(ckpt), (2,), _all([Shard(0)]), {}))


def test_2_to_3_ranks_shard0_to_shard1(ckpt):
    out = run_ranks(2, _save, str(ckpt), (2,), _all([Shard(0)]), {})
    assert all(r["files"] for r in out)  # both ranks wrote their own share
    check_loads(run_ranks(3, _load, str(ckpt), (3,), _all([Shard(1)]), {}))


def test_3_to_1_rank(ckpt):
    run_ranks(3, _save, str(ckpt), (3,), _all([Shard(0)]), {})
    target = {k: torch.zeros_like(v) for k, v in reference().items()}
    load(target, ckpt)
    ref = reference()
    assert all(torch.equal(target[k], ref[k]) for k in ref)


def test_2d_mesh_4_ranks_to_1d_2_ranks(ckpt):
    placements = {"emb": [Shard(0), Shard(1)], "proj": [Replicate(), Shard(0)], "bias": [Replicate(), Replicate()]}
    run_ranks(4, _save, str(ckpt), (2, 2), placements, {})
    check_loads(run_ranks(2, _load, str(ckpt), (2,), _all([Shard(1)]), {}))


def test_data_dirs_striped_across_ranks_and_found_on_load(tmp_path):
    dirs = [str(tmp_path / "nvme0"), str(tmp_path / "nvme1")]
    ckpt = str(tmp_path / "ckpt")
    out = run_ranks(2, _save, ckpt, (2,), _all([Shard(0)]), {"data_dirs": dirs, "lanes_per_dir": 1})
    for r in out:
        assert len(r["files"]) == 2  # one per data directory
    assert sorted(os.listdir(ckpt)) == [".lock", ".metadata"]
    check_loads(run_ranks(3, _load, ckpt, (3,), _all([Shard(0)]), {"data_dirs": dirs}))
    outcomes = run_ranks_outcomes(
        2, _load, ckpt, (2,), _all([Shard(0)]), {"data_dirs": [dirs[0], str(tmp_path / "gone")]}
    )
    for ok, value in outcomes:
        assert not ok and "gone (data_dirs[1]) is missing" in value[1]


def _stock_save(rank: int, world: int, path: str) -> None:
    dcp.save(sharded((world,), _all([Shard(0)])), storage_writer=dcp.FileSystemWriter(path))


def test_stock_multi_rank_checkpoint_loads_through_fast_persist_reader(ckpt):
    """Switch readers first: a FileSystemWriter checkpoint of 2 ranks, resharded onto 3 by FastPersistReader."""
    run_ranks(2, _stock_save, str(ckpt))
    for r in run_ranks(3, _load, str(ckpt), (3,), _all([Shard(1)]), {}):
        assert r["bad"] == []


def _fail_on_rank_1(rank: int, world: int, path: str) -> None:
    if rank == 1:
        os.environ["FP_DCP_FAULT_AT"] = "1"  # this rank's first write fails with EIO
    state = sharded((world,), _all([Shard(0)]))
    dcp.save(state, storage_writer=FastPersistWriter(path))


def test_failure_on_one_rank_surfaces_on_all_without_hanging(ckpt):
    outcomes = run_ranks_outcomes(3, _fail_on_rank_1, str(ckpt), timeout=90)
    for ok, value in outcomes:
        assert not ok
        kind, message, _ = value
        assert kind == "CheckpointException" and "RANK 1" in message and "injected fault" in message
    assert not (ckpt / ".metadata").exists()
    assert not [n for n in os.listdir(ckpt) if n.startswith("__1_")]  # the failed rank removed its file


def _balanced_save(rank: int, world: int, path: str, planner_name: str) -> dict:
    g = torch.Generator().manual_seed(7)
    state = {  # dominated by one replicated embedding table, DDP-style
        "embed": torch.randn(4096, 1024, generator=g),
        "head": torch.randn(512, 1024, generator=g),
        **{f"layer{i}.w": torch.randn(256, 256, generator=g) for i in range(6)},
        **{f"layer{i}.b": torch.randn(256, generator=g) for i in range(6)},
    }
    planner = FastPersistSavePlanner() if planner_name == "fp" else None
    writer = FastPersistWriter(path)
    dcp.save(state, storage_writer=writer, planner=planner)
    shares = [0] * world
    dist.all_gather_object(shares, writer.last_save.bytes)
    return {"shares": shares, "planned": planner.byte_shares if planner is not None and rank == 0 else None}


def test_byte_balanced_write_partitioning(tmp_path):
    fp = run_ranks(3, _balanced_save, str(tmp_path / "fp"), "fp")
    stock = run_ranks(3, _balanced_save, str(tmp_path / "stock"), "default")
    shares = fp[0]["shares"]
    if compat.has(compat.BALANCED_PLANS):
        assert shares == fp[0]["planned"]  # what the planner dealt is what the ranks wrote
        assert max(shares) / (sum(shares) / len(shares)) <= 1.05
    else:  # DCP's own de-duplication dealt the items (the planner says so: tests/test_compat.py)
        assert fp[0]["planned"] == [] and sum(shares) == sum(stock[0]["shares"])
    stock_shares = stock[0]["shares"]
    assert max(stock_shares) / (sum(stock_shares) / 3) > 1.5  # the default planner leaves ranks idle
    # the row-chunked checkpoint loads anywhere, here in one process
    g = torch.Generator().manual_seed(7)
    expected = {"embed": torch.randn(4096, 1024, generator=g), "head": torch.randn(512, 1024, generator=g)}
    target = {k: torch.zeros_like(v) for k, v in expected.items()}
    load(target, tmp_path / "fp")
    assert all(torch.equal(target[k], expected[k]) for k in expected)


def _fsdp_model(world: int):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 48), torch.nn.Linear(48, 8)
    )
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _full_state(model, optim) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_sd, optim_sd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    flat = {f"model.{k}": v for k, v in model_sd.items()}
    for fqn, state in optim_sd.get("state", {}).items():  # full state lands on rank 0 only
        for name, value in state.items():
            flat[f"optim.{fqn}.{name}"] = value
    return flat


def _fsdp_train_and_save(rank: int, world: int, path: str) -> dict | None:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim = _fsdp_model(world)
    for step in range(2):
        torch.manual_seed(100 + step)  # same batch on every rank
        optim.zero_grad()
        model(torch.randn(16, 32)).square().mean().backward()
        optim.step()
    model_sd, optim_sd = get_state_dict(model, optim)
    dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=FastPersistWriter(path))
    full = _full_state(model, optim)
    return full if rank == 0 else None


def _fsdp_load(rank: int, world: int, path: str) -> dict | None:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optim = _fsdp_model(world)
    model(torch.randn(2, 32)).sum().backward()  # materialize optimizer state to load into
    optim.step()
    optim.zero_grad()
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, storage_reader=FastPersistReader(path))
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    full = _full_state(model, optim)
    return full if rank == 0 else None


def test_fsdp2_model_and_optimizer_round_trip_across_world_sizes(ckpt):
    saved = run_ranks(2, _fsdp_train_and_save, str(ckpt), timeout=150)[0]
    loaded = run_ranks(3, _fsdp_load, str(ckpt), timeout=150)[0]
    assert saved.keys() == loaded.keys() and any(k.endswith("exp_avg") for k in saved)
    for k in saved:
        assert torch.equal(saved[k], loaded[k]), k


def test_rank_error_helper_reports_the_failing_rank():
    with pytest.raises(RankError, match="rank 1 raised ValueError: boom"):
        run_ranks(2, _boom_on_rank_1)


def _boom_on_rank_1(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("boom")


def test_a_hanging_rank_fails_the_test_and_prints_where_it_hung(capfd):
    with pytest.raises(TimeoutError, match=r"ranks \[0\] did not finish within 3 s"):
        run_ranks(1, _hang_in_a_named_place, timeout=3)
    assert "_hang_in_a_named_place" in capfd.readouterr().err  # the rank's stack, printed before it was killed


def _hang_in_a_named_place(rank: int, world: int) -> None:
    time.sleep(120)


def test_a_rank_that_dies_fails_the_test_at_once():
    # at once: before rank 0 wakes, and not as a timeout
    with pytest.raises(RankError, match="rank 1 raised exit: ended with code 3 and no outcome"):
        run_ranks(2, _die_on_rank_1)


def _die_on_rank_1(rank: int, world: int) -> None:
    if rank == 1:
        os._exit(3)
    time.sleep(120)


def _empty_on_one_rank(rank: int, world: int, path: str, engine: str, direct: bool) -> list[str]:
    from fp_dcp import IOConfig

    mesh = init_device_mesh("cpu", (world,))
    config = IOConfig(engine=engine, direct_io=direct)
    # one row over two ranks: rank 1's shard is empty, and so is every item it is given
    state = {"row": distribute_tensor(torch.arange(4.0).reshape(1, 4), mesh, [Shard(0)]), "z": torch.zeros(0, 1024)}
    dcp.save(state, storage_writer=FastPersistWriter(path, config=config))
    back = {"row": distribute_tensor(torch.zeros(1, 4), mesh, [Shard(0)]), "z": torch.ones(0, 1024)}
    dcp.load(back, storage_reader=FastPersistReader(path, config=config))
    bad = [] if torch.equal(back["row"].full_tensor(), torch.arange(4.0).reshape(1, 4)) else ["row"]
    return bad + ([] if back["z"].shape == (0, 1024) else ["z"])


@pytest.mark.parametrize(("engine", "direct"), [("io_uring", True), ("threads", False)])
def test_a_rank_that_owns_only_empty_items(ckpt, engine, direct):
    assert run_ranks(2, _empty_on_one_rank, str(ckpt), engine, direct) == [[], []]
