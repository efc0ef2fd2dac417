"""``FastPersistReader``: a ``torch.distributed.checkpoint.StorageReader``."""

from __future__ import annotations

import dataclasses
import os
import time
import uuid
from collections.abc import Sequence
from typing import Any, Literal

import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from .._native import _cio
from ..checkpoint import is_safetensors_directory, open_checkpoint, read_metadata_bytes
from ..compat import DCP_HIDES_METADATA_ERRORS
from ..config import IOConfig
from ..errors import CheckpointReplacedError, CorruptCheckpointError, NotACheckpointError
from ..format import chunk_nbytes
from ..log import log
from ..names import METADATA_NAME
from ..net.group import Group, node_name
from ..net.transport import Transport
from .catalog import Catalog, FastPersistCatalog
from .context import ReadContext
from .pipeline import ReadCounts, read_items
from .resources import ReaderResources
from .safetensors import open_safetensors
from .sharing import Exchange, plan_exchange, read_shared

__all__ = ["FastPersistReader", "LoadSummary"]


@dataclasses.dataclass(frozen=True)
class LoadSummary:
    """What one rank's part of a load did; ``FastPersistReader.last_load`` after each load."""

    bytes: int  # bytes transferred from the files, holes and alignment padding included
    needed: int  # bytes of the requested regions (read / needed is the read amplification)
    seconds: float  # read_data, from first open to last commit
    engine: str
    received_bytes: int = 0  # bytes of shared items received from the ranks that read them (``share``)
    requests: int = 0  # read requests issued to storage (0 for a stock checkpoint, read by torch)
    staged_bytes: int = 0  # of ``bytes``, read into a buffer and copied into place, not straight into targets

    @property
    def read_bytes(self) -> int:
        """Bytes this rank read from storage (``bytes``)."""
        return self.bytes

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0


_GROUPS: dict[int, Group] = {}  # gloo groups for sharing, by the id of the group loads run on: made once


def _sharing_group(process_group: dist.ProcessGroup | None) -> Group:
    """A gloo group of the ranks of ``process_group``, made by all of them at their first load that exchanges."""
    key = id(process_group)
    if key not in _GROUPS:
        _GROUPS[key] = Group.new(process_group)
    return _GROUPS[key]


