"""Incremental saves: tensors unchanged since an earlier checkpoint are referenced there, not written again.

An incremental save stores two hashes per item: the XXH3-128 of all its
bytes, computed in the same pass over memory as its CRC-32C, and (for
tensors over 64 KiB) the XXH3-128 of a *sample*, 16 windows of 4 KiB spread
evenly over it (docs/format.md). Given a *base* (an earlier incremental
checkpoint, saved with the same ``data_dirs``), each rank decides for its
own items: a tensor chunk whose dtype, shape, byte length, CRC-32C and
XXH3-128 all equal those of the same chunk in the base is not written; the
new checkpoint's metadata points at the base's bytes instead, in the file of
whichever checkpoint wrote them (references never chain).

Deciding needs the item's hash before its bytes are written, so an item
that may be unchanged is read once to hash it (in parallel threads) and, if
it did change, again to write it. The sample keeps that first read off the
items that change at every save (trained weights, optimizer state): when
its 64 KiB sample differs from the base's, the item has changed and is
written at once, hashed as it is written. The sample never decides that an
item is unchanged: only the full hash does.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from .._native import _cio
from ..checkpoint import Checkpoint, open_checkpoint
from ..errors import CheckpointError
from ..format import HASHING, SAMPLE_MIN, SAMPLE_WINDOW, ItemLocation, sample_offsets
from ..log import log
from ..tensors import ByteSource

__all__ = ["HASHING", "Base", "Incremental", "check_hashing", "digest", "sample_digest"]

T = TypeVar("T")


def check_hashing() -> None:
    if not HASHING:
        raise RuntimeError(
            "incremental saves need fp_dcp._native._cio built with libxxhash (Debian: apt-get install libxxhash-dev, "
            "then rebuild fp-dcp); this build has no content hash"
        )


def sample_digest(source: ByteSource) -> str | None:
    """XXH3-128 of an item's sample; None for small items and for sources that cannot be sampled cheaply."""
    if source.nbytes <= SAMPLE_MIN:
        return None
    windows = source.windows(sample_offsets(source.nbytes), SAMPLE_WINDOW)
    if windows is None:
        return None
    hasher = _cio.Hash128()
    hasher.update(windows)
    return hasher.hexdigest()


class Base:
    """The earlier checkpoint an incremental save compares against, as one rank sees it."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        self.checkpoint = checkpoint
        self.path = checkpoint.path
        self._chunks: dict[tuple[str, tuple[int, ...]], tuple[torch.Size, torch.dtype]] = {}
        for fqn, md in checkpoint.metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                for chunk in md.chunks:
                    self._chunks[(fqn, tuple(chunk.offsets))] = (chunk.sizes, md.properties.dtype)

    @classmethod
    def open(cls, path: str, data_dirs: list[str]) -> Base | None:
        """The base at ``path``, or None (with a warning: the save then writes everything) if it cannot serve."""
        try:
            checkpoint = open_checkpoint(path)
        except (CheckpointError, OSError) as e:
            log.warning("fp-dcp: incremental base %s cannot be read, saving in full: %s", path, e)
            return None
        footer = checkpoint.footer
        if footer is None or (footer.get("data_dirs") or []) != data_dirs:
            what = (
                "is not an fp-dcp checkpoint" if footer is None else f"was saved with data_dirs {footer['data_dirs']}"
            )
            log.warning("fp-dcp: incremental base %s %s, not %s: saving in full", path, what, data_dirs)
            return None
        return cls(checkpoint)

    def candidate(self, item: WriteItem, nbytes: int) -> ItemLocation | None:
        """The base's location of the same tensor chunk, if it has the same dtype, shape, length and a hash."""
        data = item.tensor_data
        if item.type == WriteItemType.BYTE_IO or data is None:
            return None  # objects are small pickles: not worth a reference
        # open_checkpoint made every location an ItemLocation
        location: ItemLocation | None = self.checkpoint.metadata.storage_data.get(item.index)
        if location is None or location.xxh3_128 is None or location.length != nbytes:
            return None
        stored = self._chunks.get((item.index.fqn, tuple(data.chunk.offsets)))
        if stored != (data.chunk.sizes, data.properties.dtype):
            return None
        return location

    def entry(self, name: str, directory: str) -> dict[str, Any]:
        """The footer entry, in the checkpoint being saved in ``directory``, of the base's file ``name``."""
        footer = self.checkpoint.footer
        assert footer is not None
        entry = footer["files"][name]
        owner = self.checkpoint.owners.get(name, self.path)
        subdir = entry.get("data_subdir") if name in self.checkpoint.owners else footer.get("data_subdir")
        result: dict[str, Any] = {"size": entry["size"], "dir": entry["dir"]}
        # "." for a save over its own base: the file stays where it is, but was written by an earlier save
        result["owner"] = os.path.relpath(os.path.abspath(owner), os.path.abspath(directory))
        if entry["dir"] is not None:
            result["data_subdir"] = subdir
        return result


def digest(source: ByteSource) -> tuple[int, str]:
    """(CRC-32C, XXH3-128) of an item's bytes, in one pass."""
    hasher = _cio.Hash128()
    crc = source.checksum(hasher)
    return crc, hasher.hexdigest()


class Incremental:
    """One incremental save on one rank: its base (None for the first save), hashing ``threads`` items at a time."""

    def __init__(self, base: Base | None, threads: int) -> None:
        self.base = base
        self.threads = threads

    def unchanged(
        self, items: list[tuple[WriteItem, ByteSource]], samples: list[str | None]
    ) -> dict[int, ItemLocation]:
        """Positions in ``items`` of the items unchanged since the base, with the base's locations.

        ``samples``: each item's ``sample_digest``.
        """
        if self.base is None:
            return {}
        candidates = []
        for position, ((write_item, source), sample) in enumerate(zip(items, samples, strict=True)):
            location = self.base.candidate(write_item, source.nbytes)
            if location is None:
                continue
            if sample is not None and location.xxh3_sample is not None and sample != location.xxh3_sample:
                continue  # changed: its sample differs
            candidates.append((position, location))
        if not candidates:
            return {}
        digests = _map(lambda c: digest(items[c[0]][1]), candidates, self.threads)
        return {
            position: location
            for (position, location), found in zip(candidates, digests, strict=True)
            if found == (location.crc32c, location.xxh3_128)
        }


def _map(fn: Callable[[Any], T], inputs: list[Any], threads: int) -> list[T]:
    if threads <= 1 or len(inputs) == 1:
        return [fn(x) for x in inputs]
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="fp-dcp-hash") as pool:
        return list(pool.map(fn, inputs))
