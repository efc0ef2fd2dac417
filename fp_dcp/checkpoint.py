"""Opening a checkpoint directory: once, for every tool that reads one.

``open_checkpoint`` reads ``.metadata`` once, tells an fp-dcp checkpoint
from a torch ``FileSystemWriter`` one (the stock ``.metadata`` is unpickled
once, here), checks fp-dcp's checksums and footer (``fp_dcp.format``) and
the metadata of either kind (``fp_dcp.structure``: every tensor's chunks
tile it, every item is where the footer allows), and says where every data
file is now. The reader, ``verify``, ``convert``, ``inspect`` and the commit
protocol all start here, so a load that would be partial or wrong fails
before it reads anything.

Where the data files are: without ``data_dirs`` at save time, beside
``.metadata``. With them, file ``name`` with footer entry ``dir = i`` is
``data_dirs[i]/<data_subdir>/<name>``. A checkpoint may have moved since
(copied with its data directories, or to another mount), so the directories
are tried in this order:

1. the ``data_dirs`` the caller gives, if any (the new locations, in the
   order of the save's list): only these;
2. otherwise, the save-time data directory placed relative to the checkpoint
   as it was at save time (``storage_meta.checkpoint_id``), applied to the
   checkpoint's path now: a tree copied or mounted elsewhere as a whole;
3. the save-time data directory itself;
4. for a data directory recorded as a relative path (fp-dcp records them
   absolute; older versions recorded them as given, relative to the saving
   process's working directory, which is not recorded): that path under the
   checkpoint directory and under each directory above it, now and at save
   time, nearest first, since that working directory was most likely one of
   them;
5. the checkpoint directory (data files gathered beside ``.metadata``), and
   its ``<data_subdir>`` subdirectory.

The first that holds the file wins; if none does, the first path of rules 2
and 3 is given, and reading it reports the missing file with the items it
holds. For a relative data directory, the path given is the file in the
first directory of rules 3 and 4 whose ``<data_subdir>`` exists; if none
does, ``DataDirectoryNotFoundError`` is raised instead: the data directory
was not found, which says nothing of whether its files are intact.

A file an incremental save referenced (its footer entry has an ``owner``)
is looked for by the same rules, with the owner's directory (the entry's
``owner``, relative to this checkpoint's directory) in place of this one and
the entry's own ``data_subdir``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any, BinaryIO, Literal

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from ._native import _cio
from .compat import is_item_location, item_fields
from .errors import (
    CheckpointError,
    CorruptCheckpointError,
    DataDirectoryNotFoundError,
    IncompatibleCheckpointError,
    NotACheckpointError,
)
from .format import (
    TRAILER_SIZE,
    ItemLocation,
    decode_footer,
    decode_metadata,
    footer_span,
    is_file_name,
    is_fp_metadata,
    unpickle_metadata,
)
from .io.files import NotRegularFileError, open_regular
from .names import METADATA_NAME, NODE_MARKER
from .safetensors_format import INDEX_NAME, SUFFIX
from .structure import check_structure

__all__ = [
    "Kind",
    "Checkpoint",
    "open_checkpoint",
    "read_metadata_bytes",
    "published_files",
    "referenced_files",
    "is_safetensors_directory",
    "node_of",
    "saved_at",
    "decode_checked",
]

Kind = Literal["fp", "dcp"]


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A published checkpoint as read from its ``.metadata``.

    Attributes:
        path: the checkpoint directory.
        kind: ``"fp"`` (written by ``FastPersistWriter``) or ``"dcp"`` (torch ``FileSystemWriter``).
        metadata: DCP's ``Metadata``.
        footer: fp-dcp's footer (docs/format.md); None for ``"dcp"``.
        files: data file name -> its path now, for every file the checkpoint references.
        file_sizes: data file name -> its size as written (fp-dcp only; empty for ``"dcp"``).
        metadata_crc: CRC-32C of the ``.metadata`` bytes read (a later save changes it).
        owners: data file name -> the directory of the checkpoint that wrote it, for each
            file an incremental save referenced in an earlier checkpoint (empty otherwise;
            the directory is ``path`` itself for a save over its own base).
    """

    path: str
    kind: Kind
    metadata: Metadata
    footer: dict[str, Any] | None
    files: dict[str, str]
    file_sizes: dict[str, int]
    metadata_crc: int
    owners: dict[str, str] = dataclasses.field(default_factory=dict)

    def own_files(self) -> dict[str, str]:
        """``files`` less those of other checkpoints: what removing this checkpoint may delete."""
        here = os.path.normpath(self.path)
        return {name: path for name, path in self.files.items() if self.owners.get(name, here) == here}

    def referenced_checkpoints(self) -> set[str]:
        """The directories of the other checkpoints whose files this one uses."""
        return set(self.owners.values()) - {os.path.normpath(self.path)}


