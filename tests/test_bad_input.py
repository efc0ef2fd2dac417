"""Bad input gets a clear error naming the problem, and leaves nothing that looks like a checkpoint."""

from __future__ import annotations

import inspect
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import failure, load, metadata_failure, save
from torch.distributed.checkpoint.api import CheckpointException

from fp_dcp import (
    CheckpointExistsError,
    CorruptCheckpointError,
    FastPersistReader,
    FastPersistWriter,
    IncompatibleCheckpointError,
    IOConfig,
    NotACheckpointError,
    UnsupportedTensorError,
    format,
)


def test_path_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_bytes(b"x")
    with pytest.raises(NotADirectoryError, match="exists and is not a directory"):
        FastPersistWriter(f)
    writer = FastPersistWriter(tmp_path / "ok")
    with pytest.raises(NotADirectoryError, match="is not a directory"):
        writer.reset(f)
    assert not FastPersistWriter.validate_checkpoint_id(f)
    assert not FastPersistWriter.validate_checkpoint_id("s3://bucket/ckpt")
    with pytest.raises(ValueError, match="looks like a URL"):
        FastPersistWriter("s3://bucket/ckpt")


def test_parent_is_a_file(tmp_path):
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(CheckpointException) as e:
        save({"w": torch.ones(2)}, tmp_path / "file" / "ckpt")
    err = failure(e)
    assert isinstance(err, NotADirectoryError) and "file" in str(err)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to another user")
