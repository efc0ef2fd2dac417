"""A run's step directories, and what state each is in: ``list_steps`` (also ``fp-dcp ls``).

A run's root holds one directory per saved step, ``step-{N}``; each is an
fp-dcp checkpoint once its ``.metadata`` is published. A step directory may
also be *retired* (``.retired``: kept only for data files that newer steps
reference), or the leftover of a save that died (no ``.metadata``). With
checkpoint tiers, each node's directory of a step names the node in
``.node`` and may hold only that node's files (and replicas): ``partial``,
not corrupt; ``.replicated`` and ``.durable`` record that the step's peer
copies and its durable copy were made.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from typing import Literal

from ..checkpoint import node_of, open_checkpoint
from ..errors import CheckpointError, DataDirectoryNotFoundError
from ..format import parse_data_file_name
from ..load.verify import verify_checkpoint
from ..names import DURABLE_NAME, METADATA_NAME, REPLICATED_NAME, RETIRED_NAME, parse_step_name, step_name
from ..save import commit
from ..save.commit import SaveLock

__all__ = [
    "StepInfo",
    "Status",
    "list_steps",
    "step_directory",
    "step_directories",
    "step_state",
    "own_files",
    "inspect_step",
    "inspect_if_present",
    "remove_leftovers",
]

Status = Literal["complete", "verified", "incomplete", "corrupt", "retired", "partial"]


def step_directory(root: str | os.PathLike[str], step: int) -> str:
    return os.path.join(os.fspath(root), step_name(step))


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """One ``step-N`` directory of a run's root, as ``list_steps`` found it."""

    step: int
    path: str
    # "complete": published and its metadata checks; "verified": every checksum too; "retired": no longer a
    # checkpoint, its directory kept for data files that newer steps reference; "partial": one node's copy of
    # a step saved on node-local roots, the other nodes' files elsewhere
    status: Status
    bytes: int  # the bytes of the data files it loads from (its own and those it references)
    published: float | None  # when its .metadata was published (seconds since the epoch)
    problem: str = ""  # why it is incomplete or corrupt
    written: int = 0  # the bytes of its own data files (what its save wrote)
    references: tuple[str, ...] = ()  # the directories (under the root, by name) of the files it references
    # the copies made besides this one: "replicated" (on peer nodes), "durable" (drained)
    copies: tuple[str, ...] = ()
    # data files in its directory that it does not list: a save into it that died, or the files of the checkpoint
    # it replaced whose removal a crash cut short (``remove_leftovers``); no part of the checkpoint
    leftovers: tuple[str, ...] = ()


def list_steps(root: str | os.PathLike[str], *, verify: bool = False) -> list[StepInfo]:
    """Every ``step-N`` directory under ``root``, oldest first, with what state it is in.

    ``verify`` checks every item's checksum (reads all data) instead of the
    metadata and the data files' presence and sizes.
    """
    found = (inspect_if_present(step, path, verify) for step, path in step_directories(root))
    return [info for info in found if info is not None]


def step_directories(root: str | os.PathLike[str]) -> list[tuple[int, str]]:
    """(N, path) of every ``step-N`` directory under ``root``, oldest first."""
    root = os.fspath(root)
    found = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        step = parse_step_name(name)
        if step is not None and os.path.isdir(os.path.join(root, name)):
            found.append((step, os.path.join(root, name)))
    return sorted(found)


def inspect_if_present(step: int, path: str, verify: bool) -> StepInfo | None:
    """``inspect_step``, or None where the step's directory is gone by the end: a pruning removed it meanwhile
    (another rank of the node sharing the root, another process), and what was read of it may be half of it
    (a missing file is then no damage)."""
    try:
        info = inspect_step(step, path, verify)
    except FileNotFoundError:
        if os.path.isdir(path):
            raise
        return None
    return info if os.path.isdir(path) else None


def inspect_step(step: int, path: str, verify: bool) -> StepInfo:
    metadata = os.path.join(path, METADATA_NAME)
    if os.path.exists(os.path.join(path, RETIRED_NAME)):
        size = _size(path)
        return StepInfo(step, path, "retired", size, None, "kept for data files newer steps reference", size)
    if not os.path.exists(metadata):
        size = _size(path)
        return StepInfo(step, path, "incomplete", size, None, "no published .metadata (a save that died)", size)
    published = os.stat(metadata).st_mtime
    try:
        checkpoint = open_checkpoint(path)
    except DataDirectoryNotFoundError:
        raise  # where the files are depends on where the reader stands: not damage, and not for an older step
    except (CheckpointError, OSError) as e:
        size = _size(path)
        return StepInfo(step, path, "corrupt", size, published, str(e), size)
    sizes = {name: os.path.getsize(file) if os.path.exists(file) else -1 for name, file in checkpoint.files.items()}
    size = sum(max(n, 0) for n in sizes.values())
    written = sum(max(sizes[name], 0) for name in checkpoint.own_files())
    references = tuple(sorted(os.path.basename(owner) for owner in checkpoint.referenced_checkpoints()))
    copies = tuple(label for label, marker in _COPIES if os.path.exists(os.path.join(path, marker)))
    leftovers = tuple(sorted(set(_data_files(path)) - set(checkpoint.files)))
    info = StepInfo(step, path, "complete", size, published, "", written, references, copies, leftovers)
    absent = [name for name, n in sizes.items() if n < 0]
    node = node_of(path)
    partial = bool(absent) and node is not None
    for name, n in sizes.items():
        if n < checkpoint.file_sizes.get(name, 0) and not (partial and n < 0):
            what = "missing" if n < 0 else f"short ({n} of {checkpoint.file_sizes[name]} bytes)"
            problem = f"data file {checkpoint.files[name]} is {what}"
            return dataclasses.replace(info, status="corrupt", problem=problem)
    if verify:
        report = verify_checkpoint(path)
        if not report.ok:
            return dataclasses.replace(info, status="corrupt", problem="; ".join(report.problems[:3]))
        info = dataclasses.replace(info, status="verified")
    if partial:
        problem = f"node {node}'s copy: {len(sizes) - len(absent)} of {len(sizes)} data files, the rest on other nodes"
        return dataclasses.replace(info, status="partial", problem=problem)
    return info


_COPIES = (("replicated", REPLICATED_NAME), ("durable", DURABLE_NAME))


def step_state(path: str) -> Literal["published", "retired", "dead"]:
    if os.path.exists(os.path.join(path, RETIRED_NAME)):
        return "retired"  # even while its .metadata is still there: a retirement cut short
    return "published" if os.path.exists(os.path.join(path, METADATA_NAME)) else "dead"


def own_files(path: str) -> list[str]:
    """The data files a step directory's own save wrote, wherever they are; [] if it cannot tell."""
    marker = os.path.join(path, RETIRED_NAME)
    if os.path.exists(marker):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            with open(marker) as f:
                return [os.path.normpath(os.path.join(path, file)) for file in json.load(f)["files"]]
        return []
    with contextlib.suppress(CheckpointError, OSError):
        return list(open_checkpoint(path).own_files().values())
    return []


def remove_leftovers(path: str) -> list[str]:
    """Remove a published step's ``leftovers`` (``StepInfo``), under its save lock; returns their names.

    Raises ``CheckpointBusyError`` while a save into the step runs (its files in progress are not leftovers).
    """
    lock = SaveLock(path)
    try:
        return commit.remove_leftovers(path, set(open_checkpoint(path).files), set())
    finally:
        lock.release()


def _data_files(path: str) -> list[str]:
    return [name for name in os.listdir(path) if parse_data_file_name(name) is not None]


def _size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(path) for n in names)
