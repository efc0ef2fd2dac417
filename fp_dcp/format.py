"""The on-disk format (specified for humans in docs/format.md).

A checkpoint is a directory with

- data files ``__{rank}_{k}.{token}.distcp``: raw item bytes at the offsets
  the metadata gives, zero padding between them, size a multiple of 4096;
  ``token`` is unique per save, so a new save never touches the files of the
  checkpoint it replaces;
- ``.metadata``: a pickled ``torch.distributed.checkpoint.Metadata`` whose
  ``storage_data`` maps each ``MetadataIndex`` to where the item is
  (``fp_dcp.compat.item_fields``: file, offset, length, crc32c, and the
  XXH3-128 of incremental saves), followed by a JSON footer (format version,
  data file sizes, checksum of the pickle) and a 16-byte trailer.
  ``pickle.load`` stops at the end of the pickle, so DCP tools that unpickle
  ``.metadata`` still work.

An incremental save's footer may list data files of an earlier checkpoint
(an ``owner`` in their entry): its unchanged items are referenced there
instead of written again (format version 3).

A directory without ``.metadata`` is not a checkpoint, whatever else it holds.
"""

from __future__ import annotations

import gc
import io
import json
import math
import pickle
import re
import struct
import sys
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem

from ._native import _cio
from .errors import CorruptCheckpointError, IncompatibleCheckpointError
from .units import PAGE, align_up

__all__ = [
    "FORMAT_VERSION",
    "ItemLocation",
    "data_file_name",
    "parse_data_file_name",
    "layout",
    "encode_metadata",
    "decode_metadata",
    "is_fp_metadata",
]

FORMAT_NAME = "fp-dcp"
FORMAT_VERSION = 3
REFERENCES_VERSION = 3  # the first version with file entries owned by another checkpoint
TRAILER_MAGIC = b"FPDCP\x00\r\n"
_TRAILER = struct.Struct("<II8s")  # footer length, crc32c of footer, magic
TRAILER_SIZE = _TRAILER.size

SMALL_ALIGN = 64  # small items are packed tightly, at cache-line (and any dtype's) alignment

_DATA_FILE = re.compile(r"^__(\d+)_(\d+)\.([0-9a-f]{8,32})\.distcp$")


class ItemLocation(NamedTuple):
    """Where one item's bytes are: ``file``, byte ``offset`` and ``length``, their CRC-32C, and hashes.

    Incremental saves store ``xxh3_128``, the XXH3-128 of the bytes, and for
    tensors over 64 KiB ``xxh3_sample``, that of a sample of them
    (``fp_dcp.save.incremental``), each as 32 hex digits; else they are None.
    """

    file: str
    offset: int
    length: int
    crc32c: int
    xxh3_128: str | None = None
    xxh3_sample: str | None = None


# The sample of an incremental save's item: 16 windows of 4 KiB spread evenly over it, the last at its end.
SAMPLE_WINDOWS = 16
SAMPLE_WINDOW = 4096
SAMPLE_MIN = SAMPLE_WINDOWS * SAMPLE_WINDOW  # smaller items have no sample: hashing all of them is as cheap


HASHING = hasattr(_cio, "Hash128")  # XXH3-128: fp_dcp._native._cio built with libxxhash


