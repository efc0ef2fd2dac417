"""Relative data_dirs: recorded absolute, so any working directory finds them; older checkpoints' found or named."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import empty_like, failure, load, same_bytes, save
from torch.distributed.checkpoint.api import CheckpointException

from fp_dcp import (
    CorruptCheckpointError,
    DataDirectoryNotFoundError,
    FastPersistReader,
    NotACheckpointError,
    verify_checkpoint,
)
from fp_dcp.checkpoint import open_checkpoint
from fp_dcp.save import placement, writer
from fp_dcp.tools.cli import main

STATE = {"w": torch.randn(64, 32).to(torch.bfloat16), "b": torch.arange(7), "step": 12}


def assert_loads(path, **kwargs) -> None:
    target = empty_like(STATE)
    target["step"] = 0
    load(target, path, **kwargs)
    assert same_bytes(target["w"], STATE["w"]) and same_bytes(target["b"], STATE["b"]) and target["step"] == 12


def as_given(data_dirs) -> list[str]:
    """What fp-dcp recorded before data directories were resolved: the paths as given."""
    return [os.fspath(d) for d in data_dirs or ()]


@pytest.fixture
def old_writer(monkeypatch):
    """Saves record data_dirs as an older fp-dcp did: relative ones relative."""
    monkeypatch.setattr(placement, "data_directories", as_given)
    monkeypatch.setattr(writer, "data_directories", as_given)


@pytest.mark.parametrize("checkpoint", ["absolute", "relative"])
def test_relative_data_dirs_load_and_verify_from_another_working_directory(tmp_path, monkeypatch, checkpoint):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    path = tmp_path / "a" / "ck"
    monkeypatch.chdir(tmp_path / "a")
    save(STATE, path if checkpoint == "absolute" else "ck", data_dirs=["d1", "d2"], lanes_per_dir=2)
    footer = open_checkpoint(path).footer
    assert footer is not None and footer["data_dirs"] == [str(tmp_path / "a" / "d1"), str(tmp_path / "a" / "d2")]
    monkeypatch.chdir(tmp_path / "b")
    assert_loads(path)
    report = verify_checkpoint(path)
    assert report.ok and not report.problems


def test_older_relative_data_dirs_are_found_under_a_directory_above_the_checkpoint(tmp_path, monkeypatch, old_writer):
    origin, elsewhere = tmp_path / "origin", tmp_path / "elsewhere"
    origin.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(origin)
    save(STATE, origin / "run" / "ck", data_dirs=["disks/d1", "d2"])
    footer = open_checkpoint(origin / "run" / "ck").footer
    assert footer is not None and footer["data_dirs"] == ["disks/d1", "d2"]  # as an older fp-dcp recorded them
    monkeypatch.chdir(elsewhere)
    assert_loads(origin / "run" / "ck")
    assert verify_checkpoint(origin / "run" / "ck").ok
    os.rename(origin, tmp_path / "moved")  # the save's working directory moved whole, checkpoint and data
    assert_loads(tmp_path / "moved" / "run" / "ck")
    assert verify_checkpoint(tmp_path / "moved" / "run" / "ck").ok


def test_an_older_relative_data_dir_found_nowhere_is_named_not_reported_as_damage(
    tmp_path, monkeypatch, old_writer, capsys
):
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    path = tmp_path / "ckpts" / "ck"
    save(STATE, path, data_dirs=["d1"])  # d1 is in work/, which is not above ckpts/ck
    monkeypatch.chdir(tmp_path)
    expected = "recorded as relative path 'd1'"
    with pytest.raises(DataDirectoryNotFoundError, match=expected) as e:
        FastPersistReader(path).read_metadata()
    # not the classes that make CheckpointManager.restore count a step as damaged and fall back to an older one
    assert not isinstance(e.value, (CorruptCheckpointError, NotACheckpointError))
    assert "pass data_dirs= to the reader" in str(e.value)
    with pytest.raises(CheckpointException) as e:
        assert_loads(path)
    assert expected in str(failure(e))  # DCP reports a failed read_metadata in an error of its own
    with pytest.raises(DataDirectoryNotFoundError, match=expected):
        verify_checkpoint(path)
    assert main(["verify", str(path)]) == 1
    out, errors = capsys.readouterr()
    assert "DAMAGED" not in out and expected in errors
    assert_loads(path, data_dirs=[tmp_path / "work" / "d1"])  # told where it is


def test_a_file_missing_from_a_found_relative_data_dir_is_damage(tmp_path, monkeypatch, old_writer):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "ck"
    save(STATE, path, data_dirs=["d1"])
    (lost,) = (tmp_path / "d1").rglob("*.distcp")
    lost.unlink()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    report = verify_checkpoint(path)
    assert not report.ok and f"data file {lost} is missing" in report.problems[0]
    with pytest.raises(CheckpointException) as e:
        assert_loads(path)
    assert isinstance(failure(e), CorruptCheckpointError)
