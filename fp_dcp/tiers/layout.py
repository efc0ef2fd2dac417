"""A step's files as the tiers name them: ``step-N/<file>``, the same under every root.

Every tier (a node's local root, a peer's replicas, the durable root) keeps
a run's layout: ``step-N/`` holds the data files step N's save wrote and its
``.metadata``. A file an incremental step references stays in the directory
of the step that wrote it (``step-K/<file>``), so one key names a file in
every tier, and the references inside ``.metadata`` resolve in each.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import secrets
from typing import Any

from ..checkpoint import Checkpoint, open_checkpoint
from ..errors import CorruptCheckpointError
from ..format import decode_footer, parse_data_file_name
from ..io.files import NotRegularFileError, open_regular, write_durably
from ..load.stream_check import StreamCheck, items_by_file
from ..names import METADATA_NAME, NODE_MARKER, RETIRED_NAME, parse_step_name
from ..save import commit

__all__ = [
    "StepLayout",
    "publish_metadata",
    "files_in_metadata",
    "owner_step",
    "mark_referenced",
    "mark_node",
    "list_tier",
]


def list_tier(root: str) -> dict[str, dict[str, int]]:
    """{step directory: {file: size}} under a tier's root on a filesystem: data files and ``.metadata``.

    Temporary and marker files (dot files) are left out, and so is the
    ``.metadata`` of a retired step (a retirement cut short): it does not
    make the step a checkpoint.
    """
    found: dict[str, dict[str, int]] = {}
    for step in os.listdir(root) if os.path.isdir(root) else []:
        directory = os.path.join(root, step)
        if parse_step_name(step) is None or not os.path.isdir(directory):
            continue
        found[step] = {}
        names = os.listdir(directory)
        for name in names:
            if not name.startswith(".") or (name == METADATA_NAME and RETIRED_NAME not in names):
                with contextlib.suppress(FileNotFoundError):  # removed meanwhile: not there
                    found[step][name] = os.stat(os.path.join(directory, name)).st_size
    return found


def files_in_metadata(step: str, data: bytes) -> dict[str, int]:
    """{key: size} of every data file the ``.metadata`` bytes of step directory ``step`` list (the footer alone).

    CorruptCheckpointError if the footer is damaged, or an owner is no step of the root (``owner_step``).
    """
    where = f"{step}/{METADATA_NAME}"
    footer = decode_footer(data, where)
    files = {}
    for name, entry in footer["files"].items():
        files[f"{owner_step(step, entry.get('owner', '.'), where)}/{name}"] = int(entry["size"])
    return files


def owner_step(step: str, owner: str, where: str) -> str:
    """The step directory, in the tier root of step directory ``step``, of a file whose entry gives ``owner``.

    A key names a file under a tier root, so the owner must be a step of the
    same root: ``normpath(join(step, owner))`` a step name (``.``,
    ``../step-K``). Any other is no tier's: CorruptCheckpointError.
    """
    found = os.path.normpath(os.path.join(step, owner))
    if parse_step_name(found) is None:
        raise CorruptCheckpointError(
            f"{where}: a file's owner {owner!r} is not a step of the same root ('../step-K'): no tier holds it"
        )
    return found


@dataclasses.dataclass(frozen=True)
class StepLayout:
    """The files one published step needs, by key, opened from a copy of its ``.metadata``."""

    checkpoint: Checkpoint

    @classmethod
    def open(cls, directory: str) -> StepLayout:
        """The layout of the step in ``directory``; CorruptCheckpointError if an owner is no step of its root."""
        checkpoint = open_checkpoint(directory)
        step = os.path.basename(os.path.normpath(directory))
        for name, entry in (checkpoint.footer or {}).get("files", {}).items():
            if "owner" in entry:
                owner_step(step, entry["owner"], f"{directory}: {METADATA_NAME}'s entry for {name}")
        return cls(checkpoint)

    def key(self, name: str) -> str:
        owner = self.checkpoint.owners.get(name, self.checkpoint.path)
        return f"{os.path.basename(os.path.normpath(owner))}/{name}"

    def files(self) -> dict[str, int]:
        """{key: size} of every data file the step loads from, its own and those it references."""
        return {self.key(name): size for name, size in self.checkpoint.file_sizes.items()}

    def own(self) -> list[str]:
        """The keys of the files this step's save wrote."""
        return [self.key(name) for name in self.checkpoint.own_files()]

    def writer(self, key: str) -> int | None:
        """The rank that wrote the file (from its name)."""
        parsed = parse_data_file_name(os.path.basename(key))
        return parsed[0] if parsed else None

    @functools.cached_property
    def _items(self) -> dict[str, list[Any]]:
        return items_by_file(self.checkpoint)

    def check(self, key: str) -> StreamCheck:
        """A fresh check of the file's bytes against this step's checksums."""
        name = os.path.basename(key)
        items = self._items.get(name, [])
        whole = name not in self.checkpoint.owners
        return StreamCheck(name, self.checkpoint.file_sizes[name], items, whole)


def mark_referenced(directory: str, name: str) -> None:
    """Record that ``directory`` (an earlier step without its own ``.metadata`` here) keeps file ``name``.

    Such a directory is a retired step (``.retired`` lists the files it
    keeps): never a checkpoint itself, kept while newer steps reference it.
    """
    if os.path.exists(os.path.join(directory, METADATA_NAME)):
        return  # a published step: its own metadata lists its files
    os.makedirs(directory, exist_ok=True)
    marker = os.path.join(directory, RETIRED_NAME)
    listed: set[str] = set()
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        with open_regular(marker) as f:
            listed = set(json.load(f)["files"])
    if name not in listed:
        write_durably(marker, json.dumps({"files": sorted(listed | {name})}))


def mark_node(directory: str, node: str) -> None:
    """Record that ``directory`` is ``node``'s copy of a step (``fp-dcp ls`` then calls missing files partial)."""
    marker = os.path.join(directory, NODE_MARKER)
    if not _holds(marker, node.encode()):
        write_durably(marker, node)


def publish_metadata(directory: str, data: bytes) -> None:
    """Make ``data`` the ``.metadata`` of ``directory`` (a copy from another node or tier), atomically.

    Nothing is written when an identical copy is already there.
    """
    if not _holds(os.path.join(directory, METADATA_NAME), data):
        os.makedirs(directory, exist_ok=True)
        commit.publish(directory, data, secrets.token_hex(8))


def _holds(path: str, data: bytes) -> bool:
    try:
        with open_regular(path) as f:
            return f.read() == data
    except (FileNotFoundError, NotRegularFileError):  # what is there gets replaced by a file
        return False
