"""Every private torch API fp-dcp uses, every protocol detail it relies on, and the torch versions they need.

Checked against each torch in ``CHECKED_TORCH`` (``benchmarks/torch_matrix.sh``
runs the suite on each; CI runs it on both ends of the range);
``tests/test_compat.py`` fails when one of these stops holding, so a torch
upgrade shows here first. The package declares ``torch>=2.7`` (``OLDEST_TORCH``).

Features that need a newer torch than the oldest (``TorchFeature``, each with
the version it needs): ``import fp_dcp`` works on every declared torch, and
such a feature raises ``TorchVersionError`` naming that version when it is
used (``require``), never an ``ImportError`` of a private torch module.

- ``ASYNC_STAGING`` (torch 2.9): ``dcp.async_save(..., async_stager=writer)``
  and the ``AsyncSaveResponse`` it returns: the writer's own staging
  (``FastPersistWriter.stage``, its ``mode``). Before 2.9,
  ``dcp.async_save(sd, storage_writer=writer)`` stages with torch's own host
  copy, and ``OverlappedCheckpointer`` and ``CheckpointManager`` save
  synchronously, saying so once (torch 2.7's threaded ``async_save`` left
  gloo ranks hanging in ``destroy_process_group`` about one run in three).
- ``CONSOLIDATION`` (torch 2.9): ``consolidate_safetensors_files`` for
  ``SafetensorsWriter(enable_consolidation=True)``.
- ``BALANCED_PLANS`` (torch 2.8): ``DefaultSavePlanner._dedup_save_plans``,
  the hook through which ``FastPersistSavePlanner`` deals replicated items
  out by bytes. With 2.7, DCP's own de-duplication runs instead (every item
  still written once, the ranks' shares less even), said once in the log.

Fields that older torches lack, set as attributes instead (pickled with the
instance's ``__dict__`` all the same, so a checkpoint saved with any
declared torch loads with any other): ``Metadata.version`` (a field from 2.9
on; ``dcp_metadata_version`` reads it from any checkpoint) and
``_StorageInfo.transform_descriptors`` (2.7 on).

Private names (torch offers no public equivalent):

- ``flatten_state_dict`` (``torch.distributed.checkpoint._nested_dict``):
  the flattening DCP applies before planning; ``convert`` uses it to list a
  state dict's entries the way DCP stores them.
- ``EmptyStateDictLoadPlanner`` (``default_planner._EmptyStateDictLoadPlanner``)
  and ``load_state_dict_no_dist`` (``state_dict_loader._load_state_dict``):
  loading a whole checkpoint without a target state dict, as torch's own
  ``format_utils.dcp_to_torch_save`` does (torch 2.7's needs ``planner_data``
  to be a dict; a safetensors directory's metadata has None).
- ``consolidate_safetensors_files``
  (``torch.distributed.checkpoint._consolidate_hf_safetensors``): merging the
  per-rank safetensors files of a ``save_distributed`` save into whole
  tensors, as ``HuggingFaceStorageWriter(enable_consolidation=True)`` does;
  ``fp_dcp.save.safetensors`` runs it for the same option (torch 2.9 on).
- ``save_arguments``: the group the DCP save that calls the writer runs
  its collectives on (``process_group``; None: the default group) and
  whether it runs any (``no_dist``), read from the arguments of
  ``state_dict_saver._save_state_dict`` up the calling thread's stack: DCP
  hands a storage writer its rank, never its group. Where no such frame is
  found it says None, and the writer warns about nothing.
- ``dtensor_with_local``: a DTensor rebuilt around a host copy of its local
  shard through ``DTensor(local, spec)``, as torch's state-dict utilities do
  (``DTensor.from_local`` would move the shard back to the mesh's device).
- ``process_group_store`` (``distributed_c10d._get_process_group_store``):
  the key-value store a process group was made with (the rendezvous store,
  under the group's prefix), where ranks agree on a preemption step without
  a collective (``fp_dcp.runs.preemption``).

Protocol details (public API, but behaviour fp-dcp depends on):

- ``dcp.async_save`` uses the storage writer as its ``AsyncStager`` when
  ``isinstance(writer, AsyncStager)``; that runtime-checkable protocol also
  lists ``_synchronize_after_execute``, which ``FastPersistWriter`` leaves
  unset, so the check is False and the writer stages only when passed as
  ``async_stager=`` (torch 2.9 on; before, torch stages with its own copy)
  (``WRITER_IS_NOT_AN_ASYNC_STAGER`` names this).
- Code written for torch's ``FileSystemWriter`` passes its keyword
  arguments; ``check_filesystem_writer_options`` accepts those that leave
  the checkpoint as fp-dcp writes it and refuses the rest by name.
- For a call with only a ``checkpoint_id`` (no storage writer or reader),
  DCP's ``_storage_setup`` (``torch.distributed.checkpoint._storage_utils``)
  tries the classes bound to the names ``FileSystemWriter`` /
  ``FileSystemReader`` in that module, then fsspec's, taking the first whose
  ``validate_checkpoint_id`` accepts the id. ``default_storage`` and
  ``set_default_storage`` read and rebind exactly those two names (nothing
  else), which is all ``fp_dcp.install()`` changes.
- ``.metadata`` stores each item's location as torch's own
  ``filesystem._StorageInfo`` (file, offset, length) with two additions: a
  ``crc32c`` attribute (pickled with the instance's ``__dict__``) and a
  transform descriptor that no torch extension registry knows. torch's
  ``FileSystemReader``, which cannot read fp-dcp's raw bytes, then fails with
  ``ValueError: Unknown extension name='fp-dcp raw tensor bytes (...)'``,
  a message naming fp-dcp and the fix (``item_location`` and ``item_fields``).
- DCP caches save plans per planner class, not per storage writer, and a
  cached plan keeps the ``storage_data`` its first save's writer put in it.
  ``FastPersistWriter`` needs none, and puts what ``FileSystemWriter`` puts
  there (``stock_plan_data``), so that either writer can follow the other in
  one process with caching on.
- DCP (2.9 on; none before) retries a failed ``StorageReader.read_metadata``
  with ``rank=...`` only when the method has a parameter literally named ``kwargs``;
  ``FastPersistReader.read_metadata`` names its one differently, so its
  first error is the one reported (``READ_METADATA_KWARGS``).
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from types import FrameType
from typing import Any, NamedTuple

import torch
from torch.distributed import ProcessGroup, Store, distributed_c10d
from torch.distributed.checkpoint import _storage_utils
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo, _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.checkpoint.state_dict_saver import _save_state_dict
from torch.distributed.checkpoint.storage import StorageReader

__all__ = [
    "CHECKED_TORCH",
    "OLDEST_TORCH",
    "TORCH",
    "TorchVersionError",
    "TorchFeature",
    "ASYNC_STAGING",
    "CONSOLIDATION",
    "BALANCED_PLANS",
    "FEATURES",
    "has",
    "require",
    "WRITER_IS_NOT_AN_ASYNC_STAGER",
    "DCP_HIDES_METADATA_ERRORS",
    "READ_METADATA_KWARGS",
    "flatten_state_dict",
    "EmptyStateDictLoadPlanner",
    "load_state_dict_no_dist",
    "consolidate_safetensors_files",
    "dtensor_with_local",
    "dcp_metadata_version",
    "process_group_store",
    "save_arguments",
    "FILESYSTEM_WRITER_OPTIONS",
    "default_storage",
    "STOCK_READER_HINT",
    "item_location",
    "item_fields",
    "is_storage_info",
    "is_item_location",
    "stock_plan_data",
    "plan_rank",
    "set_default_storage",
    "check_filesystem_writer_options",
]

CHECKED_TORCH = ("2.7.1", "2.8.0", "2.9.1", "2.10.0", "2.11.0", "2.12.0", "2.13.0", "2.14.1")
OLDEST_TORCH = (2, 7)  # pyproject.toml's torch>=2.7


def _minor(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


TORCH = _minor(torch.__version__)  # (major, minor) of the torch installed here


class TorchVersionError(RuntimeError):
    """A feature needs a newer torch than the one installed; the message names the feature and the version."""


class TorchFeature(NamedTuple):
    """An fp-dcp feature that needs a torch API newer than ``OLDEST_TORCH``."""

    what: str
    since: tuple[int, int]

    def refusal(self) -> str:
        major, minor = self.since
        return f"{self.what} needs torch>={major}.{minor}; this is torch {torch.__version__}"


ASYNC_STAGING = TorchFeature(
    "the writer's own staging for dcp.async_save (async_stager=writer, FastPersistWriter's mode)",
    (2, 9),
)
CONSOLIDATION = TorchFeature(
    "SafetensorsWriter(enable_consolidation=True) (torch's consolidate_safetensors_files)", (2, 9)
)
BALANCED_PLANS = TorchFeature(
    "FastPersistSavePlanner's byte-balanced plans (DefaultSavePlanner._dedup_save_plans)", (2, 8)
)
FEATURES = (ASYNC_STAGING, CONSOLIDATION, BALANCED_PLANS)


def has(feature: TorchFeature) -> bool:
    """Whether the torch installed here has what ``feature`` needs."""
    return TORCH >= feature.since


def require(feature: TorchFeature) -> None:
    """Raise ``TorchVersionError`` naming the torch ``feature`` needs, unless this torch has it."""
    if not has(feature):
        raise TorchVersionError(feature.refusal())


# torch 2.9 to 2.11's load catches read_metadata's error, logs it only at a level nothing shows by default,
# and fails on a bare `assert metadata is not None`: the reader logs the error itself there.
DCP_HIDES_METADATA_ERRORS = (2, 9) <= TORCH < (2, 12)

WRITER_IS_NOT_AN_ASYNC_STAGER = "_synchronize_after_execute"  # the AsyncStager member the writer leaves unset
READ_METADATA_KWARGS = "kwargs"  # the parameter name that makes DCP retry read_metadata with rank=...


class EmptyStateDictLoadPlanner(_EmptyStateDictLoadPlanner):
    """torch's, taking metadata without ``planner_data`` (a safetensors directory's) on torch 2.7 too."""

    def set_up_planner(
        self, state_dict: dict[str, Any], metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        if metadata is not None and metadata.planner_data is None:  # torch 2.7 looks keys up in it unchecked
            metadata = dataclasses.replace(metadata, planner_data={})
        super().set_up_planner(state_dict, metadata, is_coordinator)


# The "name" of a transform descriptor ends at its first "/": this one has none.
STOCK_READER_HINT = (
    "fp-dcp raw tensor bytes (torch's FileSystemReader cannot read an fp-dcp checkpoint: load it with "
    "fp_dcp.FastPersistReader, or call fp_dcp.install() first, or convert it with: fp-dcp convert CKPT OUT --to dcp)"
)


def item_location(
    file: str, offset: int, length: int, crc32c: int, xxh3_128: str | None = None, xxh3_sample: str | None = None
) -> Any:
    """A ``storage_data`` value of ``.metadata`` (format version 2 and later)."""
    info = _StorageInfo(file, offset, length)
    # A field of _StorageInfo from torch 2.7 on; set as an attribute, so that a checkpoint saved with an
    # older torch carries it too (it is pickled with the instance's __dict__ either way).
    info.transform_descriptors = [f"{STOCK_READER_HINT}/1"]
    info.crc32c = crc32c  # type: ignore[attr-defined]
    for name, value in (("xxh3_128", xxh3_128), ("xxh3_sample", xxh3_sample)):
        if value is not None:
            setattr(info, name, value)
    return info


def is_storage_info(value: Any) -> bool:
    """Whether a ``storage_data`` value is torch's ``_StorageInfo`` itself (not a subclass, nor another class
    with its fields: no writer makes one, and torch's reader needs more of it than the fields)."""
    return type(value) is _StorageInfo


