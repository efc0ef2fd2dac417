"""The safetensors format (Hugging Face): header bytes ↔ tensor entries, file and index names; no I/O.

A ``.safetensors`` file is an 8-byte little-endian header length ``N``, ``N``
bytes of JSON, then the data: every tensor's elements in C order,
little-endian, back to back from the data's first byte to the file's last,
with no gap. The JSON object maps each tensor's name to its ``dtype``,
``shape`` and ``data_offsets`` (begin and end, in the data), and may hold
``"__metadata__"``, a map of strings; trailing spaces pad it. safetensors
stores no checksum, so its structure is all a reader can check:
``parse_header`` and ``check_layout`` check all of it, and every error
names the file and, where there is one, the tensor.

A checkpoint of several files has an index, ``model.safetensors.index.json``
(``{"metadata": {"total_size": ...}, "weight_map": {name: file}}``). DCP's
``HuggingFaceStorageWriter`` adds to each file's ``__metadata__`` a
``DCP_SHARDING_INFO`` entry: where each tensor (then a chunk of a larger one)
sits in the whole (``saved_offsets``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from typing import Any, TypeGuard

import torch

from .errors import CorruptCheckpointError, IncompatibleCheckpointError
from .units import PAGE, align_up

__all__ = [
    "SUFFIX",
    "INDEX_NAME",
    "LENGTH_BYTES",
    "DTYPES",
    "Entry",
    "header_length",
    "parse_header",
    "check_layout",
    "chunk_offsets",
    "encode_header",
    "file_name",
    "encode_index",
    "parse_index",
]

SUFFIX = ".safetensors"
INDEX_NAME = "model.safetensors.index.json"
LENGTH_BYTES = 8  # the header length, little-endian
MAX_HEADER = 100_000_000  # safetensors' own limit on the header's length
METADATA_KEY = "__metadata__"
SHARDING_KEY = "DCP_SHARDING_INFO"
SAVED_OFFSETS = "saved_offsets"
# What DCP's HuggingFaceStorageWriter puts beside the sharding info (torch's _hf_utils).
DCP_METADATA = {"DCP_VERSION": "1.0", "format": "pt"}

_OPTIONAL = {"F8_E8M0": "float8_e8m0fnu"}  # torch versions before 2.7 lack it
DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "U16": torch.uint16,
    "I16": torch.int16,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "U32": torch.uint32,
    "I32": torch.int32,
    "F32": torch.float32,
    "U64": torch.uint64,
    "I64": torch.int64,
    "F64": torch.float64,
    "C64": torch.complex64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    **{name: getattr(torch, attr) for name, attr in _OPTIONAL.items() if hasattr(torch, attr)},
}
"""safetensors dtype names and the torch dtypes they are."""
NAMES = {dtype: name for name, dtype in DTYPES.items()}
_SUB_BYTE = ("F4", "F6_E2M3", "F6_E3M2")  # safetensors dtypes no torch dtype holds element by element


@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor of a file: its dtype, shape and bytes ``begin..end`` of the data."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def header_length(head: bytes, file_size: int, where: str) -> int:
    """``N``, from the file's first 8 bytes, checked against the file's size."""
    if file_size < LENGTH_BYTES:
        raise CorruptCheckpointError(
            f"{where} is truncated: {file_size} bytes, too short for the {LENGTH_BYTES}-byte header length"
        )
    n = int.from_bytes(head[:LENGTH_BYTES], "little")
    if n > MAX_HEADER:
        raise CorruptCheckpointError(
            f"{where}: header length {n} is over safetensors' limit of {MAX_HEADER} bytes "
            "(damaged, or not a safetensors file)"
        )
    if LENGTH_BYTES + n > file_size:
        raise CorruptCheckpointError(
            f"{where}: the header length ({n} bytes) runs past the end of the file ({file_size} bytes): "
            "truncated, or not a safetensors file"
        )
    return n


def parse_header(raw: bytes, where: str) -> tuple[list[Entry], dict[str, str]]:
    """The tensors (in data order) and the ``__metadata__`` of a header's JSON bytes, each entry checked."""
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptCheckpointError(f"{where}: the header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{where}: the header is a JSON {type(header).__name__}, not an object")
    metadata = header.pop(METADATA_KEY, None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CorruptCheckpointError(f"{where}: the header's {METADATA_KEY} is not a map of strings")
    entries = [_entry(name, value, where) for name, value in header.items()]
    return sorted(entries, key=lambda e: (e.begin, e.end)), metadata


def _entry(name: str, value: Any, where: str) -> Entry:
    what = f"{where}: tensor {name!r}"
    if not isinstance(value, dict):
        raise CorruptCheckpointError(f"{what}: its header entry is not an object")
    dtype_name, shape, offsets = value.get("dtype"), value.get("shape"), value.get("data_offsets")
    if not isinstance(dtype_name, str):
        raise CorruptCheckpointError(f"{what}: its dtype is missing or not a string")
    if dtype_name not in DTYPES:
        if dtype_name in _SUB_BYTE:
            raise IncompatibleCheckpointError(f"{what} has dtype {dtype_name}, which no torch dtype holds")
        raise CorruptCheckpointError(f"{what} has unknown dtype {dtype_name!r} (known: {', '.join(DTYPES)})")
    if not _ints(shape):
        raise CorruptCheckpointError(f"{what}: its shape {shape!r} is not a list of non-negative integers")
    if not _ints(offsets) or len(offsets) != 2 or offsets[0] > offsets[1]:
        raise CorruptCheckpointError(f"{what}: its data_offsets {offsets!r} are not [begin, end] with begin <= end")
    dtype = DTYPES[dtype_name]
    begin, end = offsets
    expected = math.prod(shape) * dtype.itemsize
    if end - begin != expected:
        raise CorruptCheckpointError(
            f"{what} is {dtype_name} of shape {shape} ({expected} bytes), but its byte range "
            f"{begin}..{end} holds {end - begin} bytes"
        )
    return Entry(name, dtype, tuple(shape), begin, end)


def _ints(value: Any) -> TypeGuard[list[int]]:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)


