"""examples/read_checkpoint.py, written from docs/format.md alone, reads every kind of fp-dcp checkpoint bit-exact.

The kinds: one rank with every dtype DCP can save (bfloat16, the float8s,
bool, the complex dtypes, unsigned ints), 0-d and empty tensors, keys
holding dots, lists and objects; two ranks with data directories, two lanes
each and tensors cut into row chunks, read in place and moved; incremental
checkpoints that reference two earlier ones, with and without data
directories, and one saved over its own base; format version 1 (plain
tuples) and the other byte order, both made by hand from a checkpoint of
today's writer (fp-dcp writes neither, and refuses the second). Each must
come back equal to what was saved, bit for bit. The example refuses a stock
DCP checkpoint as another format, a flipped bit as damage, and a hash that
disagrees with bytes whose CRC-32C agrees.

It also runs as a user runs it, in a process of its own (with fp-dcp's own
CRC-32C and XXH3-128 standing in for the PyPI packages where they are not
installed). tests/test_docs_examples.py checks its search for data files
against fp-dcp's, case by case.
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import STORABLE_DTYPES, random_of
from test_docs_examples import EXAMPLE, ROOT, reading_example
from test_format_rules import edit
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from fp_dcp import FastPersistReader, FastPersistSavePlanner, FastPersistWriter, errors, verify_checkpoint
from fp_dcp._native import _cio
from fp_dcp.testing.ranks import run_ranks


def one_rank_state() -> dict[str, Any]:
    return {
        "dtypes": {str(dtype).removeprefix("torch."): random_of(dtype, 3, 5) for dtype in STORABLE_DTYPES},
        "scalar": torch.tensor(2.5, dtype=torch.float64),  # 0-d
        "empty": torch.zeros(0, 4, dtype=torch.bfloat16),
        "model": {"norm.weight": random_of(torch.float32, 8), "layers": [random_of(torch.float16, 4, 4)] * 2},
        "extra": {"step": 3, "name": "run 7", "betas": (0.9, 0.95), "lrs": [1e-3, 3e-4]},
    }


def two_rank_state() -> dict[str, Any]:
    torch.manual_seed(0)  # every rank saves the same state: the planner deals it out, cut into row chunks
    return {
        "embed": random_of(torch.float32, 64, 8),
        "bf": random_of(torch.bfloat16, 96, 8),
        "f8": random_of(torch.float8_e4m3fn, 256, 8),
        "c": random_of(torch.complex64, 40, 3),
        "flags": random_of(torch.bool, 2000),
        "model": {"norm.weight": random_of(torch.bfloat16, 16), "scale": torch.tensor(0.5)},
        "optim": {"step": 7, "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95)}]},
    }


def save_on_rank(rank: int, world: int, path: str, data_dirs: list[str]) -> None:
    writer = FastPersistWriter(path, data_dirs=data_dirs, lanes_per_dir=2)
    dcp.save(two_rank_state(), storage_writer=writer, planner=FastPersistSavePlanner(split_bytes=1024))


def same(a: Any, b: Any) -> bool:
    """Bit-exact equality of nested state dicts: tensors by dtype, shape and bytes."""
    if isinstance(a, dict):
        return type(b) is dict and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return type(b) is list and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and (a.dtype, a.shape) == (b.dtype, b.shape)
            and a.contiguous().reshape(-1).view(torch.uint8).equal(b.contiguous().reshape(-1).view(torch.uint8))
        )
    return type(a) is type(b) and a == b


def save(path: Path, state: dict[str, Any], **options: Any) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        with FastPersistWriter(path, **options) as writer:
            dcp.save(state, storage_writer=writer, no_dist=True)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Path:
    """``run/ck`` saved by two ranks into ``run/d0`` and ``run/d1``; made once (spawning ranks is slow)."""
    root = tmp_path_factory.mktemp("two-ranks")
    run_ranks(2, save_on_rank, str(root / "run" / "ck"), [str(root / "run" / "d0"), str(root / "run" / "d1")])
    return root


@pytest.fixture
def example(monkeypatch) -> Any:
    return reading_example(monkeypatch)


def test_one_rank_every_dtype(example, tmp_path):
    state = one_rank_state()
    save(tmp_path / "ck", state)
    assert same(example.read_checkpoint(str(tmp_path / "ck")), state)


@pytest.mark.parametrize("moved", [False, True], ids=["in-place", "moved"])
def test_two_ranks_data_dirs_lanes_and_row_chunks(moved, example, two_ranks, tmp_path):
    shutil.copytree(two_ranks, tmp_path, dirs_exist_ok=True)
    if moved:
        shutil.move(tmp_path / "run", tmp_path / "elsewhere")
    path = tmp_path / ("elsewhere" if moved else "run") / "ck"
    footer, md = example.read_metadata(str(path))
    assert len(footer["data_dirs"]) == 2 and {entry["dir"] for entry in footer["files"].values()} == {0, 1}
    assert len(footer["files"]) > 4  # two lanes a directory, two ranks
    assert {name.split("_")[2] for name in footer["files"]} == {"0", "1"}  # both ranks wrote files
    chunks = md.state_dict_metadata["f8"].chunks
    assert len(chunks) > 1 and {c.offsets[0] for c in chunks} != {0}
    assert same(example.read_checkpoint(str(path)), two_rank_state())


def test_incremental_references_two_checkpoints_and_its_own_base(example, tmp_path):
    state = one_rank_state()
    save(tmp_path / "inc-1", state, incremental=True)
    state["model"]["norm.weight"] = random_of(torch.float32, 8)
    save(tmp_path / "inc-2", state, incremental=True, base=tmp_path / "inc-1")
    state["dtypes"]["bfloat16"] = random_of(torch.bfloat16, 3, 5)
    save(tmp_path / "inc-3", state, incremental=True, base=tmp_path / "inc-2")
    footer, _ = example.read_metadata(str(tmp_path / "inc-3"))
    owners = {entry.get("owner") for entry in footer["files"].values()}
    assert footer["format_version"] == 3 and owners == {None, "../inc-1", "../inc-2"}, owners
    assert same(example.read_checkpoint(str(tmp_path / "inc-3")), state)
    state["scalar"] = torch.tensor(-1.0, dtype=torch.float64)
    save(tmp_path / "inc-3", state, incremental=True, base=tmp_path / "inc-3")  # over its own base
    footer, _ = example.read_metadata(str(tmp_path / "inc-3"))
    assert "." in {entry.get("owner") for entry in footer["files"].values()}
    assert same(example.read_checkpoint(str(tmp_path / "inc-3")), state)


def test_incremental_with_data_dirs_moved(example, tmp_path):
    state = one_rank_state()
    dirs = [tmp_path / "run" / "d0", tmp_path / "run" / "d1"]
    save(tmp_path / "run" / "s1", state, incremental=True, data_dirs=dirs)
    state["scalar"] = torch.tensor(1.0, dtype=torch.float64)
    save(tmp_path / "run" / "s2", state, incremental=True, data_dirs=dirs, base=tmp_path / "run" / "s1")
    shutil.move(tmp_path / "run", tmp_path / "moved")
    footer, _ = example.read_metadata(str(tmp_path / "moved" / "s2"))
    assert any("owner" in entry and entry["dir"] is not None for entry in footer["files"].values())
    assert same(example.read_checkpoint(str(tmp_path / "moved" / "s2")), state)


def as_version_1(md: Any, footer: dict[str, Any]) -> None:
    """Every storage_data value a plain tuple of four, as format version 1 stored it."""
    for index, info in md.storage_data.items():
        md.storage_data[index] = (info.relative_path, info.offset, info.length, info.crc32c)
    footer["format_version"] = 1


def test_format_version_1(example, tmp_path):
    state = one_rank_state()
    save(tmp_path / "ck", state)
    edit(tmp_path / "ck", metadata=as_version_1)
    assert same(example.read_checkpoint(str(tmp_path / "ck")), state)
    assert verify_checkpoint(tmp_path / "ck").ok  # fp-dcp reads it too


def the_other_byte_order(path: Path) -> None:
    """Rewrite an fp-dcp checkpoint saved on this host as one saved on a host of the other byte order."""
    other = "big" if sys.byteorder == "little" else "little"

    def swap(md: Any, footer: dict[str, Any]) -> None:
        for fqn, entry in md.state_dict_metadata.items():
            if not isinstance(entry, TensorStorageMetadata):
                continue
            dtype = entry.properties.dtype
            unit = dtype.itemsize // 2 if dtype.is_complex else dtype.itemsize  # each half of a complex apart
            for chunk in entry.chunks:
                info = md.storage_data[MetadataIndex(fqn, chunk.offsets)]
                with open(path / info.relative_path, "r+b") as f:
                    f.seek(info.offset)
                    raw = np.frombuffer(f.read(info.length), np.uint8).reshape(-1, unit)[:, ::-1].tobytes()
                    f.seek(info.offset)
                    f.write(raw)
                info.crc32c = _cio.crc32c(raw)
        footer["byteorder"] = other

    edit(path, metadata=swap)


def test_the_other_byte_order(example, tmp_path):
    state = one_rank_state()
    save(tmp_path / "ck", state)
    the_other_byte_order(tmp_path / "ck")
    assert same(example.read_checkpoint(str(tmp_path / "ck")), state)
    with pytest.raises(errors.IncompatibleCheckpointError):  # fp-dcp refuses it: both are allowed
        FastPersistReader(tmp_path / "ck").read_metadata()


def test_a_stock_checkpoint_is_another_format(example, tmp_path):
    dcp.save({"w": torch.ones(3)}, storage_writer=FileSystemWriter(str(tmp_path / "ck")), no_dist=True)
    with pytest.raises(example.OtherFormat, match="FileSystemWriter"):
        example.read_checkpoint(str(tmp_path / "ck"))


def test_damage_is_refused(example, tmp_path):
    state = {"w": torch.arange(1000.0), "big": torch.arange(40_000.0)}
    save(tmp_path / "ck", state, incremental=True)
    md = pickle.loads((tmp_path / "ck" / ".metadata").read_bytes())
    info = md.storage_data[MetadataIndex("w", [0])]
    with open(tmp_path / "ck" / info.relative_path, "r+b") as f:
        f.seek(info.offset + 100)
        byte = f.read(1)[0]
        f.seek(info.offset + 100)
        f.write(bytes([byte ^ 1]))
    with pytest.raises(example.Damage, match=f"'w' is damaged: bytes {info.offset} to {info.offset + 4000} of "):
        example.read_checkpoint(str(tmp_path / "ck"))

    save(tmp_path / "ck2", state, incremental=True)

    def wrong_hash(md: Any, footer: dict[str, Any]) -> None:
        md.storage_data[MetadataIndex("big", [0])].xxh3_sample = "0" * 32

    edit(tmp_path / "ck2", metadata=wrong_hash)
    with pytest.raises(example.Damage, match=r"'big' is damaged: .* \(xxh3_sample\)"):
        example.read_checkpoint(str(tmp_path / "ck2"))


def shims(into: Path) -> list[str]:
    """Modules ``crc32c`` and ``xxhash`` made of fp-dcp's own functions, for those of the PyPI packages missing."""
    if importlib.util.find_spec("crc32c") is None:
        (into / "crc32c.py").write_text("from fp_dcp._native._cio import crc32c  # noqa: F401\n")
    if importlib.util.find_spec("xxhash") is None:
        (into / "xxhash.py").write_text(
            "from fp_dcp._native import _cio\n\n\ndef xxh3_128_hexdigest(data):\n"
            "    hasher = _cio.Hash128()\n    hasher.update(data)\n    return hasher.hexdigest()\n"
        )
    return [str(into)] if any(into.iterdir()) else []


@pytest.mark.slow
def test_it_runs_as_a_program(two_ranks, tmp_path):
    shutil.copytree(two_ranks, tmp_path / "ckpts")
    (tmp_path / "shims").mkdir()
    path = os.pathsep.join([*shims(tmp_path / "shims"), str(ROOT)])
    env = {**os.environ, "PYTHONPATH": path}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, str(EXAMPLE), *args]
        return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)

    done = run("ckpts/run/ck")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert "('f8',): torch.float8_e4m3fn [256, 8]" in lines and "('optim', 'step'): 7" in lines, lines
    assert lines[-1] == "ckpts/run/ck: intact, 10 values read", lines
    shutil.move(tmp_path / "ckpts" / "run" / "d1", tmp_path / "d1")
    done = run("ckpts/run/ck", "--data-dir", "ckpts/run/d0", "--data-dir", "d1")
    assert done.returncode == 0 and done.stdout.splitlines()[-1] == "ckpts/run/ck: intact, 10 values read", done
    done = run("ckpts/run/ck", "--data-dir", "ckpts/run/d0")
    assert done.returncode == 1, done
    assert done.stdout.startswith("ckpts/run/ck: not a checkpoint: "), done.stdout
