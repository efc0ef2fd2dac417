"""``FastPersistWriter``: a ``torch.distributed.checkpoint.StorageWriter``."""

from __future__ import annotations

import dataclasses
import functools
import os
import secrets
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future as StagingFuture
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ..checkpoint import published_files
from ..compat import (
    ASYNC_STAGING,
    check_filesystem_writer_options,
    item_location,
    plan_rank,
    require,
    stock_plan_data,
)
from ..config import IOConfig
from ..errors import CheckpointError, CheckpointExistsError
from ..format import ItemLocation, data_file_name, encode_metadata, file_index
from ..gpu.stager import AsyncSaves, Mode, StagedSave
from ..io import files
from ..io.engine import engine_stores
from ..names import LOCK_NAME, METADATA_NAME
from ..net.group import check_save_group
from ..units import PAGE, align_up
from . import commit
from .checkpoint_path import checkpoint_directory
from .controls import SaveControls
from .incremental import Base, Incremental, check_hashing
from .pipeline import write_files
from .placement import Placement, data_directories, planned_bytes
from .resources import WriterResources, shared_resources
from .spare import take_spares
from .summary import SaveSummary

__all__ = ["FastPersistWriter", "SaveSummary"]

# The DCP metadata schema version this writer produces (torch's FileSystemWriter's).
DCP_METADATA_VERSION = "1.0.0"


