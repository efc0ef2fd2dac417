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

import dataclasses
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
from ..io.files import NotRegularFileError, open_regular
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

__all__ = [
    "SafetensorsCatalog",
    "Header",
    "open_safetensors",
    "read_weight_map",
    "checkpoint_files",
    "read_header",
    "catalogue",
]


class SafetensorsCatalog(Catalog):
    """Where each tensor of a safetensors checkpoint is; safetensors stores no checksums."""

    checksums = False


@dataclasses.dataclass(frozen=True)
class Header:
    """One file's header, checked: where its data starts, its tensors in data order, where each sits in its
    whole tensor (``DCP_SHARDING_INFO``, else zeros), and the file's size."""

    name: str
    data_start: int
    entries: list[Entry]
    offsets: dict[str, tuple[int, ...]]
    size: int


def open_safetensors(path: str | os.PathLike[str]) -> tuple[Metadata, SafetensorsCatalog]:
    """DCP's metadata for the safetensors checkpoint in directory ``path``, and its catalogue; every header checked.

    Raises:
        NotACheckpointError: no safetensors file there.
        CorruptCheckpointError: a file, a header or the index is damaged (each names the file and tensor).
        IncompatibleCheckpointError: a tensor of a dtype torch has not (sub-byte floats).
    """
    directory = os.fspath(path)
    weight_map = read_weight_map(directory)
    names = checkpoint_files(directory, weight_map)
    return catalogue(directory, [read_header(directory, name, weight_map) for name in names])


def read_weight_map(directory: str) -> dict[str, str] | None:
    """The index's ``weight_map`` (tensor name -> file), None where there is no index."""
    index = os.path.join(directory, INDEX_NAME)
    try:
        with open_regular(index) as f:
            return parse_index(f.read(), index)
    except FileNotFoundError:
        return None
    except NotRegularFileError as e:
        raise CorruptCheckpointError(f"{index} is {e.strerror}, not an index file") from None


def checkpoint_files(directory: str, weight_map: dict[str, str] | None) -> list[str]:
    """The files of the checkpoint: those the index names, else every ``*.safetensors`` file there."""
    names = (
        sorted(set(weight_map.values()))
        if weight_map is not None
        else sorted(name for name in os.listdir(directory) if name.endswith(SUFFIX))
    )
    if not names:
        raise NotACheckpointError(f"{directory} holds no {SUFFIX} files")
    return names


def read_header(directory: str, name: str, weight_map: dict[str, str] | None) -> Header:
    """File ``name``'s header, checked on its own and against the index (every tensor it lists there is in it)."""
    path = os.path.join(directory, name)
    stored = [] if weight_map is None else [t for t, f in weight_map.items() if f == name]
    try:
        f = open_regular(path)
    except FileNotFoundError:
        link = f", a link to {os.readlink(path)}, which" if os.path.islink(path) else ""
        held = f" (the index lists {stored[0]!r} in it)" if stored else ""
        raise CorruptCheckpointError(f"{path}{link} is missing{held}") from None
    except NotRegularFileError as e:
        raise CorruptCheckpointError(f"{path} is {e.strerror}, not a {SUFFIX} file") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        n = header_length(f.read(LENGTH_BYTES), size, path)
        entries, extra = parse_header(f.read(n), path)
    check_layout(entries, size - LENGTH_BYTES - n, path)
    present = {e.name for e in entries}
    for tensor in stored:
        if tensor not in present:
            raise CorruptCheckpointError(f"tensor {tensor!r} is listed in {INDEX_NAME} under {name}, not in it")
    return Header(name, LENGTH_BYTES + n, entries, chunk_offsets(entries, extra, path), size)


def catalogue(directory: str, headers: list[Header]) -> tuple[Metadata, SafetensorsCatalog]:
    """DCP's metadata and the catalogue of the files' headers: no tensor stored twice, chunks tiling each tensor."""
    locations: dict[MetadataIndex, ItemLocation] = {}
    chunks: dict[ChunkKey, tuple[torch.Size, torch.dtype]] = {}
    where: dict[ChunkKey, str] = {}
    for header in headers:
        for e in header.entries:
            key = (e.name, header.offsets[e.name])
            if key in chunks:
                raise CorruptCheckpointError(
                    f"tensor {e.name!r}{_at(key)} is stored twice: in {where[key]} and in {header.name}"
                )
            chunks[key], where[key] = (torch.Size(e.shape), e.dtype), header.name
            location = ItemLocation(header.name, header.data_start + e.begin, e.end - e.begin, 0)
            locations[MetadataIndex(e.name, key[1])] = location
    metadata = Metadata(_tensors(chunks, where), storage_data=dict(locations))
    paths = {h.name: os.path.join(directory, h.name) for h in headers}
    return metadata, SafetensorsCatalog(locations, chunks, paths, {h.name: h.size for h in headers})


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
