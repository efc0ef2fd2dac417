"""``CheckpointManager``: the checkpoints of a whole training run, kept, pruned and resumed from.

A run's root holds one directory per saved step, ``step-{N}``; each is an
fp-dcp checkpoint and exists as a step only once its ``.metadata`` is
published (fp-dcp's commit protocol). Nothing else records which steps
exist: the manager derives everything from the directory listing, so there
is no pointer file to get out of step with the data. ::

    mgr = CheckpointManager("/nvme/run42", keep_last=3, keep_every=1000, every_n_steps=100)
    step = mgr.restore(state)          # newest intact step loaded into `state`; None when there is none
    for step in range((step or 0) + 1, steps):
        train_step()
        if mgr.should_save(step):
            mgr.save(step, state)      # returns once `state` may change; the write goes on meanwhile
    mgr.close()                        # waits for the last save, then prunes

Retention removes a step only after a newer one is published, and only on
the coordinating rank: it renames ``step-N`` to ``.deleting-step-N`` (one
atomic step, after which nothing treats it as a checkpoint), makes the rename
durable, then removes the files. A manager that finds a ``.deleting-*``
directory (a removal cut short) finishes it. Directories of saves that died
(no ``.metadata``) older than the newest published step are removed the same
way. Killed at any point, the root still restores to a complete checkpoint.

With ``incremental=True`` each save references the unchanged tensors of the
step before it (``fp_dcp.save.incremental``), so a step may hold files that
newer steps use. Which files are in use is counted afresh, at every pruning,
from the ``.metadata`` of the steps that stay (never from memory). A step
retention lets go whose files are in use is *retired* instead of removed: a
``.retired`` file listing its own data files is made durable, then its
``.metadata`` is removed (from then on it is not a checkpoint and never
restored), and its files that no kept step uses are removed; the rest go
once the last step using them does. A retirement cut short is finished by
the next manager.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable
from typing import Any, Literal, TypeVar

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ..checkpoint import open_checkpoint, referenced_files
from ..config import IOConfig
from ..errors import CheckpointError, CorruptCheckpointError, NotACheckpointError
from ..format import METADATA_NAME
from ..gpu.stager import Mode
from ..io.files import fsync_directory, replace_durably
from ..load.reader import FastPersistReader
from ..load.verify import verify_checkpoint
from ..log import log
from ..save.commit import SaveLock
from ..save.writer import FastPersistWriter
from .overlap import OverlappedCheckpointer

__all__ = ["CheckpointManager", "StepInfo", "list_steps", "step_directory"]

StateDict = dict[str, Any]
T = TypeVar("T")
Status = Literal["complete", "verified", "incomplete", "corrupt", "retired"]

_STEP = re.compile(r"step-(\d+)")
_DELETING = ".deleting-"
RETIRED_NAME = ".retired"  # in a step directory: not a checkpoint any more, kept for files newer steps use


def step_directory(root: str | os.PathLike[str], step: int) -> str:
    return os.path.join(os.fspath(root), f"step-{step}")


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """One ``step-N`` directory of a run's root, as ``list_steps`` found it."""

    step: int
    path: str
    # "complete": published and its metadata checks; "verified": every checksum too; "retired": no longer a
    # checkpoint, its directory kept for data files that newer steps reference
    status: Status
    bytes: int  # the bytes of the data files it loads from (its own and those it references)
    published: float | None  # when its .metadata was published (seconds since the epoch)
    problem: str = ""  # why it is incomplete or corrupt
    written: int = 0  # the bytes of its own data files (what its save wrote)
    references: tuple[str, ...] = ()  # the directories (under the root, by name) of the files it references


def list_steps(root: str | os.PathLike[str], *, verify: bool = False) -> list[StepInfo]:
    """Every ``step-N`` directory under ``root``, oldest first, with what state it is in.

    ``verify`` checks every item's checksum (reads all data) instead of the
    metadata and the data files' presence and sizes.
    """
    return [_inspect(step, path, verify) for step, path in _step_directories(root)]


def _step_directories(root: str | os.PathLike[str]) -> list[tuple[int, str]]:
    """(N, path) of every ``step-N`` directory under ``root``, oldest first."""
    root = os.fspath(root)
    found = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        match = _STEP.fullmatch(name)
        if match and os.path.isdir(os.path.join(root, name)):
            found.append((int(match.group(1)), os.path.join(root, name)))
    return sorted(found)


