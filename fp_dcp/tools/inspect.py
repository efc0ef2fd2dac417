"""``fp-dcp inspect``: what a checkpoint holds, as a dict (``--json``) or a table.

fp-dcp and stock DCP checkpoints are read through ``open_checkpoint``; a
directory of Hugging Face safetensors files through ``FastPersistReader``'s
metadata, every header checked as a load checks it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from .. import FastPersistReader
from ..checkpoint import is_safetensors_directory, open_checkpoint
from ..compat import dcp_metadata_version
from ..format import ItemLocation
from ..safetensors_format import INDEX_NAME

__all__ = ["inspect_checkpoint", "print_inspect", "human", "plural"]


def inspect_checkpoint(
    path: str | os.PathLike[str], data_dirs: Sequence[str | os.PathLike[str]] | None = None
) -> dict[str, Any]:
    """What ``fp-dcp inspect --json`` prints: format, writer, every item, the files, where they are, totals.

    Works on fp-dcp and stock DCP (``FileSystemWriter``) checkpoints, and on
    directories of safetensors files (``format`` ``safetensors``). ``bytes``
    are the stored bytes (for stock checkpoints, torch.save records).
    ``data_dirs``: where the data directories are now, if they moved
    (``paths`` then shows where each file was found).
    """
    path = os.fspath(path)
    if is_safetensors_directory(path):
        if data_dirs:
            raise ValueError(f"{path} is a safetensors checkpoint: data_dirs does not apply to it")
        return _inspect_safetensors(path)
    checkpoint = open_checkpoint(path, data_dirs)
    kind, metadata, footer = checkpoint.kind, checkpoint.metadata, checkpoint.footer
    items = _items(metadata, own_locations=footer is not None)
    if footer is not None:
        files = {name: entry["size"] for name, entry in footer["files"].items()}
        about = {
            "format": kind,
            "format_version": footer["format_version"],
            "writer": "fp-dcp FastPersistWriter",
            "engine": footer.get("engine"),  # the coordinator's engine and I/O mode
            "save_id": footer.get("save_id"),
            "data_dirs": footer.get("data_dirs") or [],
        }
    else:
        names = sorted({name for item in items for name in item["files"]})
        found = {n: checkpoint.files[n] for n in names if os.path.exists(checkpoint.files[n])}
        files = {n: os.path.getsize(p) for n, p in found.items()}
        storage_meta = metadata.storage_meta
        about = {
            "format": kind,
            "format_version": None,
            "writer": "torch FileSystemWriter",
            "engine": None,
            "save_id": storage_meta.save_id if storage_meta is not None else None,
            "data_dirs": [],
        }
    return _summary(path, about, metadata, items, files, checkpoint.files)


def _inspect_safetensors(path: str) -> dict[str, Any]:
    with FastPersistReader(path) as reader:
        metadata = reader.read_metadata()
    indexed = os.path.isfile(os.path.join(path, INDEX_NAME))
    about: dict[str, Any] = {
        "format": "safetensors",
        "format_version": None,
        "writer": f"Hugging Face safetensors ({f'indexed by {INDEX_NAME}' if indexed else 'no index'})",
        "engine": None,
        "save_id": None,
        "data_dirs": [],
    }
    items = _items(metadata, own_locations=True)
    paths = {name: os.path.join(path, name) for name in sorted({n for item in items for n in item["files"]})}
    return _summary(path, about, metadata, items, {n: os.path.getsize(p) for n, p in paths.items()}, paths)


def _items(metadata: Metadata, *, own_locations: bool) -> list[dict[str, Any]]:
    """One entry per fqn. ``own_locations``: the storage data are ``ItemLocation``s (fp-dcp's, safetensors'),
    else torch ``FileSystemWriter``'s."""
    stored: dict[str, list[tuple[str, int]]] = {}
    for index, value in metadata.storage_data.items():
        if own_locations:
            location = ItemLocation._make(value)
            entry = (location.file, location.length)
        else:
            entry = (value.relative_path, value.length)
        stored.setdefault(index.fqn, []).append(entry)
    items: list[dict[str, Any]] = []
    for fqn, md in metadata.state_dict_metadata.items():
        pieces = stored.get(fqn, [])
        item: dict[str, Any] = {"fqn": fqn, "type": "object", "dtype": None, "shape": None, "chunks": len(pieces)}
        if isinstance(md, TensorStorageMetadata):
            dtype = str(md.properties.dtype).removeprefix("torch.")
            item.update(type="tensor", dtype=dtype, shape=list(md.size), chunks=len(md.chunks))
        item.update(bytes=sum(length for _, length in pieces), files=sorted({name for name, _ in pieces}))
        items.append(item)
    return items


def _summary(
    path: str,
    about: dict[str, Any],
    metadata: Metadata,
    items: list[dict[str, Any]],
    files: dict[str, int],
    paths: dict[str, str],
) -> dict[str, Any]:
    tensors = sum(item["type"] == "tensor" for item in items)
    return {
        "path": path,
        **about,
        "dcp_metadata_version": dcp_metadata_version(metadata),
        "items": items,
        "files": files,
        "paths": {name: paths[name] for name in files},
        "totals": {
            "items": len(items),
            "tensors": tensors,
            "objects": len(items) - tensors,
            "chunks": len(metadata.storage_data),
            "bytes": sum(item["bytes"] for item in items),
            "files": len(files),
            "file_bytes": sum(files.values()),
        },
    }


def human(n: float) -> str:
    """``n`` bytes in binary units: ``512 B``, ``41.0 KiB``, ``1.9 GiB``."""
    units = ("B", "KiB", "MiB", "GiB")
    power = 0
    while n >= 1024 and power < len(units) - 1:
        n /= 1024
        power += 1
    return f"{n:.0f} B" if power == 0 else f"{n:.1f} {units[power]}"


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _table(rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(
            cell.rjust(w) if i in right else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    ]


def print_inspect(info: dict[str, Any]) -> None:
    print(f"checkpoint: {info['path']}")
    if info["format"] == "safetensors":
        print("format:     safetensors")
    else:
        kind = f"fp-dcp format version {info['format_version']}" if info["format"] == "fp" else "torch DCP"
        print(f"format:     {info['format']} ({kind}, DCP metadata {info['dcp_metadata_version']})")
    print(f"written by: {info['writer']}")
    if info["engine"]:
        print(f"engine:     {info['engine']}")
    if info["data_dirs"]:
        print(f"data dirs:  {', '.join(info['data_dirs'])}")
    rows = [["fqn", "dtype", "shape", "chunks", "bytes", "file"]]
    for item in info["items"]:
        files = item["files"]
        rows.append(
            [
                item["fqn"],
                item["dtype"] or "object",
                str(item["shape"]) if item["shape"] is not None else "-",
                str(item["chunks"]),
                human(item["bytes"]),
                files[0] + (f" +{len(files) - 1}" if len(files) > 1 else "") if files else "-",
            ]
        )
    print()
    print("\n".join(_table(rows, right={3, 4})))
    t = info["totals"]
    print()
    print(
        f"totals: {plural(t['items'], 'item')} ({plural(t['tensors'], 'tensor')}, {plural(t['objects'], 'object')}), "
        f"{plural(t['chunks'], 'chunk')}, {human(t['bytes'])} stored in {plural(t['files'], 'file')} "
        f"({human(t['file_bytes'])} on disk)"
    )
