"""Read an fp-dcp checkpoint by docs/format.md alone: every tensor and object, every checksum checked.

    python examples/read_checkpoint.py CHECKPOINT [--data-dir DIR ...]

prints each value of the checkpoint's state dict (its nested key, and a
tensor's dtype and shape) and exits 0 when every check passed; else it
prints the verdict (damage, incompatible, not a checkpoint, ...) and exits 1.

No part of fp-dcp is used: the standard library, torch (to unpickle DCP's
metadata classes and to hold the tensors), numpy (bytes into elements), and
the PyPI packages the page names for the checksums (``pip install crc32c
xxhash``). It applies every check of docs/format.md's table that can change
what it reads, and checks every checksum: the footer's and the pickle's
CRC-32C, every item's CRC-32C and, where an incremental save stored them, its
XXH3-128 hashes. Left out: ``file-exact``, ``size-rounded``, ``no-overlap``
and ``zeros`` (the bytes outside items, which no value depends on).

Where a data file is: at the place its footer entry records
(``data_file_paths``); for a checkpoint that moved since, the places
docs/reading.md lists, in its order, which are the places fp-dcp looks
(tests/test_docs_examples.py checks that both find the same files). Other
nodes' tiers are not searched (docs/runs.md, "On disk: run directories and
tiers").

Objects are unpickled with ``torch.load(weights_only=False)``, which can run
code: read only checkpoints you trust.
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import math
import os
import pickle
import struct
import sys
import warnings
from typing import Any

import numpy as np
import torch
from crc32c import crc32c  # pip install crc32c
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from xxhash import xxh3_128_hexdigest  # pip install xxhash

MAGIC = b"FPDCP\x00\r\n"
NEWEST_VERSION = 3
SAMPLE_MIN = 65_536  # items longer than this may have an xxh3_sample: 16 windows of 4096 bytes
QUANTIZED = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}
HEX128 = set("0123456789abcdef")


class Refused(Exception):
    """The checkpoint cannot be read; ``verdict`` says why, in docs/format.md's words."""

    verdict = "refused"


class Damage(Refused):
    verdict = "damage"


class Incompatible(Refused):
    verdict = "incompatible"


class NotACheckpoint(Refused):
    verdict = "not a checkpoint"


class OtherFormat(Refused):
    verdict = "not fp-dcp's format"


class DataDirectoryNotFound(Refused):
    verdict = "data directory not found"


def check(holds: bool, message: str, verdict: type[Refused] = Damage) -> None:
    if not holds:
        raise verdict(message)


# ---- .metadata


def read_metadata(path: str) -> tuple[dict[str, Any], Metadata]:
    """(footer, Metadata) of the checkpoint directory ``path``, every check of ``.metadata`` made."""
    where = os.path.join(path, ".metadata")
    check(os.path.isfile(where), f"{path} has no .metadata that is a regular file", NotACheckpoint)
    with open(where, "rb") as f:
        data = f.read()
    if len(data) < 16 or data[-8:] != MAGIC:
        stock = f"{where} is torch FileSystemWriter's: read it with torch's FileSystemReader"
        check(not is_stock(data), stock, OtherFormat)
        raise Damage(f"{where}: no fp-dcp trailer, and no stock DCP metadata either")
    footer_length, footer_crc, _ = struct.unpack("<II8s", data[-16:])
    check(footer_length + 16 <= len(data), f"{where}: the footer is longer than the file")
    footer_bytes = data[len(data) - 16 - footer_length : -16]
    check(crc32c(footer_bytes) == footer_crc, f"{where}: the footer fails its CRC-32C")
    try:
        footer = json.loads(footer_bytes.decode("utf-8"), object_pairs_hook=unique_keys, parse_constant=not_json)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise Damage(f"{where}: the footer is no UTF-8 JSON ({e})") from None
    check(type(footer) is dict and footer.get("format") == "fp-dcp", f"{where}: the footer is not fp-dcp's")
    version = footer.get("format_version")
    check(type(version) is int and version >= 1, f"{where}: format_version {version!r} is no version")
    check(version <= NEWEST_VERSION, f"{where}: format version {version} is newer than this reader's", Incompatible)
    check_footer(footer, where)
    check(footer["byteorder"] in ("little", "big"), f"{where}: byteorder {footer['byteorder']!r}")
    body = data[: footer["pickle_length"]]
    check(footer["pickle_length"] + footer_length + 16 == len(data), f"{where}: pickle_length is not the pickle's")
    check(crc32c(body) == footer["pickle_crc32c"], f"{where}: the pickle fails its CRC-32C")
    return footer, unpickle(body, where)


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    check(len({key for key, _ in pairs}) == len(pairs), "the footer gives a key twice")
    return dict(pairs)