def _inspect(step: int, path: str, verify: bool) -> StepInfo:
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
    except (CheckpointError, OSError) as e:
        size = _size(path)
        return StepInfo(step, path, "corrupt", size, published, str(e), size)
    sizes = {name: os.path.getsize(file) if os.path.exists(file) else -1 for name, file in checkpoint.files.items()}
    size = sum(max(n, 0) for n in sizes.values())
    written = sum(max(sizes[name], 0) for name in checkpoint.own_files())
    references = tuple(sorted(os.path.basename(owner) for owner in checkpoint.referenced_checkpoints()))
    info = StepInfo(step, path, "complete", size, published, "", written, references)
    for name, n in sizes.items():
        if n < checkpoint.file_sizes.get(name, 0):
            what = "missing" if n < 0 else f"short ({n} of {checkpoint.file_sizes[name]} bytes)"
            problem = f"data file {checkpoint.files[name]} is {what}"
            return dataclasses.replace(info, status="corrupt", problem=problem)
    if verify:
        report = verify_checkpoint(path)
        if not report.ok:
            return dataclasses.replace(info, status="corrupt", problem="; ".join(report.problems[:3]))
        return dataclasses.replace(info, status="verified")
    return info


def _damaged(error: BaseException) -> bool:
    """Whether a failed load failed on the checkpoint's bytes (on every rank that failed)."""
    if isinstance(error, CheckpointException):
        return all(_damaged(failure[0]) for failure in error.failures.values())
    return isinstance(error, (CorruptCheckpointError, NotACheckpointError))


def _state(path: str) -> Literal["published", "retired", "dead"]:
    if os.path.exists(os.path.join(path, RETIRED_NAME)):
        return "retired"  # even while its .metadata is still there: a retirement cut short
    return "published" if os.path.exists(os.path.join(path, METADATA_NAME)) else "dead"


def _own_files(path: str) -> list[str]:
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


def _size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(path) for n in names)


