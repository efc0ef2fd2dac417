"""A data file's bytes checked in file order as they pass: the items' checksums and hashes, the zeros between.

``verify_checkpoint`` reads a file front to back through the load
pipeline's window (``scan_ranges``); a tier's transfer or read-back feeds
the bytes as they arrive (``StreamCheck``). Both cut the file into
segments (``segments_of``): each item's bytes, checked against its CRC-32C
and the XXH3-128 hashes an incremental save stored, and, in a file of the
checkpoint's own, the bytes around them, which the format says are zeros.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
from torch.distributed.checkpoint.metadata import MetadataIndex

from .._native import _cio
from ..checkpoint import Checkpoint
from ..config import IOConfig
from ..format import ItemLocation, checksum_mismatch, describe_item
from ..io.context import IOContext, IOResources
from ..io.extents import Extent, Piece, Window, plan_extents
from ..io.files import DataFile
from ..io.progress import Progress
from ..names import METADATA_NAME
from ..units import PAGE, MiB, align_up
from .hashes import ItemHashes

__all__ = [
    "Item",
    "FedRange",
    "Segment",
    "segments_of",
    "hash_mismatch",
    "items_by_file",
    "StreamCheck",
    "scan_ranges",
    "scan_resources",
]

# A check of a whole checkpoint reads 16 MiB at a time, four in flight: enough to keep a disk busy, with 64 MiB of
# buffers.
_READ = 16 * MiB
_IN_FLIGHT = 4

Item = tuple[MetadataIndex, ItemLocation]  # a stored item: its index and where it is


class FedRange(Protocol):
    """Bytes ``start..stop`` of a file, fed to it in order as they are read."""

    start: int
    stop: int

    def feed(self, data: memoryview, at: int) -> None: ...


class Segment:
    """A byte range of a data file to check: an item's bytes (``item`` set) or padding (``item`` None)."""

    __slots__ = ("start", "stop", "item", "crc", "hashes", "nonzero", "first_nonzero")

    def __init__(self, start: int, stop: int, item: Item | None) -> None:
        self.start = start
        self.stop = stop
        self.item = item
        self.crc = 0
        self.hashes = ItemHashes.of(item[1]) if item is not None else None
        self.nonzero = 0
        self.first_nonzero = -1

    def feed(self, data: memoryview, at: int) -> None:
        if self.item is not None:
            if self.hashes is None:
                self.crc = _cio.crc32c(data, self.crc)
            else:
                self.crc = _cio.crc32c(data, self.crc, self.hashes.hasher)
                self.hashes.feed_sample(data, at - self.start)
            return
        flags = np.frombuffer(data, dtype=np.uint8)
        count = int(np.count_nonzero(flags))
        if count and not self.nonzero:
            self.first_nonzero = at + int(np.flatnonzero(flags)[0])
        self.nonzero += count

    def problem(self, path: str) -> str | None:
        if self.item is None:
            if not self.nonzero:
                return None
            return (
                f"data file {path}: {self.nonzero} byte(s) outside every item are not zero, the first at offset "
                f"{self.first_nonzero} (damaged after the save; the items there are intact)"
            )
        index, loc = self.item
        if self.crc != loc.crc32c:
            return checksum_mismatch(index, loc, self.crc)
        return hash_mismatch(index, self.hashes)


def hash_mismatch(index: MetadataIndex, hashes: ItemHashes | None) -> str | None:
    """A problem line if the item's stored hashes disagree with its bytes (its CRC-32C agreeing)."""
    if hashes is None or not (wrong := hashes.problems()):
        return None
    return f"hash mismatch for {describe_item(index, hashes.location)} (its CRC-32C matches): {'; '.join(wrong)}"