def not_json(constant: str) -> None:
    raise ValueError(f"{constant} is not JSON")


def is_int(value: Any) -> bool:
    return type(value) is int  # not bool: JSON's true is no integer


def is_path(text: Any) -> bool:
    """A non-empty str without NUL that encodes as a Linux path (UTF-8, lone surrogates U+DC80-U+DCFF only)."""
    if type(text) is not str or not text or "\0" in text:
        return False
    try:
        text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return False
    return True


def is_component(name: Any) -> bool:
    """One path component: a path without '/', not '.' or '..'."""
    return is_path(name) and "/" not in name and name not in (".", "..")


def check_footer(footer: dict[str, Any], where: str) -> None:
    """The footer's keys, their JSON types and ranges, and every entry of ``files`` (checks footer-keys, file-entry)."""
    for key, types in [("pickle_length", int), ("pickle_crc32c", int), ("files", dict), ("byteorder", str)]:
        check(key in footer and type(footer[key]) is types, f"{where}: the footer's {key} is missing or no {types}")
    data_dirs, subdir = footer.get("data_dirs", []), footer.get("data_subdir")
    check(type(data_dirs) is list and all(is_path(d) for d in data_dirs), f"{where}: data_dirs {data_dirs!r}")
    check(subdir is None or is_component(subdir), f"{where}: data_subdir {subdir!r}")
    check((subdir is None) == (not data_dirs), f"{where}: data_subdir {subdir!r} with data_dirs {data_dirs!r}")
    for name, entry in footer["files"].items():
        check(is_component(name) and type(entry) is dict, f"{where}: the entry of {name!r}")
        size, index, owner = entry.get("size"), entry.get("dir", ""), entry.get("owner")
        check(is_int(size) and size >= 0 and size % 4096 == 0, f"{where}: {name}'s size {size!r}")
        check(index is None or (is_int(index) and 0 <= index < len(data_dirs)), f"{where}: {name}'s dir {index!r}")
        check(owner is None or (is_path(owner) and not owner.startswith("/")), f"{where}: {name}'s owner {owner!r}")
        own_subdir = entry.get("data_subdir", "")
        check(own_subdir == "" or is_component(own_subdir), f"{where}: {name}'s data_subdir {own_subdir!r}")
        check(owner is None or index is None or "data_subdir" in entry, f"{where}: {name} has no data_subdir")


class MissingClass(Exception):
    pass


class Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return super().find_class(module, name)
        except (ImportError, AttributeError):
            raise MissingClass(f"{module}.{name}") from None


def unpickle(body: bytes, where: str) -> Metadata:
    """The ``Metadata`` pickled in ``body``, which must end where ``body`` does (check pickle)."""
    stream = io.BytesIO(body)
    try:
        md = Unpickler(stream).load()
    except MissingClass as e:
        raise Incompatible(f"{where}: the pickle names {e}, which this Python and torch lack") from None
    except Exception as e:
        raise Damage(f"{where}: the pickle does not unpickle ({type(e).__name__}: {e})") from None
    check(stream.tell() == len(body), f"{where}: the pickle ends before pickle_length")
    check(isinstance(md, Metadata), f"{where}: the pickle holds a {type(md).__name__}, not a Metadata")
    return md


def is_stock(data: bytes) -> bool:
    """Whether ``.metadata`` bytes are torch FileSystemWriter's: one pickle of a Metadata of _StorageInfo values."""
    try:
        stream = io.BytesIO(data)
        md = Unpickler(stream).load()
    except Exception:
        return False
    values = getattr(md, "storage_data", None)
    return (
        stream.tell() == len(data)
        and isinstance(md, Metadata)
        and type(values) is dict
        and all(type(v) is _StorageInfo and "crc32c" not in vars(v) for v in values.values())
    )


