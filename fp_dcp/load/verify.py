"""Check a whole checkpoint without loading it: ``verify_checkpoint``.

A load checks what it reads; this checks everything, once, front to back
(docs/format.md's table of checks lists each, and who makes it):

- ``.metadata``: everything opening a checkpoint checks
  (``fp_dcp.checkpoint.open_checkpoint``: trailer, footer and pickle
  checksums, the footer's keys and ranges, item locations, the tiling of
  every tensor's chunks); then that every stored item is one the metadata
  describes, and that ``planner_data`` nests it without conflicts
  (``fp_dcp.structure.nesting_fault``: a load into a state dict never
  uses it, but a rebuild of the nested state dict does);
- every data file the footer lists: present, exactly the size it was
  written with, holding at least one item, and (a file of this save) of
  the size its last item's end rounds up to;
- every item: inside its file, not overlapping another, its CRC-32C, and
  the XXH3-128 hashes an incremental save stored with it;
- the bytes between, before and after the items: zeros, as the format
  specifies. So a flipped byte anywhere in a data file is found, not only one
  inside an item (a load would not notice one in the padding, nor need to).
  In a file an incremental save referenced in an earlier checkpoint, only
  the items it references are checked (the rest belong to that checkpoint).

A node's copy of a tiered step (``.node``) may lack the files of other
nodes: those are reported as ``partial``, not as problems, and the files
it holds are checked.

Data files are read through the same engine and in-flight window as loads
(io_uring or threads, O_DIRECT where the filesystem allows, so the disk's
bytes are checked rather than a cached copy), several reads in flight while
earlier ones are checked.
Files in the directory that ``.metadata`` does not list (leftovers of saves
that never published) are not part of the checkpoint and are not examined.

A torch ``FileSystemWriter`` checkpoint stores no checksums: for one, only the
presence and sizes of its files are checked, and the report says so with
``checksums=False`` (that alone does not make ``ok`` false). A directory of
Hugging Face safetensors files is checked by ``fp_dcp.load.safetensors_verify``.
"""

from __future__ import annotations

import os
import stat
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex

from .. import _cio
from ..checkpoint import Checkpoint, is_safetensors_directory, node_of, open_checkpoint
from ..config import IOConfig
from ..errors import CorruptCheckpointError
from ..format import METADATA_NAME, ItemLocation, checksum_mismatch, describe_item
from ..io.buffers import BufferPool
from ..io.engine import Engine, IOResources
from ..io.extents import Extent, Piece, Window, plan_extents
from ..io.files import DataFile, open_file
from ..io.progress import Progress, ProgressCallback
from ..structure import nesting_fault
from ..units import PAGE, MiB, align_up
from .catalog import FastPersistCatalog
from .hashes import ItemHashes

__all__ = [
    "VerifyReport",
    "verify_checkpoint",
    "StreamCheck",
    "items_by_file",
    "scan_resources",
    "scan_ranges",
    "FedRange",
]

# Reads of 16 MiB, four in flight: enough to keep a disk busy, with 64 MiB of buffers.
_READ = 16 * MiB
_IN_FLIGHT = 4
_NAMES_SHOWN = 5  # items named in a problem about a whole file

_Item = tuple[MetadataIndex, ItemLocation]


@dataclass(frozen=True)
class VerifyReport:
    """What ``verify_checkpoint`` found.

    Attributes:
        path: the checkpoint directory.
        ok: no problem found.
        problems: one line per problem, naming the file and, where the
            problem is in an item's bytes, the item (its fqn and chunk).
        items: items the metadata lists (all examined).
        bytes: item bytes read and checked against their CRC-32C.
        files: data files the metadata lists.
        checksums: False for a torch ``FileSystemWriter`` checkpoint, which
            stores none: then only file presence and sizes were checked.
        partial: for a node's copy of a tiered step (``.node``) that lacks
            data files, what it holds ("" otherwise): the files there are
            checked, the absent ones are on other nodes' roots or the
            durable root, and their absence is no problem.
    """

    path: str
    ok: bool
    problems: list[str]
    items: int
    bytes: int
    files: int
    checksums: bool = True
    partial: str = ""


