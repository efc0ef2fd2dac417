"""Every check in docs/format.md's table, broken on purpose: the loader and ``verify`` do what the tables say.

The tables are read from the pages themselves: docs/format.md's names each
check and its verdict (damage, incompatible), docs/reading.md's the same
checks and two of fp-dcp's search for moved files, with when fp-dcp's
loader makes each (``open``: before it reads or writes anything; ``read``:
as it reads) or that only ``verify`` does, and the error. Each row has at
least one case here that breaks it, a hand-edited checkpoint; every error
class a row names is raised by one of its cases, and each is the one
format.md's verdict names.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pickle
import re
import shutil
import socket
import struct
import subprocess
import sys
import threading
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import failure
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

from fp_dcp import FastPersistReader, FastPersistWriter, errors, verify_checkpoint
from fp_dcp._native import _cio
from fp_dcp.format import HASHING

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Row:
    check: str
    made_by: frozenset[str]  # open, read, verify
    errors: frozenset[str]


def section_rows(doc: str, heading: str, columns: int) -> dict[str, list[str]]:
    """The rows of the table under ``heading`` in docs/``doc``, by their first cell (a check's name)."""
    text = (ROOT / "docs" / doc).read_text()
    start = text.index(f"\n{heading}\n")
    end = text.find("\n## ", start + 1)
    rows = {}
    for line in text[start : end if end >= 0 else len(text)].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == columns and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = cells[1:]
    return rows


def table() -> dict[str, Row]:
    """docs/reading.md's table: each check, who makes it, the errors."""
    rows = section_rows("reading.md", "## Which check raises what", 3)
    return {
        check: Row(check, frozenset(c.strip() for c in by.split(",")), frozenset(re.findall(r"`(\w+Error)`", error)))
        for check, (by, error) in rows.items()
    }


TABLE = table()
# docs/format.md's table: each check's verdict when broken
VERDICTS = {check: cells[1] for check, cells in section_rows("format.md", "## The checks", 3).items()}
# the errors fp-dcp raises for each verdict (docs/reading.md)
ERRORS = {
    "damage": "CorruptCheckpointError",
    "incompatible": "IncompatibleCheckpointError",
    "not a checkpoint": "NotACheckpointError",
}
# checks of fp-dcp's search for moved data files (docs/reading.md), not rules of the format
SEARCH = {"data-dirs-given", "data-dir-found"}


def state() -> dict[str, Any]:
    return {
        "w": torch.arange(32.0).reshape(8, 4),
        "w2": torch.arange(32.0).reshape(8, 4),  # the same bytes as w
        "big": torch.arange(20_000.0),  # over 64 KiB: it has a sample hash
        "o": {"step": 3},
    }


def target() -> dict[str, Any]:
    """What a load fills: every value set to one that no checkpoint holds."""
    return {
        "w": torch.full((8, 4), -1.0),
        "w2": torch.full((8, 4), -1.0),
        "big": torch.full((20_000,), -1.0),
        "o": {"step": -1},
    }


@pytest.fixture(scope="module")
def templates(tmp_path_factory) -> Path:
    """fp-dcp's checkpoint `plain` (incremental, so with hashes), `inc` referencing its tensors, one saved with two
    data_dirs, a stock one."""
    root = tmp_path_factory.mktemp("templates")
    with FastPersistWriter(root / "plain", incremental=True) as writer:
        dcp.save(state(), storage_writer=writer, no_dist=True)
    with FastPersistWriter(root / "inc", incremental=True, base=root / "plain") as writer:
        dcp.save(state(), storage_writer=writer, no_dist=True)
    dirs = [root / "disk0", root / "disk1"]
    dcp.save(state(), storage_writer=FastPersistWriter(root / "dirs", data_dirs=dirs), no_dist=True)
    dcp.save(state(), storage_writer=FileSystemWriter(str(root / "stock")), no_dist=True)
    return root


# ---- editing a checkpoint by hand


def parts(path: Path) -> tuple[bytes, bytes, bytes]:
    data = (path / ".metadata").read_bytes()
    footer_len = struct.unpack("<I", data[-16:-12])[0]
    return data[: len(data) - 16 - footer_len], data[-16 - footer_len : -16], data[-8:]


def edit(
    path: Path,
    metadata: Callable[[Any, dict[str, Any]], None] | None = None,
    footer: Callable[[dict[str, Any]], None] | None = None,
    raw_footer: Callable[[dict[str, Any]], bytes] | None = None,
    raw_pickle: bytes | None = None,
) -> None:
    """Rewrite fp-dcp `.metadata` with the edits, its lengths and checksums made to match."""
    body, footer_bytes, magic = parts(path)
    decoded = json.loads(footer_bytes)
    if metadata is not None:
        md = pickle.loads(body)
        metadata(md, decoded)
        body = pickle.dumps(md)
    body = raw_pickle if raw_pickle is not None else body
    decoded.update(pickle_length=len(body), pickle_crc32c=_cio.crc32c(body))
    if footer is not None:
        footer(decoded)
    new = raw_footer(decoded) if raw_footer is not None else json.dumps(decoded).encode()
    (path / ".metadata").write_bytes(body + new + struct.pack("<II", len(new), _cio.crc32c(new)) + magic)


def edit_stock(path: Path, metadata: Callable[[Any], None]) -> None:
    md = pickle.loads((path / ".metadata").read_bytes())
    metadata(md)
    (path / ".metadata").write_bytes(pickle.dumps(md))


def location(md: Any, fqn: str, offsets: list[int] | None = None) -> Any:
    return md.storage_data[MetadataIndex(fqn, offsets)]


def data_file(path: Path) -> Path:
    (found,) = list(path.rglob("*.distcp"))
    return found


def only_file(footer: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    ((name, entry),) = footer["files"].items()
    return name, entry


def write_at(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def rekey(md: Any, fqn: str, old: list[int], new: list[int]) -> None:
    md.storage_data[MetadataIndex(fqn, new)] = md.storage_data.pop(MetadataIndex(fqn, old))


# ---- the cases: (check, how, the error, words the error or verify's problem holds, arrange)

Arrange = Callable[[Path], dict[str, Any]]  # breaks the checkpoint at the path; returns the reader's kwargs


@dataclasses.dataclass(frozen=True)
class Case:
    check: str
    how: str
    error: str
    words: str
    arrange: Arrange
    template: str = "plain"

    @property
    def id(self) -> str:
        return f"{self.check}: {self.how}"


def edits(**kwargs: Any) -> Arrange:
    def arrange(path: Path) -> dict[str, Any]:
        edit(path, **kwargs)
        return {}

    return arrange


def on_metadata(change: Callable[[Any], None]) -> Arrange:
    return edits(metadata=lambda md, footer: change(md))


def on_footer(change: Callable[[dict[str, Any]], None]) -> Arrange:
    return edits(footer=change)


def on_entry(change: Callable[[dict[str, Any]], None]) -> Arrange:
    return on_footer(lambda footer: change(only_file(footer)[1]))


def on_stock(change: Callable[[Any], None]) -> Arrange:
    def arrange(path: Path) -> dict[str, Any]:
        edit_stock(path, change)
        return {}

    return arrange


def set_attr(fqn: str, offsets: list[int] | None, **values: Any) -> Arrange:
    def change(md: Any) -> None:
        for key, value in values.items():
            setattr(location(md, fqn, offsets), key, value)

    return on_metadata(change)


def replace_magic(path: Path) -> dict[str, Any]:
    data = (path / ".metadata").read_bytes()
    (path / ".metadata").write_bytes(data[:-8] + b"NOTFPDCP")
    return {}


def magic_alone(path: Path) -> dict[str, Any]:
    (path / ".metadata").write_bytes(b"FPDCP\x00\r\n")  # 8 bytes: no room for a trailer
    return {}


def stock_and_more(path: Path) -> dict[str, Any]:
    with open(path / ".metadata", "ab") as f:
        f.write(b"more")
    return {}


def pickle_and_more(path: Path) -> dict[str, Any]:
    """Bytes after the pickle, within pickle_length (and its checksum)."""
    edit(path, raw_pickle=parts(path)[0] + b"more")
    return {}


def owners_file(path: Path) -> Path:
    """The data file of `plain` that the checkpoint `inc` at `path` references."""
    ((name, entry),) = [(n, e) for n, e in json.loads(parts(path)[1])["files"].items() if "owner" in e]
    assert entry["owner"] == "../plain"
    return path.parent / "plain" / name


def grow_owners_file(path: Path) -> dict[str, Any]:
    with open(owners_file(path), "ab") as f:
        f.write(bytes(4096))
    return {}


def chunks_tuple(md: Any) -> None:
    md.state_dict_metadata["w"].chunks = tuple(md.state_dict_metadata["w"].chunks)


def one_dimension(md: Any) -> None:
    """w's chunk given one offset and one size (w has two dimensions)."""
    md.state_dict_metadata["w"].chunks[0] = ChunkStorageMetadata(torch.Size([0]), torch.Size([32]))
    rekey(md, "w", [0, 0], [0])


def look_alike(md: Any) -> None:
    """w's location an object of another class with the same fields."""
    md.storage_data[MetadataIndex("w", [0, 0])] = types.SimpleNamespace(**vars(location(md, "w", [0, 0])))


def stock_set(fqn: str, offsets: list[int] | None, **values: Any) -> Arrange:
    def change(md: Any) -> None:
        for key, value in values.items():
            if value is None:
                delattr(location(md, fqn, offsets), key)
            else:
                setattr(location(md, fqn, offsets), key, value)

    return on_stock(change)


def flip_footer_byte(path: Path) -> dict[str, Any]:
    body, footer_bytes, _ = parts(path)
    data = bytearray((path / ".metadata").read_bytes())
    data[len(body) + footer_bytes.index(b'"byteorder"') + 2] ^= 0x01  # the b of byteorder
    (path / ".metadata").write_bytes(bytes(data))
    return {}


def flip_pickle_byte(path: Path) -> dict[str, Any]:
    data = bytearray((path / ".metadata").read_bytes())
    data[len(data) // 4] ^= 0x01
    (path / ".metadata").write_bytes(bytes(data))
    return {}


def twice(footer: dict[str, Any]) -> bytes:
    return b'{"format": "fp-dcp", ' + json.dumps(footer).encode()[1:]


def gap(md: Any) -> None:
    md.state_dict_metadata["w"].size = torch.Size([10, 4])


def overlap(md: Any) -> None:
    tensor = md.state_dict_metadata["w"]
    tensor.chunks.append(ChunkStorageMetadata(torch.Size([4, 0]), torch.Size([4, 4])))
    whole = location(md, "w", [0, 0])
    half = pickle.loads(pickle.dumps(whole))  # rows 4..7 of w: its last 64 bytes
    half.offset, half.length = whole.offset + 64, 64
    half.crc32c = _cio.crc32c(torch.arange(16.0, 32.0).numpy().tobytes())
    md.storage_data[MetadataIndex("w", [4, 0])] = half


def outside(md: Any) -> None:
    md.state_dict_metadata["w"].chunks[0].offsets = torch.Size([2, 0])
    rekey(md, "w", [0, 0], [2, 0])


def no_chunks(md: Any) -> None:
    md.state_dict_metadata["w"].chunks = []
    del md.storage_data[MetadataIndex("w", [0, 0])]


def stock_gap(md: Any) -> None:
    md.state_dict_metadata["w"].size = torch.Size([9, 4])


def missing_class(path: Path) -> dict[str, Any]:
    edit(path, raw_pickle=b"cfp_dcp_no_such_module\nMetadata\n.")
    return {}


def quantized(md: Any) -> None:
    md.state_dict_metadata["w"].properties.dtype = torch.qint8


def undescribed(md: Any) -> None:
    md.storage_data[MetadataIndex("ghost", [0, 0])] = location(md, "w", [0, 0])


def w2_over_w(md: Any) -> None:
    """w2's item at w's bytes (the same values): two items on one byte range, each whole and intact."""
    w, w2 = location(md, "w", [0, 0]), location(md, "w2", [0, 0])
    w2.offset, w2.crc32c = w.offset, w.crc32c


def no_checkpoint_id(md: Any) -> None:
    md.storage_meta.checkpoint_id = 42


def too_few_dirs(path: Path) -> dict[str, Any]:
    return {"data_dirs": [str(path.parent / "disk0")]}


def a_dir_not_there(path: Path) -> dict[str, Any]:
    return {"data_dirs": [str(path.parent / "disk0"), str(path.parent / "nowhere")]}


def relative_dirs_not_found(path: Path) -> dict[str, Any]:
    edit(path, footer=lambda footer: footer.update(data_dirs=["gone0", "gone1"]))
    return {}


def delete_file(path: Path) -> dict[str, Any]:
    data_file(path).unlink()
    return {}


def cut_file(path: Path) -> dict[str, Any]:
    f = data_file(path)
    os.truncate(f, f.stat().st_size - 4096)
    return {}


def grow_file(path: Path) -> dict[str, Any]:
    with open(data_file(path), "ab") as f:
        f.write(bytes(4096))
    return {}


def unused_entry(path: Path) -> dict[str, Any]:
    (path / "__9_0.0123456789abcdef.distcp").write_bytes(b"")
    edit(
        path, footer=lambda footer: footer["files"].update({"__9_0.0123456789abcdef.distcp": {"dir": None, "size": 0}})
    )
    return {}


def oversized(path: Path) -> dict[str, Any]:
    grow_file(path)
    edit(path, footer=lambda footer: only_file(footer)[1].update(size=only_file(footer)[1]["size"] + 4096))
    return {}


def flip_item_byte(path: Path) -> dict[str, Any]:
    write_at(data_file(path), 3, b"\xff")  # in w, the first item
    return {}


def dirty_padding(path: Path) -> dict[str, Any]:
    f = data_file(path)
    write_at(f, f.stat().st_size - 1, b"\x01")  # past the last item, within the size
    return {}


def no_path_name(path: Path) -> dict[str, Any]:
    """The data file named with a JSON-escaped lone surrogate in the footer and in every location."""
    bad = "\ud800.distcp"

    def rename(md: Any, footer: dict[str, Any]) -> None:
        name, entry = only_file(footer)
        footer["files"] = {name.replace(".distcp", bad): entry}
        for info in md.storage_data.values():
            info.relative_path = info.relative_path.replace(".distcp", bad)

    edit(path, metadata=rename)
    return {}


def other_byteorder(footer: dict[str, Any]) -> None:
    footer["byteorder"] = "big" if sys.byteorder == "little" else "little"


CASES = [
    Case("magic", "another magic", "CorruptCheckpointError", "not fp-dcp metadata", replace_magic),
    Case("magic", "the magic alone, 8 bytes", "CorruptCheckpointError", "not fp-dcp metadata", magic_alone),
    Case(
        "magic",
        "stock: bytes after the pickle",
        "CorruptCheckpointError",
        "not fp-dcp metadata",
        stock_and_more,
        "stock",
    ),
    Case(
        "footer-crc", "a flipped footer byte", "CorruptCheckpointError", "footer fails its checksum", flip_footer_byte
    ),
    Case("footer-json", "a key twice", "CorruptCheckpointError", "key 'format' given twice", edits(raw_footer=twice)),
    Case(
        "footer-json",
        "UTF-16",
        "CorruptCheckpointError",
        "not a UTF-8 JSON object",
        edits(raw_footer=lambda footer: json.dumps(footer).encode("utf-16")),
    ),
    Case(
        "footer-json",
        "NaN",
        "CorruptCheckpointError",
        "NaN is not JSON",
        edits(raw_footer=lambda footer: json.dumps({**footer, "x": float("nan")}).encode()),
    ),
    Case(
        "footer-json",
        "an array",
        "CorruptCheckpointError",
        "list JSON, not an object",
        edits(raw_footer=lambda footer: json.dumps([footer]).encode()),
    ),
    Case(
        "format", "missing", "CorruptCheckpointError", "footer names format None", on_footer(lambda f: f.pop("format"))
    ),
    Case(
        "format",
        "another",
        "CorruptCheckpointError",
        "format 'fp-dcp2'",
        on_footer(lambda f: f.update(format="fp-dcp2")),
    ),
    Case(
        "format-version",
        "0",
        "CorruptCheckpointError",
        "format_version 0",
        on_footer(lambda f: f.update(format_version=0)),
    ),
    Case(
        "format-version",
        "4",
        "IncompatibleCheckpointError",
        "upgrade fp-dcp",
        on_footer(lambda f: f.update(format_version=4)),
    ),
    Case(
        "footer-keys",
        "no pickle_length",
        "CorruptCheckpointError",
        "has no 'pickle_length'",
        on_footer(lambda f: f.pop("pickle_length")),
    ),
    Case(
        "footer-keys",
        "data_dirs a string",
        "CorruptCheckpointError",
        "gives data_dirs 'disk0', not an array",
        on_footer(lambda f: f.update(data_dirs="disk0")),
    ),
    Case(
        "footer-keys",
        "a data_subdir without data_dirs",
        "CorruptCheckpointError",
        "gives data_subdir 'sub' with data_dirs []",
        on_footer(lambda f: f.update(data_subdir="sub")),
    ),
    Case(
        "footer-keys",
        "an empty data dir",
        "CorruptCheckpointError",
        "lists '' in data_dirs",
        on_footer(lambda f: f.update(data_dirs=[""], data_subdir="s")),
    ),
    Case(
        "file-entry",
        "a negative size",
        "CorruptCheckpointError",
        "gives size -4096",
        on_entry(lambda e: e.update(size=-4096)),
    ),
    Case(
        "file-entry",
        "a size not of pages",
        "CorruptCheckpointError",
        "gives size 81921, not a multiple of 4096",
        on_entry(lambda e: e.update(size=81921)),
    ),
    Case("file-entry", "no dir", "CorruptCheckpointError", "has no 'dir'", on_entry(lambda e: e.pop("dir"))),
    Case("file-entry", "no size", "CorruptCheckpointError", "has no 'size'", on_entry(lambda e: e.pop("size"))),
    Case(
        "file-entry",
        "a data_subdir null",
        "CorruptCheckpointError",
        "gives data_subdir None, not a string",
        on_entry(lambda e: e.update(data_subdir=None)),
    ),
    Case(
        "file-entry",
        "a dir past data_dirs",
        "CorruptCheckpointError",
        "gives dir 0; the footer lists 0 data_dirs",
        on_entry(lambda e: e.update(dir=0)),
    ),
    Case(
        "file-entry",
        "an absolute owner",
        "CorruptCheckpointError",
        "gives owner '/x', not a relative path",
        on_entry(lambda e: e.update(owner="/x")),
    ),
    Case(
        "file-entry",
        "not an object",
        "CorruptCheckpointError",
        "is 5, not an object",
        on_footer(lambda f: f["files"].update({only_file(f)[0]: 5})),
    ),
    Case(
        "file-entry",
        "a name of two components",
        "CorruptCheckpointError",
        "'../x.distcp' is not a file name",
        on_footer(lambda f: f["files"].update({"../x.distcp": f["files"].pop(only_file(f)[0])})),
    ),
    Case(
        "file-entry",
        "a name with a lone surrogate",
        "CorruptCheckpointError",
        "\\ud800.distcp' is not a file name",
        no_path_name,
    ),
    Case(
        "file-entry",
        "an owner with a lone surrogate",
        "CorruptCheckpointError",
        "gives owner '..\\ud800', not a relative path",
        on_entry(lambda e: e.update(owner="..\ud800")),
    ),
    Case(
        "footer-keys",
        "a data dir with a lone surrogate",
        "CorruptCheckpointError",
        "lists '/d\\ud800' in data_dirs, not a path",
        on_footer(lambda f: f.update(data_dirs=["/d\ud800"], data_subdir="s")),
    ),
    Case(
        "byteorder",
        "middle",
        "CorruptCheckpointError",
        "byteorder 'middle'",
        on_footer(lambda f: f.update(byteorder="middle")),
    ),
    Case("byteorder", "the other", "IncompatibleCheckpointError", "-endian data", on_footer(other_byteorder)),
    Case(
        "pickle-crc", "a flipped pickle byte", "CorruptCheckpointError", "pickle fails its checksum", flip_pickle_byte
    ),
    Case(
        "pickle-crc",
        "a negative pickle_length",
        "CorruptCheckpointError",
        "pickle fails its checksum",
        on_footer(lambda f: f.update(pickle_length=-1)),
    ),
    Case(
        "pickle-crc",
        "a pickle_crc32c of 33 bits",
        "CorruptCheckpointError",
        "pickle fails its checksum",
        on_footer(lambda f: f.update(pickle_crc32c=f["pickle_crc32c"] + 2**32)),
    ),
    Case(
        "pickle", "a dict", "CorruptCheckpointError", "metadata pickle holds dict", edits(raw_pickle=pickle.dumps({}))
    ),
    Case(
        "pickle", "a class torch lacks", "IncompatibleCheckpointError", "fp_dcp_no_such_module.Metadata", missing_class
    ),
    Case("pickle", "truncated", "CorruptCheckpointError", "does not unpickle", edits(raw_pickle=pickle.dumps({})[:-1])),
    Case(
        "pickle",
        "ending before pickle_length",
        "CorruptCheckpointError",
        "metadata pickle ends at byte",
        pickle_and_more,
    ),
    Case(
        "entry",
        "a quantized dtype",
        "CorruptCheckpointError",
        "'w' has the quantized dtype torch.qint8",
        on_metadata(quantized),
    ),
    Case(
        "entry",
        "a negative size",
        "CorruptCheckpointError",
        "'w' has size",
        on_metadata(lambda md: setattr(md.state_dict_metadata["w"], "size", torch.Size([-8, 4]))),
    ),
    Case(
        "entry",
        "a size as a list",
        "CorruptCheckpointError",
        "'big' has size [20000] and chunks",
        on_metadata(lambda md: setattr(md.state_dict_metadata["big"], "size", [20000])),
    ),
    Case(
        "entry",
        "stock: a size as a list",
        "CorruptCheckpointError",
        "'big' has size [20000] and chunks",
        on_stock(lambda md: setattr(md.state_dict_metadata["big"], "size", [20000])),
        "stock",
    ),
    Case(
        "entry",
        "a chunk's sizes as a list",
        "CorruptCheckpointError",
        "'w' has a chunk at torch.Size([0, 0]) of sizes [8, 4]",
        on_metadata(lambda md: setattr(md.state_dict_metadata["w"].chunks[0], "sizes", [8, 4])),
    ),
    Case(
        "entry",
        "chunks a tuple",
        "CorruptCheckpointError",
        "'w' has size torch.Size([8, 4]) and chunks (",
        on_metadata(chunks_tuple),
    ),
    Case(
        "entry",
        "a chunk without sizes",
        "CorruptCheckpointError",
        "'w' has a chunk at None of sizes None",
        on_metadata(lambda md: md.state_dict_metadata["w"].chunks.__setitem__(0, object())),
    ),
    Case(
        "entry",
        "neither tensor nor object",
        "CorruptCheckpointError",
        "'w' is described by str",
        on_metadata(lambda md: md.state_dict_metadata.update(w="w")),
    ),
    Case(
        "entry",
        "stock: a string dtype",
        "CorruptCheckpointError",
        "'w' has dtype 'float32'",
        on_stock(lambda md: setattr(md.state_dict_metadata["w"].properties, "dtype", "float32")),
        "stock",
    ),
    Case(
        "location",
        "a CRC of 33 bits",
        "CorruptCheckpointError",
        "a CRC-32C (an int below 2**32",
        set_attr("w", [0, 0], crc32c=2**32),
    ),
    Case(
        "location",
        "a negative offset",
        "CorruptCheckpointError",
        "non-negative ints",
        set_attr("w", [0, 0], offset=-64),
    ),
    Case(
        "location",
        "a length as a string",
        "CorruptCheckpointError",
        "non-negative ints",
        set_attr("w", [0, 0], length="128"),
    ),
    Case(
        "location",
        "a hash not of hex digits",
        "CorruptCheckpointError",
        "not 32 lowercase hex digits",
        set_attr("w", [0, 0], xxh3_128="xyz"),
    ),
    Case(
        "location",
        "a file not listed",
        "CorruptCheckpointError",
        "the footer's files do not list __7_0",
        set_attr("w", [0, 0], relative_path="__7_0.0123456789abcdef.distcp"),
    ),
    Case(
        "location",
        "stock: a file of two components",
        "CorruptCheckpointError",
        "relative_path '../__0_0.distcp'",
        stock_set("w", [0, 0], relative_path="../__0_0.distcp"),
        "stock",
    ),
    Case(
        "location",
        "stock: a file with a lone surrogate",
        "CorruptCheckpointError",
        "relative_path '__0_0\\ud800.distcp'",
        stock_set("w", [0, 0], relative_path="__0_0\ud800.distcp"),
        "stock",
    ),
    Case(
        "location",
        "a look-alike of _StorageInfo",
        "CorruptCheckpointError",
        "the location of 'w' is malformed (TypeError: a SimpleNamespace, not a _StorageInfo",
        on_metadata(look_alike),
    ),
    Case(
        "location",
        "stock: a look-alike of _StorageInfo",
        "CorruptCheckpointError",
        "'w' is stored at a SimpleNamespace, not a _StorageInfo",
        on_stock(look_alike),
        "stock",
    ),
    Case(
        "location",
        "stock: no length",
        "CorruptCheckpointError",
        "length None: not a file name",
        stock_set("w", [0, 0], length=None),
        "stock",
    ),
    Case(
        "within-file", "past the size", "CorruptCheckpointError", "past the end of", set_attr("w", [0, 0], offset=81920)
    ),
    Case(
        "chunk-length",
        "4 bytes short",
        "CorruptCheckpointError",
        "124 bytes do not hold [8, 4] elements",
        set_attr("w", [0, 0], length=124),
    ),
    Case(
        "tiling",
        "a gap",
        "CorruptCheckpointError",
        "'w' of size [10, 4]: element [8, 0] is in no chunk",
        on_metadata(gap),
    ),
    Case(
        "tiling",
        "an overlap",
        "CorruptCheckpointError",
        "'w' of size [8, 4]: its chunks at [0, 0] and [4, 0] both hold [4:8, 0:4]",
        on_metadata(overlap),
    ),
    Case(
        "tiling",
        "a chunk outside",
        "CorruptCheckpointError",
        "'w' of size [8, 4]: its chunk at [2, 0] (sizes [8, 4]) reaches outside it: dimension 0 ends at 10, past 8",
        on_metadata(outside),
    ),
    Case(
        "tiling",
        "a chunk of one dimension",
        "CorruptCheckpointError",
        "'w' of size [8, 4]: its chunk at [0] has 1 offsets and 1 sizes, not 2",
        on_metadata(one_dimension),
    ),
    Case(
        "tiling",
        "no chunk",
        "CorruptCheckpointError",
        "'w' of size [8, 4]: no chunk holds any of its 32 elements",
        on_metadata(no_chunks),
    ),
    Case(
        "tiling",
        "stock: a gap",
        "CorruptCheckpointError",
        "'w' of size [9, 4]: element [8, 0] is in no chunk",
        on_stock(stock_gap),
        "stock",
    ),
    Case(
        "stored",
        "an object without its item",
        "CorruptCheckpointError",
        "object 'o.step' has no stored item",
        on_metadata(lambda md: md.storage_data.pop(MetadataIndex("o.step"))),
    ),
    Case(
        "stored",
        "stock: a chunk without its item",
        "CorruptCheckpointError",
        "'w': its chunk at [0, 0] has no stored item",
        on_stock(lambda md: md.storage_data.pop(MetadataIndex("w", [0, 0]))),
        "stock",
    ),
    Case(
        "described",
        "an item of no entry",
        "CorruptCheckpointError",
        "'ghost' (chunk at [0, 0])",
        on_metadata(undescribed),
    ),
    Case(
        "nesting",
        "two values at one path",
        "CorruptCheckpointError",
        "both at ['o', 'step']",
        on_metadata(lambda md: md.planner_data.update(w=("o", "step"))),
    ),
    Case(
        "nesting",
        "a value inside another",
        "CorruptCheckpointError",
        "planner_data puts 'w' at ['o'], where other values are nested",
        on_metadata(lambda md: md.planner_data.update(w=("o",))),
    ),
    Case(
        "nesting",
        "a dict and a list",
        "CorruptCheckpointError",
        "which makes ['o'] a dict and a list",
        on_metadata(lambda md: md.planner_data.update(w=("o", 0))),
    ),
    Case(
        "nesting",
        "stock: a path not a tuple",
        "CorruptCheckpointError",
        "planner_data gives 'w' the path 'w'",
        on_stock(lambda md: md.planner_data.update(w="w")),
        "stock",
    ),
    Case(
        "checkpoint-id",
        "an int",
        "CorruptCheckpointError",
        "checkpoint_id is 42, not a path",
        on_metadata(no_checkpoint_id),
    ),
    Case("data-dirs-given", "too few", "NotACheckpointError", "pass that many directories", too_few_dirs, "dirs"),
    Case(
        "data-dirs-given",
        "not a directory",
        "CorruptCheckpointError",
        "(data_dirs[1]) is missing",
        a_dir_not_there,
        "dirs",
    ),
    Case(
        "data-dir-found",
        "relative, nowhere",
        "DataDirectoryNotFoundError",
        "recorded as relative path 'gone",
        relative_dirs_not_found,
        "dirs",
    ),
    Case("file-present", "deleted", "CorruptCheckpointError", "missing", delete_file),
    Case("file-size", "cut short", "CorruptCheckpointError", "truncated", cut_file),
    Case("file-exact", "4096 bytes more", "CorruptCheckpointError", "something appended to it", grow_file),
    Case(
        "file-exact",
        "an owner's file 4096 bytes more",
        "CorruptCheckpointError",
        "something appended to it",
        grow_owners_file,
        "inc",
    ),
    Case(
        "file-used",
        "an entry holding nothing",
        "CorruptCheckpointError",
        "the footer lists it, but it holds no item",
        unused_entry,
    ),
    Case(
        "size-rounded",
        "a page more",
        "CorruptCheckpointError",
        "so it was written as 81920",
        oversized,
    ),
    Case(
        "no-overlap",
        "two items on the same bytes",
        "CorruptCheckpointError",
        "overlaps the item before it",
        on_metadata(w2_over_w),
    ),
    Case("crc32c", "a flipped item byte", "CorruptCheckpointError", "checksum mismatch for 'w'", flip_item_byte),
    Case(
        "location",
        "a CRC of no bytes but 0",
        "CorruptCheckpointError",
        "0 for no bytes",
        set_attr("o.step", None, length=0, crc32c=7),
    ),
    Case(
        "hashes",
        "another xxh3_128",
        "CorruptCheckpointError",
        "hash mismatch for 'w'",
        set_attr("w", [0, 0], xxh3_128="0" * 32),
    ),
    Case(
        "hashes",
        "another xxh3_sample",
        "CorruptCheckpointError",
        "xxh3_sample stored 00000000",
        set_attr("big", [0], xxh3_sample="0" * 32),
    ),
    Case(
        "hashes",
        "a sample of a small item",
        "CorruptCheckpointError",
        "xxh3_sample stored for 128 bytes",
        set_attr("w", [0, 0], xxh3_sample="0" * 32),
    ),
    Case("zeros", "a byte of padding", "CorruptCheckpointError", "outside every item are not zero", dirty_padding),
]


def test_every_check_of_the_table_is_broken_by_a_case_raising_each_error_it_names():
    assert len(TABLE) >= 25
    assert {case.check for case in CASES} == set(TABLE)
    for row in TABLE.values():
        assert row.made_by in ({"open", "verify"}, {"read", "verify"}, {"verify"}), row
        assert {case.error for case in CASES if case.check == row.check} == row.errors, row


def test_the_format_names_every_check_and_its_verdict_is_the_error_fp_dcp_raises():
    assert set(VERDICTS) == set(TABLE) - SEARCH
    for check, verdict in VERDICTS.items():
        named = {error for words, error in ERRORS.items() if re.search(rf"\b{words}\b", verdict)}
        assert named == TABLE[check].errors, (check, verdict, TABLE[check].errors)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_a_broken_rule_is_refused_as_the_table_says(case, templates, tmp_path):
    if case.check == "hashes" and not HASHING:
        pytest.skip("fp_dcp._native._cio was built without libxxhash: no hashes to check")
    shutil.copytree(templates, tmp_path, dirs_exist_ok=True)
    path = tmp_path / case.template
    kwargs = case.arrange(path)
    row = TABLE[case.check]
    error = getattr(errors, case.error)
    into = target()
    if "open" in row.made_by:
        with pytest.raises(error) as raised:
            FastPersistReader(path, **kwargs).read_metadata()
        assert case.words in str(raised.value)
        with pytest.raises(CheckpointException) as e:
            dcp.load(into, storage_reader=FastPersistReader(path, **kwargs), no_dist=True)
        assert case.words in str(failure(e))
        assert all(torch.equal(into[k], target()[k]) for k in ("w", "w2", "big")) and into["o"] == {"step": -1}
    elif "read" in row.made_by:
        with pytest.raises(CheckpointException) as e:
            dcp.load(into, storage_reader=FastPersistReader(path, **kwargs), no_dist=True)
        assert isinstance(failure(e), error) and case.words in str(failure(e)), failure(e)
    else:  # a check of verify's only: the loaded values are right all the same
        dcp.load(into, storage_reader=FastPersistReader(path, **kwargs), no_dist=True)
        assert all(torch.equal(into[k], v) for k, v in state().items() if k != "o") and into["o"] == {"step": 3}
    if error is errors.CorruptCheckpointError:
        report = verify_checkpoint(path, kwargs.get("data_dirs"))
        assert not report.ok and any(case.words in problem for problem in report.problems), report.problems
    else:
        with pytest.raises(error, match=re.escape(case.words)):
            verify_checkpoint(path, kwargs.get("data_dirs"))


def test_verify_prints_its_verdict_on_a_name_that_encodes_as_no_path(templates, tmp_path):
    """The name is quoted in the problem: printed raw, a lone surrogate would raise on any stdout."""
    shutil.copytree(templates / "plain", tmp_path / "plain")
    no_path_name(tmp_path / "plain")
    done = subprocess.run(
        [sys.executable, "-m", "fp_dcp", "verify", str(tmp_path / "plain")],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONIOENCODING": "utf-8"},  # strict, whatever the environment says
    )
    assert done.returncode == 1 and "BAD " in done.stdout, done
    assert "\\ud800.distcp' is not a file name" in done.stdout


@pytest.fixture
def recipe(monkeypatch) -> Any:
    """examples/read_checkpoint.py, a reader written from docs/format.md alone."""
    from test_docs_examples import reading_example

    return reading_example(monkeypatch)


@pytest.mark.parametrize(
    "case", [c for c in CASES if c.check == "tiling" and c.template == "plain"], ids=lambda c: c.how
)
def test_the_pages_reader_refuses_what_does_not_tile(case, recipe, templates, tmp_path):
    shutil.copytree(templates / "plain", tmp_path / "plain")
    assert recipe.read_checkpoint(str(tmp_path / "plain"))["w"].equal(state()["w"])
    case.arrange(tmp_path / "plain")
    with pytest.raises(recipe.Damage, match="the chunks of 'w' do not tile it"):
        recipe.read_checkpoint(str(tmp_path / "plain"))


@pytest.mark.parametrize(
    "paths",
    [
        {"w": ("o", "step"), "o.step": ("o", "step")},  # two values at one path
        {"w": ("o",), "o.step": ("o", "step")},  # one value's path runs through another
        {"w": ("o", 0), "o.step": ("o", "step")},  # a list and a dict at one place
        {"w": (0,)},  # the root is a dict
        {"w": ("l", -1)},  # no negative index
    ],
    ids=["same-path", "through-a-value", "list-and-dict", "int-at-root", "negative"],
)
def test_the_pages_reader_refuses_conflicting_paths(paths, recipe, templates, tmp_path):
    shutil.copytree(templates / "plain", tmp_path / "plain")
    edit(tmp_path / "plain", metadata=lambda md, footer: md.planner_data.update(paths))
    with pytest.raises(recipe.Damage):
        recipe.read_checkpoint(str(tmp_path / "plain"))


def test_the_pages_reader_leaves_none_in_the_holes_of_a_list(recipe, templates, tmp_path):
    shutil.copytree(templates / "plain", tmp_path / "plain")
    edit(
        tmp_path / "plain", metadata=lambda md, footer: md.planner_data.update(w=("l", 2), **{"o.step": ("l", 0, "s")})
    )
    state = recipe.read_checkpoint(str(tmp_path / "plain"))
    assert state["l"][0] == {"s": 3} and state["l"][1] is None and state["l"][2].equal(torch.arange(32.0).reshape(8, 4))


def test_a_metadata_that_is_a_directory_or_a_broken_link_is_no_checkpoint(tmp_path):
    (tmp_path / "a" / ".metadata").mkdir(parents=True)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / ".metadata").symlink_to(tmp_path / "nowhere")
    for path in (tmp_path / "a", tmp_path / "b"):
        with pytest.raises(errors.NotACheckpointError):
            FastPersistReader(path).read_metadata()
        with pytest.raises(errors.NotACheckpointError):
            verify_checkpoint(path)


def version_2(footer: dict[str, Any]) -> None:
    assert footer["format_version"] == 3
    footer["format_version"] = 2


@pytest.mark.parametrize(
    "template, change",
    [
        ("plain", lambda footer: footer.update(save_id=5, engine=["any", 1])),
        ("plain", lambda footer: (footer.pop("save_id"), footer.pop("engine", None))),
        ("inc", version_2),  # an owner in a version-2 footer is followed all the same
    ],
    ids=["save_id-and-engine-of-any-type", "no-save_id", "owner-in-version-2"],
)
def test_what_no_rule_covers_reads_as_written(template, change, templates, tmp_path):
    shutil.copytree(templates, tmp_path, dirs_exist_ok=True)
    path = tmp_path / template
    edit(path, footer=change)
    into = target()
    dcp.load(into, storage_reader=FastPersistReader(path), no_dist=True)
    assert all(torch.equal(into[k], v) for k, v in state().items() if k != "o") and into["o"] == {"step": 3}
    report = verify_checkpoint(path)
    assert report.ok, report.problems


def plain_tuples(md: Any) -> None:
    """Every size and offset of w and big, and their items' keys, a tuple that is no torch.Size."""
    for fqn in ("w", "big"):
        tensor = md.state_dict_metadata[fqn]
        tensor.size = tuple(tensor.size)
        for chunk in tensor.chunks:
            chunk.offsets, chunk.sizes = tuple(chunk.offsets), tuple(chunk.sizes)
            location = md.storage_data.pop(MetadataIndex(fqn, chunk.offsets))
            key = MetadataIndex(fqn)
            object.__setattr__(key, "offset", chunk.offsets)  # its __init__ would make a torch.Size of it
            md.storage_data[key] = location


@pytest.mark.parametrize("template", ["plain", "stock"])
def test_sizes_and_offsets_as_plain_tuples_read_the_same(template, templates, tmp_path):
    shutil.copytree(templates / template, tmp_path / template)
    path = tmp_path / template
    if template == "stock":
        edit_stock(path, plain_tuples)
    else:
        edit(path, metadata=lambda md, footer: plain_tuples(md))
    md = FastPersistReader(path).read_metadata()
    assert type(md.state_dict_metadata["w"].chunks[0].sizes) is tuple
    assert {type(key.offset) for key in md.storage_data if key.fqn == "w"} == {tuple}
    into = target()
    dcp.load(into, storage_reader=FastPersistReader(path), no_dist=True)
    assert all(torch.equal(into[k], v) for k, v in state().items() if k != "o") and into["o"] == {"step": 3}
    assert verify_checkpoint(path).ok


def test_a_one_byte_float4_pair_is_stored_as_its_byte(tmp_path):
    if not hasattr(torch, "float4_e2m1fn_x2"):
        pytest.skip("this torch has no float4_e2m1fn_x2")
    packed = torch.arange(256, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    dcp.save({"f4": packed}, storage_writer=FastPersistWriter(tmp_path), no_dist=True)
    (loc,) = pickle.loads((tmp_path / ".metadata").read_bytes()).storage_data.values()
    with open(data_file(tmp_path), "rb") as f:
        f.seek(loc.offset)
        assert f.read(loc.length) == bytes(range(256))
    into = {"f4": torch.zeros(256, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)}
    dcp.load(into, storage_reader=FastPersistReader(tmp_path), no_dist=True)
    assert into["f4"].view(torch.uint8).equal(packed.view(torch.uint8))


@pytest.mark.parametrize("case", [c for c in CASES if c.check == "nesting"], ids=lambda c: c.how)
def test_convert_refuses_paths_that_conflict(case, templates, tmp_path):
    from fp_dcp.tools.convert import read_state_dict

    shutil.copytree(templates, tmp_path, dirs_exist_ok=True)
    path = tmp_path / case.template
    assert read_state_dict(path)["w"].equal(state()["w"])
    case.arrange(path)
    with pytest.raises(errors.CorruptCheckpointError, match=re.escape(case.words)):
        read_state_dict(path)


@pytest.mark.parametrize("kind", ["fifo", "socket", "device"])
def test_a_metadata_that_is_no_regular_file_is_no_checkpoint(kind, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a socket's path must be short
    os.mkdir("c")
    if kind == "fifo":
        os.mkfifo("c/.metadata")
    elif kind == "socket":
        server = socket.socket(socket.AF_UNIX)
        server.bind("c/.metadata")
    else:
        os.symlink(os.devnull, "c/.metadata")
    raised: list[BaseException] = []

    def read() -> None:
        try:
            FastPersistReader("c").read_metadata()
        except BaseException as e:
            raised.append(e)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(10)  # a FIFO opened for reading waits for a writer
    if reader.is_alive():
        fd = os.open("c/.metadata", os.O_WRONLY | os.O_NONBLOCK)  # let it go
        os.close(fd)
    assert len(raised) == 1 and isinstance(raised[0], errors.NotACheckpointError), raised
    with pytest.raises(errors.NotACheckpointError):
        verify_checkpoint("c")


@pytest.mark.parametrize("kind", ["directory", "fifo", "socket"])
def test_a_data_file_that_is_no_regular_file_is_damage_and_not_waited_on(kind, templates, tmp_path, monkeypatch):
    shutil.copytree(templates / "plain", tmp_path / "plain")
    name = data_file(tmp_path / "plain")
    name.unlink()
    if kind == "socket":  # opening one fails (ENXIO) rather than finding something else
        monkeypatch.chdir(name.parent)  # a socket's path must be short
        server = socket.socket(socket.AF_UNIX)
        server.bind(name.name)
    else:
        name.mkdir() if kind == "directory" else os.mkfifo(name)
    outcome: list[Any] = []

    def check() -> None:
        with pytest.raises(CheckpointException) as e:
            dcp.load(target(), storage_reader=FastPersistReader(tmp_path / "plain"), no_dist=True)
        outcome.extend([failure(e), verify_checkpoint(tmp_path / "plain")])

    checks = threading.Thread(target=check, daemon=True)
    checks.start()
    checks.join(20)
    waited = checks.is_alive()
    while checks.is_alive():  # opened for reading, a FIFO waits for a writer: let each open go
        with contextlib.suppress(OSError):
            os.close(os.open(name, os.O_WRONLY | os.O_NONBLOCK))
        checks.join(1)
    assert not waited, "a load or verify waited on the FIFO"
    error, report = outcome
    assert isinstance(error, errors.CorruptCheckpointError) and "not a regular file" in str(error)
    assert any("not a regular file" in problem for problem in report.problems), report.problems


@pytest.mark.parametrize("field", ["state_dict_metadata", "storage_data"])
@pytest.mark.parametrize("template", ["plain", "stock"])
def test_a_metadata_without_a_field_is_damage(field, template, templates, tmp_path):
    shutil.copytree(templates / template, tmp_path / template)
    path = tmp_path / template
    if template == "stock":
        edit_stock(path, lambda md: delattr(md, field))
    else:
        edit(path, metadata=lambda md, footer: delattr(md, field))
    with pytest.raises(errors.CorruptCheckpointError):
        FastPersistReader(path).read_metadata()
    assert not verify_checkpoint(path).ok


@pytest.mark.parametrize("owner", ["../step-1", "../plain", "../../x/step-1", "..", "../.."])
def test_a_tier_takes_only_an_owner_that_is_a_step_of_its_root(owner, templates, tmp_path):
    """Check tier-key of docs/runs.md's table: damage to the tiers."""
    from fp_dcp.tiers.layout import StepLayout, files_in_metadata

    assert section_rows("runs.md", "## On disk: run directories and tiers", 3)["tier-key"][1].startswith("damage")

    shutil.copytree(templates / "plain", tmp_path / "root" / "step-1")
    shutil.copytree(templates / "inc", tmp_path / "root" / "step-2")
    step = tmp_path / "root" / "step-2"

    def change(footer: dict[str, Any]) -> None:
        for entry in footer["files"].values():
            if "owner" in entry:
                entry["owner"] = owner

    edit(step, footer=change)
    data = (step / ".metadata").read_bytes()
    if owner == "../step-1":
        assert any(key.startswith("step-1/") for key in files_in_metadata("step-2", data))
        assert any(key.startswith("step-1/") for key in StepLayout.open(str(step)).files())
        return
    with pytest.raises(errors.CorruptCheckpointError, match="not a step of the same root"):
        files_in_metadata("step-2", data)
    with pytest.raises(errors.CorruptCheckpointError, match="not a step of the same root"):
        StepLayout.open(str(step))