# ---- where the data files are


def data_file_paths(
    path: str, footer: dict[str, Any], md: Metadata, data_dirs: list[str] | None = None
) -> dict[str, str]:
    """{name: where the file is now} for every data file of the checkpoint in ``path`` (docs/reading.md's rules).

    data_dirs: where the data directories it was saved with are now, in the same order
    (default: looked for, rule 3).
    """
    saved_at = checkpoint_id(md)
    paths = {}
    for name, entry in footer["files"].items():
        home = os.path.normpath(os.path.join(path, entry["owner"])) if "owner" in entry else path
        if entry["dir"] is None:  # rule 1
            paths[name] = os.path.join(home, name)
            continue
        i = entry["dir"]
        subdir = (entry.get("data_subdir") if "owner" in entry else footer.get("data_subdir")) or ""
        if data_dirs:  # rule 2
            count = len(footer["data_dirs"])
            check(i < len(data_dirs), f"{name} is in data_dirs[{i}]: give {count} directories", NotACheckpoint)
            check(os.path.isdir(data_dirs[i]), f"data directory {data_dirs[i]} is missing: so is {name}")
            paths[name] = os.path.join(data_dirs[i], subdir, name)
            continue
        recorded = footer["data_dirs"][i]  # rule 3
        roots = []
        if os.path.isabs(recorded) and os.path.isabs(saved_at):
            roots.append(os.path.normpath(os.path.join(path, os.path.relpath(recorded, saved_at))))
        roots.append(recorded)
        if not os.path.isabs(recorded):
            roots += [os.path.join(above, recorded) for above in directories_above(path, saved_at)]
        in_roots = [os.path.join(root, subdir, name) for root in roots]
        candidates = [*in_roots, os.path.join(home, name), os.path.join(home, subdir, name)]
        found = next((c for c in candidates if os.path.exists(c)), None)
        if found is None and not os.path.isabs(recorded):
            found = next((c for c in in_roots if os.path.isdir(os.path.dirname(c))), None)
            check(found is not None, f"data directory {recorded!r} not found: give data_dirs", DataDirectoryNotFound)
        paths[name] = found or in_roots[0]
    return paths


def checkpoint_id(md: Metadata) -> str:
    """The checkpoint's path as the saving process named it, "" if none (check checkpoint-id)."""
    meta = md.storage_meta
    if meta is None:
        return ""
    check(isinstance(meta, StorageMeta), f"storage_meta is a {type(meta).__name__}")
    found = meta.checkpoint_id
    path = os.fspath(found) if isinstance(found, (str, os.PathLike)) else None
    check(found is None or type(path) is str, f"storage_meta.checkpoint_id is {found!r}, not a path")
    return path or ""


def directories_above(path: str, saved_at: str) -> list[str]:
    """abspath(path) and the directories above it, then saved_at's (if absolute), each once."""
    chain: list[str] = []
    for start in [os.path.abspath(path)] + ([os.path.normpath(saved_at)] if os.path.isabs(saved_at) else []):
        while start not in chain:
            chain.append(start)
            start = os.path.dirname(start)
    return chain


# ---- items


def location(index: Any, value: Any, files: dict[str, Any]) -> tuple[str, int, int, int, dict[str, str]]:
    """(file, offset, length, crc32c, {hash name: digest}) of a storage_data entry, its checks made (check location)."""
    check(isinstance(index, MetadataIndex) and type(index.fqn) is str, f"storage_data has the key {index!r}")
    check(index.offset is None or is_counts(index.offset), f"storage_data has the key {index!r}")
    if type(value) is tuple and len(value) == 4:  # format version 1
        (file, offset, length, crc), hashes = value, {}
    else:
        check(type(value) is _StorageInfo and "crc32c" in vars(value), f"{index.fqn!r} is stored at {value!r}")
        file, offset, length, crc = value.relative_path, value.offset, value.length, vars(value)["crc32c"]
        hashes = {k: vars(value)[k] for k in ("xxh3_128", "xxh3_sample") if vars(value).get(k) is not None}
    check(file in files, f"{index.fqn!r} is in {file!r}, which the footer's files do not list")
    ints = is_int(offset) and is_int(length) and is_int(crc) and min(offset, length) >= 0
    check(ints and 0 <= crc < 2**32 and (crc == 0 or length > 0), f"{index.fqn!r} is stored at {value!r}")
    check(offset + length <= files[file]["size"], f"{index.fqn!r} lies past the end of {file}")
    for digest in hashes.values():
        check(type(digest) is str and len(digest) == 32 and set(digest) <= HEX128, f"{index.fqn!r}: hash {digest!r}")
    return file, offset, length, crc, hashes


