"""``CheckpointManager``: the checkpoints of a whole training run, kept, pruned, copied and resumed from.

A run's root holds one directory per saved step, ``step-{N}`` (``steps``);
each is an fp-dcp checkpoint and exists as a step only once its
``.metadata`` is published (fp-dcp's commit protocol). Nothing else records
which steps exist: the manager derives everything from the directory
listing, so there is no pointer file to get out of step with the data. ::

    mgr = CheckpointManager("/nvme/run42", keep_last=3, keep_every=1000, every_n_steps=100)
    step = mgr.restore(state)          # newest intact step loaded into `state`; None when there is none
    for step in range((step or 0) + 1, steps):
        train_step()
        if mgr.should_save(step):
            mgr.save(step, state)      # returns once `state` may change; the write goes on meanwhile
    mgr.close()                        # waits for the last save (and its copies), then prunes

Old steps are pruned by ``retention`` (atomically, and never a file a kept
step references: incremental runs, ``incremental=True``, reference the
unchanged tensors of the step before).

Checkpoint tiers (``fp_dcp.tiers``): with a root on each node's own disk
(``{node}`` in the path expands to the node's name), ``replicas=2`` copies
every rank's files to a peer node in the background, and ``durable=`` drains
steps to a shared filesystem or an object store. ``restore`` then takes the
newest step that is whole somewhere, each file from the fastest intact copy.

With ``save_on_preemption=True`` a SIGTERM on any rank makes every rank save
the next step, and ``preempted`` tells the loop to stop (``.preemption``).
"""

from __future__ import annotations

import functools
import operator
import os
import signal
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ..config import IOConfig
from ..errors import CheckpointBusyError, DurableStorageError
from ..gpu.stager import Mode
from ..names import SPARE_NAME
from ..net.group import Group, background_group
from ..save.commit import SaveLock
from ..save.placement import data_directories
from ..save.spare import worth_reusing
from ..save.writer import FastPersistWriter
from ..tiers import DurableStore, Tiers
from .overlap import OverlappedCheckpointer
from .preemption import Preemption, PreemptionSave
from .resume import Resume
from .retention import Retention, finish_deletions, remove_spare, user_of
from .steps import StepInfo, list_steps, step_directory

__all__ = ["CheckpointManager", "StepInfo", "list_steps", "step_directory"]

StateDict = dict[str, Any]
T = TypeVar("T")


