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
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import time
from collections.abc import Callable
from typing import Any, Literal

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ..checkpoint import open_checkpoint
from ..config import IOConfig
from ..errors import CheckpointError, CorruptCheckpointError, NotACheckpointError
from ..format import METADATA_NAME
from ..io.files import fsync_directory
from ..load.reader import FastPersistReader
from ..load.verify import verify_checkpoint
from ..log import log
from ..save.commit import SaveLock
from ..save.writer import FastPersistWriter
from .overlap import OverlappedCheckpointer

__all__ = ["CheckpointManager", "StepInfo", "list_steps", "step_directory"]

StateDict = dict[str, Any]
Status = Literal["complete", "verified", "incomplete", "corrupt"]

_STEP = re.compile(r"step-(\d+)")
_DELETING = ".deleting-"


def step_directory(root: str | os.PathLike[str], step: int) -> str:
    return os.path.join(os.fspath(root), f"step-{step}")


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """One ``step-N`` directory of a run's root, as ``list_steps`` found it."""

    step: int
    path: str
    status: Status  # "complete": published and its metadata checks; "verified": every checksum too
    bytes: int  # the data files' bytes
    published: float | None  # when its .metadata was published (seconds since the epoch)
    problem: str = ""  # why it is incomplete or corrupt


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
    if not os.path.exists(metadata):
        return StepInfo(step, path, "incomplete", _size(path), None, "no published .metadata (a save that died)")
    published = os.stat(metadata).st_mtime
    try:
        checkpoint = open_checkpoint(path)
    except (CheckpointError, OSError) as e:
        return StepInfo(step, path, "corrupt", _size(path), published, str(e))
    sizes = {name: os.path.getsize(file) if os.path.exists(file) else -1 for name, file in checkpoint.files.items()}
    size = sum(max(n, 0) for n in sizes.values())
    for name, n in sizes.items():
        if n < checkpoint.file_sizes.get(name, 0):
            what = "missing" if n < 0 else f"short ({n} of {checkpoint.file_sizes[name]} bytes)"
            return StepInfo(step, path, "corrupt", size, published, f"data file {checkpoint.files[name]} is {what}")
    if verify:
        report = verify_checkpoint(path)
        if not report.ok:
            return StepInfo(step, path, "corrupt", size, published, "; ".join(report.problems[:3]))
    return StepInfo(step, path, "verified" if verify else "complete", size, published)


def _damaged(error: BaseException) -> bool:
    """Whether a failed load failed on the checkpoint's bytes (on every rank that failed)."""
    if isinstance(error, CheckpointException):
        return all(_damaged(failure[0]) for failure in error.failures.values())
    return isinstance(error, (CorruptCheckpointError, NotACheckpointError))


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
        self.asynchronous, self.verify = asynchronous, verify
        self.process_group = process_group
        self.writer = FastPersistWriter(data_dirs=data_dirs, config=config, mode="snapshot")
        self.data_dirs = data_dirs
        self.config = config
        self._overlap = OverlappedCheckpointer(
            self.writer, checkpoint_id=lambda step: step_directory(self.root, step), process_group=process_group
        )
        self._published = 0  # of the overlapped saves started
        self._last_save_time: float | None = None
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
        """Checkpoint ``state`` as ``step``; waits for the previous save first (and raises its error)."""
        self.wait()
        self._last_save_time = time.monotonic()
        if not self.asynchronous:
            path = step_directory(self.root, step)
            dcp.save(state, checkpoint_id=path, storage_writer=self.writer, process_group=self.process_group)
            self._prune()
            return
        self._overlap.after_update(step, state)
        self._overlap.before_update()  # the snapshot holds the values: training may change them

    def wait(self) -> None:
        """Block until the last save is published, then prune; raises that save's error."""
        if self._overlap.saves > self._published:
            self._overlap.wait()
            self._published = self._overlap.saves
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
            log.warning("fp-dcp: skipping step %d of %s (%s): %s", info.step, self.root, info.status, info.problem)
        return None

    # ------------------------------------------------------------- retention

    def _prune(self) -> None:
        """Remove the steps retention lets go (coordinator only), after a newer one is published."""
        if not self.is_coordinator:
            return
        # Published or not is all retention needs: no metadata is read (a run may keep hundreds of steps).
        steps = [
            (step, path, os.path.exists(os.path.join(path, METADATA_NAME)))
            for step, path in _step_directories(self.root)
        ]
        published = [step for step, _, done in steps if done]
        if not published:
            return
        newest, kept = published[-1], set(published[-self.keep_last :])
        for step, path, done in steps:
            wanted = done and (
                step in kept
                or (self.keep_every is not None and step % self.keep_every == 0)
                or (self.keep is not None and self.keep(step))
            )
            if step < newest and not wanted:
                self._delete(path)

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

    def _remove(self, trash: str) -> None:
        # Data files may live in data_dirs: find them through the metadata before it goes.
        with contextlib.suppress(CheckpointError, OSError):
            for file in open_checkpoint(trash).files.values():
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

    def _agree(self, step: int | None) -> int | None:
        """The coordinator's choice, on every rank."""
        if not self._distributed():
            return step
        box = [step]
        group = self.process_group
        coordinator = dist.get_global_rank(group, 0) if group is not None else 0
        dist.broadcast_object_list(box, src=coordinator, group=group)
        return box[0]