def is_counts(values: Any) -> bool:
    """A tuple (torch.Size is one) of non-negative ints; a list is none."""
    return isinstance(values, tuple) and all(is_int(v) and v >= 0 for v in values)


def tiles(size: tuple[int, ...], chunks: list[Any]) -> bool:
    """Whether the chunks tile a tensor of ``size``: each within it, and their signed corners those of its box."""
    corners: dict[tuple[int, ...], int] = {}
    for offsets, sizes, sign in [(c.offsets, c.sizes, 1) for c in chunks] + [((0,) * len(size), size, -1)]:
        if not len(offsets) == len(sizes) == len(size):
            return False
        if any(o + n > s for o, n, s in zip(offsets, sizes, size, strict=True)):
            return False
        if 0 in sizes:
            continue  # a box of no elements covers nothing
        for corner in itertools.product(*[(o, o + n) for o, n in zip(offsets, sizes, strict=True)]):
            upper = sum(c != o for c, o in zip(corner, offsets, strict=True))  # how many coordinates are an upper end
            corners[corner] = corners.get(corner, 0) + sign * (-1) ** upper
    return not any(corners.values())


def sample(raw: bytes) -> bytes:
    """The 65,536 bytes an xxh3_sample hashes: 16 windows of 4096 bytes, the first at 0, the last at the end."""
    return b"".join(raw[s : s + 4096] for s in (i * (len(raw) - 4096) // 15 for i in range(16)))


def read_checkpoint(path: str, data_dirs: list[str] | None = None) -> dict[str, Any]:
    """The state dict saved in the checkpoint directory ``path`` (data_dirs: as for data_file_paths)."""
    footer, md = read_metadata(path)
    files = footer["files"]
    entries, stored = getattr(md, "state_dict_metadata", None), getattr(md, "storage_data", None)
    check(type(entries) is dict and type(stored) is dict, f"{path}: the Metadata lacks its entries")
    where = {index: location(index, value, files) for index, value in stored.items()}
    check({loc[0] for loc in where.values()} == set(files), f"{path}: the footer lists a file that holds no item")
    paths = data_file_paths(path, footer, md, data_dirs)
    for name, entry in files.items():
        check(os.path.isfile(paths[name]), f"data file {paths[name]} is missing (or no regular file)")
        check(os.path.getsize(paths[name]) >= entry["size"], f"data file {paths[name]} is truncated")
    swap = footer["byteorder"] != sys.byteorder

    def item(index: MetadataIndex) -> bytes:
        """An item's bytes, checked against its CRC-32C and hashes."""
        check(index in where, f"{index.fqn!r} (chunk at {index.offset}) has no item in storage_data")
        file, offset, length, crc, hashes = where[index]
        with open(paths[file], "rb") as f:
            f.seek(offset)
            raw = f.read(length)
        damaged = f"{index.fqn!r} is damaged: bytes {offset} to {offset + length} of {file}"
        check(len(raw) == length and crc32c(raw) == crc, damaged)
        check(hashes.get("xxh3_128", xxh3_128_hexdigest(raw)) == xxh3_128_hexdigest(raw), damaged + " (xxh3_128)")
        if "xxh3_sample" in hashes:
            check(length > SAMPLE_MIN, f"{index.fqn!r}: a sample hash on an item of {length} bytes")
            check(hashes["xxh3_sample"] == xxh3_128_hexdigest(sample(raw)), damaged + " (xxh3_sample)")
        return raw

    values: dict[Any, Any] = {}
    described = set()
    for fqn, entry in entries.items():
        check(type(fqn) is str, f"state_dict_metadata has the key {fqn!r}")
        if isinstance(entry, BytesStorageMetadata):
            described.add(MetadataIndex(fqn))
            # unpickling can run code: only for checkpoints you trust
            value = torch.load(io.BytesIO(item(MetadataIndex(fqn))), weights_only=False)
        else:
            check(isinstance(entry, TensorStorageMetadata), f"{fqn!r} is described by {type(entry).__name__}")
            dtype, size, chunks = entry.properties.dtype, entry.size, entry.chunks
            check(type(dtype) is torch.dtype and dtype not in QUANTIZED, f"{fqn!r} has the dtype {dtype!r}")
            check(is_counts(size) and type(chunks) is list, f"{fqn!r} has size {size!r} and chunks {chunks!r}")
            check(all(is_counts(c.offsets) and is_counts(c.sizes) for c in chunks), f"{fqn!r} has a malformed chunk")
            check(tiles(size, chunks), f"the chunks of {fqn!r} do not tile it")
            unit = dtype.itemsize // 2 if dtype.is_complex else dtype.itemsize  # what a foreign byte order reverses
            elements = torch.zeros((*size, dtype.itemsize), dtype=torch.uint8)  # each element as its bytes
            for chunk in chunks:
                index = MetadataIndex(fqn, chunk.offsets)
                described.add(index)
                raw = item(index)
                check(len(raw) == math.prod(chunk.sizes) * dtype.itemsize, f"{fqn!r}: a chunk's length is wrong")
                piece = np.frombuffer(raw, np.uint8).reshape(-1, unit)
                if swap:
                    piece = piece[:, ::-1]
                box = tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes, strict=True))
                elements[box] = torch.from_numpy(np.array(piece)).reshape(*chunk.sizes, dtype.itemsize)
            value = elements.view(dtype).squeeze(-1)  # bytes into elements, bit-exact
        paths_of = md.planner_data if isinstance(md.planner_data, dict) else {}
        values[paths_of.get(fqn, (fqn,))] = value
    check(set(stored) <= described, f"{path}: storage_data holds an item no entry describes")
    return nest(values, len(entries))