def verify_checkpoint(
    path: str | os.PathLike[str],
    data_dirs: Sequence[str | os.PathLike[str]] | None = None,
    *,
    progress: ProgressCallback | None = None,
) -> VerifyReport:
    """Check every byte of the checkpoint at ``path`` against its metadata and checksums.

    Args:
        path: checkpoint directory.
        data_dirs: where the data directories are now, if the checkpoint
            moved (as for ``FastPersistReader``).
        progress: called as ``progress(bytes_done, bytes_total)`` in bytes of
            data files, once before reading and then after each read; the last
            call has ``bytes_done == bytes_total``.

    Returns a report: damage of any kind (to ``.metadata``, a data file, an
    item) is a problem in it, not an exception.

    Raises:
        NotACheckpointError: ``path`` holds no checkpoint (no ``.metadata``, no
            safetensors files), or ``data_dirs`` lists fewer directories than the save used.
        IncompatibleCheckpointError: written by a newer fp-dcp format version,
            or on a host of the other byte order.
    """
    directory = os.fspath(path)
    if is_safetensors_directory(directory):
        from .safetensors_verify import verify_safetensors  # it builds on this module's report and reader

        if data_dirs:
            raise ValueError(f"{directory} is a safetensors checkpoint: data_dirs does not apply to it")
        return verify_safetensors(directory, progress=progress)
    try:
        checkpoint = open_checkpoint(directory, data_dirs)
    except CorruptCheckpointError as e:
        return VerifyReport(directory, False, [str(e)], 0, 0, 0)
    if checkpoint.kind == "dcp":
        return _verify_stock(checkpoint)
    catalog = FastPersistCatalog(checkpoint)
    problems = _undescribed(checkpoint.metadata, catalog) + _nesting(checkpoint.metadata)
    by_file = items_by_file(checkpoint)
    problems += _file_problems(checkpoint, by_file)
    absent, partial = _absent_from_node(checkpoint)
    present = {name: items for name, items in by_file.items() if name not in absent}

    tracker = Progress("verify", sum(catalog.file_sizes[name] for name in present), callback=progress)
    checked = 0
    io = scan_resources(max(catalog.file_sizes.values(), default=1))
    try:
        engine, pool = io.get()
        for name, items in present.items():
            size = catalog.file_sizes[name]
            before = tracker.done
            whole = name not in checkpoint.owners
            checked += _verify_file(catalog.paths[name], size, items, whole, engine, pool, tracker, problems)
            tracker.advance(size - (tracker.done - before))  # bytes a short or missing file could not give
    finally:
        io.close()
    tracker.finish()
    stored = len(catalog.locations)
    return VerifyReport(directory, not problems, problems, stored, checked, len(catalog.paths), partial=partial)


def scan_resources(largest: int) -> IOResources:
    """An engine and buffers to read files of up to ``largest`` bytes front to back (small files, small buffers)."""
    read = min(_READ, align_up(largest, PAGE))
    return IOResources(IOConfig(buffer_size=read, num_buffers=_IN_FLIGHT, block_size=read, queue_depth=_IN_FLIGHT))


def _undescribed(metadata: Metadata, catalog: FastPersistCatalog) -> list[str]:
    """Stored items that no chunk or object of the metadata describes (opening checked the converse)."""
    objects = {fqn for fqn, md in metadata.state_dict_metadata.items() if isinstance(md, BytesStorageMetadata)}

    def described(index: MetadataIndex) -> bool:
        return index.fqn in objects if index.offset is None else (index.fqn, tuple(index.offset)) in catalog.chunks

    return [
        f"{describe_item(index, loc)}: stored, but {METADATA_NAME} describes no such chunk or object"
        for index, loc in catalog.locations.items()
        if not described(index)
    ]


