"""What fp_dcp.compat records about torch still holds for the torch installed here."""

from __future__ import annotations

import inspect
import pickle

import pytest
import torch
from torch.distributed.checkpoint import state_dict_loader
from torch.distributed.checkpoint.staging import AsyncStager

from fp_dcp import FastPersistReader, FastPersistWriter, compat


def test_this_torch_is_one_the_module_was_checked_against():
    assert torch.__version__.split("+")[0] in compat.CHECKED_TORCH, (
        f"torch {torch.__version__} is not in fp_dcp.compat.CHECKED_TORCH: re-check every entry of that module"
    )


def test_the_writer_is_not_an_async_stager_by_isinstance(tmp_path):
    writer = FastPersistWriter(tmp_path)
    assert compat.WRITER_IS_NOT_AN_ASYNC_STAGER in AsyncStager.__protocol_attrs__  # the member the check needs
    assert not hasattr(writer, compat.WRITER_IS_NOT_AN_ASYNC_STAGER)
    assert not isinstance(writer, AsyncStager)
    assert callable(writer.stage) and callable(writer.synchronize_staging)  # usable as async_stager= all the same


def test_dcp_retries_read_metadata_only_for_a_parameter_named_kwargs():
    assert f'"{compat.READ_METADATA_KWARGS}"' in inspect.getsource(state_dict_loader)
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
