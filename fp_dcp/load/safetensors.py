"""Hugging Face safetensors checkpoints: the catalogue the reader loads them through.

``FastPersistReader`` opens a directory without ``.metadata`` that holds
``*.safetensors`` files as a safetensors checkpoint (``open_safetensors``):

- With ``model.safetensors.index.json``, the files its ``weight_map`` names
  are the checkpoint, and each tensor it lists must be in its file; without
  one, every ``*.safetensors`` file in the directory is.
- Every file's header is read and checked (``fp_dcp.safetensors_format``):
  the tensors fill the data exactly, each as long as its dtype and shape
  say, the file neither shorter nor longer. Files DCP's
  ``HuggingFaceStorageWriter`` wrote with ``save_distributed=True`` hold
  chunks of larger tensors (``DCP_SHARDING_INFO``): the chunks of each
  tensor must tile it exactly.
- Files may be symbolic links, as in the Hugging Face cache
  (``snapshots/<revision>/`` links into ``blobs/``); a link whose blob is
  missing is named as such.

The result is what ``HuggingFaceStorageReader`` gives DCP (each tensor
under its own name, a chunk per stored piece), so a state dict loads the
same through either, resharded to any DTensor placement; and a catalogue
for the read pipeline, which reads only the byte runs each rank's plan
needs, O_DIRECT, and shares what several ranks need (``share``). The items
carry no checksum (``checksums`` is False): a load checks structure and
lengths, not content.
"""

from __future__ import annotations

import os
from collections import defaultdict

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ..errors import CorruptCheckpointError, NotACheckpointError
from ..format import ItemLocation
from ..safetensors_format import (
    INDEX_NAME,
    LENGTH_BYTES,
    SUFFIX,
    Entry,
    check_layout,
    chunk_offsets,
    header_length,
    parse_header,
    parse_index,
)
from ..tiling import tiling_fault
from .catalog import Catalog, ChunkKey

__all__ = ["SafetensorsCatalog", "open_safetensors"]


class SafetensorsCatalog(Catalog):
    """Where each tensor of a safetensors checkpoint is; safetensors stores no checksums."""

    checksums = False


def open_safetensors(path: str | os.PathLike[str]) -> tuple[Metadata, SafetensorsCatalog]:
    """DCP's metadata for the safetensors checkpoint in directory ``path``, and its catalogue; every header checked.

    Raises:
        NotACheckpointError: no safetensors file there.
        CorruptCheckpointError: a file, a header or the index is damaged (each names the file and tensor).
        IncompatibleCheckpointError: a tensor of a dtype torch has not (sub-byte floats).
    """
    directory = os.fspath(path)
    weight_map = _weight_map(directory)
    names = sorted(set(weight_map.values())) if weight_map is not None else _listed(directory)
    if not names:
        raise NotACheckpointError(f"{directory} holds no {SUFFIX} files")
    locations: dict[MetadataIndex, ItemLocation] = {}
    chunks: dict[ChunkKey, tuple[torch.Size, torch.dtype]] = {}
    where: dict[ChunkKey, str] = {}
    paths = {name: os.path.join(directory, name) for name in names}
    sizes: dict[str, int] = {}
    for name in names:
        stored = [] if weight_map is None else [t for t, f in weight_map.items() if f == name]
        data_start, entries, offsets, sizes[name] = _read_header(paths[name], stored)
        present = {e.name for e in entries}
        for tensor in stored:
            if tensor not in present:
                raise CorruptCheckpointError(f"tensor {tensor!r} is listed in {INDEX_NAME} under {name}, not in it")
        for e in entries:
            key = (e.name, offsets[e.name])
            if key in chunks:
                raise CorruptCheckpointError(
                    f"tensor {e.name!r}{_at(key)} is stored twice: in {where[key]} and in {name}"
                )
            chunks[key], where[key] = (torch.Size(e.shape), e.dtype), name
            length = e.end - e.begin
            locations[MetadataIndex(e.name, key[1])] = ItemLocation(name, data_start + e.begin, length, 0)
    metadata = Metadata(_tensors(chunks, where), storage_data=dict(locations))
    return metadata, SafetensorsCatalog(locations, chunks, paths, sizes)


def _weight_map(directory: str) -> dict[str, str] | None:
    index = os.path.join(directory, INDEX_NAME)
    try:
        with open(index, "rb") as f:
            return parse_index(f.read(), index)
    except FileNotFoundError:
        return None


def _listed(directory: str) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.endswith(SUFFIX))


def _read_header(path: str, stored: list[str]) -> tuple[int, list[Entry], dict[str, tuple[int, ...]], int]:
    """The data's start, the tensors, where each sits in its whole tensor, and the file's size."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        link = f", a link to {os.readlink(path)}, which" if os.path.islink(path) else ""
        held = f" (the index lists {stored[0]!r} in it)" if stored else ""
        raise CorruptCheckpointError(f"{path}{link} is missing{held}") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        n = header_length(f.read(LENGTH_BYTES), size, path)
        entries, extra = parse_header(f.read(n), path)
    check_layout(entries, size - LENGTH_BYTES - n, path)
    return LENGTH_BYTES + n, entries, chunk_offsets(entries, extra, path), size


def _at(key: ChunkKey) -> str:
    return f" (chunk at {list(key[1])})" if any(key[1]) else ""


def _tensors(
    chunks: dict[ChunkKey, tuple[torch.Size, torch.dtype]], where: dict[ChunkKey, str]
) -> dict[str, TensorStorageMetadata | BytesStorageMetadata]:
    """Each tensor's DCP metadata: dtype, whole size (reaching every chunk), chunks, which must tile it exactly."""
    by_fqn: dict[str, list[ChunkKey]] = defaultdict(list)
    for key in chunks:
        by_fqn[key[0]].append(key)
    out: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    for fqn, keys in by_fqn.items():
        dtypes = {chunks[k][1] for k in keys}
        if len(dtypes) > 1:
            raise CorruptCheckpointError(
                f"tensor {fqn!r} is stored in chunks of different dtypes ({', '.join(sorted(map(str, dtypes)))}) "
                f"in {', '.join(sorted({where[k] for k in keys}))}"
            )
        files = ", ".join(sorted({where[k] for k in keys}))
        boxes = [(k[1], tuple(chunks[k][0])) for k in keys]
        if len({len(o) for o, _ in boxes}) > 1:
            raise CorruptCheckpointError(f"tensor {fqn!r}: its chunks in {files} differ in rank")
        size = [max(o[d] + s[d] for o, s in boxes) for d in range(len(boxes[0][0]))]
        fault = tiling_fault(size, boxes)  # the size reaches every chunk: none lies outside it
        if fault is not None:
            raise CorruptCheckpointError(f"tensor {fqn!r} of size {size}, stored in {files}: {fault}")
        out[fqn] = TensorStorageMetadata(
            TensorProperties(dtype=dtypes.pop()),
            torch.Size(size),
            [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in boxes],
        )
    return out