def _nesting(metadata: Metadata) -> list[str]:
    fault = nesting_fault(metadata)
    return [f"{METADATA_NAME}: {fault}"] if fault is not None else []


def _file_problems(checkpoint: Checkpoint, by_file: dict[str, list[_Item]]) -> list[str]:
    """Files the footer lists that hold no item, and own files whose size is not their last item's end rounded up.

    A file an entry with an ``owner`` names holds that checkpoint's other items too, past the referenced ones.
    """
    problems = []
    for name, items in by_file.items():
        if not items:
            problems.append(f"data file {name}: the footer lists it, but it holds no item")
        elif name not in checkpoint.owners:
            end = max(loc.offset + loc.length for _, loc in items)
            if checkpoint.file_sizes[name] != align_up(end, PAGE):
                problems.append(
                    f"data file {name}: the footer gives size {checkpoint.file_sizes[name]}, but its last item ends "
                    f"at byte {end}, so it was written as {align_up(end, PAGE)}"
                )
    return problems


class FedRange(Protocol):
    """Bytes ``start..stop`` of a file, fed to it in order as they are read."""

    start: int
    stop: int

    def feed(self, data: memoryview, at: int) -> None: ...


def _absent_from_node(checkpoint: Checkpoint) -> tuple[set[str], str]:
    """The data files a node's copy of a tiered step lacks (other tiers hold them), and a line saying so."""
    node = node_of(checkpoint.path)
    if node is None:
        return set(), ""
    absent = {name for name, path in checkpoint.files.items() if not os.path.exists(path)}
    if not absent:
        return absent, ""
    held = len(checkpoint.files) - len(absent)
    return absent, (
        f"partial: node {node}'s files only ({held} of {len(checkpoint.files)} data files), "
        "complete with the other tiers' roots"
    )


class _Segment:
    """A byte range of a data file to check: an item's bytes (``item`` set) or padding (``item`` None)."""

    __slots__ = ("start", "stop", "item", "crc", "hashes", "nonzero", "first_nonzero")

    def __init__(self, start: int, stop: int, item: _Item | None) -> None:
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
        return _hash_mismatch(index, self.hashes)


def _hash_mismatch(index: MetadataIndex, hashes: ItemHashes | None) -> str | None:
    """A problem line if the item's stored hashes disagree with its bytes (its CRC-32C agreeing)."""
    if hashes is None or not (wrong := hashes.problems()):
        return None
    return f"hash mismatch for {describe_item(index, hashes.location)} (its CRC-32C matches): {'; '.join(wrong)}"


def _segments(
    name: str, size: int, items: list[_Item], padding: bool, problems: list[str]
) -> tuple[list[_Segment], int]:
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
            segments.append(_Segment(cursor, loc.offset, None))
        if loc.length:
            segments.append(_Segment(loc.offset, stop, (index, loc)))
        elif (wrong := _hash_mismatch(index, ItemHashes.of(loc))) is not None:  # its CRC-32C 0: opening checked
            problems.append(wrong)
        nbytes += loc.length
        cursor = stop
    if cursor < size and padding:
        segments.append(_Segment(cursor, size, None))
    return segments, nbytes


