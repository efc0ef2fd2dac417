"""Retention: which steps of a run's root stay, and removing the others so that a crash never loses a step.

A step is removed only after a newer one is published: ``step-N`` is
renamed to ``.deleting-step-N`` (one atomic step, after which nothing treats
it as a checkpoint), the rename made durable, then the files removed. A
``.deleting-*`` directory found later (a removal cut short) is finished by
``finish_deletions``. Directories of saves that died (no ``.metadata``)
older than the newest published step are removed the same way. A step
kept as the *spare* (``fp_dcp.save.spare``) is renamed to ``.spare``
instead, and what the next save did not take of it is removed at the next
pruning (or by ``finish_deletions``).

Which files are in use is counted afresh, at every pruning, from the
``.metadata`` of the steps that stay (never from memory). A step retention
lets go whose files are in use is *retired* instead of removed: a
``.retired`` file listing its own data files is made durable, then its
``.metadata`` is removed (from then on it is not a checkpoint and never
restored), and its files that no kept step uses are removed; the rest go
once the last step using them does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
from collections.abc import Callable, Iterable

from ..checkpoint import open_checkpoint, referenced_files
from ..errors import CheckpointError
from ..io.files import fsync_directory, write_durably
from ..log import log
from ..names import DELETING_PREFIX, METADATA_NAME, RETIRED_NAME, SPARE_NAME
from ..save.commit import SaveLock
from .steps import own_files, step_directories, step_directory, step_state

__all__ = ["Retention", "clean_unfinished", "finish_deletions", "remove_spare", "unfinished", "user_of"]


@dataclasses.dataclass(frozen=True)
class Retention:
    """Which published steps stay: the newest ``keep_last``, multiples of ``keep_every``, and those ``keep`` picks."""

    keep_last: int = 3
    keep_every: int | None = None
    keep: Callable[[int], bool] | None = None

    def prune(self, root: str, busy: Iterable[int] = (), spare: bool = False) -> None:
        """Remove (or retire) the steps of ``root`` retention lets go, but none in ``busy`` (still being copied).

        The spare left by the pruning before goes first. With ``spare``, the
        first step removed whole becomes the new one (``fp_dcp.save.spare``):
        renamed at once, its files removed at the next pruning.
        """
        busy = set(busy)
        remove_spare(root)
        # Published, retired or neither is all retention needs to decide: no metadata is read for it.
        steps = [(step, path, step_state(path)) for step, path in step_directories(root)]
        published = [step for step, _, state in steps if state == "published"]
        if not published:
            return
        newest, kept = published[-1], set(published[-self.keep_last :])

        def wanted(step: int) -> bool:
            return (
                step >= newest
                or step in kept
                or step in busy
                or (self.keep_every is not None and step % self.keep_every == 0)
                or (self.keep is not None and self.keep(step))
            )

        used = _files_in_use(root, (path for step, path, state in steps if state == "published" and wanted(step)))
        for step, path, state in steps:
            if (state == "published" and wanted(step)) or (state == "dead" and (step >= newest or step in busy)):
                continue
            if state == "dead":
                _delete(root, path)
            elif used is None:
                continue  # a staying step's references are unreadable: remove nothing they might need
            elif state == "published" and os.path.abspath(path) not in used:
                _delete(root, path, spare)
                spare = False
            else:
                _retire(root, path, used.get(os.path.abspath(path), set()))


def user_of(root: str, step: int) -> str | None:
    """A step that references files of ``step``'s directory, if there is one (its name)."""
    path = step_directory(root, step)
    state = step_state(path) if os.path.isdir(path) else "dead"
    if state == "dead":
        return None
    for other, other_path in step_directories(root):
        if other <= step or step_state(other_path) != "published":
            continue
        try:
            owners = referenced_files(other_path)
        except (CheckpointError, OSError):
            continue  # a step whose metadata is unreadable is not restorable: nothing to protect
        if os.path.abspath(path) in map(os.path.abspath, owners.values()):
            return os.path.basename(other_path)
    return "a newer step" if state == "retired" else None  # retired: kept because something references it