def check_layout(entries: list[Entry], data_length: int, where: str) -> None:
    """The tensors (in data order) fill the ``data_length`` bytes after the header exactly: no overlap, no hole."""
    end, last = 0, None
    for e in entries:
        if e.begin < end and last is not None:
            raise CorruptCheckpointError(
                f"{where}: tensors {last.name!r} (bytes {last.begin}..{last.end}) and {e.name!r} "
                f"(bytes {e.begin}..{e.end}) overlap"
            )
        if e.begin > end:
            before = f"after tensor {last.name!r}" if last is not None else "at the start of the data"
            raise CorruptCheckpointError(
                f"{where}: bytes {end}..{e.begin} of the data, {before} and before tensor {e.name!r}, "
                "belong to no tensor (a hole)"
            )
        if e.end > data_length:
            raise CorruptCheckpointError(
                f"{where}: tensor {e.name!r} (bytes {e.begin}..{e.end} of the data) runs past the end of the file, "
                f"whose data holds {data_length} bytes: truncated, or its header is wrong"
            )
        end, last = e.end, e
    if end != data_length:
        after = f"after the last tensor, {last.name!r}," if last is not None else "of data in a file of no tensors"
        raise CorruptCheckpointError(f"{where}: {data_length - end} bytes {after} belong to no tensor")


def chunk_offsets(entries: list[Entry], metadata: dict[str, str], where: str) -> dict[str, tuple[int, ...]]:
    """Where each tensor sits in its whole tensor: DCP's sharding info where there is some, else at zeros."""
    offsets = {e.name: (0,) * len(e.shape) for e in entries}
    if SHARDING_KEY not in metadata:
        return offsets
    try:
        info = json.loads(metadata[SHARDING_KEY])
    except json.JSONDecodeError as e:
        raise CorruptCheckpointError(f"{where}: its {SHARDING_KEY} is not valid JSON ({e})") from None
    for entry in entries:
        about = info.get(entry.name) if isinstance(info, dict) else None
        saved = about.get(SAVED_OFFSETS) if isinstance(about, dict) else None
        if not _ints(saved) or len(saved) != len(entry.shape):
            raise CorruptCheckpointError(
                f"{where}: tensor {entry.name!r}: {SHARDING_KEY} gives no {SAVED_OFFSETS} of {len(entry.shape)} "
                f"non-negative integers (got {saved!r})"
            )
        offsets[entry.name] = tuple(saved)
    return offsets


def encode_header(
    tensors: Sequence[tuple[str, torch.dtype, Sequence[int]]], metadata: dict[str, str]
) -> tuple[bytes, dict[str, int]]:
    """The bytes before the data (length and JSON), and each tensor's offset in the data.

    Tensors go in safetensors' own order, widest dtype first, then by name,
    so each lies at a multiple of its element size; the JSON is padded with
    spaces to make the data start on a page, where O_DIRECT can write it.
    """
    ordered = sorted(tensors, key=lambda t: (-t[1].itemsize, t[0]))
    header: dict[str, Any] = {METADATA_KEY: metadata} if metadata else {}
    offsets: dict[str, int] = {}
    at = 0
    for name, dtype, shape in ordered:
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [at, at + nbytes]}
        offsets[name] = at
        at += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (align_up(LENGTH_BYTES + len(raw), PAGE) - LENGTH_BYTES - len(raw))
    return len(raw).to_bytes(LENGTH_BYTES, "little") + raw, offsets


def file_name(index: int, count: int, shard: int | None = None) -> str:
    """``model-00001-of-00003.safetensors`` (``shard-00002-model-...`` for one rank's shard), as DCP names them."""
    model = f"model-{index:05d}-of-{count:05d}{SUFFIX}"
    return model if shard is None else f"shard-{shard:05d}-{model}"


def encode_index(weight_map: dict[str, str], total_size: int) -> bytes:
    return json.dumps({"metadata": {"total_size": total_size}, "weight_map": weight_map}, indent=2).encode()


def parse_index(raw: bytes, where: str) -> dict[str, str]:
    """The ``weight_map`` (tensor name -> file) of an index's bytes."""
    try:
        index = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptCheckpointError(f"{where} is not valid JSON ({e})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CorruptCheckpointError(f"{where}: no weight_map of tensor names to file names")
    return weight_map
