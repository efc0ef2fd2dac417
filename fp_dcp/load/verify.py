"""Check a whole checkpoint without loading it: ``verify_checkpoint``.

A load checks what it reads; this checks everything, once, front to back
(docs/format.md's table of checks lists each, docs/reading.md who makes it):

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

from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex

from ..checkpoint import Checkpoint, is_safetensors_directory, node_of, open_checkpoint
from ..errors import CorruptCheckpointError
from ..format import describe_item
from ..io.context import IOContext
from ..io.files import NotRegularFileError, open_file
from ..io.progress import Progress, ProgressCallback
from ..names import METADATA_NAME
from ..structure import nesting_fault
from ..units import PAGE, align_up
from .catalog import FastPersistCatalog
from .report import VerifyReport
from .safetensors_verify import verify_safetensors
from .stream_check import Item, items_by_file, scan_ranges, scan_resources, segments_of

__all__ = ["VerifyReport", "verify_checkpoint"]

_NAMES_SHOWN = 5  # items named in a problem about a whole file


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
        ctx = io.context()
        for name, items in present.items():
            size = catalog.file_sizes[name]
            before = tracker.done
            whole = name not in checkpoint.owners
            nbytes, found = _verify_file(catalog.paths[name], size, items, whole, ctx, tracker)
            checked += nbytes
            problems += found
            tracker.advance(size - (tracker.done - before))  # bytes a short or missing file could not give
    finally:
        io.close()
    tracker.finish()
    stored = len(catalog.locations)
    return VerifyReport(directory, not problems, problems, stored, checked, len(catalog.paths), partial=partial)


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


def _file_problems(checkpoint: Checkpoint, by_file: dict[str, list[Item]]) -> list[str]:
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


def _verify_file(
    path: str, expected: int, items: list[Item], whole: bool, io: IOContext, tracker: Progress
) -> tuple[int, list[str]]:
    """Check one data file (``whole``: its padding too); returns the item bytes checked and the problems found."""
    name = os.path.basename(path)
    problems: list[str] = []
    try:
        f = open_file(path, create=False, direct=None)
    except FileNotFoundError:
        problems.append(f"data file {path} is missing; {_holds(items)}")
        return 0, problems
    except NotRegularFileError as e:
        problems.append(f"data file {path} is {e.strerror}, not a regular file; {_holds(items)}")
        return 0, problems
    except OSError as e:
        problems.append(f"data file {path} cannot be opened ({e.strerror}); {_holds(items)}")
        return 0, problems
    try:
        status = os.fstat(f.fd)
        if not stat.S_ISREG(status.st_mode):  # a directory where the rules find the file
            problems.append(f"data file {path} is not a regular file; {_holds(items)}")
            return 0, problems
        size = status.st_size
        if size < expected:
            problems.append(f"data file {path} is truncated: {size} bytes, written as {expected}")
        elif size > expected:
            problems.append(f"data file {path} is {size} bytes, written as {expected}: something appended to it")
        segments, nbytes = segments_of(name, min(size, expected), items, whole, problems)
        if f.direct and min(size, expected) % f.align:
            # A truncated file: through the page cache, so no direct read has to end past the end.
            f.close()
            f = open_file(path, create=False, direct=False)
        try:
            scan_ranges(io, f, segments, tracker)
        except OSError as e:  # CorruptCheckpointError too, if the file shrinks while being read
            problems.append(f"data file {path} could not be read ({e}); {_holds(items)}")
            return 0, problems
    finally:
        f.close()
    problems += filter(None, (segment.problem(path) for segment in segments))
    return nbytes, problems


def _holds(items: list[Item]) -> str:
    if not items:
        return "it holds no items"
    names = ", ".join(repr(index.fqn) for index, _ in items[:_NAMES_SHOWN])
    more = f" and {len(items) - _NAMES_SHOWN} more" if len(items) > _NAMES_SHOWN else ""
    return f"it holds {len(items)} item(s): {names}{more}"


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