def sample_offsets(length: int) -> list[int]:
    """Where the windows of the sample of a ``length``-byte item start: the first at 0, the last at the end."""
    last = length - SAMPLE_WINDOW
    return [i * last // (SAMPLE_WINDOWS - 1) for i in range(SAMPLE_WINDOWS)]


def is_path(text: Any) -> bool:
    """Whether ``text`` can name a file: a non-empty ``str`` without NUL that encodes as a path.

    Encodes as Python does on Linux: UTF-8, the lone surrogates U+DC80 to U+DCFF standing for the bytes of a
    name that is no UTF-8 (``os.fsdecode`` makes them); any other lone surrogate names no file (opening it
    raises ``UnicodeEncodeError``).
    """
    if type(text) is not str or not text or "\0" in text:
        return False
    try:
        text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return False
    return True


def is_file_name(name: Any) -> bool:
    """Whether ``name`` is one path component: a path (``is_path``), not ``.`` or ``..``, without ``/``."""
    return is_path(name) and name not in (".", "..") and "/" not in name


def data_file_name(rank: int, index: int, token: str) -> str:
    return f"__{rank}_{index}.{token}.distcp"


def parse_data_file_name(name: str) -> tuple[int, int, str] | None:
    """(rank, index, token) for one of our data file names, else None."""
    m = _DATA_FILE.match(name)
    return (int(m.group(1)), int(m.group(2)), m.group(3)) if m else None


def chunk_nbytes(sizes: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes a tensor chunk of ``sizes`` occupies on disk: its elements, nothing else."""
    return math.prod(sizes) * dtype.itemsize


def stored_nbytes(item: WriteItem) -> int | None:
    """Bytes a tensor WriteItem occupies on disk (its chunk, not the whole tensor); None for byte items.

    DCP's own ``WriteItem.tensor_storage_size`` counts the global tensor, not the chunk.
    """
    data = item.tensor_data
    if data is None:
        return None
    return chunk_nbytes(data.chunk.sizes, data.properties.dtype)


def describe_item(index: MetadataIndex, loc: ItemLocation) -> str:
    """``'fqn' (chunk at [0, 0]) in FILE bytes A..B``: how errors name a stored item."""
    chunk = f" (chunk at {list(index.offset)})" if index.offset is not None else ""
    return f"{index.fqn!r}{chunk} in {loc.file} bytes {loc.offset}..{loc.offset + loc.length}"


def checksum_mismatch(index: MetadataIndex, loc: ItemLocation, read: int) -> str:
    return f"checksum mismatch for {describe_item(index, loc)}: stored {loc.crc32c:08x}, read {read:08x}"


def file_index(name: str) -> int:
    """``k`` of a data file named ``__{rank}_{k}.{token}.distcp``."""
    parsed = parse_data_file_name(name)
    if parsed is None:
        raise ValueError(f"{name!r} is not an fp-dcp data file name")
    return parsed[1]


def layout(items: list[tuple[int, int | None]], large: int) -> tuple[list[int], int]:
    """Offsets for items given as (length, memory address or None), and the file size.

    Small items are packed at 64-byte alignment. An item of at least ``large``
    bytes starts where its offset is congruent to its memory address modulo a
    page (a page boundary if its address is unknown): then all of it but a
    sub-page head and tail can go straight between tensor memory and the disk
    with O_DIRECT, whatever alignment (up to a page) the filesystem needs.
    """
    offsets = []
    cursor = 0
    for length, address in items:
        offset = align_up(cursor, SMALL_ALIGN)
        if length >= large:
            target = address % PAGE if address is not None and address % SMALL_ALIGN == 0 else 0
            offset += (target - offset) % PAGE
        offsets.append(offset)
        cursor = offset + length
    return offsets, align_up(cursor, PAGE)


def encode_metadata(metadata: Metadata, files: dict[str, dict[str, Any]], extra: dict[str, Any]) -> bytes:
    """Bytes of ``.metadata``: pickle, JSON footer, trailer."""
    body = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)
    # Without references the checkpoint is exactly version 2, which older fp-dcp releases read.
    version = REFERENCES_VERSION if any("owner" in entry for entry in files.values()) else 2
    footer = json.dumps(
        {
            "format": FORMAT_NAME,
            "format_version": version,
            "pickle_length": len(body),
            "pickle_crc32c": _cio.crc32c(body),
            "files": files,
            "byteorder": sys.byteorder,
            **extra,
        },
        sort_keys=True,
    ).encode()
    return body + footer + _TRAILER.pack(len(footer), _cio.crc32c(footer), TRAILER_MAGIC)


def decode_footer(tail: bytes, where: str) -> dict[str, Any]:
    """The footer, from the last bytes of ``.metadata`` (at least footer and trailer; all of it will do).

    Checks the trailer, the footer's checksum, that it is a UTF-8 JSON
    object without repeated keys, its format name and version, the keys it
    always has (and each data file entry's) with their types and ranges,
    and the byte order.
    """
    if not is_fp_metadata(tail):
        raise CorruptCheckpointError(f"{where}: not fp-dcp metadata (trailer missing or damaged)")
    footer_len, footer_crc, _ = _TRAILER.unpack_from(tail, len(tail) - TRAILER_SIZE)
    footer_end = len(tail) - TRAILER_SIZE
    footer_bytes = tail[footer_end - footer_len : footer_end] if footer_len <= footer_end else b""
    if len(footer_bytes) != footer_len or _cio.crc32c(footer_bytes) != footer_crc:
        raise CorruptCheckpointError(f"{where}: metadata footer fails its checksum")
    footer = _parse_json(footer_bytes, where)
    if footer.get("format") != FORMAT_NAME:
        raise CorruptCheckpointError(f"{where}: footer names format {footer.get('format')!r}")
    version = footer.get("format_version")
    if type(version) is not int or version < 1:  # True is an int to isinstance, and no version
        raise CorruptCheckpointError(
            f"{where}: footer gives format_version {version!r}; fp-dcp's format versions are integers from 1"
        )
    if version > FORMAT_VERSION:
        raise IncompatibleCheckpointError(
            f"{where} was written in fp-dcp format version {version}; this fp-dcp reads "
            f"versions up to {FORMAT_VERSION}: upgrade fp-dcp"
        )
    _check_keys(footer, _FOOTER_KEYS, f"{where}: footer")
    _check_places(footer, f"{where}: footer")
    for name, entry in footer["files"].items():
        if not is_file_name(name):  # before the name is in a message unquoted
            raise CorruptCheckpointError(f"{where}: footer's files: {name!r} is not a file name (one path component)")
        _check_keys(entry, _ENTRY_KEYS, f"{where}: footer's entry for {name}")
        _check_entry(entry, len(footer.get("data_dirs", [])), f"{where}: footer's entry for {name}")
    if footer["byteorder"] not in _BYTE_ORDERS:
        raise CorruptCheckpointError(f"{where}: footer gives byteorder {footer['byteorder']!r}, not 'little' or 'big'")
    if footer["byteorder"] != sys.byteorder:
        raise IncompatibleCheckpointError(
            f"{where} holds {footer['byteorder']}-endian data; this host is {sys.byteorder}-endian"
        )
    return footer


def _parse_json(raw: bytes, where: str) -> dict[str, Any]:
    """The footer's JSON object: strict UTF-8 (json.loads of bytes would also take UTF-16 and UTF-32), no key
    twice, no NaN or Infinity (not JSON)."""

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        found = dict(pairs)
        if len(found) != len(pairs):
            twice = next(key for i, (key, _) in enumerate(pairs) if key in dict(pairs[:i]))
            raise ValueError(f"key {twice!r} given twice")
        return found

    def no_constant(name: str) -> None:
        raise ValueError(f"{name} is not JSON")

    try:
        parsed = json.loads(raw.decode("utf-8"), object_pairs_hook=unique, parse_constant=no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise CorruptCheckpointError(f"{where}: metadata footer is not a UTF-8 JSON object ({e})") from None
    if type(parsed) is not dict:
        raise CorruptCheckpointError(f"{where}: metadata footer is {type(parsed).__name__} JSON, not an object")
    return parsed


# The keys a footer, and each entry of its "files", has (optional ones: when there), and their JSON types.
_Keys = dict[str, tuple[type, ...]]
_FOOTER_KEYS: _Keys = {
    "pickle_length": (int,),
    "pickle_crc32c": (int,),
    "files": (dict,),
    "byteorder": (str,),
    "data_dirs": (list,),
    "data_subdir": (str, type(None)),
}
_ENTRY_KEYS: _Keys = {"size": (int,), "dir": (int, type(None)), "owner": (str,), "data_subdir": (str,)}
_OPTIONAL = {"owner", "data_dirs", "data_subdir"}
_JSON_TYPES = {int: "an integer", str: "a string", dict: "an object", list: "an array", type(None): "null"}
_BYTE_ORDERS = ("little", "big")


def _check_keys(found: Any, keys: _Keys, what: str) -> None:
    """CorruptCheckpointError naming ``what`` and the key, unless ``found`` is an object holding ``keys``."""
    if type(found) is not dict:
        raise CorruptCheckpointError(f"{what} is {found!r}, not an object")
    for key, types in keys.items():
        if key not in found:
            if key in _OPTIONAL:
                continue
            raise CorruptCheckpointError(f"{what} has no {key!r}")
        if type(found[key]) not in types:  # type(), not isinstance: JSON's true is no integer
            kinds = " or ".join(_JSON_TYPES[t] for t in types)
            raise CorruptCheckpointError(f"{what} gives {key} {found[key]!r}, not {kinds}")


def _check_places(footer: dict[str, Any], what: str) -> None:
    """``data_dirs``: non-empty strings; ``data_subdir``: one path component, given exactly with data_dirs."""
    data_dirs = footer.get("data_dirs", [])
    for directory in data_dirs:
        if not is_path(directory):
            raise CorruptCheckpointError(f"{what} lists {directory!r} in data_dirs, not a path")
    subdir = footer.get("data_subdir")
    if subdir is not None and not is_file_name(subdir):
        raise CorruptCheckpointError(f"{what} gives data_subdir {subdir!r}, not one path component")
    if (subdir is None) != (not data_dirs):
        raise CorruptCheckpointError(f"{what} gives data_subdir {subdir!r} with data_dirs {data_dirs!r}")


def _check_entry(entry: dict[str, Any], data_dirs: int, what: str) -> None:
    """One data file's entry: its size, directory index, owner and subdirectory within their ranges."""
    if entry["size"] < 0 or entry["size"] % PAGE:
        raise CorruptCheckpointError(f"{what} gives size {entry['size']}, not a multiple of {PAGE} from 0")
    index = entry["dir"]
    if index is not None and not 0 <= index < data_dirs:
        raise CorruptCheckpointError(f"{what} gives dir {index}; the footer lists {data_dirs} data_dirs")
    owner = entry.get("owner")
    if owner is not None and (not is_path(owner) or owner.startswith("/")):
        raise CorruptCheckpointError(f"{what} gives owner {owner!r}, not a relative path")
    subdir = entry.get("data_subdir")
    if subdir is not None and not is_file_name(subdir):
        raise CorruptCheckpointError(f"{what} gives data_subdir {subdir!r}, not one path component")
    if owner is not None and index is not None and subdir is None:
        raise CorruptCheckpointError(f"{what} has an owner and a dir but no 'data_subdir'")


def footer_span(trailer: bytes) -> int:
    """How many bytes at the end of ``.metadata`` hold the footer and the trailer, from its last 16 bytes."""
    footer_len, _, _ = _TRAILER.unpack(trailer[-TRAILER_SIZE:])
    return int(footer_len) + TRAILER_SIZE


def decode_metadata(data: bytes, where: str) -> tuple[Metadata, dict[str, Any]]:
    """Parse ``.metadata`` bytes read from ``where``; returns (Metadata, footer)."""
    footer = decode_footer(data, where)
    footer_start = len(data) - footer_span(data)
    body = data[: footer["pickle_length"]]
    if footer["pickle_length"] != footer_start or _cio.crc32c(body) != footer["pickle_crc32c"]:
        raise CorruptCheckpointError(f"{where}: metadata pickle fails its checksum")
    metadata = unpickle_metadata(body, where)
    if not isinstance(metadata, Metadata):
        raise CorruptCheckpointError(f"{where}: metadata pickle holds {type(metadata).__name__}")
    return metadata, footer


class _Unpickler(pickle.Unpickler):
    """Says which class a pickle names that this Python or torch lacks: not damage, another environment."""

    def __init__(self, stream: io.BytesIO, where: str) -> None:
        super().__init__(stream)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        try:
            return super().find_class(module, name)
        except (ImportError, AttributeError):
            raise IncompatibleCheckpointError(
                f"{self.where}: the metadata pickle names {module}.{name}, which this Python and torch do not have"
            ) from None


def unpickle_metadata(body: bytes, where: str) -> Any:
    """The object pickled in ``body``, a pickle that ends where ``body`` does; anything else is damage.

    ``pickle.loads`` would ignore bytes after the pickle: no writer leaves
    any, so they are damage that an accepted checkpoint would hide. The
    garbage collector is off meanwhile: unpickling makes objects only (DCP's
    metadata holds no cycles), and collections triggered by every few
    hundred of them made opening a checkpoint of many items several times
    slower (docs/benchmarks.md, "Figures behind design comments").
    """
    stream = io.BytesIO(body)
    collecting = gc.isenabled()
    gc.disable()
    try:
        found = _Unpickler(stream, where).load()
    except IncompatibleCheckpointError:
        raise
    except Exception as e:  # fp-dcp's bytes are as written (the checksum matched), yet no object
        raise CorruptCheckpointError(f"{where}: metadata pickle does not unpickle ({type(e).__name__}: {e})") from None
    finally:
        if collecting:
            gc.enable()
    end = stream.tell()
    if end != len(body):
        raise CorruptCheckpointError(f"{where}: metadata pickle ends at byte {end}, and {len(body) - end} bytes follow")
    return found


def is_fp_metadata(data: bytes) -> bool:
    """Whether ``.metadata`` bytes end in fp-dcp's trailer (checksums are checked by ``decode_metadata``)."""
    return len(data) >= TRAILER_SIZE and data.endswith(TRAILER_MAGIC)