def nest(values: dict[Any, Any], count: int) -> dict[str, Any]:
    """The nested state dict of {path: value} (check nesting)."""
    kinds: dict[tuple[Any, ...], type] = {(): str}  # the kind of step (str: dict key, int: list index) of each place
    for path in values:
        good = type(path) is tuple and path and all(type(s) is str or (is_int(s) and s >= 0) for s in path)
        check(bool(good), f"planner_data gives the path {path!r}")
        for i, step in enumerate(path):
            check(kinds.setdefault(path[:i], type(step)) is type(step), f"{path} makes a place a dict and a list")
    check(len(values) == count and not values.keys() & kinds.keys(), "two values at one path, or one in another")
    state: dict[str, Any] = {}
    for path, value in values.items():
        node: Any = state
        for step, next_step in zip(path, (*path[1:], None), strict=True):
            if isinstance(node, list) and len(node) <= step:
                node.extend([None] * (step + 1 - len(node)))  # holes stay None
            if next_step is None:
                node[step] = value
            elif (node.get(step) if isinstance(node, dict) else node[step]) is None:
                node[step] = {} if isinstance(next_step, str) else []
            node = node[step]
    return state


def leaves(node: Any, path: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], Any]]:
    """(path, value) of every leaf of a nested state dict."""
    if not isinstance(node, (dict, list)) or not node:
        return [(path, node)]
    pairs = node.items() if isinstance(node, dict) else enumerate(node)
    return [leaf for key, value in pairs for leaf in leaves(value, (*path, key))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="the checkpoint directory (the one holding .metadata)")
    parser.add_argument("--data-dir", action="append", help="where each data directory is now, in the save's order")
    args = parser.parse_args()
    try:
        state = read_checkpoint(args.checkpoint, args.data_dir)
    except Refused as e:
        print(f"{args.checkpoint}: {e.verdict}: {e}")
        raise SystemExit(1) from None
    values = leaves(state)
    for path, value in values:
        shown = f"{value.dtype} {list(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)
        print(f"{path}: {shown}")
    print(f"{args.checkpoint}: intact, {len(values)} values read")


if __name__ == "__main__":
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    main()