class FastPersistReader(StorageReader):
    """Loads checkpoints written by ``FastPersistWriter``, torch ``FileSystemWriter``'s, and safetensors ones.

    Reads only the byte ranges each rank's load plan needs, straight into the
    target tensors where their memory allows, and verifies each item's
    CRC-32C when the item is read whole. Use with
    ``torch.distributed.checkpoint.load``::

        dcp.load(state_dict, storage_reader=FastPersistReader("/nvme/ckpt/step-100"))

    A checkpoint written by torch's ``FileSystemWriter`` is recognised and read
    through torch's ``FileSystemReader``, so jobs can switch readers before
    writers. A directory of Hugging Face ``*.safetensors`` files (with or
    without ``model.safetensors.index.json``; a Hugging Face cache's
    ``snapshots/<revision>/`` too) is read through its own catalogue
    (``fp_dcp.load.safetensors``), the same way: ``FastPersistReader(path)``
    replaces ``HuggingFaceStorageReader(path)``. safetensors stores no
    checksums: its structure is checked, its bytes cannot be.

    Args:
        path: checkpoint directory. Optional: DCP's ``checkpoint_id``
            overrides it (``dcp.load(sd, checkpoint_id=..., storage_reader=r)``);
            a load with neither fails with a ``ValueError`` saying so.
        verify_checksums: check each wholly read item against its stored
            CRC-32C (its CPU cost per GB: docs/benchmarks.md, "Single process,
            4 GB"); a mismatch raises
            ``CorruptCheckpointError`` naming the item and file.
        data_dirs: where the checkpoint's data directories are now, in the
            order of the list it was saved with, when they have moved to
            places the reader cannot find by itself (``fp_dcp.checkpoint``
            lists where it looks: the save-time directories, the same
            directories moved along with the checkpoint, and the checkpoint
            directory itself).
        config: I/O settings (engine, O_DIRECT, buffers, queue depth).
        share: in a multi-rank load, read every stored item that several ranks
            need whole from storage once, on one rank, and send it to the
            others over a gloo process group of fp-dcp's own
            (``fp_dcp.load.sharing``): replicated parameters and a full state
            loaded by every rank then cost the storage 1x, not once per rank.
            Items one rank needs are read by it as always. ``"auto"`` (the
            default) shares when the job's ranks are on more than one node
            (host name, or ``FP_DCP_NODE``), where the storage is a shared
            filesystem or each node's own; on one node every rank reading
            from the local disk is faster than the exchange. True always
            shares, False never.
        process_group: the group ``dcp.load`` runs on, when not the default
            one (sharing makes a gloo group of the same ranks).
        _extension_registry: as for torch's ``FileSystemReader`` (so code
            constructing one takes this class unchanged); used when the
            checkpoint is a stock DCP one written with stream extensions.
        thread_count: as for torch's ``HuggingFaceStorageReader`` (so code
            constructing one takes this class unchanged); it changes nothing:
            the requests in flight come from ``config``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        verify_checksums: bool = True,
        data_dirs: Sequence[str | os.PathLike[str]] | None = None,
        config: IOConfig | None = None,
        share: bool | Literal["auto"] = "auto",
        process_group: dist.ProcessGroup | None = None,
        _extension_registry: Any = None,
        thread_count: int = 1,
    ) -> None:
        super().__init__()
        self._default_path = os.fspath(path) if path is not None else None
        self._path = self._default_path
        self._extension_registry = _extension_registry
        self.data_dirs = [os.fspath(d) for d in data_dirs] if data_dirs else []
        self.verify_checksums = verify_checksums
        self.config = config if config is not None else IOConfig()
        self.load_id = str(uuid.uuid4())
        self.last_load: LoadSummary | None = None
        self._catalog: Catalog | None = None
        self._metadata_crc: int | None = None  # of the .metadata this load read (None: a safetensors checkpoint)
        self._stock: FileSystemReader | None = None  # set when the checkpoint is torch FileSystemWriter's
        self._stock_metadata = Metadata({})
        self._resources = ReaderResources(self.config)  # engine, pool, host threads, device loads: kept
        self.share = share
        self.process_group = process_group
        self._may_share = False  # whether this load's ranks plan an exchange (several ranks, ``share`` allows)

    # ----------------------------------------------------------- DCP contract

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._path = os.fspath(checkpoint_id) if checkpoint_id else self._default_path

    @property
    def path(self) -> str:
        """The directory the next load reads: the last ``checkpoint_id``, else the constructor's ``path``."""
        if self._path is None:
            raise ValueError(
                "FastPersistReader has no checkpoint directory: pass one as FastPersistReader(path) "
                "or as checkpoint_id= to dcp.load"
            )
        return self._path

    # The variadic keyword parameter is deliberately not named ``kwargs``
    # (fp_dcp.compat.READ_METADATA_KWARGS): fp-dcp writes no per-rank metadata,
    # so DCP's retry with rank=... would only bury the real error under a second one.
    # DCP calls reset() only when a checkpoint_id is passed, so every load starts here.
    def read_metadata(self, *args: Any, **options: Any) -> Metadata:
        try:
            return self._read_metadata()
        except Exception as e:
            if DCP_HIDES_METADATA_ERRORS and "rank" not in options:  # (DCP retries with rank=: said once)
                log.error(f"fp-dcp: {type(e).__name__}: {e}")
            raise

    def _read_metadata(self) -> Metadata:
        self.load_id = str(uuid.uuid4())
        self._catalog = None
        self._stock = None
        self._metadata_crc = None
        if is_safetensors_directory(self.path):
            metadata, self._catalog = open_safetensors(self.path)
            metadata.storage_meta = StorageMeta(checkpoint_id=self.path, load_id=self.load_id)
            return metadata
        checkpoint = open_checkpoint(self.path, self.data_dirs)
        self._metadata_crc = checkpoint.metadata_crc
        metadata = checkpoint.metadata
        if checkpoint.kind == "dcp":
            # it reads through the metadata handed to set_up_storage_reader: no second read
            self._stock = FileSystemReader(self.path, self._extension_registry)
        else:
            self._catalog = FastPersistCatalog(checkpoint)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        distributed = dist.is_available() and dist.is_initialized() and kwargs.get("use_collectives", True)
        self._may_share = bool(
            self.share is not False
            and self._stock is None
            and distributed
            and dist.get_world_size(self.process_group) > 1
        )
        if self._stock is not None:
            self._stock.set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
            self._stock_metadata = metadata
        elif self._catalog is None:
            raise RuntimeError("FastPersistReader.set_up_storage_reader called before read_metadata")

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        if not self._may_share or self._catalog is None:
            return plan
        # this rank's node, and the data files it can open: shared items are read where their files are
        visible = {name for name, path in self._catalog.paths.items() if os.path.exists(path)}
        return dataclasses.replace(plan, storage_data=(node_name(), visible))

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        if not self._may_share or self._catalog is None:
            return plans
        seen = [p.storage_data if isinstance(p.storage_data, tuple) else ("", set()) for p in plans]
        if self.share == "auto" and len({node for node, _ in seen}) < 2:
            return plans  # one node: the disk serves every rank at its own speed, cheaper than the exchange
        # the same exchange for every rank: each walks it in the same order
        exchange = plan_exchange(plans, self._catalog, [files for _, files in seen])
        return [dataclasses.replace(plan, storage_data=exchange) for plan in plans]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        start = time.perf_counter()
        if self._stock is not None:
            self._stock.read_data(plan, planner).wait()
            # torch's reader reads every record whole, whatever part of it is needed
            stored = self._stock_metadata.storage_data
            counts = ReadCounts(
                sum(stored[item.storage_index].length for item in plan.items),
                sum(self._needed(item) for item in plan.items),
                0,
            )
            received, engine = 0, "torch FileSystemReader (stock DCP checkpoint)"
        elif self._catalog is None:
            raise RuntimeError("FastPersistReader.read_data called before read_metadata")
        else:
            ctx = self._resources.context(self.verify_checksums)
            try:
                counts, received = self._read(plan, planner, self._catalog, ctx)
            except CorruptCheckpointError as e:
                if self._replaced():
                    raise CheckpointReplacedError(
                        f"{self.path} was replaced by a newer save while this load read it; load again"
                    ) from e
                raise
            engine = ctx.engine.describe()
        seconds = time.perf_counter() - start
        self.last_load = LoadSummary(
            counts.read, counts.needed, seconds, engine, received, counts.requests, counts.staged
        )
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _read(self, plan: LoadPlan, planner: LoadPlanner, catalog: Catalog, ctx: ReadContext) -> tuple[ReadCounts, int]:
        """Read the plan's items, shared ones through the exchange; returns the storage reads and bytes received."""
        exchange = plan.storage_data if isinstance(plan.storage_data, Exchange) else None
        if exchange is None:
            return read_items(plan.items, planner, catalog, ctx), 0
        # every rank got the same global plan, so all of them make the group here, or none: a job on one node
        # (share="auto") never makes one
        transport = Transport(_sharing_group(self.process_group))
        shared: list[ReadItem] = []
        own: list[ReadItem] = []
        for req in plan.items:
            loc = catalog.location(req)
            (shared if (loc.file, loc.offset) in exchange.readers else own).append(req)
        # the exchange first: a failure in this rank's own reads must not leave the others waiting in it
        peers, received = read_shared(shared, exchange, planner, catalog, ctx, transport)
        return read_items(own, planner, catalog, ctx) + peers, received

    def _needed(self, item: ReadItem) -> int:
        """Bytes of the region a stock checkpoint's ReadItem asks for (the whole record for objects)."""
        if item.type == LoadItemType.BYTE_IO:
            return int(self._stock_metadata.storage_data[item.storage_index].length)
        md = self._stock_metadata.state_dict_metadata[item.storage_index.fqn]
        assert isinstance(md, TensorStorageMetadata)
        return chunk_nbytes(item.lengths, md.properties.dtype)

    def _replaced(self) -> bool:
        """Whether ``.metadata`` is no longer the one this load read (a save published meanwhile)."""
        if self._metadata_crc is None:
            return False  # safetensors: nothing is published atomically, so nothing tells
        try:
            return _cio.crc32c(read_metadata_bytes(self.path)[1]) != self._metadata_crc
        except NotACheckpointError:
            return True

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        directory = os.fspath(checkpoint_id)
        return os.path.isfile(os.path.join(directory, METADATA_NAME)) or is_safetensors_directory(directory)

    @property
    def checkpoint_id(self) -> str | None:
        return self._path

    # -------------------------------------------------------------- resources

    def close(self) -> None:
        """Release the staging buffers and the I/O engine."""
        self._resources.close()

    def __enter__(self) -> FastPersistReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