def read_metadata_bytes(directory: str) -> tuple[str, bytes]:
    """The path and bytes of a checkpoint directory's ``.metadata``; NotACheckpointError if there is none."""
    if not os.path.isdir(directory):
        raise NotACheckpointError(f"{directory} is not a directory, so not a checkpoint")
    with _open_metadata(directory) as f:
        return os.path.join(directory, METADATA_NAME), f.read()


def _open_metadata(directory: str) -> BinaryIO:
    """``directory``'s ``.metadata``, open for reading; NotACheckpointError unless it is a regular file."""
    try:
        return open_regular(os.path.join(directory, METADATA_NAME))
    except FileNotFoundError:
        raise NotACheckpointError(
            f"{directory} holds no checkpoint: {METADATA_NAME} is missing (wrong path, or a save that never completed)"
        ) from None
    except NotRegularFileError as e:
        raise NotACheckpointError(f"{directory} holds no checkpoint: its {METADATA_NAME} is {e.strerror}") from None


def _stock_metadata(data: bytes) -> Metadata | None:
    """The ``Metadata`` in torch FileSystemWriter ``.metadata`` bytes, else None.

    The bytes are one pickle, nothing after it (torch writes nothing more).
    Its entries have a ``relative_path``, and none is an fp-dcp location (fp-dcp
    metadata whose trailer is damaged must not pass for a stock checkpoint).
    """
    try:
        metadata = unpickle_metadata(data, METADATA_NAME)
    except CheckpointError:  # whatever fails to unpickle, a missing class too: not a stock checkpoint's metadata
        return None
    if not isinstance(metadata, Metadata) or type(metadata.storage_data) is not dict:  # None: its __dict__ lacks it
        return None
    entries = metadata.storage_data.values()
    if all(hasattr(v, "relative_path") and not is_item_location(v) for v in entries):
        return metadata
    return None


def open_checkpoint(
    path: str | os.PathLike[str], data_dirs: Sequence[str | os.PathLike[str]] | None = None
) -> Checkpoint:
    """Read and check the checkpoint at ``path``; ``data_dirs``: where its data directories are now, if moved.

    Raises:
        NotACheckpointError: no ``.metadata`` there.
        CorruptCheckpointError: ``.metadata`` fails its checksums, or is neither fp-dcp's nor torch's.
        IncompatibleCheckpointError: a newer fp-dcp format version, or the other byte order.
    """
    directory = os.fspath(path)
    where, data = read_metadata_bytes(directory)
    crc = _cio.crc32c(data)
    if not is_fp_metadata(data):
        stock = _stock_metadata(data)
        if stock is None:
            raise CorruptCheckpointError(f"{where}: not fp-dcp metadata (trailer missing or damaged)")
        check_structure(stock, where)
        names = {info.relative_path for info in stock.storage_data.values()}
        files = {name: os.path.join(directory, name) for name in names}
        return Checkpoint(directory, "dcp", stock, None, files, {}, crc)
    metadata, footer = decode_checked(data, where)
    owners = _owners(directory, footer)
    files = _locate(directory, footer, saved_at(metadata, where), data_dirs, owners)
    sizes = {name: entry["size"] for name, entry in footer["files"].items()}
    return Checkpoint(directory, "fp", metadata, footer, files, sizes, crc, owners)


def _owners(directory: str, footer: dict[str, Any]) -> dict[str, str]:
    """File name -> directory of the checkpoint whose save wrote it, for the files an earlier save wrote.

    That directory is ``directory`` itself (owner ``"."``) after a save over its own base.
    """
    entries = footer["files"].items()
    return {
        name: os.path.normpath(os.path.join(directory, entry["owner"])) for name, entry in entries if "owner" in entry
    }