class CheckpointManager:
    """Saves a run's checkpoints, keeps some, and resumes from the newest intact one.

    Args:
        root: the run's directory; created if missing.
        keep_last: how many of the newest published steps to keep (at least 1).
        keep_every: also keep, forever, every step divisible by this (None: none).
        keep: also keep every step for which this returns True.
        every_n_steps: ``should_save(step)`` is True for steps divisible by this.
        every_seconds: ... or when this many seconds have passed since the last save.
            With neither, ``should_save`` is always True.
        asynchronous: ``save`` returns once the state has been copied to host
            memory (the writer's reused page-locked snapshot) and writes on a
            background thread; False writes before returning.
        verify: ``restore`` checks every checksum of a step before loading it
            (reads the whole checkpoint once more); without it a step must have
            intact metadata and all its data files, and the load itself checks
            each item's checksum.
        incremental: each save after the first (in this process, or after
            ``restore``) writes only the tensors that changed since the step
            before it and references the rest (see the module doc). Saves of
            a state that hardly changes (frozen weights) then write little;
            every tensor is still read once per save to hash it.
        mode: how the writer gets tensors to the host for ``asynchronous``
            saves (``FastPersistWriter``'s ``mode``): ``"snapshot"`` (the
            default) copies the state to a reused page-locked host arena and
            ``save`` returns when that copy is done; ``"streaming"`` copies
            nothing up front, and ``save`` returns once the write has read
            every tensor (less host memory, a longer wait).
        data_dirs, config: as for ``FastPersistWriter``.
        process_group: the group DCP's collectives use; with training on gloo
            too, give checkpoints their own (see ``fp_dcp.training.overlap``).

    Every rank of the job makes the same calls; the coordinating rank (rank
    0 of ``process_group``) alone deletes old steps and picks the step that
    ``restore`` loads.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        keep_last: int = 3,
        keep_every: int | None = None,
        keep: Callable[[int], bool] | None = None,
        every_n_steps: int | None = None,
        every_seconds: float | None = None,
        asynchronous: bool = True,
        verify: bool = False,
        incremental: bool = False,
        mode: Mode = "snapshot",
        data_dirs: list[str] | None = None,
        config: IOConfig | None = None,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be at least 1 (the newest step is always kept), got {keep_last}")
        for name, value in (("keep_every", keep_every), ("every_n_steps", every_n_steps)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        self.root = os.fspath(root)
        self.keep_last, self.keep_every, self.keep = keep_last, keep_every, keep
        self.every_n_steps, self.every_seconds = every_n_steps, every_seconds
        self.asynchronous, self.verify, self.incremental = asynchronous, verify, incremental
        self.process_group = process_group
        self.writer = FastPersistWriter(data_dirs=data_dirs, config=config, mode=mode, incremental=incremental)
        self.data_dirs = data_dirs
        self.config = config
        self._overlap = OverlappedCheckpointer(
            self.writer, checkpoint_id=lambda step: step_directory(self.root, step), process_group=process_group
        )
        self._published = 0  # of the overlapped saves started
        self._last_save_time: float | None = None
        self._saving: int | None = None  # the step of the save in flight
        self._last_step: int | None = None  # the newest step saved or restored: the next save's base
        self._lock: SaveLock | None = None
        if self.is_coordinator:
            os.makedirs(self.root, exist_ok=True)
            self._lock = SaveLock(self.root)  # one manager per root: pruning must not race another job's saves
            self._finish_deletions()
        self._barrier()

    # ------------------------------------------------------------------ saving

    def should_save(self, step: int) -> bool:
        """Whether ``step`` is due a checkpoint by ``every_n_steps`` / ``every_seconds``."""
        if self.every_n_steps is None and self.every_seconds is None:
            return True
        if self.every_n_steps is not None and step % self.every_n_steps == 0:
            return True
        last = self._last_save_time
        return self.every_seconds is not None and (last is None or time.monotonic() - last >= self.every_seconds)

    def save(self, step: int, state: StateDict) -> None:
        """Checkpoint ``state`` as ``step``; waits for the previous save first (and raises its error).

        Saving over a step whose files a newer step references (in an
        incremental run) raises ``ValueError``: it would damage that step.
        """
        self.wait()
        user = self._agree(self._user_of(step) if self.is_coordinator else None)
        if user is not None:
            raise ValueError(
                f"step {step} of {self.root} holds data files that {user} references: saving over it would damage "
                f"that step; save under a newer step number"
            )
        self._last_save_time = time.monotonic()
        last = self._last_step
        self.writer.base = step_directory(self.root, last) if self.incremental and last is not None else None
        if not self.asynchronous:
            path = step_directory(self.root, step)
            dcp.save(state, checkpoint_id=path, storage_writer=self.writer, process_group=self.process_group)
            self._last_step = step
            self._prune()
            return
        self._saving = step
        self._overlap.after_update(step, state)
        self._overlap.before_update()  # the state may change now (snapshot: copied; streaming: written)

    def wait(self) -> None:
        """Block until the last save is published, then prune; raises that save's error."""
        if self._overlap.saves > self._published:
            self._published = self._overlap.saves
            self._overlap.wait()
            self._last_step = self._saving
            self._prune()

    def close(self) -> None:
        """Wait for the last save, prune, and release the writer and the root's lock."""
        try:
            self.wait()
        finally:
            self.writer.close()
            if self._lock is not None:
                self._lock.release()
                self._lock = None

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --------------------------------------------------------------- restoring

    def restore(self, state: StateDict) -> int | None:
        """Load the newest intact step into ``state``; its step number, or None when there is none.

        A step that is incomplete, fails its checks (see ``verify``) or fails
        to load is skipped with a warning naming why, and the next older one
        is tried. Loads reshard to the current world size as ``dcp.load`` does.
        """
        tried: set[int] = set()
        while True:
            step = self._agree(self._newest_intact(exclude=tried) if self.is_coordinator else None)
            if step is None:
                return None
            tried.add(step)
            try:
                dcp.load(
                    state,
                    checkpoint_id=step_directory(self.root, step),
                    storage_reader=FastPersistReader(data_dirs=self.data_dirs, config=self.config),
                    process_group=self.process_group,
                )
            except (CheckpointException, CheckpointError) as e:
                if not _damaged(e):
                    raise  # the state asked for something the step does not hold: not for an older step to fix
                log.warning("fp-dcp: step %d of %s did not load, trying an older one: %s", step, self.root, e)
                continue
            self._last_step = step
            return step

    def steps(self, *, verify: bool = False) -> list[StepInfo]:
        """The root's steps, oldest first (``list_steps``)."""
        return list_steps(self.root, verify=verify)

    def _newest_intact(self, exclude: set[int]) -> int | None:
        # Newest first, each step checked only when reached: with verify=True a check reads the whole step.
        for step, path in reversed(_step_directories(self.root)):
            if step in exclude:
                continue
            info = _inspect(step, path, self.verify)
            if info.status in ("complete", "verified"):
                return info.step
            if info.status == "retired":
                continue  # not a checkpoint by design: nothing to warn about
            log.warning("fp-dcp: skipping step %d of %s (%s): %s", info.step, self.root, info.status, info.problem)
        return None

    def _user_of(self, step: int) -> str | None:
        """A step that references files of ``step``'s directory, if there is one (its name)."""
        path = step_directory(self.root, step)
        state = _state(path) if os.path.isdir(path) else "dead"
        if state == "dead":
            return None
        for other, other_path in _step_directories(self.root):
            if other <= step or _state(other_path) != "published":
                continue
            try:
                owners = referenced_files(other_path)
            except (CheckpointError, OSError):
                continue  # a step whose metadata is unreadable is not restorable: nothing to protect
            if os.path.abspath(path) in map(os.path.abspath, owners.values()):
                return os.path.basename(other_path)
        return "a newer step" if state == "retired" else None  # retired: kept because something references it

    # ------------------------------------------------------------- retention

    def _prune(self) -> None:
        """Remove (or retire) the steps retention lets go (coordinator only), after a newer one is published."""
        if not self.is_coordinator:
            return
        # Published, retired or neither is all retention needs to decide: no metadata is read for it.
        steps = [(step, path, _state(path)) for step, path in _step_directories(self.root)]
        published = [step for step, _, state in steps if state == "published"]
        if not published:
            return
        newest, kept = published[-1], set(published[-self.keep_last :])

        def wanted(step: int) -> bool:
            return (
                step >= newest
                or step in kept
                or (self.keep_every is not None and step % self.keep_every == 0)
                or (self.keep is not None and self.keep(step))
            )

        used = self._files_in_use(path for step, path, state in steps if state == "published" and wanted(step))
        for step, path, state in steps:
            if (state == "published" and wanted(step)) or (state == "dead" and step >= newest):
                continue
            if state == "dead":
                self._delete(path)
            elif used is None:
                continue  # a staying step's references are unreadable: remove nothing they might need
            elif state == "published" and os.path.abspath(path) not in used:
                self._delete(path)
            else:
                self._retire(path, used.get(os.path.abspath(path), set()))

    def _files_in_use(self, paths: Iterable[str]) -> dict[str, set[str]] | None:
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
                log.warning("fp-dcp: not pruning %s: the references of %s cannot be read (%s)", self.root, path, e)
                return None
            for name, owner in owners.items():
                used.setdefault(os.path.abspath(owner), set()).add(name)
        return used

    def _retire(self, path: str, used: set[str]) -> None:
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
            listed = json.dumps({"files": [os.path.relpath(file, path) for file in own]})

            def write(tmp: str) -> None:
                with open(tmp, "x") as f:
                    f.write(listed)

            replace_durably(marker, marker + ".tmp", write)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(path, METADATA_NAME))
            fsync_directory(path)
        if not used:
            self._delete(path)
            return
        for file in _own_files(path):
            if os.path.basename(file) not in used:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(file)

    def _delete(self, path: str) -> None:
        """Rename, make the rename durable, then remove: a step is gone at once, its bytes after."""
        trash = os.path.join(self.root, _DELETING + os.path.basename(path))
        os.replace(path, trash)
        fsync_directory(self.root)
        self._remove(trash)

    def _finish_deletions(self) -> None:
        for name in os.listdir(self.root):
            if name.startswith(_DELETING):
                self._remove(os.path.join(self.root, name))
            elif os.path.exists(os.path.join(self.root, name, RETIRED_NAME)):
                with contextlib.suppress(FileNotFoundError):  # a retirement cut short before its .metadata went
                    os.unlink(os.path.join(self.root, name, METADATA_NAME))
                    fsync_directory(os.path.join(self.root, name))

    def _remove(self, trash: str) -> None:
        # Its data files may live in data_dirs: find them (its own only) before the directory goes.
        for file in _own_files(trash):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(file)
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.dirname(file))  # the checkpoint's subdirectory of a data dir
        shutil.rmtree(trash, ignore_errors=True)
        fsync_directory(self.root)

    # ------------------------------------------------------------ collectives

    @property
    def is_coordinator(self) -> bool:
        return not self._distributed() or dist.get_rank(self.process_group) == 0

    def _distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def _barrier(self) -> None:
        if self._distributed():
            dist.barrier(self.process_group)

    def _agree(self, choice: T) -> T:
        """The coordinator's choice, on every rank."""
        if not self._distributed():
            return choice
        box = [choice]
        group = self.process_group
        coordinator = dist.get_global_rank(group, 0) if group is not None else 0
        dist.broadcast_object_list(box, src=coordinator, group=group)
        return box[0]