def _verify_file(
    path: str,
    expected: int,
    items: list[_Item],
    whole: bool,
    engine: Engine,
    pool: BufferPool,
    tracker: Progress,
    problems: list[str],
) -> int:
    """Check one data file (``whole``: its padding too), adding to ``problems``; returns the item bytes checked."""
    name = os.path.basename(path)
    try:
        f = open_file(path, create=False, direct=None)
    except FileNotFoundError:
        problems.append(f"data file {path} is missing; {_holds(items)}")
        return 0
    except OSError as e:
        problems.append(f"data file {path} cannot be opened ({e.strerror}); {_holds(items)}")
        return 0
    try:
        status = os.fstat(f.fd)
        if not stat.S_ISREG(status.st_mode):  # a directory where the rules find the file
            problems.append(f"data file {path} is not a regular file; {_holds(items)}")
            return 0
        size = status.st_size
        if size < expected:
            problems.append(f"data file {path} is truncated: {size} bytes, written as {expected}")
        elif size > expected:
            problems.append(f"data file {path} is {size} bytes, written as {expected}: something appended to it")
        segments, nbytes = _segments(name, min(size, expected), items, whole, problems)
        if f.direct and min(size, expected) % f.align:
            # A truncated file: through the page cache, so no direct read has to end past the end.
            f.close()
            f = open_file(path, create=False, direct=False)
        try:
            scan_ranges(engine, f, pool, segments, tracker)
        except OSError as e:  # CorruptCheckpointError too, if the file shrinks while being read
            problems.append(f"data file {path} could not be read ({e}); {_holds(items)}")
            return 0
    finally:
        f.close()
    problems += filter(None, (segment.problem(path) for segment in segments))
    return nbytes


def items_by_file(checkpoint: Checkpoint) -> dict[str, list[_Item]]:
    """Every data file the checkpoint lists, with the items it stores in it (by its metadata)."""
    by_file: dict[str, list[_Item]] = {name: [] for name in checkpoint.files}
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

    def __init__(self, name: str, size: int, items: list[_Item], whole: bool) -> None:
        self.name, self.size, self.whole = name, size, whole
        self._problems: list[str] = []
        self._segments, _ = _segments(name, size, items, whole, self._problems)
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


def _holds(items: list[_Item]) -> str:
    if not items:
        return "it holds no items"
    names = ", ".join(repr(index.fqn) for index, _ in items[:_NAMES_SHOWN])
    more = f" and {len(items) - _NAMES_SHOWN} more" if len(items) > _NAMES_SHOWN else ""
    return f"it holds {len(items)} item(s): {names}{more}"


def scan_ranges(
    engine: Engine,
    f: DataFile,
    pool: BufferPool,
    segments: Sequence[FedRange],
    progress: Progress,
    end: int | None = None,
) -> None:
    """Read the bytes the segments cover (in file order) through the read pipeline's window, feeding each.

    ``end``: where the file ends, for a file whose end is not on the alignment (else every read is whole).
    """

    def retire(extent: Extent, buffer: memoryview | None) -> None:
        assert buffer is not None  # segments have no memory of their own: every extent is staged
        for segment, at, buf_offset, length in extent.parts:
            segment.feed(buffer[buf_offset : buf_offset + length], segment.start + at)

    pieces = (Piece(s.start, s.stop - s.start, s, 0, None) for s in segments)
    window = Window(engine, pool, retire, pool.count, progress)
    try:
        for extent in plan_extents(pieces, f.align, pool.size, pool.size, 0.0):
            buffer = window.stage(extent.length)
            window.push(engine.read(f, buffer, extent.file_offset, end), extent, buffer)
        window.finish()
    except BaseException:
        window.abort()
        raise


def _verify_stock(checkpoint: Checkpoint) -> VerifyReport:
    """A torch FileSystemWriter checkpoint: its files are there and long enough (it stores no checksums)."""
    directory, metadata = checkpoint.path, checkpoint.metadata
    problems = _nesting(metadata)
    by_file: dict[str, list[tuple[MetadataIndex, int]]] = defaultdict(list)
    for index, info in metadata.storage_data.items():
        by_file[info.relative_path].append((index, info.offset + info.length))
    for name, items in by_file.items():
        file = os.path.join(directory, name)
        try:
            size = os.stat(file).st_size
        except FileNotFoundError:
            shown = ", ".join(repr(index.fqn) for index, _ in items[:_NAMES_SHOWN])
            problems.append(f"data file {file} is missing; it holds {len(items)} item(s): {shown}")
            continue
        for index, stop in items:
            if stop > size:
                problems.append(f"{index.fqn!r} in {name}: the file ends at byte {size}, before the item's end {stop}")
    return VerifyReport(directory, not problems, problems, len(metadata.storage_data), 0, len(by_file), checksums=False)