def referenced_files(directory: str) -> dict[str, str]:
    """``Checkpoint.owners`` of the checkpoint in ``directory``, from the footer at the end of its ``.metadata``.

    Cheap whatever the checkpoint's size: the pickle is neither read nor
    checked. {} for a torch ``FileSystemWriter`` checkpoint, which has no
    references (telling one takes unpickling its metadata). Raises
    NotACheckpointError without ``.metadata``, and CorruptCheckpointError
    when it is neither an intact fp-dcp footer nor a stock checkpoint.
    """
    where = os.path.join(directory, METADATA_NAME)
    with _open_metadata(directory) as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(max(0, size - TRAILER_SIZE))
        trailer = f.read()
        if is_fp_metadata(trailer):
            f.seek(max(0, size - footer_span(trailer)))
            return _owners(directory, decode_footer(f.read(), where))
        f.seek(0)
        if _stock_metadata(f.read()) is not None:
            return {}
    raise CorruptCheckpointError(f"{where}: not fp-dcp metadata (trailer missing or damaged)")


def decode_checked(data: bytes, where: str) -> tuple[Metadata, dict[str, Any]]:
    """(Metadata, footer) of fp-dcp ``.metadata`` bytes, every check opening makes of them done.

    The metadata's locations are ``ItemLocation`` tuples, whatever the format version.
    """
    metadata, footer = decode_metadata(data, where)
    stored = metadata.storage_data
    if type(stored) is dict:  # (check_structure names anything else)
        metadata.storage_data = {index: _location(index, value, where) for index, value in stored.items()}
    check_structure(metadata, where, footer["files"])
    return metadata, footer


def _location(index: Any, value: Any, where: str) -> ItemLocation:
    """The ``ItemLocation`` of an fp-dcp ``storage_data`` value; CorruptCheckpointError naming the item, if none."""
    try:
        return ItemLocation(*item_fields(value))
    except (KeyError, AttributeError, TypeError, ValueError) as e:
        fqn = getattr(index, "fqn", index)
        raise CorruptCheckpointError(
            f"{where}: the location of {fqn!r} is malformed ({type(e).__name__}: {e})"
        ) from None


def saved_at(metadata: Metadata, where: str) -> str:
    """The checkpoint's path as the saving process named it (``storage_meta.checkpoint_id``); "" if None.

    A ``str``, or an ``os.PathLike`` giving one; anything else is damage.
    """
    meta = metadata.storage_meta
    if meta is None:
        return ""
    if not isinstance(meta, StorageMeta):
        raise CorruptCheckpointError(f"{where}: storage_meta is {type(meta).__name__}, not a StorageMeta")
    checkpoint_id = meta.checkpoint_id
    path = os.fspath(checkpoint_id) if isinstance(checkpoint_id, (str, os.PathLike)) else None
    if checkpoint_id is not None and not isinstance(path, str):
        raise CorruptCheckpointError(f"{where}: storage_meta.checkpoint_id is {checkpoint_id!r}, not a path")
    return path or ""


def _locate(
    directory: str,
    footer: dict[str, Any],
    saved_at: str,
    data_dirs: Sequence[str | os.PathLike[str]] | None,
    owners: dict[str, str],
) -> dict[str, str]:
    given = [os.fspath(d) for d in data_dirs] if data_dirs else []
    recorded: list[str] = footer.get("data_dirs", [])
    paths = {}
    for name, entry in footer["files"].items():
        index = entry["dir"]
        home = owners.get(name, directory)  # the directory of the checkpoint that wrote the file
        subdir = (entry.get("data_subdir") if name in owners else footer.get("data_subdir")) or ""
        if index is None:
            paths[name] = os.path.join(home, name)
        elif given:
            paths[name] = _given(directory, given, index, subdir, name, recorded)
        else:
            paths[name] = _found(directory, home, recorded, index, saved_at, subdir, name)
    return paths


