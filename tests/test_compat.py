"""What fp_dcp.compat records about torch still holds for the torch installed here."""

from __future__ import annotations

import importlib.util
import inspect
import pickle
import re
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import state_dict_loader
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.staging import AsyncStager

import fp_dcp.log
from fp_dcp import (
    FastPersistReader,
    FastPersistSavePlanner,
    FastPersistWriter,
    OverlappedCheckpointer,
    SafetensorsWriter,
    TorchVersionError,
    compat,
)
from fp_dcp.checkpoint import read_metadata_bytes
from fp_dcp.format import decode_metadata

ROOT = Path(__file__).resolve().parents[1]


def test_this_torch_is_one_the_module_was_checked_against():
    assert torch.__version__.split("+")[0] in compat.CHECKED_TORCH, (
        f"torch {torch.__version__} is not in fp_dcp.compat.CHECKED_TORCH: re-check every entry of that module"
    )


def test_the_declared_range_starts_at_the_oldest_checked_torch():
    requirement = re.search(r'"(torch[^"]*)"', (ROOT / "pyproject.toml").read_text())
    oldest = ".".join(map(str, compat.OLDEST_TORCH))
    assert requirement is not None and requirement[1] == f"torch>={oldest}"
    assert f"`torch>={oldest}`" in (ROOT / "README.md").read_text()
    assert min(compat._minor(v) for v in compat.CHECKED_TORCH) == compat.OLDEST_TORCH
    ci_end = re.search(r"^OLDEST_TORCH := (\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert ci_end is not None and ci_end[1] in compat.CHECKED_TORCH  # `make test`'s second run
    assert compat._minor(ci_end[1]) == compat.OLDEST_TORCH
    assert compat.TORCH >= compat.OLDEST_TORCH


def test_async_staging_works_from_its_torch_on_and_is_said_by_name_before(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(fp_dcp.log, "_logged", set())  # said once per process: maybe by an earlier test
    takes_a_stager = "async_stager" in inspect.signature(dcp.async_save).parameters
    assert takes_a_stager == compat.has(compat.ASYNC_STAGING)  # the version compat names is torch's
    state = {"w": torch.arange(6.0)}
    with FastPersistWriter(tmp_path / "direct", mode="snapshot") as writer:
        if not takes_a_stager:
            with pytest.raises(TorchVersionError, match=re.escape(compat.ASYNC_STAGING.refusal())):
                writer.stage(state)
        overlapped = OverlappedCheckpointer(writer, checkpoint_id=lambda step: tmp_path / f"step-{step}")
        overlapped.after_update(0, state)  # where the writer cannot stage, the whole save runs here
        overlapped.before_update()
        overlapped.close()
    loaded = {"w": torch.zeros(6)}
    dcp.load(loaded, storage_reader=FastPersistReader(tmp_path / "step-0"), no_dist=True)
    assert torch.equal(loaded["w"], state["w"])
    said = [r.getMessage() for r in caplog.records if "async_stager" in r.getMessage()]
    assert bool(said) != takes_a_stager, said
    assert all("needs torch>=2.9" in m and "saves run to their end before after_update returns" in m for m in said)


def test_consolidation_works_from_its_torch_on_and_is_refused_by_name_before(tmp_path):
    module = "torch.distributed.checkpoint._consolidate_hf_safetensors"
    assert (importlib.util.find_spec(module) is not None) == compat.has(compat.CONSOLIDATION)
    if compat.has(compat.CONSOLIDATION):
        pytest.importorskip("safetensors")
        SafetensorsWriter(tmp_path, save_distributed=True, enable_consolidation=True).close()
    else:
        with pytest.raises(TorchVersionError, match=r"enable_consolidation=True\).* needs torch>=2\.9; this is torch"):
            SafetensorsWriter(tmp_path, save_distributed=True, enable_consolidation=True)
    assert not any(tmp_path.iterdir())  # refused or not, nothing written yet


def test_balanced_plans_work_from_their_torch_on_and_are_said_by_name_before(caplog, monkeypatch):
    monkeypatch.setattr(fp_dcp.log, "_logged", set())
    hook = "_dedup_save_plans" in vars(DefaultSavePlanner)  # what FastPersistSavePlanner overrides
    assert hook == compat.has(compat.BALANCED_PLANS)
    FastPersistSavePlanner()
    said = [r.getMessage() for r in caplog.records if "_dedup_save_plans" in r.getMessage()]
    assert said == (
        [] if hook else [f"{compat.BALANCED_PLANS.refusal()}: DCP's own de-duplication deals the items out instead"]
    )


def test_a_save_records_the_fields_older_torches_lack(tmp_path):
    dcp.save({"w": torch.arange(4.0)}, storage_writer=FastPersistWriter(tmp_path), no_dist=True)
    metadata, _ = decode_metadata(read_metadata_bytes(str(tmp_path))[1], "here")  # as any other torch unpickles it
    assert metadata.version == "1.0.0"
    (location,) = metadata.storage_data.values()
    assert location.transform_descriptors == [f"{compat.STOCK_READER_HINT}/1"]
    assert compat.dcp_metadata_version(metadata) == "1.0.0"
    metadata.__dict__.pop("version", None)  # as torch before 2.9 saves it
    assert compat.dcp_metadata_version(metadata) in (None, "1.0.0")


def test_the_writer_is_not_an_async_stager_by_isinstance(tmp_path):
    writer = FastPersistWriter(tmp_path)
    assert compat.WRITER_IS_NOT_AN_ASYNC_STAGER in AsyncStager.__protocol_attrs__  # the member the check needs
    assert not hasattr(writer, compat.WRITER_IS_NOT_AN_ASYNC_STAGER)
    assert not isinstance(writer, AsyncStager)
    assert callable(writer.stage) and callable(writer.synchronize_staging)  # usable as async_stager= all the same


def test_the_writer_reads_the_group_of_the_save_that_calls_it(tmp_path):
    seen = []

    class Recording(FastPersistWriter):
        def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
            seen.append(compat.save_arguments())
            super().set_up_storage_writer(is_coordinator, *args, **kwargs)

    with Recording(tmp_path) as writer:
        dcp.save({"w": torch.ones(2)}, storage_writer=writer)  # one process: DCP runs no collective
    assert seen == [{"process_group": None, "no_dist": True}]
    assert compat.save_arguments() is None  # outside a save


def test_dcp_retries_read_metadata_only_for_a_parameter_named_kwargs():
    retries = f'"{compat.READ_METADATA_KWARGS}"' in inspect.getsource(state_dict_loader)
    assert retries == (compat.TORCH >= (2, 9))  # before 2.9 DCP retries nothing: the first error is reported too
    assert compat.READ_METADATA_KWARGS not in inspect.signature(FastPersistReader.read_metadata).parameters


def test_item_locations_keep_their_checksum_through_a_pickle_and_refuse_stock_readers():
    from torch.distributed.checkpoint._extension import ExtensionRegistry

    location = pickle.loads(pickle.dumps(compat.item_location("__0_0.x.distcp", 4096, 10, 0xDEADBEEF)))
    assert compat.item_fields(location) == ("__0_0.x.distcp", 4096, 10, 0xDEADBEEF, None, None)
    assert compat.item_fields(("f", 1, 2, 3)) == ("f", 1, 2, 3, None, None)  # format version 1
    hashed = pickle.loads(pickle.dumps(compat.item_location("f", 0, 1, 2, "a" * 32, "b" * 32)))
    assert compat.item_fields(hashed) == ("f", 0, 1, 2, "a" * 32, "b" * 32)  # incremental saves' hashes
    with pytest.raises(ValueError, match="fp-dcp raw tensor bytes"):
        ExtensionRegistry().from_descriptor_list(location.transform_descriptors)


def test_default_storage_names_are_what_dcp_tries_for_a_checkpoint_id():
    from torch.distributed.checkpoint import _storage_utils

    assert "FileSystemWriter" in inspect.getsource(_storage_utils._storage_setup)
    assert compat.default_storage() == (_storage_utils.FileSystemWriter, _storage_utils.FileSystemReader)
