"""``fp-dcp verify`` and ``inspect`` on directories of Hugging Face safetensors files.

verify checks the structure a load checks (every file, every problem
reported), reads every byte, and checks the hashes a Hugging Face download
recorded: the blob names of the hub cache, the etags of a ``local_dir``
download's sidecars.
"""

from __future__ import annotations

import hashlib
import json
import os
import time

import pytest
from hf_util import INDEX, llama_state, raw_file, write_model

from fp_dcp import verify_checkpoint
from fp_dcp.io.engine import FAULT_ENV
from fp_dcp.load.safetensors_verify import recorded_hash
from fp_dcp.tools.cli import main
from fp_dcp.tools.inspect import inspect_checkpoint

SMALL = {"layers": 1, "hidden": 64, "inter": 128, "vocab": 256}


@pytest.fixture
def model(tmp_path):
    """A Llama-shaped model in 3 shards with an index, and its state."""
    state = llama_state(**SMALL)
    directory = tmp_path / "model"
    write_model(directory, state, files=3)
    return directory, state


def shards(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))


def last_tensor(path) -> str:
    """The name of the tensor whose bytes end the file."""
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    header.pop("__metadata__", None)
    return max(header, key=lambda name: header[name]["data_offsets"][1])


def flip_last_byte(path) -> None:
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_END)
        f.write(bytes([byte ^ 0x40]))


def git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def as_hub_cache(directory, cache) -> str:
    """``directory``'s files laid out as huggingface_hub's cache: a snapshot of links into blobs named by hash."""
    blobs, snapshot = cache / "blobs", cache / "snapshots" / ("a" * 40)
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for name in os.listdir(directory):
        data = (directory / name).read_bytes()
        digest = hashlib.sha256(data).hexdigest() if name.endswith(".safetensors") else git_sha1(data)
        (blobs / digest).write_bytes(data)
        os.symlink(os.path.join("..", "..", "blobs", digest), snapshot / name)
    return str(snapshot)


def test_intact_model_every_byte_read_no_hash_claimed(model, capsys):
    directory, state = model
    report = verify_checkpoint(directory)
    assert report.ok and report.problems == []
    assert (report.items, report.files) == (len(state), 3)
    assert report.read_bytes == sum(os.path.getsize(directory / n) for n in shards(directory))
    assert (report.checksums, report.hashed_files, report.bytes) == (False, 0, 0)  # safetensors stores none
    assert main(["verify", str(directory)]) == 0
    out = capsys.readouterr().out
    assert f"intact: {len(state)} tensors in 3 files" in out and "no checksums stored" in out


def test_truncated_shard_names_the_file_and_tensor(model, capsys):
    directory, _ = model
    path = directory / shards(directory)[1]
    tensor = last_tensor(path)
    os.truncate(path, os.path.getsize(path) - 100)
    report = verify_checkpoint(directory)
    assert not report.ok
    assert any(str(path) in p and repr(tensor) in p and "truncated" in p for p in report.problems), report.problems
    assert main(["verify", str(directory)]) == 1
    assert f"BAD  {path}: tensor {tensor!r}" in capsys.readouterr().out


def test_every_damaged_file_is_reported_not_only_the_first(tmp_path):
    directory = tmp_path / "lies"
    directory.mkdir()
    # A header that lies about a shape (24 bytes said, 16 held), and one whose tensor runs past the file's end.
    raw_file(directory / "a.safetensors", {"w": {"dtype": "F32", "shape": [6], "data_offsets": [0, 16]}}, bytes(16))
    raw_file(directory / "b.safetensors", {"v": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]}}, bytes(20))
    report = verify_checkpoint(directory)
    assert len(report.problems) == 2, report.problems
    first, second = report.problems
    assert "a.safetensors: tensor 'w' is F32 of shape [6] (24 bytes)" in first
    assert "b.safetensors: tensor 'v'" in second and "runs past the end of the file" in second


