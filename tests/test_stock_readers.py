"""Torch's own readers meeting an fp-dcp checkpoint fail with an error that names fp-dcp and the fix;
checkpoints of the previous format version still load."""

from __future__ import annotations

import json
import pickle
import struct

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import failure, load, save
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from fp_dcp._native import _cio
from fp_dcp.compat import item_fields
from fp_dcp.names import METADATA_NAME


def test_stock_filesystem_reader_names_fp_dcp_and_the_fix(ckpt):
    save({"w": torch.randn(8, 8), "step": 3}, ckpt)
    with pytest.raises(BaseException) as e:
        dcp.load({"w": torch.zeros(8, 8), "step": 0}, storage_reader=FileSystemReader(str(ckpt)))
    message = str(failure(e))
    assert "fp-dcp raw tensor bytes" in message
    assert "FastPersistReader" in message and "fp_dcp.install()" in message and "fp-dcp convert" in message


def test_torch_offline_conversion_tools_name_fp_dcp_too(ckpt, tmp_path):
    # what Lightning's consolidate command and accelerate's merge-weights call
    save({"w": torch.randn(4)}, ckpt)
    with pytest.raises(BaseException) as e:
        dcp_to_torch_save(str(ckpt), str(tmp_path / "out.pt"))
    assert "fp-dcp raw tensor bytes" in str(failure(e))


def test_metadata_unpickles_without_fp_dcp_classes(ckpt):
    save({"w": torch.randn(4)}, ckpt)
    data = (ckpt / METADATA_NAME).read_bytes()
    metadata = pickle.loads(data)  # stops at the end of the pickle, before the footer
    (location,) = metadata.storage_data.values()
    assert type(location).__module__.startswith("torch.")
    file, offset, length, crc, *_ = item_fields(location)
    raw = (ckpt / file).read_bytes()[offset : offset + length]
    assert _cio.crc32c(raw) == crc and length == 16


def as_format_version_1(path) -> None:
    """Rewrite .metadata as fp-dcp format version 1 wrote it: plain tuples, version 1 in the footer."""
    data = (path / METADATA_NAME).read_bytes()
    footer_len, _, magic = struct.unpack("<II8s", data[-16:])
    footer = json.loads(data[len(data) - 16 - footer_len : -16])
    metadata = pickle.loads(data)
    metadata.storage_data = {k: tuple(item_fields(v)[:4]) for k, v in metadata.storage_data.items()}
    body = pickle.dumps(metadata)
    footer.update(format_version=1, pickle_length=len(body), pickle_crc32c=_cio.crc32c(body))
    new = json.dumps(footer).encode()
    (path / METADATA_NAME).write_bytes(body + new + struct.pack("<II8s", len(new), _cio.crc32c(new), magic))


def test_a_format_version_1_checkpoint_still_loads(ckpt):
    sd = {"w": torch.randn(16, 3), "b": torch.arange(5)}
    save(sd, ckpt)
    as_format_version_1(ckpt)
    back = {k: torch.zeros_like(v) for k, v in sd.items()}
    load(back, ckpt)
    assert all(torch.equal(back[k], sd[k]) for k in sd)
