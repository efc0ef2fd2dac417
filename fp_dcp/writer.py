"""``FastPersistWriter``: a ``torch.distributed.checkpoint.StorageWriter``."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import time
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from . import commit
from .config import IOConfig
from .engine import IOResources
from .errors import CheckpointExistsError
from .format import METADATA_NAME, PAGE, align_up, data_file_name, encode_metadata, file_index
from .packer import split_items, write_files
from .placement import Placement

__all__ = ["FastPersistWriter", "SaveSummary"]

# The DCP metadata schema version this writer produces (torch's FileSystemWriter's).
DCP_METADATA_VERSION = "1.0.0"


@dataclasses.dataclass(frozen=True)
class SaveSummary:
    """What one rank's part of a save did; ``FastPersistWriter.last_save`` after each save."""

    bytes: int  # item bytes this rank wrote
    seconds: float  # write_data, from first resolve to fsync
    files: tuple[str, ...]
    engine: str  # e.g. "io_uring", or "threads (io_uring refused by the kernel: ...)"
    direct_io: bool  # whether the data files were written with O_DIRECT

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0


@dataclasses.dataclass(frozen=True)
class _RankFiles:
    """``SavePlan.storage_data``: which files a rank writes in this save."""

    rank: int
    token: str


def checkpoint_directory(path: str | os.PathLike[str]) -> str:
    """``path`` as a string, refusing what can never be a checkpoint directory."""
    text = os.fspath(path)
    if not isinstance(text, str) or not text:
        raise ValueError(f"checkpoint path must be a non-empty filesystem path, got {path!r}")
    if "://" in text:
        raise ValueError(f"fp-dcp writes to local or mounted filesystems; {text!r} looks like a URL")
    if os.path.exists(text) and not os.path.isdir(text):
        raise NotADirectoryError(f"checkpoint path {text} exists and is not a directory")
    return text


