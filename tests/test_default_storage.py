"""``fp_dcp.install()``: fp-dcp as the storage of ``checkpoint_id``-only DCP calls, opt-in and reversible."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._storage_utils import _storage_setup

import fp_dcp
from fp_dcp import FastPersistReader, FastPersistWriter
from fp_dcp.checkpoint import open_checkpoint
from fp_dcp.testing.ranks import run_ranks

pytestmark = pytest.mark.slow  # its tests start processes


def kind(path) -> str:
    return open_checkpoint(path).kind


@pytest.fixture(autouse=True)
def stock_afterwards():
    yield
    fp_dcp.uninstall()


def roundtrip(path) -> bool:
    sd = {"w": torch.randn(16, 4), "n": torch.tensor(3)}
    dcp.save(sd, checkpoint_id=path)
    back = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(back, checkpoint_id=path)
    return all(torch.equal(back[k], sd[k]) for k in sd)


def test_nothing_changes_unless_installed(tmp_path):
    assert not fp_dcp.is_installed()
    assert roundtrip(tmp_path / "a")
    assert kind(tmp_path / "a") == "dcp"
    assert type(_storage_setup(None, str(tmp_path / "b"))) is FileSystemWriter


def test_installed_path_only_calls_save_and_load_through_fp_dcp_and_uninstall_restores(tmp_path):
    dcp.save({"old": torch.ones(3)}, checkpoint_id=tmp_path / "stock")  # before: torch's format
    with fp_dcp.installed():
        assert fp_dcp.is_installed()
        assert roundtrip(tmp_path / "fp")
        assert kind(tmp_path / "fp") == "fp"
        assert type(_storage_setup(None, str(tmp_path / "fp"), reader=True)) is FastPersistReader
        back = {"old": torch.zeros(3)}
        dcp.load(back, checkpoint_id=tmp_path / "stock")  # stock checkpoints still load
        assert torch.equal(back["old"], torch.ones(3))
        # URLs still go to torch's fsspec storage, which fp-dcp does not replace
        assert type(_storage_setup(None, "memory://bucket/ckpt")).__name__ == "FsspecWriter"
        # explicit storage is never touched
        assert type(_storage_setup(FileSystemWriter(str(tmp_path / "x")), None)) is FileSystemWriter
    assert not fp_dcp.is_installed()
    assert type(_storage_setup(None, str(tmp_path / "c"))) is FileSystemWriter
    assert type(_storage_setup(None, str(tmp_path / "stock"), reader=True)) is FileSystemReader


def test_install_is_idempotent_and_nesting_keeps_the_outer_state(tmp_path):
    fp_dcp.uninstall()  # a no-op when not installed
    fp_dcp.install()
    fp_dcp.install()
    with fp_dcp.installed():
        pass
    assert fp_dcp.is_installed()  # the block did not undo the outer install
    assert type(_storage_setup(None, str(tmp_path))) is FastPersistWriter
    fp_dcp.uninstall()
    assert type(_storage_setup(None, str(tmp_path))) is FileSystemWriter


def _env(value: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "FP_DCP_DEFAULT_STORAGE"}
    if value is not None:
        env["FP_DCP_DEFAULT_STORAGE"] = value
    return env


@pytest.mark.parametrize(("value", "expected"), [("1", "True"), ("0", "False"), (None, "False")])
def test_environment_variable_installs_at_import(value, expected):
    probe = "import fp_dcp; print(fp_dcp.is_installed())"
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=_env(value), timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == expected


def test_a_bad_environment_value_is_named():
    run = subprocess.run(
        [sys.executable, "-c", "import fp_dcp"], capture_output=True, text=True, env=_env("yes"), timeout=120
    )
    assert run.returncode != 0
    assert "FP_DCP_DEFAULT_STORAGE must be 1" in run.stderr and "'yes'" in run.stderr


def _save_path_only(rank: int, world: int, root: str) -> tuple[bool, str]:
    sd = {f"r{rank}": torch.full((8,), float(rank)), "shared": torch.arange(4.0)}
    dcp.save(sd, checkpoint_id=root)
    return fp_dcp.is_installed(), type(_storage_setup(None, root)).__name__


def test_spawned_ranks_inherit_the_environment_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("FP_DCP_DEFAULT_STORAGE", "1")
    root = str(tmp_path / "ckpt")
    assert run_ranks(2, _save_path_only, root, fresh=True) == [(True, "FastPersistWriter")] * 2
    assert kind(root) == "fp"
    back = {"r0": torch.zeros(8), "r1": torch.zeros(8), "shared": torch.zeros(4)}
    dcp.load(back, storage_reader=FastPersistReader(root))
    assert torch.equal(back["r1"], torch.ones(8)) and torch.equal(back["shared"], torch.arange(4.0))


@pytest.mark.parametrize("value", ["1", ""])
def test_forked_ranks_follow_the_environment_not_the_fork_servers(tmp_path, monkeypatch, value):
    """Ranks forked from the server that imported fp-dcp once (fp_dcp.testing.processes) are DCP's default storage
    as their environment says when they start, whatever the server's was when it imported fp-dcp."""
    monkeypatch.setenv("FP_DCP_DEFAULT_STORAGE", value)
    root = str(tmp_path / "ckpt")
    expected = (True, "FastPersistWriter") if value else (False, "FileSystemWriter")
    assert run_ranks(2, _save_path_only, root) == [expected] * 2