def segments_of(
    name: str, size: int, items: list[Item], padding: bool, problems: list[str]
) -> tuple[list[Segment], int]:
    """The items within the first ``size`` bytes and (with ``padding``) the bytes around them, in file order.

    Also returns the items' bytes.
    """
    segments = []
    cursor = 0
    nbytes = 0
    for index, loc in sorted(items, key=lambda item: item[1].offset):
        stop = loc.offset + loc.length
        if stop > size:
            problems.append(f"{describe_item(index, loc)}: {name} ends at byte {size}, before the end of the item")
            cursor = max(cursor, stop)  # what is left of the item is not padding
            continue
        if loc.offset < cursor:
            problems.append(
                f"{describe_item(index, loc)}: overlaps the item before it ({METADATA_NAME} is inconsistent)"
            )
            continue
        if loc.offset > cursor and padding:
            segments.append(Segment(cursor, loc.offset, None))
        if loc.length:
            segments.append(Segment(loc.offset, stop, (index, loc)))
        elif (wrong := hash_mismatch(index, ItemHashes.of(loc))) is not None:  # its CRC-32C 0: opening checked
            problems.append(wrong)
        nbytes += loc.length
        cursor = stop
    if cursor < size and padding:
        segments.append(Segment(cursor, size, None))
    return segments, nbytes


def items_by_file(checkpoint: Checkpoint) -> dict[str, list[Item]]:
    """Every data file the checkpoint lists, with the items it stores in it (by its metadata)."""
    by_file: dict[str, list[Item]] = {name: [] for name in checkpoint.files}
    for index, value in checkpoint.metadata.storage_data.items():
        loc = ItemLocation._make(value)
        by_file.setdefault(loc.file, []).append((index, loc))
    return by_file


class StreamCheck:
    """Checks one data file's bytes as they pass by in order: a transfer or a read-back, not a file on disk.

    ``whole``: the file is this checkpoint's own, so its size must be exact and
    the bytes around the items zeros (as ``verify_checkpoint`` checks); a file
    it references in an earlier checkpoint holds that one's items too, so only
    the referenced items are checked and the file may be longer than they reach.
    """

    def __init__(self, name: str, size: int, items: list[Item], whole: bool) -> None:
        self.name, self.size, self.whole = name, size, whole
        self._problems: list[str] = []
        self._segments, _ = segments_of(name, size, items, whole, self._problems)
        self._next = 0  # the first segment not yet wholly fed
        self.received = 0

    def feed(self, data: memoryview | bytes) -> None:
        """The next ``len(data)`` bytes of the file."""
        view = memoryview(data).cast("B")
        start, stop = self.received, self.received + len(view)
        self.received = stop
        k = self._next
        while k < len(self._segments) and self._segments[k].start < stop:
            segment = self._segments[k]
            lo, hi = max(segment.start, start), min(segment.stop, stop)
            if lo < hi:
                segment.feed(view[lo - start : hi - start], lo)
            if segment.stop > stop:
                break
            k += 1
        self._next = k

    def problems(self, where: str) -> list[str]:
        """What is wrong with the bytes fed so far, as the whole file (``where`` names it in the lines)."""
        problems = list(self._problems)
        if self.received < self.size or (self.whole and self.received > self.size):
            problems.append(f"data file {where} is {self.received} bytes, written as {self.size}")
        problems += filter(None, (segment.problem(where) for segment in self._segments))
        return problems


def scan_ranges(
    io: IOContext, f: DataFile, segments: Sequence[FedRange], progress: Progress, end: int | None = None
) -> None:
    """Read the bytes the segments cover (in file order) through the read pipeline's window, feeding each.

    ``end``: where the file ends, for a file whose end is not on the alignment (else every read is whole).
    """

    def retire(extent: Extent, buffer: memoryview | None) -> None:
        assert buffer is not None  # segments have no memory of their own: every extent is staged
        for segment, at, buf_offset, length in extent.parts:
            segment.feed(buffer[buf_offset : buf_offset + length], segment.start + at)

    pieces = (Piece(s.start, s.stop - s.start, s, 0, None) for s in segments)
    engine, pool = io.engine, io.pool
    window = Window(engine, pool, retire, pool.count, progress)  # one read in flight per buffer
    try:
        for extent in plan_extents(pieces, f.align, pool.size, pool.size, 0.0):
            buffer = window.stage(extent.length)
            window.push(engine.read(f, buffer, extent.file_offset, end), extent, buffer)
        window.finish()
    except BaseException:
        window.abort()
        raise


def scan_resources(largest: int) -> IOResources:
    """An engine and buffers to read files of up to ``largest`` bytes front to back (small files, small buffers)."""
    read = min(_READ, align_up(largest, PAGE))
    return IOResources(IOConfig(buffer_size=read, num_buffers=_IN_FLIGHT, block_size=read, queue_depth=_IN_FLIGHT))