def _files_in_use(root: str, paths: Iterable[str]) -> dict[str, set[str]] | None:
    """The files the given steps reference in other steps: {that step's absolute path: names}.

    Read from each step's metadata footer, whether or not this manager is
    incremental (an earlier run's may have been). None if a footer cannot
    be read: the references are then unknown.
    """
    used: dict[str, set[str]] = {}
    for path in paths:
        try:
            owners = referenced_files(path)
        except (CheckpointError, OSError) as e:
            log.warning("fp-dcp: not pruning %s: the references of %s cannot be read (%s)", root, path, e)
            return None
        for name, owner in owners.items():
            used.setdefault(os.path.abspath(owner), set()).add(name)
    return used


def _retire(root: str, path: str, used: set[str]) -> None:
    """Make ``path`` a non-checkpoint kept for the files in ``used``; remove its other data files.

    A step no staying step uses is removed whole.
    """
    marker = os.path.join(path, RETIRED_NAME)
    if not os.path.exists(marker):
        try:
            own = open_checkpoint(path).own_files().values()
        except (CheckpointError, OSError) as e:  # damaged: not restorable, but its files cannot be told apart
            log.warning("fp-dcp: cannot retire %s (its metadata cannot be read), leaving it: %s", path, e)
            return
        write_durably(marker, json.dumps({"files": [os.path.relpath(file, path) for file in own]}), marker + ".tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(path, METADATA_NAME))
        fsync_directory(path)
    if not used:
        _delete(root, path)
        return
    for file in own_files(path):
        if os.path.basename(file) not in used:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(file)


def _delete(root: str, path: str, spare: bool = False) -> None:
    """Rename, make the rename durable, then remove: a step is gone at once, its bytes after (a ``spare``'s
    at the next pruning)."""
    trash = os.path.join(root, SPARE_NAME if spare else DELETING_PREFIX + os.path.basename(path))
    os.replace(path, trash)
    fsync_directory(root)
    if not spare:
        _remove(root, trash)


def remove_spare(root: str) -> None:
    """Remove what is left of ``root``'s spare step, if it has one."""
    spare = os.path.join(root, SPARE_NAME)
    if os.path.isdir(spare):
        _remove(root, spare)


def finish_deletions(root: str) -> None:
    """Finish what removals and retirements cut short by a crash left in ``root``."""
    for name in unfinished(root):
        _remove(root, os.path.join(root, name))
    for name in os.listdir(root):
        if os.path.exists(os.path.join(root, name, RETIRED_NAME)):
            with contextlib.suppress(FileNotFoundError):  # a retirement cut short before its .metadata went
                os.unlink(os.path.join(root, name, METADATA_NAME))
                fsync_directory(os.path.join(root, name))


def unfinished(root: str | os.PathLike[str]) -> list[str]:
    """The entries of a run's root that a pruning left: ``.spare`` (for the next save) and ``.deleting-*`` (a
    removal cut short). Neither is a checkpoint; the manager removes both when it opens the root."""
    return sorted(n for n in os.listdir(root) if n == SPARE_NAME or n.startswith(DELETING_PREFIX))


def clean_unfinished(root: str | os.PathLike[str]) -> list[str]:
    """Remove what ``unfinished`` names (and finish retirements cut short), under the root's lock, as a manager
    opening the root does; returns the names removed. Raises ``CheckpointBusyError`` while a manager has the
    root open (its next save may be taking the spare's files)."""
    root = os.fspath(root)
    lock = SaveLock(root)
    try:
        names = unfinished(root)
        finish_deletions(root)
        return names
    finally:
        lock.release()


def _remove(root: str, trash: str) -> None:
    # Its data files may live in data_dirs: find them (its own only) before the directory goes.
    for file in own_files(trash):
        with contextlib.suppress(FileNotFoundError):  # a spare's file a save took
            os.unlink(file)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(file))  # the checkpoint's subdirectory of a data dir, once empty
    shutil.rmtree(trash, ignore_errors=True)
    fsync_directory(root)
