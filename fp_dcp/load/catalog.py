"""Catalogues: where a checkpoint's stored items are, whatever its format.

The read pipeline (``fp_dcp.load.pipeline``) and load sharing
(``fp_dcp.load.sharing``) read through this interface alone: every stored item
(a ``MetadataIndex``) maps to its bytes (file, offset, length), every tensor
chunk to its shape and dtype, every data file to its path now and the size
it must have. A format the reader opens brings its own catalogue, built from
its own index: ``FastPersistCatalog`` from fp-dcp's ``.metadata``,
``fp_dcp.load.safetensors.SafetensorsCatalog`` from safetensors headers.

Only some formats store a checksum per item (``checksums``): where one has
none, the pipeline checks what the structure allows (lengths, file sizes)
and verifies no checksum.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

from ..checkpoint import Checkpoint
from ..errors import CorruptCheckpointError
from ..format import ItemLocation

__all__ = ["ChunkKey", "Catalog", "FastPersistCatalog"]

ChunkKey = tuple[str, tuple[int, ...]]  # (fqn, offsets of the chunk in the whole tensor)


class Catalog:
    """Where every stored item of one checkpoint is.

    Attributes:
        locations: each stored item's file (a name in ``paths``), offset and length.
        chunks: each stored tensor chunk's shape and dtype.
        paths: data file name -> its path now.
        file_sizes: data file name -> the size the checkpoint says it has (a shorter file is damaged).
        checksums: whether ``ItemLocation.crc32c`` holds each item's CRC-32C; when False it holds nothing
            (0), and no read verifies it.
    """

    checksums = True

    def __init__(
        self,
        locations: dict[MetadataIndex, ItemLocation],
        chunks: dict[ChunkKey, tuple[torch.Size, torch.dtype]],
        paths: dict[str, str],
        file_sizes: dict[str, int],
    ) -> None:
        self.locations = locations
        self.chunks = chunks
        self.paths = paths
        self.file_sizes = file_sizes

    def location(self, req: ReadItem) -> ItemLocation:
        try:
            return self.locations[req.storage_index]
        except KeyError:
            raise CorruptCheckpointError(
                f"the checkpoint metadata has no stored bytes for {req.storage_index}"
            ) from None


class FastPersistCatalog(Catalog):
    """The catalogue of an fp-dcp checkpoint, from its ``.metadata``."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        metadata = checkpoint.metadata
        chunks: dict[ChunkKey, tuple[torch.Size, torch.dtype]] = {}
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                for chunk in md.chunks:
                    chunks[(fqn, tuple(chunk.offsets))] = (chunk.sizes, md.properties.dtype)
        super().__init__(
            {index: ItemLocation._make(value) for index, value in metadata.storage_data.items()},
            chunks,
            checkpoint.files,
            checkpoint.file_sizes,
        )