def is_item_location(value: Any) -> bool:
    """Whether a ``storage_data`` value is fp-dcp's (format version 2), not a stock ``_StorageInfo``."""
    return "crc32c" in getattr(value, "__dict__", {})


def item_fields(value: Any) -> tuple[str, int, int, int, str | None, str | None]:
    """(file, offset, length, crc32c, xxh3_128, xxh3_sample) of a ``storage_data`` value, any format version.

    The hashes are None where the save stored none. TypeError for a value
    neither a plain tuple (version 1) nor a ``_StorageInfo`` (``is_storage_info``).
    """
    if type(value) is tuple:  # format version 1
        file, offset, length, crc32c = value
        return file, offset, length, crc32c, None, None
    if not is_storage_info(value):
        raise TypeError(f"a {type(value).__name__}, not a _StorageInfo (nor a version-1 tuple)")
    fields = value.__dict__
    hashes = fields.get("xxh3_128"), fields.get("xxh3_sample")
    return value.relative_path, value.offset, value.length, fields["crc32c"], *hashes


def stock_plan_data(rank: int) -> Any:
    """The ``SavePlan.storage_data`` ``FileSystemWriter.prepare_global_plan`` gives rank ``rank``'s plan."""
    return _StoragePrefix(f"__{rank}_")