def _found(directory: str, home: str, recorded: list[str], index: int, saved_at: str, subdir: str, name: str) -> str:
    """Where data file ``name`` of ``recorded[index]`` is now, by rules 2 to 5 of the module doc."""
    data_dir = recorded[index]
    relative = not os.path.isabs(data_dir)
    roots = []  # where the data directory may be now, most likely first
    if os.path.isabs(saved_at) and not relative:
        roots.append(os.path.normpath(os.path.join(directory, os.path.relpath(data_dir, saved_at))))
    roots.append(data_dir)
    if relative:
        roots += [os.path.join(above, data_dir) for above in _directories_above(directory, saved_at)]
    in_roots = [os.path.join(root, subdir, name) for root in roots]
    candidates = [*in_roots, os.path.join(home, name), os.path.join(home, subdir, name)]
    found = next((c for c in candidates if os.path.exists(c)), None)
    if found is not None:
        return found
    if not relative:
        return in_roots[0]  # reading it reports the file missing, with the items it holds
    present = next((path for path in in_roots if os.path.isdir(os.path.dirname(path))), None)
    if present is not None:
        return present  # the data directory is there, the file is not: reading it reports it missing
    raise DataDirectoryNotFoundError(
        f"cannot find data file {name} of {directory}: its data directory (data_dirs[{index}]) was recorded "
        f"as relative path {data_dir!r}, relative to the working directory of the save, which the checkpoint "
        f"does not record, and {os.path.join(data_dir, subdir)} is not under the checkpoint or a directory "
        "above it; pass data_dirs= to the reader (--data-dir to fp-dcp) with where it is"
    )


def _directories_above(directory: str, saved_at: str) -> list[str]:
    """The checkpoint directory and every directory above it, now and (if recorded absolute) at save time."""
    starts = [os.path.abspath(directory)] + ([os.path.normpath(saved_at)] if os.path.isabs(saved_at) else [])
    chain: dict[str, None] = {}  # ordered, without repeats
    for path in starts:
        while path not in chain:
            chain[path] = None
            path = os.path.dirname(path)
    return list(chain)


def _given(directory: str, given: list[str], index: int, subdir: str, name: str, recorded: list[str]) -> str:
    if index >= len(given):
        raise NotACheckpointError(
            f"the data files of {directory} were written to data_dirs {recorded} "
            f"(file {name} in entry {index}); pass that many directories as data_dirs= to the reader, "
            f"in the same order (got {given})"
        )
    if not os.path.isdir(given[index]):
        raise CorruptCheckpointError(f"data directory {given[index]} (data_dirs[{index}]) is missing; it holds {name}")
    return os.path.join(given[index], subdir, name)


def is_safetensors_directory(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a directory of Hugging Face safetensors files (index or not) and no DCP checkpoint.

    ``fp_dcp.load.safetensors`` opens one.
    """
    directory = os.fspath(path)
    if not os.path.isdir(directory) or os.path.exists(os.path.join(directory, METADATA_NAME)):
        return False
    return any(name.endswith(SUFFIX) or name == INDEX_NAME for name in os.listdir(directory))


def node_of(directory: str) -> str | None:
    """The node whose copy of a tiered step ``directory`` is (its ``.node``, UTF-8), else None.

    Such a copy may hold only that node's data files: missing ones are on
    other nodes' roots or the durable root, and the copy is partial, not damaged.
    """
    try:
        with open_regular(os.path.join(directory, NODE_MARKER)) as f:
            return f.read().decode("utf-8", errors="replace").strip()
    except (FileNotFoundError, NotADirectoryError, NotRegularFileError):  # only a regular file marks a copy (runs.md)
        return None


def published_files(directory: str) -> set[str]:
    """Names of the data files the checkpoint now published in ``directory`` lists; empty if none is readable.

    The commit protocol removes these once a new checkpoint replaces it; a
    damaged ``.metadata`` lists nothing, so nothing is removed on its word,
    and neither is a stock item's path that leads out of ``directory``.
    """
    try:
        _, data = read_metadata_bytes(directory)
    except NotACheckpointError:
        return set()
    if not is_fp_metadata(data):
        stock = _stock_metadata(data)
        if stock is None:
            return set()
        names = {info.relative_path for info in stock.storage_data.values()}  # (_stock_metadata checked they have one)
        return {name for name in names if isinstance(name, str) and is_file_name(name)}
    try:
        _, footer = decode_metadata(data, directory)
    except (CorruptCheckpointError, IncompatibleCheckpointError):
        return set()
    return set(footer["files"])