class FastPersistWriter(StorageWriter):
    """Saves DCP checkpoints at the speed of the disk.

    Each rank writes its items as raw bytes into one file of its own, through
    io_uring with O_DIRECT where the system allows (see ``IOConfig``), with a
    CRC-32C per item; the coordinator then publishes ``.metadata`` atomically
    (see ``fp_dcp.commit``). Use with ``torch.distributed.checkpoint.save`` or
    ``async_save``::

        dcp.save(state_dict, storage_writer=FastPersistWriter("/nvme/ckpt/step-100"))

    GPU tensors are copied device-to-host on a side CUDA stream into the
    writer's page-locked staging buffers, pipelined with the disk writes
    (``fp_dcp.gpu``, docs/gpu.md). For saves that overlap training, pass
    the writer as DCP's ``AsyncStager`` too::

        resp = dcp.async_save(state_dict, storage_writer=writer, async_stager=writer)
        ...                                   # forward and backward of the next step
        resp.staging_completion.result()      # before optimizer.step(): parameters may change
        resp.upload_completion.result()       # the checkpoint is published

    ``staging_completion`` fires when training may change the parameters,
    ``upload_completion`` after the durable commit; how soon the first comes
    depends on ``mode``. ``fp_dcp.OverlappedCheckpointer`` does this in a
    training loop. ``isinstance(writer, AsyncStager)`` is deliberately False
    (``fp_dcp.compat``), so ``dcp.async_save(sd, storage_writer=writer)``
    without ``async_stager`` keeps torch's default stager (a full host copy)
    and its plain Future, as before. Async saves need DCP's thread executor
    (the default).

    Args:
        path: checkpoint directory; created if missing. Optional: DCP's
            ``checkpoint_id`` (``dcp.save(sd, checkpoint_id=..., storage_writer=w)``)
            overrides it for that save and the ones after it, so one writer
            serves a directory per step. A save with neither fails with a
            ``ValueError`` saying so.
        overwrite: replace a checkpoint already published at ``path``. The old
            one stays loadable until the new one is published, and its files
            are removed only then. With False, an existing checkpoint makes
            the save fail before anything is written.
        data_dirs: directories on separate devices to spread the data files
            over (see ``fp_dcp.save.placement``); ``.metadata`` stays in ``path``.
            Resolved to absolute paths here (relative to the current directory). Default: all in ``path``.
        lanes_per_dir: data files each rank writes into each directory, all
            written at the same time (more lanes keep more requests in flight
            per device on striped or networked filesystems). None (auto): one
            where the files get O_DIRECT to a device; where the kernel copies
            every byte (tmpfs, the page cache), twice ``host_threads`` files a
            rank, at most 8 and one for every 64 MiB, over the directories
            (``placement.auto_lanes``).
        config: I/O settings (engine, O_DIRECT, buffers, queue depth).
        mode: what ``stage`` does for ``async_save`` (``dcp.save`` always streams):
            ``"streaming"`` copies nothing up front: the save reads the tensors
            themselves (GPU ones through the staging buffers), and
            ``staging_completion`` fires once it has read them all, as in
            FastPersist, where the write ends before the next optimizer step.
            Host memory: the staging buffers, whatever the state's size.
            ``"snapshot"`` copies the whole state into a page-locked host arena
            (kept and reused across saves) on a side stream, and
            ``staging_completion`` fires when the copy is done; the write may
            then span several steps. Host memory: the state's size, once.
        incremental: store each item's XXH3-128 content hash (computed in
            the same pass as its CRC-32C), so that later saves can use this
            checkpoint as their ``base``. Needs fp-dcp built with libxxhash.
        base: with ``incremental``, an earlier incremental checkpoint (saved
            with the same ``data_dirs``): tensor chunks whose bytes equal
            those stored there (same dtype, shape, length, CRC-32C and
            XXH3-128) are not written again; the new checkpoint references
            them in the file that holds them (``fp_dcp.save.incremental``).
            Deleting or changing a checkpoint whose files a later one
            references damages that one: ``CheckpointManager(incremental=True)``
            keeps track. A settable attribute; None (the default) writes everything.
        spare: a retired checkpoint directory whose files of this rank the next save renames and overwrites
            (``fp_dcp.save.spare``; ``CheckpointManager`` sets it). A settable attribute; default None.
        **filesystem_writer_options: the keyword arguments of torch's
            ``FileSystemWriter`` are accepted, so that code constructing one
            takes this class unchanged (``fp_dcp.compat.check_filesystem_writer_options``
            says what each one does here).

    One writer runs one save at a time (async saves queue behind each other).
    It keeps its staging buffers, I/O engine and snapshot between saves
    (reusing warm memory); ``close()`` releases them. ``cancel()`` stops a
    save in progress.
    """

    # Declared for type checkers only: left unset so that isinstance(writer, AsyncStager)
    # is False (see the class docstring). stage() always returns a future, so DCP never reads it.
    _synchronize_after_execute: bool

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        overwrite: bool = True,
        data_dirs: Sequence[str | os.PathLike[str]] | None = None,
        lanes_per_dir: int | None = None,
        config: IOConfig | None = None,
        mode: Mode = "streaming",
        incremental: bool = False,
        base: str | os.PathLike[str] | None = None,
        spare: str | os.PathLike[str] | None = None,
        **filesystem_writer_options: Any,
    ) -> None:
        super().__init__()
        check_filesystem_writer_options(filesystem_writer_options)
        if incremental:
            check_hashing()
        elif base is not None:
            raise ValueError("FastPersistWriter(base=...) needs incremental=True")
        self.incremental = incremental
        self.base = base
        self.spare = spare
        self._default_path = checkpoint_directory(path) if path is not None else None
        self._path = self._default_path
        self.overwrite = overwrite
        self.data_dirs = data_directories(data_dirs)  # resolved now: a later chdir changes nothing
        self.lanes_per_dir = lanes_per_dir
        self.placement = Placement(self._path or "", self.data_dirs, lanes_per_dir)  # checks the arguments
        self.config = config if config is not None else IOConfig()
        if mode not in ("streaming", "snapshot"):
            raise ValueError(f"mode must be 'streaming' or 'snapshot', not {mode!r}")
        self.mode: Mode = mode
        self._id = uuid.uuid4().hex
        self._start(WriterResources(self.config))

    def _start(self, resources: WriterResources) -> None:
        """The per-process state: made by ``__init__`` and again where the writer is unpickled."""
        self._resources = resources
        self._async = AsyncSaves()
        self._staged: StagedSave | None = None  # the async save now running, if any
        self._cancel = threading.Event()
        self.save_id = str(uuid.uuid4())
        self.rank: int | None = 0
        self.is_coordinator = False
        self.last_save: SaveSummary | None = None
        self._lock: commit.SaveLock | None = None
        self._replaced: set[str] = set()
        self._cleanup = commit.Cleanup()
        self._token = ""
        self._base: Base | None = None  # the base opened for the save in progress

    # What travels to DCP's checkpoint process: the settings and the current directory.
    _PICKLED = (
        "_default_path",
        "_path",
        "overwrite",
        "data_dirs",
        "lanes_per_dir",
        "config",
        "mode",
        "incremental",
        "base",
        "spare",
        "_id",
    )

    def __getstate__(self) -> dict[str, Any]:
        waiting = self._async.unbegun()
        if waiting:
            error = TypeError(
                "FastPersistWriter was passed as async_stager to a save that pickles it (DCP's "
                "AsyncCheckpointerType.PROCESS); its staging works in this process only: omit async_stager "
                "(torch's stager then copies the state for the checkpoint process) or use the thread executor"
            )
            for save in waiting:
                save.fail(error)
                save.end()
            raise error
        return {name: self.__dict__[name] for name in self._PICKLED}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.placement = Placement(self._path or "", self.data_dirs, self.lanes_per_dir)
        self._start(shared_resources(self._id, self.config))

    @property
    def path(self) -> str:
        """The directory the next save writes to: the last ``checkpoint_id``, else the constructor's ``path``."""
        if self._path is None:
            raise ValueError(
                "FastPersistWriter has no checkpoint directory: pass one as FastPersistWriter(path) "
                "or as checkpoint_id= to dcp.save / dcp.async_save"
            )
        return self._path

    # ----------------------------------------------------------- DCP contract

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._path = checkpoint_directory(checkpoint_id) if checkpoint_id else self._default_path

    # DCP calls reset() only when a checkpoint_id is passed, so every save starts here.
    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._release_lock()  # left over if the previous save failed on some rank
        self._cleanup.wait()
        self._staged = self._async.begin()
        self.save_id = str(uuid.uuid4())
        self._token = secrets.token_hex(8)  # new file names: the replaced checkpoint stays intact
        if not kwargs.get("use_collectives", True):
            raise ValueError("FastPersistWriter needs use_collectives=True: one coordinator publishes the checkpoint")
        check_save_group()  # DCP calls this on the thread that runs the save's collectives
        self.rank = kwargs.get("rank")  # None from torch 2.7 (no rank passed): write_data takes the plan's
        self.is_coordinator = is_coordinator
        self._path = checkpoint_directory(self.path)
        self.placement = Placement(self.path, self.data_dirs, self.lanes_per_dir)
        self.placement.make_directories()
        if is_coordinator:
            if not self.overwrite and os.path.exists(os.path.join(self.path, METADATA_NAME)):
                raise CheckpointExistsError(f"Checkpoint already exists in {self.path} (published) and overwrite=False")
            self._lock = commit.SaveLock(self.path)
            self._replaced = published_files(self.path)
        if self.base is not None and not self.incremental:
            raise ValueError("FastPersistWriter.base is set but incremental is False")
        self._base = Base.open(os.fspath(self.base), self.data_dirs) if self.base is not None else None

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # The writer needs nothing in the plans: each rank names its files itself (its rank from
        # set_up_storage_writer, a new token per save), so that plans cached by DCP stay valid. They
        # carry FileSystemWriter's storage_data instead: DCP caches plans per planner class, not per
        # writer, so a FileSystemWriter save in this process may be handed a plan cached here.
        return [dataclasses.replace(p, storage_data=stock_plan_data(rank)) for rank, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        staged, self._staged = self._staged, None  # the async_save this is, from set_up; None for dcp.save
        controls = SaveControls(self._cancel, staged.release if staged else None)
        try:
            with self._resources.busy:  # async saves run in DCP's threads: one pipeline at a time
                return self._write_data(plan, planner, controls, staged)
        except BaseException as e:
            self._release_lock()  # this save is over: a retry, by this writer or a new one, finds the directory free
            if staged is not None:
                staged.fail(e)  # staging_completion must not stay pending
            raise
        finally:
            self._cancel.clear()
            if staged is not None:
                staged.end()

    def _write_data(
        self, plan: SavePlan, planner: SavePlanner, controls: SaveControls, staged: StagedSave | None
    ) -> Future[list[WriteResult]]:
        start = time.perf_counter()
        if self.rank is None:
            self.rank = plan_rank(plan.storage_data)
        count = self.placement.files(planned_bytes(plan.items), self.config)
        ctx = self._resources.context(controls, count, staged.ready if staged else None)
        names = [data_file_name(self.rank, k, self._token) for k in range(count)]
        paths = [os.path.join(self.placement.directory_of(k), name) for k, name in enumerate(names)]
        reuse = None
        if self.spare and ctx.engine.stores:
            reuse = functools.partial(take_spares, os.fspath(self.spare), self.rank)
        threads = min(self.config.io_threads, os.cpu_count() or 1)
        incremental = Incremental(self._base, threads) if self.incremental else None
        results, written = write_files(plan.items, paths, planner, ctx, incremental, reuse)
        for directory in {self.placement.directory_of(file_index(w.name)) for w in written}:
            files.fsync_directory(directory)  # the new names are durable before anything refers to them
        self.last_save = SaveSummary(
            bytes=sum(w.payload for w in written),
            seconds=time.perf_counter() - start,
            files=tuple(w.name for w in written),
            engine=ctx.engine.describe(),
            direct_io=all(w.direct for w in written),
            staging=ctx.copier.describe(),
            referenced=sum(r.size_in_bytes for r in results if r.storage_data[1]),
        )
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        located = [(r.index, ItemLocation._make(r.storage_data[0]), r.storage_data[1]) for rs in results for r in rs]
        storage_data = {index: location for index, location, _ in located}
        entries = self._file_entries([(location, referenced) for _, location, referenced in located])
        # DCP's plan caching hands every save the same Metadata object: encode this save's own copy,
        # then fill the shared one in too (DCP returns it to the caller, as with FileSystemWriter).
        stored = {index: item_location(*location) for index, location in storage_data.items()}
        this_save = dataclasses.replace(metadata, storage_data=stored, storage_meta=self.storage_meta())
        this_save.version = DCP_METADATA_VERSION  # a field from torch 2.9 on, an attribute before (fp_dcp.compat)
        metadata.storage_data, metadata.storage_meta, metadata.version = (
            this_save.storage_data,
            this_save.storage_meta,
            this_save.version,
        )
        footer = {"save_id": self.save_id, **self.placement.footer()}
        if self.last_save:
            footer["engine"] = self.last_save.describe_io()  # the coordinator's
        encoded = encode_metadata(this_save, entries, footer)
        if not engine_stores(self.config):  # nothing was stored: there is no checkpoint to publish
            self.placement.remove(entries)
            self._release_lock()
            return
        try:
            try:
                commit.publish(self.path, encoded, self._token)
            except files.ReplaceFailedError:
                self.placement.remove(entries)  # unpublished: they would only hold the space a retry needs
                raise
            keep = set(entries) | {METADATA_NAME, LOCK_NAME}  # incl. files of its base it took over
            directories = list(dict.fromkeys([self.path, *self.placement.directories]))
            for directory in directories:
                commit.remove_leftovers(directory, keep, spare=self._replaced)
            self._cleanup.start(directories, self._replaced - keep)
        finally:
            self._release_lock()

    def _file_entries(self, locations: list[tuple[ItemLocation, bool]]) -> dict[str, dict[str, Any]]:
        """The footer's ``files``: the data files this save wrote, and those of its base it references."""
        sizes: dict[str, int] = {}
        referenced: set[str] = set()
        for location, is_reference in locations:
            if is_reference:
                referenced.add(location.file)
            else:
                end = align_up(location.offset + location.length, PAGE)
                sizes[location.file] = max(sizes.get(location.file, 0), end)
        entries = {name: self.placement.describe(file_index(name), size) for name, size in sizes.items()}
        base = self._base
        for name in referenced:
            if base is None or name not in base.checkpoint.file_sizes:
                raise CheckpointError(
                    f"a rank referenced {name} of the incremental base {self.base}, which the coordinating rank "
                    "cannot read or which does not list it: every rank must save against the same, readable base"
                )
            entries[name] = base.entry(name, self.path)
        return entries

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            checkpoint_directory(checkpoint_id)
        except (ValueError, TypeError, NotADirectoryError):
            return False
        return True

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str | None:
        return self._path

    # ------------------------------------------ async saves (DCP's AsyncStager)

    def stage(self, state_dict: dict[str, Any]) -> StagingFuture[dict[str, Any]]:
        """``AsyncStager.stage`` for ``dcp.async_save(..., async_stager=writer)``; see ``mode``.

        Returns at once. The future (DCP turns it into ``staging_completion``)
        completes when training may change the parameters, and fails if the
        save fails before that.
        """
        require(ASYNC_STAGING)
        return self._async.stage(state_dict, self.mode, self._resources.staging.snapshot)

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False  # stage() returns a future: async_save hands it back as staging_completion

    def synchronize_staging(self) -> None:
        """Wait until every save staged so far lets training change the parameters."""
        self._async.synchronize()

    def cancel(self) -> None:
        """Stop the save in progress (or staged and about to write) at its next transfer.

        Its ``write_data`` raises ``SaveCancelledError``, its files are removed
        and nothing is published; DCP reports the error on every rank. A no-op
        when no save is in progress.
        """
        if self._resources.busy.locked() or self._async.pending():
            self._cancel.set()

    # -------------------------------------------------------------- resources

    def _release_lock(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def close(self) -> None:
        """Wait for async saves in flight and for the removal of the files they replaced, then release the
        staging buffers, snapshot, I/O engine and lock."""
        self._async.close()
        self._cleanup.wait()
        self._release_lock()
        self._resources.close()

    def __enter__(self) -> FastPersistWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