def plan_rank(storage_data: Any) -> int:
    """The rank ``stock_plan_data`` gave a plan: the writer's rank where DCP does not pass it to
    ``set_up_storage_writer`` (torch 2.7 calls it with ``is_coordinator`` alone)."""
    prefix = getattr(storage_data, "prefix", "__0_")
    return int(prefix[2:-1])


def default_storage() -> tuple[type, type]:
    """The (writer, reader) classes DCP tries first for a ``checkpoint_id``-only call."""
    return _storage_utils.FileSystemWriter, _storage_utils.FileSystemReader


def set_default_storage(writer: type, reader: type) -> None:
    """Make DCP try ``writer`` / ``reader`` first for ``checkpoint_id``-only calls (fsspec's come after)."""
    _storage_utils.FileSystemWriter = writer  # type: ignore[misc, assignment]
    _storage_utils.FileSystemReader = reader  # type: ignore[misc, assignment]


# FileSystemWriter's keyword arguments (torch 2.13) that FastPersistWriter takes with no effect, and why.
FILESYSTEM_WRITER_OPTIONS = {
    "single_file_per_rank": "each rank writes lanes_per_dir files into each directory",
    "sync_files": "data files are always fsynced before .metadata is published (the commit protocol)",
    "thread_count": "requests in flight are set by IOConfig (queue_depth, io_threads)",
    "per_thread_copy_ahead": "device-to-host copies are pipelined by IOConfig.staging_chunk",
    "cache_staged_state_dict": "snapshot mode keeps its host arena between saves",
}