def test_parent_not_writable():
    """An unprivileged user saving under a directory it cannot write to."""
    top = tempfile.mkdtemp()  # pytest's own temp tree is closed to other users
    os.chmod(top, 0o755)
    parent = Path(top) / "readonly"
    parent.mkdir(mode=0o755)
    script = textwrap.dedent(
        f"""
        import os, warnings, torch, torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        warnings.filterwarnings("ignore")
        from fp_dcp import FastPersistWriter
        os.setgid(65534); os.setuid(65534)
        try:
            dcp.save({{"w": torch.ones(2)}}, storage_writer=FastPersistWriter({str(parent / "ckpt")!r}))
        except CheckpointException as e:
            exc = next(iter(e.failures.values()))[0]
            print(type(exc).__name__, exc)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=os.getcwd())
    try:
        assert out.stdout.startswith("PermissionError") and str(parent / "ckpt") in out.stdout
        assert list(parent.iterdir()) == []
    finally:
        shutil.rmtree(top)


def test_overwrite_false_refuses_before_writing(ckpt):
    save({"w": torch.ones(4)}, ckpt)
    before = sorted(os.listdir(ckpt))
    with pytest.raises(CheckpointException) as e:
        save({"w": torch.zeros(4)}, ckpt, overwrite=False)
    err = failure(e)
    assert isinstance(err, CheckpointExistsError) and "overwrite=False" in str(err)
    assert sorted(os.listdir(ckpt)) == before
    target = {"w": torch.zeros(4)}
    load(target, ckpt)
    assert torch.equal(target["w"], torch.ones(4))


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda: torch.eye(3).to_sparse(), "to_dense"),
        (lambda: torch.eye(3).to_sparse_csr(), "to_dense"),
        (lambda: torch.empty(3, device="meta"), "meta tensor"),
        (lambda: torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8), "quantized"),
        (lambda: torch.zeros(4, dtype=torch.uint8).view(torch.quint8), "quantized"),  # not is_quantized
    ],
    ids=["sparse_coo", "sparse_csr", "meta", "quantized", "bytes-viewed-as-quantized"],
)
def test_unsupported_tensor_kinds_are_named(ckpt, make, words):
    with pytest.raises(CheckpointException) as e:
        save({"fine": torch.ones(3), "layer.odd": make()}, ckpt)
    err = failure(e)
    assert isinstance(err, UnsupportedTensorError)
    assert "'layer.odd'" in str(err) and words in str(err)
    assert not (ckpt / ".metadata").exists()
    assert not [n for n in os.listdir(ckpt) if n.endswith(".distcp")]


def test_reader_on_missing_and_non_checkpoint_directories(tmp_path, caplog):
    with pytest.raises(CheckpointException) as e:
        load({"w": torch.zeros(2)}, tmp_path / "nowhere")
    assert "is not a directory" in metadata_failure(e, caplog)
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("hello")
    with pytest.raises(CheckpointException) as e:
        load({"w": torch.zeros(2)}, tmp_path / "plain")
    assert "holds no checkpoint: .metadata is missing" in metadata_failure(e, caplog)
    with pytest.raises(NotACheckpointError):
        FastPersistReader(tmp_path / "plain").read_metadata()
    assert not FastPersistReader.validate_checkpoint_id(tmp_path / "plain")


def test_where_dcp_hides_a_failed_metadata_read_the_reader_logs_it(tmp_path, monkeypatch, caplog):
    import fp_dcp.load.reader

    monkeypatch.setattr(fp_dcp.load.reader, "DCP_HIDES_METADATA_ERRORS", True)  # as torch 2.9-2.11 do
    with pytest.raises(NotACheckpointError):
        FastPersistReader(tmp_path / "nowhere").read_metadata()
    assert "is not a directory" in caplog.text
    caplog.clear()
    with pytest.raises(NotACheckpointError):
        FastPersistReader(tmp_path / "nowhere").read_metadata(rank=0)  # DCP's retry: said once, not twice
    assert caplog.text == ""


def rewrite_footer(path, edit: Callable[[dict[str, Any]], None] | None = None, **changes) -> None:
    """Re-encode .metadata's footer with ``changes`` (and ``edit`` applied to it), keeping its checksums valid."""
    data = (path / ".metadata").read_bytes()
    footer_len, _, magic = struct.unpack("<II8s", data[-16:])
    body_end = len(data) - 16 - footer_len
    footer = json.loads(data[body_end:-16])
    footer.update(changes)
    if edit is not None:
        edit(footer)
    new = json.dumps(footer).encode()
    (path / ".metadata").write_bytes(
        data[:body_end] + new + struct.pack("<II8s", len(new), format._cio.crc32c(new), magic)
    )


def test_reader_refuses_a_future_format_version(ckpt):
    save({"w": torch.ones(2)}, ckpt)
    rewrite_footer(ckpt, format_version=format.FORMAT_VERSION + 1)
    newer, known = format.FORMAT_VERSION + 1, format.FORMAT_VERSION
    with pytest.raises(
        IncompatibleCheckpointError, match=f"format version {newer}; this fp-dcp reads versions up to {known}"
    ):
        FastPersistReader(ckpt).read_metadata()


@pytest.mark.parametrize("version", [0, -1, True, "2", 2.0, None])
def test_reader_refuses_a_format_version_that_is_no_version(ckpt, version):
    save({"w": torch.ones(2)}, ckpt)
    rewrite_footer(ckpt, format_version=version)
    with pytest.raises(CorruptCheckpointError, match=re.escape(f"footer gives format_version {version!r}")):
        FastPersistReader(ckpt).read_metadata()


ENTRY_KEYS = ("size", "dir", "owner")  # of each data file's entry in the footer's "files" (owner: optional)


@pytest.mark.parametrize("key", ["byteorder", "files", "pickle_length", "pickle_crc32c", "size", "dir"])
def test_a_footer_without_a_key_it_always_has_is_damage_naming_the_key_and_the_file(ckpt, key):
    save({"w": torch.ones(2)}, ckpt)
    name = next(iter(format.decode_footer((ckpt / ".metadata").read_bytes(), "")["files"]))

    def drop(footer: dict[str, Any]) -> None:
        del (footer["files"][name] if key in ENTRY_KEYS else footer)[key]

    rewrite_footer(ckpt, drop)
    whose = f"footer's entry for {name}" if key in ENTRY_KEYS else "footer"
    with pytest.raises(CorruptCheckpointError, match=re.escape(f"{ckpt / '.metadata'}: {whose} has no {key!r}")):
        FastPersistReader(ckpt).read_metadata()


@pytest.mark.parametrize(
    ("key", "value"),
    [("byteorder", 1), ("files", []), ("pickle_length", "64"), ("size", 4096.0), ("dir", True), ("owner", 5)],
)
def test_a_footer_key_of_the_wrong_type_is_damage_naming_it(ckpt, key, value):
    save({"w": torch.ones(2)}, ckpt)

    def spoil(footer: dict[str, Any]) -> None:
        (next(iter(footer["files"].values())) if key in ENTRY_KEYS else footer)[key] = value

    rewrite_footer(ckpt, spoil)
    with pytest.raises(CorruptCheckpointError, match=re.escape(f"gives {key} {value!r}, not ")):
        FastPersistReader(ckpt).read_metadata()


def test_load_into_wrong_shape_names_the_item(ckpt):
    save({"w": torch.ones(4, 4)}, ckpt)
    with pytest.raises(CheckpointException) as e:
        load({"w": torch.zeros(4, 5)}, ckpt)
    assert "w" in str(e.value)


def test_bad_config_values():
    with pytest.raises(ValueError, match="buffer_size must be a positive multiple of 4096"):
        IOConfig(buffer_size=1000)
    with pytest.raises(ValueError, match="num_buffers must be at least 2"):
        IOConfig(num_buffers=1)
    with pytest.raises(ValueError, match="engine must be"):
        IOConfig(engine="spdk")  # type: ignore[arg-type]


@pytest.mark.skipif(
    "use_collectives" not in inspect.signature(dcp.save).parameters,
    reason="dcp.save has use_collectives from torch 2.9",
)
def test_use_collectives_false_is_refused(ckpt):
    # without collectives DCP calls the writer directly, so the error arrives unwrapped
    with pytest.raises(ValueError, match="needs use_collectives=True"):
        dcp.save({"w": torch.ones(2)}, storage_writer=FastPersistWriter(ckpt), use_collectives=False)