def test_index_that_disagrees_with_the_files(model):
    directory, _ = model
    index = json.loads((directory / INDEX).read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"]["model.ghost.weight"] = index["weight_map"][name]
    index["weight_map"]["model.lost.weight"] = "model-00009-of-00009.safetensors"
    (directory / INDEX).write_text(json.dumps(index))
    problems = verify_checkpoint(directory).problems
    assert any("'model.ghost.weight' is listed in" in p and index["weight_map"][name] in p for p in problems)
    missing = "model-00009-of-00009.safetensors is missing (the index lists 'model.lost.weight'"
    assert any(missing in p for p in problems)


def test_hub_cache_hashes_are_checked(model, tmp_path, capsys):
    directory, _ = model
    snapshot = as_hub_cache(directory, tmp_path / "models--org--llama")
    report = verify_checkpoint(snapshot)
    assert report.ok, report.problems
    assert (report.checksums, report.hashed_files) == (True, 3)
    assert report.bytes == report.read_bytes
    assert main(["verify", snapshot]) == 0
    assert "3 of 3 against Hugging Face's SHA-256" in capsys.readouterr().out

    victim = os.path.join(snapshot, shards(directory)[0])
    flip_last_byte(os.path.realpath(victim))  # the structure stays intact: only the hash can tell
    problems = verify_checkpoint(snapshot).problems
    assert len(problems) == 1 and problems[0].startswith(f"{victim}: its sha256 is ")
    assert "its blob's name in the Hugging Face cache records" in problems[0]


def test_hub_cache_index_is_checked_with_gits_sha1(model, tmp_path):
    directory, _ = model
    snapshot = as_hub_cache(directory, tmp_path / "models--org--llama")
    index = os.path.realpath(os.path.join(snapshot, INDEX))
    assert recorded_hash(os.path.join(snapshot, INDEX)).algorithm == "git-sha1"
    with open(index, "a") as f:
        f.write(" ")  # still valid JSON, the same weight_map: only the hash can tell
    problems = verify_checkpoint(snapshot).problems
    assert len(problems) == 1 and f"{snapshot}/{INDEX}: its git-sha1 is" in problems[0]


def test_local_dir_download_sidecars_are_checked(model):
    directory, _ = model
    sidecars = directory / ".cache" / "huggingface" / "download"
    sidecars.mkdir(parents=True)
    names = shards(directory)
    for name in names[:2]:  # the third has no record: checked for structure only
        digest = hashlib.sha256((directory / name).read_bytes()).hexdigest()
        (sidecars / f"{name}.metadata").write_text(f"{'b' * 40}\n{digest}\n{time.time()}\n")
    report = verify_checkpoint(directory)
    assert report.ok and (report.checksums, report.hashed_files) == (False, 2)
    stat = os.stat(directory / names[1])
    flip_last_byte(directory / names[1])
    os.utime(directory / names[1], ns=(stat.st_atime_ns, stat.st_mtime_ns))  # bit rot leaves the time as it was
    problems = verify_checkpoint(directory).problems
    assert len(problems) == 1 and f"{sidecars / names[1]}.metadata records" in problems[0]


def test_a_local_dir_record_older_than_its_file_is_not_used(model):
    directory, _ = model
    name = shards(directory)[0]
    sidecars = directory / ".cache" / "huggingface" / "download"
    sidecars.mkdir(parents=True)
    (sidecars / f"{name}.metadata").write_text(f"{'b' * 40}\n{'0' * 64}\n{time.time() - 3600}\n")
    report = verify_checkpoint(directory)  # the file was rewritten after the record: huggingface_hub's rule
    assert report.ok and report.hashed_files == 0


def test_a_file_that_cannot_be_read_is_named(model, monkeypatch):
    directory, _ = model
    monkeypatch.setenv(FAULT_ENV, "1")  # the engine fails its first request with EIO
    problems = verify_checkpoint(directory).problems
    assert len(problems) == 1 and problems[0].startswith(f"{directory / shards(directory)[0]} could not be read")


def test_progress_counts_every_byte(model):
    directory, _ = model
    calls = []
    verify_checkpoint(directory, progress=lambda done, total: calls.append((done, total)))
    total = sum(os.path.getsize(directory / n) for n in shards(directory))
    assert calls[0] == (0, total) and calls[-1] == (total, total)


def test_a_damaged_index_alone_is_a_problem_not_an_error(tmp_path):
    directory = tmp_path / "only-index"
    directory.mkdir()
    (directory / INDEX).write_text("{not json")
    report = verify_checkpoint(directory)
    assert (
        not report.ok and len(report.problems) == 1 and f"{directory / INDEX} is not valid JSON" in report.problems[0]
    )


def test_data_dirs_do_not_apply(model):
    with pytest.raises(ValueError, match="data_dirs does not apply"):
        verify_checkpoint(model[0], data_dirs=["elsewhere"])


def test_inspect_lists_tensors_files_and_index(model, capsys):
    directory, state = model
    info = inspect_checkpoint(directory)
    assert (info["format"], info["writer"]) == ("safetensors", f"Hugging Face safetensors (indexed by {INDEX})")
    by_fqn = {item["fqn"]: item for item in info["items"]}
    assert by_fqn.keys() == state.keys()
    index = json.loads((directory / INDEX).read_text())["weight_map"]
    for name, tensor in state.items():
        item = by_fqn[name]
        assert (item["dtype"], item["shape"], item["chunks"]) == ("bfloat16", list(tensor.shape), 1)
        assert (item["bytes"], item["files"]) == (tensor.nbytes, [index[name]])
    assert info["files"] == {n: os.path.getsize(directory / n) for n in shards(directory)}
    assert info["totals"]["bytes"] == sum(t.nbytes for t in state.values())
    assert main(["inspect", str(directory)]) == 0
    out = capsys.readouterr().out
    assert "format:     safetensors\n" in out and f"{len(state)} items ({len(state)} tensors, 0 objects)" in out


def test_inspect_of_a_damaged_directory_names_the_fault(model, capsys):
    directory, _ = model
    path = directory / shards(directory)[0]
    os.truncate(path, os.path.getsize(path) - 1)
    assert main(["inspect", str(directory)]) == 1
    assert f"{path}: tensor " in capsys.readouterr().err
