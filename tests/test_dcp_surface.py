"""Every ordinary way of calling DCP works with fp-dcp: checkpoint_id-only constructors, FileSystemWriter's
keyword arguments, plan caching, and the background-process async executor."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import failure, metadata_failure, needs_torch, same_bytes
from torch.distributed.checkpoint import filesystem
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from fp_dcp import FastPersistReader, FastPersistSavePlanner, FastPersistWriter, compat
from fp_dcp.checkpoint import published_files
from fp_dcp.format import parse_data_file_name
from fp_dcp.names import METADATA_NAME
from fp_dcp.testing.ranks import run_ranks, run_ranks_outcomes


@pytest.fixture(autouse=True)
def no_cached_plans():
    """DCP caches plans per planner class for the whole process: each test starts without any."""
    names = (
        "_cached_save_plan",
        "_cached_all_plans",
        "_cached_global_plan",
        "_cached_metadata",
        "_cached_final_save_plan",
    )
    caches = [getattr(SavePlanner, name) for name in names if hasattr(SavePlanner, name)]  # metadata: torch 2.8 on
    for cache in caches:
        cache.clear()
    yield
    for cache in caches:
        cache.clear()


def state(step: int, extra: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    sd = {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g), "step": torch.tensor(step)}
    for i in range(extra):
        sd[f"new{i}"] = torch.randn(8 + i, generator=g)
    return sd


def loaded(path: str, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {k: torch.zeros_like(v) for k, v in like.items()}
    dcp.load(out, checkpoint_id=path, storage_reader=FastPersistReader())
    return out


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert same_bytes(a[k], b[k]), k


def data_files(path: str) -> set[str]:
    return {n for n in os.listdir(path) if parse_data_file_name(n)}


# ------------------------------------------------------------ constructors


def test_writer_and_reader_without_a_path_follow_checkpoint_id(tmp_path):
    writer, reader = FastPersistWriter(), FastPersistReader()
    for step in range(3):  # one writer object, a directory per step
        path = str(tmp_path / f"step-{step}")
        dcp.save(state(step), checkpoint_id=path, storage_writer=writer)
        assert writer.checkpoint_id == path
        out = {k: torch.zeros_like(v) for k, v in state(step).items()}
        dcp.load(out, checkpoint_id=path, storage_reader=reader)
        assert_same(out, state(step))
    assert sorted(os.listdir(tmp_path)) == ["step-0", "step-1", "step-2"]


def test_checkpoint_id_overrides_the_constructor_path_which_stays_the_default(tmp_path):
    default, other = str(tmp_path / "default"), str(tmp_path / "other")
    writer = FastPersistWriter(default)
    dcp.save(state(1), checkpoint_id=other, storage_writer=writer)
    writer.reset()  # what a caller does to go back to the default
    dcp.save(state(2), storage_writer=writer)
    assert_same(loaded(other, state(1)), state(1))
    assert_same(loaded(default, state(2)), state(2))


def test_neither_path_nor_checkpoint_id_is_a_clear_error(tmp_path, caplog):
    with pytest.raises(BaseException) as e:
        dcp.save(state(0), storage_writer=FastPersistWriter())
    assert "no checkpoint directory" in str(failure(e)) and "checkpoint_id" in str(failure(e))
    caplog.clear()  # (what the save logged names the problem too)
    with pytest.raises(BaseException) as e:
        dcp.load(state(0), storage_reader=FastPersistReader())
    assert "no checkpoint directory" in metadata_failure(e, caplog)


def test_filesystem_writer_keyword_arguments_are_accepted_or_refused_by_name(tmp_path):
    # torchtune's call, with FileSystemWriter swapped for FastPersistWriter
    writer = FastPersistWriter(
        str(tmp_path / "a"), thread_count=16, single_file_per_rank=False, sync_files=False, per_thread_copy_ahead=1
    )
    dcp.save(state(3), storage_writer=writer)
    assert_same(loaded(str(tmp_path / "a"), state(3)), state(3))
    FastPersistWriter(cache_staged_state_dict=True, _extensions=None)
    formats = getattr(filesystem, "SerializationFormat", None)  # FileSystemWriter has the option from torch 2.8 on
    if formats is not None:
        FastPersistWriter(serialization_format=formats.TORCH_SAVE)
        with pytest.raises(ValueError, match="serialization_format"):
            FastPersistWriter(serialization_format=formats.SAFETENSORS)
    with pytest.raises(ValueError, match="_extensions"):
        FastPersistWriter(_extensions=[object()])
    with pytest.raises(TypeError, match="'thread_cnt'"):
        FastPersistWriter(thread_cnt=2)
    FastPersistReader(str(tmp_path / "a"), _extension_registry=None)


# ------------------------------------------------------------ plan caching


@pytest.mark.parametrize("planner_type", [DefaultSavePlanner, FastPersistSavePlanner])
def test_plan_caching_one_directory_per_step_and_repeatedly_into_one(tmp_path, planner_type):
    writer = FastPersistWriter()
    tokens = set()
    for step in range(3):
        path = str(tmp_path / f"step-{step}")
        dcp.save(state(step), checkpoint_id=path, storage_writer=writer, planner=planner_type(enable_plan_caching=True))
        tokens |= {parse_data_file_name(n)[2] for n in data_files(path)}
        assert_same(loaded(path, state(step)), state(step))
    same = str(tmp_path / "same")
    for step in range(3):
        before = data_files(same) if os.path.exists(same) else set()
        dcp.save(state(step), checkpoint_id=same, storage_writer=writer, planner=planner_type(enable_plan_caching=True))
        after = published_files(same)  # (the replaced files are removed on a thread of their own)
        assert not before & after  # new names every save: the old checkpoint was intact until publication
        tokens |= {parse_data_file_name(n)[2] for n in after}
        assert_same(loaded(same, state(step)), state(step))
    assert len(tokens) == 6  # every save its own file names
    assert SavePlanner._cached_final_save_plan  # the cache was in use


def test_plan_caching_with_a_state_dict_that_changes(tmp_path):
    writer = FastPersistWriter()
    states = [state(0), state(1), state(2, extra=2), state(3, extra=2), {"w": torch.randn(3, 3)}]
    for step, sd in enumerate(states):
        path = str(tmp_path / f"step-{step}")
        dcp.save(sd, checkpoint_id=path, storage_writer=writer, planner=DefaultSavePlanner(enable_plan_caching=True))
        assert_same(loaded(path, sd), sd)
        assert set(FastPersistReader(path).read_metadata().state_dict_metadata) == set(sd)


def _cached_saves(rank: int, world: int, root: str, planner_name: str) -> list:
    planner_type = {"default": DefaultSavePlanner, "fp": FastPersistSavePlanner}[planner_name]
    writer = FastPersistWriter()
    big = torch.arange(64 * 1024, dtype=torch.float32)  # replicated, split by FastPersistSavePlanner
    out = []
    for step in range(4):
        sd = {"big": big + step, f"own{rank}": torch.full((100,), float(rank + step))}
        if step == 3:
            sd["late"] = torch.ones(5)  # a changed plan after cached ones
        planner = planner_type(enable_plan_caching=True, **({"split_bytes": 1024} if planner_name == "fp" else {}))
        path = os.path.join(root, "same" if step % 2 else f"step-{step}")
        dcp.save(sd, checkpoint_id=path, storage_writer=writer, planner=planner)
        back = {k: torch.zeros_like(v) for k, v in sd.items()}
        dcp.load(back, checkpoint_id=path, storage_reader=FastPersistReader())
        out.append(all(torch.equal(back[k], sd[k]) for k in sd))
    return out


@pytest.mark.parametrize("planner_name", ["default", "fp"])
def test_plan_caching_on_two_ranks(tmp_path, planner_name):
    results = run_ranks(2, _cached_saves, str(tmp_path), planner_name, timeout=180)
    assert results == [[True] * 4, [True] * 4]


# --------------------------------------------- the background-process executor


def test_writer_pickles_without_its_machinery_and_copies_share_warm_resources(tmp_path):
    writer = FastPersistWriter(str(tmp_path / "p"), overwrite=False, lanes_per_dir=2, mode="snapshot")
    blob = pickle.dumps(writer)
    assert len(blob) < 2000  # settings only: no buffers
    first, second = pickle.loads(blob), pickle.loads(blob)
    assert first._resources is second._resources  # one engine and one set of buffers per writer and process
    assert (first.path, first.overwrite, first.lanes_per_dir, first.mode) == (writer.path, False, 2, "snapshot")
    dcp.save(state(5), storage_writer=first)
    assert_same(loaded(writer.path, state(5)), state(5))
    first.close()
    assert pickle.loads(blob)._resources is not first._resources  # closed resources are not handed out again


def _process_saves(rank: int, world: int, root: str) -> list:
    writer = FastPersistWriter(overwrite=False)
    results = []
    for step in range(3):
        sd = {"w": torch.full((1000,), float(step)), f"r{rank}": torch.arange(10) + rank}
        future = dcp.async_save(
            sd,
            checkpoint_id=os.path.join(root, f"step-{step}"),
            storage_writer=writer,
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
        )
        future.result()
        back = {k: torch.zeros_like(v) for k, v in sd.items()}
        dcp.load(back, checkpoint_id=os.path.join(root, f"step-{step}"), storage_reader=FastPersistReader())
        results.append(all(torch.equal(back[k], sd[k]) for k in sd))
    if compat.TORCH < (2, 9):  # torch 2.7's checkpoint process ends at a failed save (its serving loop re-raises)
        return results
    # A failure in the checkpoint process (the directory holds a checkpoint and overwrite=False)
    # reaches this process's future.
    future = dcp.async_save(
        {"w": torch.ones(3)},
        checkpoint_id=os.path.join(root, "step-0"),
        storage_writer=writer,
        async_checkpointer_type=AsyncCheckpointerType.PROCESS,
    )
    try:
        future.result()
        results.append("no error")
    except BaseException as e:  # CheckpointException is a BaseException
        results.append(str(e))
    # The process stays usable after the failure.
    dcp.async_save(
        {"w": torch.ones(3)},
        checkpoint_id=os.path.join(root, "after"),
        storage_writer=writer,
        async_checkpointer_type=AsyncCheckpointerType.PROCESS,
    ).result()
    results.append(os.path.exists(os.path.join(root, "after", METADATA_NAME)))
    return results


@pytest.mark.slow
def test_process_executor_saves_in_a_row_and_reports_a_failure(tmp_path):
    for ranks in run_ranks(2, _process_saves, str(tmp_path), timeout=300):
        assert ranks[:3] == [True, True, True]
        if compat.TORCH >= (2, 9):
            assert "Checkpoint already exists" in ranks[3] and "overwrite=False" in ranks[3]
            assert ranks[4] is True


def _process_with_writer_as_stager(rank: int, world: int, root: str) -> list[str]:
    writer = FastPersistWriter(os.path.join(root, "x"))
    response = dcp.async_save(
        {"w": torch.ones(4)},
        storage_writer=writer,
        async_stager=writer,
        async_checkpointer_type=AsyncCheckpointerType.PROCESS,
    )
    errors = []
    for future in (response.staging_completion, response.upload_completion):
        try:
            future.result(timeout=120)
            errors.append("no error")
        except BaseException as e:
            errors.append(str(e))
    return errors


@pytest.mark.slow
@needs_torch(compat.ASYNC_STAGING)
def test_writer_as_async_stager_with_the_process_executor_fails_clearly_without_hanging(tmp_path):
    for ok, value in run_ranks_outcomes(2, _process_with_writer_as_stager, str(tmp_path), timeout=300):
        assert ok, value
        assert all("AsyncCheckpointerType.PROCESS" in e and "omit async_stager" in e for e in value), value
    assert not os.path.exists(os.path.join(tmp_path, "x", METADATA_NAME))


def test_plan_caching_with_fp_dcp_and_filesystem_writer_in_one_process(tmp_path):
    # DCP keys its plan cache by planner class, not by writer: each writer must take the other's cached plans
    sd = state(7)
    writers = [FastPersistWriter(), None, FastPersistWriter(), None]
    for i, writer in enumerate(writers):
        path = str(tmp_path / f"s{i}")
        storage = writer if writer is not None else dcp.FileSystemWriter(path)
        dcp.save(sd, checkpoint_id=path, storage_writer=storage, planner=DefaultSavePlanner(enable_plan_caching=True))
        assert_same(loaded(path, sd), sd)  # FastPersistReader reads both formats
