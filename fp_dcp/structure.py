"""What a reader checks of a checkpoint's metadata when it opens it, past the checksums (docs/format.md).

``check_structure`` runs once per open, for fp-dcp's own checkpoints and
torch ``FileSystemWriter`` ones, in one pass over the entries: time linear
in the number of items. It runs before any data is read, so a load that
would come out wrong or partial fails before a target is touched:

- every entry of ``state_dict_metadata`` is an object or a tensor whose
  dtype is a torch dtype (never a quantized one in fp-dcp's format), whose
  size and chunks' offsets and sizes are tuples of non-negative ints;
- every tensor's chunks tile it (``fp_dcp.tiling``);
- every chunk and object has a stored item in ``storage_data``.

Of a stock one, every item location: torch's ``_StorageInfo`` (no other
class), a file name of one path component, an offset and a length that
are non-negative ints (torch's reader takes them as they are). Of fp-dcp's
own (given its footer's ``files``), every item location: a file the footer
lists, an offset and length that are non-negative ints and lie within the
file's size as written, a CRC-32C of 32 bits (0 for no bytes, which no read
would check), hashes of 32 lowercase hex digits, and for a tensor chunk a
length of its elements.

Left to ``fp-dcp verify`` (they change no loaded value): items that
overlap, items no entry describes, files that hold no item, and
``nesting_fault``, the paths ``planner_data`` gives (``dcp.load`` into a
state dict never uses them; ``convert``, which rebuilds the nesting, checks
them too).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any, TypeGuard

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from .compat import is_storage_info
from .errors import CorruptCheckpointError
from .format import ItemLocation, describe_item, is_file_name
from .tensors import QUANTIZED
from .tiling import tiling_fault

__all__ = ["check_structure", "nesting_fault"]

_HEX128 = re.compile(r"[0-9a-f]{32}")
_CRC_LIMIT = 1 << 32


def check_structure(metadata: Metadata, where: str, files: dict[str, dict[str, Any]] | None = None) -> None:
    """CorruptCheckpointError naming the entry, unless ``metadata`` is whole and consistent (module doc).

    ``files``: the footer's ``files`` of an fp-dcp checkpoint, whose
    ``storage_data`` values are ``ItemLocation``s; None for a stock one.
    """
    # a field the pickled __dict__ lacks reads as the dataclass's default (None), or, without one, is not there
    entries, stored = getattr(metadata, "state_dict_metadata", None), metadata.storage_data
    if type(entries) is not dict or type(stored) is not dict:
        raise CorruptCheckpointError(f"{where}: state_dict_metadata and storage_data are not both dicts")
    located: dict[tuple[str, tuple[int, ...] | None], Any] = {}
    for index, location in stored.items():
        offset = getattr(index, "offset", ())
        if (
            not isinstance(index, MetadataIndex)
            or type(index.fqn) is not str
            or not (offset is None or _counts(offset))
        ):
            raise CorruptCheckpointError(f"{where}: storage_data has the key {index!r}, not a MetadataIndex")
        if files is not None:
            _check_location(index, location, files, where)
        else:
            _check_stock_location(index, location, where)
        located[(index.fqn, tuple(offset) if offset is not None else None)] = location
    for fqn, entry in entries.items():
        if type(fqn) is not str:
            raise CorruptCheckpointError(f"{where}: state_dict_metadata has the key {fqn!r}, not a string")
        if isinstance(entry, TensorStorageMetadata):
            _check_tensor(fqn, entry, located, files is not None, where)
        elif not isinstance(entry, BytesStorageMetadata):
            raise CorruptCheckpointError(f"{where}: {fqn!r} is described by {type(entry).__name__}")
        elif (fqn, None) not in located:
            raise CorruptCheckpointError(f"{where}: object {fqn!r} has no stored item in storage_data")


def _check_tensor(
    fqn: str, entry: TensorStorageMetadata, located: dict[tuple[str, Any], Any], own: bool, where: str
) -> None:
    try:
        dtype, size, chunks = entry.properties.dtype, entry.size, entry.chunks
    except AttributeError as e:
        raise CorruptCheckpointError(f"{where}: tensor {fqn!r} is described without {e.name!r}") from None
    if type(dtype) is not torch.dtype:
        raise CorruptCheckpointError(f"{where}: tensor {fqn!r} has dtype {dtype!r}, not a torch dtype")
    if own and dtype in QUANTIZED:
        raise CorruptCheckpointError(f"{where}: tensor {fqn!r} has the quantized dtype {dtype}: not in the format")
    if not _counts(size) or type(chunks) is not list:
        raise CorruptCheckpointError(f"{where}: tensor {fqn!r} has size {size!r} and chunks {chunks!r}")
    boxes: list[tuple[Sequence[int], Sequence[int]]] = []
    for chunk in chunks:
        offsets, sizes = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
        if not _counts(offsets) or not _counts(sizes):
            raise CorruptCheckpointError(f"{where}: tensor {fqn!r} has a chunk at {offsets!r} of sizes {sizes!r}")
        boxes.append((offsets, sizes))
    fault = tiling_fault(size, boxes)
    if fault is not None:
        raise CorruptCheckpointError(f"{where}: tensor {fqn!r} of size {list(size)}: {fault}")
    for offsets, sizes in boxes:
        location = located.get((fqn, tuple(offsets)))
        if location is None:
            raise CorruptCheckpointError(f"{where}: tensor {fqn!r}: its chunk at {list(offsets)} has no stored item")
        if own and location.length != math.prod(sizes) * dtype.itemsize:
            raise CorruptCheckpointError(
                f"{where}: {describe_item(MetadataIndex(fqn, offsets), location)}: {location.length} bytes do not "
                f"hold {list(sizes)} elements of {dtype}"
            )


def _counts(values: Any) -> TypeGuard[Sequence[int]]:
    """Whether ``values`` is a tuple (``torch.Size`` is one) of non-negative ints (bool is no int).

    Not a list: DCP's loader compares a stored size with the target's ``torch.Size``, which no list equals.
    """
    if type(values) is torch.Size:  # its entries are ints
        return not values or min(values) >= 0
    return isinstance(values, tuple) and all(type(v) is int and v >= 0 for v in values)


def _check_location(index: MetadataIndex, location: ItemLocation, files: dict[str, dict[str, Any]], where: str) -> None:
    file, offset, length, crc, *hashes = location
    fields = type(file) is str and type(offset) is int and type(length) is int and type(crc) is int
    if not fields or offset < 0 or length < 0 or not 0 <= crc < _CRC_LIMIT or (crc and not length):
        raise CorruptCheckpointError(
            f"{where}: {index.fqn!r} is stored at {location[:4]!r}: not a file name, an offset and a length "
            "(non-negative ints) and a CRC-32C (an int below 2**32, 0 for no bytes)"
        )
    if (hashes[0] is not None or hashes[1] is not None) and not all(
        h is None or (type(h) is str and _HEX128.fullmatch(h)) for h in hashes
    ):
        raise CorruptCheckpointError(f"{where}: {index.fqn!r} has hashes {hashes!r}, not 32 lowercase hex digits")
    entry = files.get(file)
    if entry is None:
        raise CorruptCheckpointError(
            f"{where}: {describe_item(index, location)}: the footer's files do not list {file}"
        )
    if offset + length > entry["size"]:
        raise CorruptCheckpointError(
            f"{where}: {describe_item(index, location)}: past the end of {file}, written as {entry['size']} bytes"
        )


def _check_stock_location(index: MetadataIndex, location: Any, where: str) -> None:
    """A torch ``FileSystemWriter`` item: a ``_StorageInfo`` whose ``relative_path`` is one path component, with
    an offset and a length."""
    if not is_storage_info(location):
        raise CorruptCheckpointError(
            f"{where}: {index.fqn!r} is stored at a {type(location).__name__}, not a _StorageInfo"
        )
    file, offset, length = (getattr(location, key, None) for key in ("relative_path", "offset", "length"))
    if (
        not (type(file) is str and is_file_name(file) and type(offset) is int and type(length) is int)
        or min(offset, length) < 0
    ):
        raise CorruptCheckpointError(
            f"{where}: {index.fqn!r} is stored at relative_path {file!r}, offset {offset!r}, length {length!r}: "
            "not a file name (one path component), an offset and a length (non-negative ints)"
        )


def nesting_fault(metadata: Metadata) -> str | None:
    """Why the paths of ``metadata.planner_data`` do not nest the state dict (docs/format.md), or None if they do.

    A dict ``planner_data`` gives the path of each fqn it has as a key
    (others are top-level keys); any other ``planner_data`` says nothing of
    nesting. A path is a non-empty tuple of ``str`` and non-negative ``int``
    steps, the first a ``str``; no two values at one path, none inside
    another, and no place both a dict (``str`` steps) and a list (``int``).
    """
    paths = metadata.planner_data
    if not isinstance(paths, dict):
        return None
    kinds: dict[tuple[Any, ...], type] = {(): str}  # the kind of step each container takes (the root: a dict)
    values: dict[tuple[Any, ...], str] = {}
    for fqn in metadata.state_dict_metadata:
        path = paths.get(fqn, (fqn,))
        if type(path) is not tuple or not path or not all(type(s) is str or (type(s) is int and s >= 0) for s in path):
            return f"planner_data gives {fqn!r} the path {path!r}, not a tuple of str and non-negative int steps"
        for i, step in enumerate(path):
            if kinds.setdefault(path[:i], type(step)) is not type(step):
                return f"planner_data puts {fqn!r} at {list(path)}, which makes {list(path[:i])} a dict and a list"
        if path in values:
            return f"planner_data puts {values[path]!r} and {fqn!r} both at {list(path)}"
        values[path] = fqn
    inside = sorted(values.keys() & kinds.keys(), key=repr)
    if inside:
        return f"planner_data puts {values[inside[0]]!r} at {list(inside[0])}, where other values are nested"
    return None