def _step_number(step: int) -> int:
    """``step`` as the int that names its directory; ValueError for what no listing reads back (``step--1``)."""
    try:
        number = operator.index(step)  # any integer type; TypeError for a float, a str, None
    except TypeError:
        number = -1
    if number < 0 or isinstance(step, bool):
        raise ValueError(f"a step must be an int of 0 or more (its directory is step-N), got {step!r}")
    return number


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
        reuse_files: where the kernel copies every byte written (tmpfs, the
            page cache), keep the step pruned last as a spare (``.spare``,
            not a checkpoint) until the next save, which overwrites its
            files instead of making new ones, so their memory is not taken
            and cleared again (``fp_dcp.save.spare``). Between saves the
            root then holds one step more than retention keeps: as much as
            during a save. Default True; nothing changes where data files
            get O_DIRECT to a device.
        process_group: the group the manager's collectives use: DCP's, the
            ranks' agreement on steps, the preemption store. Default: with
            ``asynchronous``, a gloo group of all ranks made here, so that
            the saves' collectives in DCP's thread never meet training's
            (every rank makes the manager, in the same order); without, the
            default group. A group passed is used as it is (a subgroup: its
            ranks alone make the manager, and the tiers' groups are made
            over them).
        replicas: how many nodes hold each rank's files (default 1: only its
            own). With 2 or more, after each step is published its files are
            copied, in the background, to ranks on ``replicas - 1`` other
            nodes (into their own roots), and checked there; losing a node
            then loses no step. Needs that many nodes (see ``root``).
        durable: where steps are also drained, in the background: a
            directory (a shared filesystem) or an fsspec URL such as
            ``"s3://bucket/run42"`` (s3fs), or a ``fp_dcp.tiers.DurableStore``.
            Every byte stored is read back and checked; transient errors are
            retried with backoff; a step that still fails is reported as
            ``durable_error`` (a warning, never an exception in training).
            Default None: no durable copy.
        durable_every_n_steps: drain every this many published steps (the
            first step a manager publishes is always drained). A step due
            while the previous drain still runs waits for the next turn, so
            drains never queue up. Default 1: as often as the store keeps up.
        keep_durable: how many of the newest drained steps the durable root
            keeps (at least 1), with every file they reference.
        raise_durable_errors: ``save`` raises the last failed drain's
            ``DurableStorageError`` (once) instead of only warning.
        save_on_preemption: on one of ``preemption_signals`` on any rank,
            every rank saves the next step the loop passes to
            ``should_save`` or ``save`` (whatever ``every_n_steps`` says),
            synchronously, and ``preempted`` turns True. Make the manager in
            the main thread; handlers installed before are still called.
        preemption_signals: the signals that mean preemption (default SIGTERM).
        preemption_deadline: seconds the preemption save then waits for that
            step's replication and drain (tiers); past it, a warning says the
            copy is not done. Default 20: set it to fit the grace period.

    ``root`` may contain ``{node}``, replaced by each rank's node name (its
    host name, or ``FP_DCP_NODE``): then each node keeps its steps on its own
    disk, the fastest place to write. Every rank of the job makes the same
    calls; the coordinating rank (rank 0 of ``process_group``) picks the step
    that ``restore`` loads, and one rank per node prunes its root.
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
        reuse_files: bool = True,
        process_group: dist.ProcessGroup | None = None,
        replicas: int = 1,
        durable: str | os.PathLike[str] | DurableStore | None = None,
        durable_every_n_steps: int = 1,
        keep_durable: int = 3,
        raise_durable_errors: bool = False,
        save_on_preemption: bool = False,
        preemption_signals: Sequence[int] = (signal.SIGTERM,),
        preemption_deadline: float = 20.0,
    ) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be at least 1 (the newest step is always kept), got {keep_last}")
        for name, value in (("keep_every", keep_every), ("every_n_steps", every_n_steps)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        self.retention = Retention(keep_last, keep_every, keep)
        self.every_n_steps, self.every_seconds = every_n_steps, every_seconds
        self.asynchronous, self.verify, self.incremental = asynchronous, verify, incremental
        self.process_group = background_group(process_group) if asynchronous else process_group
        self._group = Group(self.process_group)
        self.writer = FastPersistWriter(data_dirs=data_dirs, config=config, mode=mode, incremental=incremental)
        self.data_dirs = data_dirs
        self.config = config
        self.reuse_files = reuse_files
        self._overlap = (
            OverlappedCheckpointer(
                self.writer,
                checkpoint_id=lambda step: step_directory(self.root, step),
                process_group=self.process_group,
            )
            if asynchronous
            else None
        )
        self._published = 0  # of the overlapped saves started
        self._last_save_time: float | None = None
        self._saving: int | None = None  # the step of the save in flight
        self._last_step: int | None = None  # the newest step saved or restored: the next save's base
        self._lock: SaveLock | None = None
        self._preemption: Preemption | None = None
        self.raise_durable_errors = raise_durable_errors
        root = os.fspath(root)
        tiered = replicas > 1 or durable is not None or "{node}" in root
        if tiered and data_dirs:
            raise ValueError(
                "CheckpointManager: checkpoint tiers (replicas, durable, {node}) keep data files in the "
                "step directories; data_dirs cannot be combined with them"
            )
        self.tiers = (
            Tiers(
                root,
                replicas=replicas,
                durable=durable,
                durable_every_n_steps=durable_every_n_steps,
                keep_durable=keep_durable,
                process_group=self.process_group,
            )
            if tiered
            else None
        )
        self.root = self.tiers.root if self.tiers is not None else root
        self.writer.spare = os.path.join(self.root, SPARE_NAME) if reuse_files else None
        if self._housekeeper:
            os.makedirs(self.root, exist_ok=True)
            try:
                self._lock = SaveLock(self.root)  # one manager per root: pruning must not race another job's saves
            except CheckpointBusyError as e:
                if self.tiers is None:
                    raise
                raise CheckpointBusyError(
                    f"{e}: if the nodes of this job share {self.root}, put {{node}} in the "
                    "root so that each keeps its own"
                ) from None
            finish_deletions(self.root)
        if self.tiers is not None:
            self.tiers.start()
        if save_on_preemption:
            try:
                name = self._agree(uuid.uuid4().hex)  # the same on every rank: this manager's keys in the store
                self._preemption = Preemption(preemption_signals, self.process_group, name, preemption_deadline)
            except BaseException:
                self._release()
                raise
        self._group.barrier()

    # ------------------------------------------------------------------ saving

    def should_save(self, step: int) -> bool:
        """Whether ``step`` is due a checkpoint by ``every_n_steps`` / ``every_seconds``, or for a preemption."""
        if self._preemption is not None and self._preemption.due(step):
            return True
        if self.every_n_steps is None and self.every_seconds is None:
            return True
        if self.every_n_steps is not None and step % self.every_n_steps == 0:
            return True
        last = self._last_save_time
        return self.every_seconds is not None and (last is None or time.monotonic() - last >= self.every_seconds)

    def save(self, step: int, state: StateDict) -> None:
        """Checkpoint ``state`` as ``step``; waits for the previous save first (and raises its error).

        ``step`` is an int of 0 or more (any integer type, such as numpy's),
        else ``ValueError``. Saving over a step whose files a newer step
        references (in an incremental run) raises ``ValueError``: it would
        damage that step. The preemption step (``save_on_preemption``) is
        saved synchronously, after the save in flight, and its copies waited
        for up to ``preemption_deadline``.
        """
        step = _step_number(step)
        if self._preemption is not None and self._preemption.due(step):
            write = functools.partial(self._write, step, state, synchronous=True, drain=True)
            self._preemption.save(step, self.wait, write, self.tiers)
            return
        self.wait()
        if self.raise_durable_errors and self.tiers is not None and self.tiers.durable_error is not None:
            error, self.tiers.durable_error = self.tiers.durable_error, None  # raised once
            raise error
        self._write(step, state, synchronous=not self.asynchronous)

    def _write(self, step: int, state: StateDict, *, synchronous: bool, drain: bool = False) -> None:
        user = self._agree(user_of(self.root, step) if self.is_coordinator else None)
        if user is not None:
            raise ValueError(
                f"step {step} of {self.root} holds data files that {user} references: saving over it would damage "
                f"that step; save under a newer step number"
            )
        self._last_save_time = time.monotonic()
        last = self._last_step
        self.writer.base = step_directory(self.root, last) if self.incremental and last is not None else None
        if synchronous:
            path = step_directory(self.root, step)
            dcp.save(state, checkpoint_id=path, storage_writer=self.writer, process_group=self.process_group)
            self._published_step(step, drain=drain)
            return
        assert self._overlap is not None
        self._saving = step
        self._overlap.after_update(step, state)
        self._overlap.before_update()  # the state may change now (snapshot: copied; streaming: written)

    def wait(self) -> None:
        """Block until the last save is published, then prune; raises that save's error."""
        if self._overlap is not None and self._overlap.saves > self._published:
            self._published = self._overlap.saves
            self._overlap.wait()
            assert self._saving is not None
            self._published_step(self._saving)

    def _published_step(self, step: int, drain: bool = False) -> None:
        self._last_step = step
        if self.tiers is not None:
            self.tiers.published(step, drain=drain)
        self._prune()

    def wait_for_copies(self) -> None:
        """``wait``, then until the replication and drain of every step saved so far have finished or failed."""
        self.wait()
        if self.tiers is not None:
            self.tiers.wait()
            self._prune()

    @property
    def preempted(self) -> bool:
        """Whether the preemption step was reached (every rank alike): stop training, ``close()`` and exit."""
        return self._preemption is not None and self._preemption.step is not None

    @property
    def preemption(self) -> PreemptionSave | None:
        """What the preemption save did on this rank: its step, timings and whether it was drained."""
        return self._preemption.report if self._preemption is not None else None

    @property
    def durable_error(self) -> DurableStorageError | None:
        """Why the last failed drain failed, until a later one succeeds (None: no failure)."""
        return self.tiers.durable_error if self.tiers is not None else None

    def close(self) -> None:
        """Wait for the last save and its copies, prune, and release the writer, the spare, the root's lock and the
        signals; returns once every rank has, so that each then finds the root as retention left it."""
        self._release()
        self._group.barrier()

    def _release(self) -> None:
        try:
            self.wait_for_copies()
        finally:
            if self._preemption is not None:
                self._preemption.close()
            if self.tiers is not None:
                self.tiers.close()
            self.writer.close()
            if self._lock is not None:
                try:
                    remove_spare(self.root)  # no later save of this manager takes its files
                finally:
                    self._lock.release()
                    self._lock = None

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self._release()  # this rank failed: the others may never come to close()

    # --------------------------------------------------------------- restoring

    def restore(self, state: StateDict) -> int | None:
        """Load the newest intact step into ``state``; its step number, or None when there is none.

        A step that is incomplete, fails its checks (see ``verify``) or fails
        to load is skipped with a warning naming why, and the next older one
        is tried. Loads reshard to the current world size as ``dcp.load`` does.
        A save in flight is published first (its collectives and the load's share a group).
        """
        self.wait()
        resume = Resume(self.root, self._group, self.tiers, self.verify, self.data_dirs, self.config)
        step = resume.load(state)
        if step is not None:
            self._last_step = step
        return step

    def steps(self, *, verify: bool = False) -> list[StepInfo]:
        """The root's steps, oldest first (``list_steps``)."""
        return list_steps(self.root, verify=verify)

    def _prune(self) -> None:
        """Apply retention to this node's root (one rank per node), sparing steps still being copied."""
        if self._housekeeper:
            directories = data_directories(self.data_dirs) or [self.root]
            spare = self.reuse_files and worth_reusing(directories, self.writer.config)
            self.retention.prune(self.root, self.tiers.busy() if self.tiers is not None else (), spare)

    @property
    def _housekeeper(self) -> bool:
        """Whether this rank prunes and locks the root: the coordinator, or with tiers each node's leader."""
        return self.tiers.is_leader if self.tiers is not None else self.is_coordinator

    @property
    def is_coordinator(self) -> bool:
        """Whether this rank coordinates: rank 0 of ``process_group`` (or no job of several ranks)."""
        return self._group.rank == 0

    def _agree(self, choice: T) -> T:
        """The coordinator's choice, on every rank."""
        return self._group.broadcast(choice)