class FastPersistWriter(StorageWriter):
    """Saves DCP checkpoints at the speed of the disk.

    Each rank writes its items as raw bytes into one file of its own, through
    io_uring with O_DIRECT where the system allows (see ``IOConfig``), with a
    CRC-32C per item; the coordinator then publishes ``.metadata`` atomically
    (see ``fp_dcp.commit``). Use with ``torch.distributed.checkpoint.save`` or
    ``async_save``::

        dcp.save(state_dict, storage_writer=FastPersistWriter("/nvme/ckpt/step-100"))

    Args:
        path: checkpoint directory; created if missing.
        overwrite: replace a checkpoint already published at ``path``. The old
            one stays loadable until the new one is published, and its files
            are removed only then. With False, an existing checkpoint makes
            the save fail before anything is written.
        data_dirs: directories on separate devices to spread the data files
            over (see ``fp_dcp.placement``); ``.metadata`` stays in ``path``.
            Default: everything in ``path``.
        lanes_per_dir: data files each rank writes into each directory, all
            written at the same time (more lanes keep more requests in flight
            per device on striped or networked filesystems).
        config: I/O settings (engine, O_DIRECT, buffers, queue depth).

    One writer runs one save at a time. It keeps its staging buffers and I/O
    engine between saves (reusing warm memory); ``close()`` releases them.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        overwrite: bool = True,
        data_dirs: Sequence[str | os.PathLike[str]] | None = None,
        lanes_per_dir: int = 1,
        config: IOConfig | None = None,
    ) -> None:
        super().__init__()
        self.path = checkpoint_directory(path)
        self.overwrite = overwrite
        self.data_dirs = [os.fspath(d) for d in data_dirs] if data_dirs else []
        self.lanes_per_dir = lanes_per_dir
        self.placement = Placement(self.path, self.data_dirs, lanes_per_dir)
        self.config = config if config is not None else IOConfig()
        self.save_id = str(uuid.uuid4())
        self.rank = 0
        self.is_coordinator = False
        self.last_save: SaveSummary | None = None
        self._io = IOResources(self.config)
        self._lock: commit.SaveLock | None = None
        self._replaced: set[str] = set()
        self._token = ""

    # ----------------------------------------------------------- DCP contract

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self.path = checkpoint_directory(checkpoint_id)

    # DCP calls reset() only when a checkpoint_id is passed, so every save starts here.
    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._release_lock()  # left over if the previous save failed on some rank
        self.save_id = str(uuid.uuid4())
        if not kwargs.get("use_collectives", True):
            raise ValueError("FastPersistWriter needs use_collectives=True: one coordinator publishes the checkpoint")
        self.rank = kwargs.get("rank") or 0
        self.is_coordinator = is_coordinator
        self.path = checkpoint_directory(self.path)
        self.placement = Placement(self.path, self.data_dirs, self.lanes_per_dir)
        os.makedirs(self.path, exist_ok=True)
        for directory in self.placement.directories:
            os.makedirs(directory, exist_ok=True)
        if is_coordinator:
            if not self.overwrite and os.path.exists(os.path.join(self.path, METADATA_NAME)):
                raise CheckpointExistsError(f"a checkpoint is already published in {self.path} and overwrite=False")
            self._lock = commit.SaveLock(self.path)
            self._replaced = commit.published_files(self.path)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        self._token = secrets.token_hex(8)  # new file names: the replaced checkpoint stays intact
        return [dataclasses.replace(plan, storage_data=_RankFiles(rank, self._token)) for rank, plan in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        spec = plan.storage_data
        if not isinstance(spec, _RankFiles):
            raise RuntimeError("FastPersistWriter.prepare_global_plan did not run for this save (cached plans are not supported)")
        start = time.perf_counter()
        engine, pool = self._io.get()
        groups = split_items(plan.items, self.placement.files_per_rank)
        targets = [
            (os.path.join(self.placement.directory_of(k), data_file_name(spec.rank, k, spec.token)), items)
            for k, items in enumerate(groups)
            if items
        ]
        try:
            results, written = write_files(targets, planner, engine, pool, self.config)
        except BaseException:
            self._release_lock()  # this save is over: a retry, by this writer or a new one, finds the directory free
            raise
        for directory in {os.path.dirname(path) for path, _ in targets}:
            commit.fsync_directory(directory)  # the new names are durable before anything refers to them
        self.last_save = SaveSummary(
            bytes=sum(w.payload for w in written),
            seconds=time.perf_counter() - start,
            files=tuple(w.name for w in written),
            engine=engine.describe(),
            direct_io=all(w.direct for w in written),
        )
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        storage_data = {r.index: r.storage_data for rank_results in results for r in rank_results}
        sizes: dict[str, int] = {}
        for file, offset, length, _ in storage_data.values():
            sizes[file] = max(sizes.get(file, 0), align_up(offset + length, PAGE))
        files = {name: self.placement.describe(file_index(name), size) for name, size in sizes.items()}
        metadata.storage_data = storage_data
        metadata.storage_meta = self.storage_meta()
        metadata.version = DCP_METADATA_VERSION
        encoded = encode_metadata(metadata, files, {"save_id": self.save_id, **self.placement.footer()})
        try:
            try:
                commit.publish(self.path, encoded, self._token)
            except commit.PublishFailedError:
                self._remove_files(files)  # unpublished: they would only hold the space a retry needs
                raise
            keep = set(files) | {METADATA_NAME, commit.LOCK_NAME}
            for directory in dict.fromkeys([self.path, *self.placement.directories]):
                commit.remove_unreferenced(directory, keep, replaced=self._replaced)
        finally:
            self._release_lock()

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
    def checkpoint_id(self) -> str:
        return self.path

    def _remove_files(self, names: Iterable[str]) -> None:
        """Remove this save's data files (those this host can reach) and make the removal durable."""
        directories = set()
        for name in names:
            directory = self.placement.directory_of(file_index(name))
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, name))
                directories.add(directory)
        for directory in directories:
            commit.fsync_directory(directory)

    # -------------------------------------------------------------- resources

    def _release_lock(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def close(self) -> None:
        """Release the staging buffers, the I/O engine and any lock still held."""
        self._release_lock()
        self._io.close()

    def __enter__(self) -> FastPersistWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