def check_filesystem_writer_options(options: dict[str, Any]) -> None:
    """Accept ``FileSystemWriter`` keyword arguments that change nothing here; refuse the others by name."""
    for name, value in options.items():
        if name in FILESYSTEM_WRITER_OPTIONS:
            continue
        if name == "_extensions":
            if value:
                raise ValueError(
                    "FastPersistWriter stores raw tensor bytes and takes no stream extensions (_extensions); "
                    "use FileSystemWriter for compressed checkpoints"
                )
        elif name == "serialization_format":
            if getattr(value, "name", value) != "TORCH_SAVE":
                raise ValueError(f"FastPersistWriter writes its own format; serialization_format={value!r} is not it")
        else:
            raise TypeError(f"FastPersistWriter got an unexpected keyword argument {name!r}")


def load_state_dict_no_dist(state_dict: dict[str, Any], reader: StorageReader, planner: LoadPlanner) -> None:
    """DCP's load in this one process, into ``state_dict`` (filled by ``planner``)."""
    _load_state_dict(state_dict, storage_reader=reader, planner=planner, no_dist=True)


def dtensor_with_local(dtensor: Any, local: torch.Tensor) -> Any:
    """A DTensor of the same placement as ``dtensor`` whose local shard is ``local`` (on any device)."""
    return type(dtensor)(local, dtensor._spec, requires_grad=False)


def consolidate_safetensors_files(*args: Any, **kwargs: Any) -> None:
    """torch's ``consolidate_safetensors_files``, imported when first called (``CONSOLIDATION``)."""
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files as merge

    merge(*args, **kwargs)


def dcp_metadata_version(metadata: Metadata) -> str | None:
    """The DCP schema version a checkpoint's ``Metadata`` records (None where torch before 2.9 saved it)."""
    return getattr(metadata, "version", None)


def process_group_store(group: ProcessGroup | None) -> Store:
    """The store of ``group`` (None: the default group), which every rank of it reaches."""
    return distributed_c10d._get_process_group_store(
        group if group is not None else distributed_c10d._get_default_group()
    )


_SAVE_STATE_DICT = inspect.unwrap(_save_state_dict).__code__


def save_arguments() -> dict[str, Any] | None:
    """``process_group`` and ``no_dist`` of the DCP save running on this thread; None outside one."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _SAVE_STATE_DICT:
            return {name: frame.f_locals[name] for name in ("process_group", "no_dist")}
        frame = frame.f_back
    return None
