"""``SafetensorsWriter``: DCP saves as Hugging Face safetensors files, written through fp-dcp's engine.

It takes ``HuggingFaceStorageWriter``'s arguments and writes what that
writer writes, so either reads the other's output (and so do
``safetensors.torch.load_file``, ``HuggingFaceStorageReader`` and
``FastPersistReader``):

- ``fqn_to_index_mapping`` puts each tensor into file ``model-0000i-of-0000N.safetensors``
  (``N`` the largest index); without it every tensor goes to ``model-00001-of-00001``.
- ``save_distributed=False`` (the default) saves one full state dict: each
  file's tensors must all be on one rank (e.g. ``get_model_state_dict(...,
  options=StateDictOptions(full_state_dict=True, cpu_offload=True))`` on
  rank 0). The coordinator then writes ``model.safetensors.index.json``.
- ``save_distributed=True``: every rank writes its own chunks into
  ``shard-0000r-model-0000i-of-0000N.safetensors`` (``r`` = rank + 1), each
  chunk's place in its tensor in the header's ``DCP_SHARDING_INFO``; there is
  no index. ``FastPersistReader`` loads such a directory resharded to any
  placement; torch's ``consolidate_safetensors_files`` (and ``..._on_every_rank``)
  merge it into whole tensors.
- ``enable_consolidation=True`` (with ``save_distributed``): the chunks go to
  ``path/sharded``, then the coordinator merges them into whole tensors in
  ``path`` with torch's ``consolidate_safetensors_files`` (its own buffered
  I/O, not fp-dcp's engine; it needs the ``safetensors`` package and handles
  floating-point tensors only, so other dtypes are refused before anything
  is written), on ``thread_count_consolidation`` threads.

Refused by name, before anything is written: non-tensor entries
(safetensors stores tensors only), dtypes safetensors has no name for, a
tensor missing from ``fqn_to_index_mapping``, tensors of one file held by
several ranks without ``save_distributed`` (``HuggingFaceStorageWriter``
would let the ranks overwrite each other's file), two chunks of one tensor
on one rank (a file holds each name once), ``enable_consolidation`` without
``save_distributed``.

How the bytes move: each file is laid out as safetensors requires (header,
then every tensor back to back, widest dtype first), with the header padded
so the data starts on a page; the write pipeline's engine writes it
(io_uring, O_DIRECT where the filesystem allows, from tensor memory where it
is co-aligned with the file, else through the staging buffers), under a
temporary name that is renamed into place once fsynced, so a file under its
final name is always whole. ``thread_count`` changes nothing (requests in
flight come from ``config``). CUDA tensors are copied to the host in slabs.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import secrets
import time
import uuid
from collections import defaultdict
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ..compat import CONSOLIDATION, consolidate_safetensors_files, require
from ..config import IOConfig
from ..io.engine import engine_stores
from ..io.files import fsync_directory, write_durably
from ..safetensors_format import (
    DCP_METADATA,
    INDEX_NAME,
    NAMES,
    SAVED_OFFSETS,
    SHARDING_KEY,
    encode_header,
    encode_index,
    file_name,
)
from ..tensors import ByteSource
from .checkpoint_path import checkpoint_directory
from .context import WriteContext
from .controls import SaveControls
from .pipeline import Placed, resolve, write_laid_out
from .resources import WriterResources
from .summary import SaveSummary
from .writer import FastPersistWriter

__all__ = ["SafetensorsWriter"]

SHARDED_DIR = "sharded"  # where enable_consolidation puts the chunks, as HuggingFaceStorageWriter does


@dataclasses.dataclass(frozen=True)
class _Files:
    """One rank's part of the save's naming: its shard number (``save_distributed``) and the file count."""

    shard: int | None
    count: int


class SafetensorsWriter(StorageWriter):
    """Saves DCP state dicts as Hugging Face safetensors files at the speed of the disk.

    A drop-in for ``torch.distributed.checkpoint.HuggingFaceStorageWriter``
    (``fp_dcp.save.safetensors`` says what each argument does)::

        dcp.save(state_dict, storage_writer=SafetensorsWriter(path, fqn_to_index_mapping=mapping))

    Args:
        path: the directory. DCP's ``checkpoint_id`` overrides it.
        fqn_to_index_mapping: tensor name -> file index (1 to N); None: one file.
        thread_count: accepted for ``HuggingFaceStorageWriter``'s signature; changes nothing.
        save_distributed: every rank writes its own chunks (no index); else one full state dict.
        enable_consolidation: with ``save_distributed``, merge the chunks into whole tensors in ``path``.
        thread_count_consolidation: threads of that merge.
        config: I/O settings (engine, O_DIRECT, buffers, queue depth).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        fqn_to_index_mapping: dict[str, int] | None = None,
        thread_count: int = 1,
        save_distributed: bool = False,
        enable_consolidation: bool = False,
        thread_count_consolidation: int = 1,
        *,
        config: IOConfig | None = None,
    ) -> None:
        super().__init__()
        if enable_consolidation and not save_distributed:
            raise ValueError(
                "SafetensorsWriter(enable_consolidation=True) needs save_distributed=True: "
                "without it the files already hold whole tensors"
            )
        if enable_consolidation:
            require(CONSOLIDATION)
            _needs_safetensors_package()
        self.config = config if config is not None else IOConfig()
        if not engine_stores(self.config):
            raise ValueError(
                f"SafetensorsWriter cannot use engine={self.config.engine!r}: its files are complete once renamed "
                "into place, and that engine stores nothing in them"
            )
        self._default_path = checkpoint_directory(path)
        self._path = self._default_path
        self.fqn_to_index_mapping = fqn_to_index_mapping
        self.save_distributed = save_distributed
        self.enable_consolidation = enable_consolidation
        self.thread_count_consolidation = thread_count_consolidation
        self._resources = WriterResources(self.config)  # GPU tensors cross through its staging, as in saves
        self.save_id = str(uuid.uuid4())
        self.last_save: SaveSummary | None = None

    @property
    def path(self) -> str:
        """Where the safetensors files go (``path/sharded`` while consolidating)."""
        return os.path.join(self._path, SHARDED_DIR) if self.enable_consolidation else self._path

    # ----------------------------------------------------------- DCP contract

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._path = checkpoint_directory(checkpoint_id) if checkpoint_id else self._default_path

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.save_id = str(uuid.uuid4())
        os.makedirs(self.path, exist_ok=True)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Refuse what safetensors, or the options, cannot store, before anything is written."""
        for item in plan.items:
            self._check(item)
        return plan

    def _check(self, item: WriteItem) -> None:
        fqn = item.index.fqn
        if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
            raise ValueError(f"safetensors stores tensors only; {fqn!r} is not one: leave it out of the state dict")
        dtype = item.tensor_data.properties.dtype
        if dtype not in NAMES:
            raise ValueError(f"safetensors has no name for {fqn!r}'s dtype {dtype}")
        if self.fqn_to_index_mapping is not None and fqn not in self.fqn_to_index_mapping:
            raise ValueError(f"{fqn!r} is not in fqn_to_index_mapping: which file it goes to is not said")
        if self.enable_consolidation and not dtype.is_floating_point:
            raise ValueError(
                f"enable_consolidation runs torch's consolidate_safetensors_files, which handles floating-point "
                f"tensors only; {fqn!r} is {dtype}: save without consolidation"
            )

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        count = max(self.fqn_to_index_mapping.values(), default=1) if self.fqn_to_index_mapping else 1
        if not self.save_distributed:
            holders: dict[int, set[int]] = defaultdict(set)
            for rank, plan in enumerate(plans):
                for item in plan.items:
                    holders[self._file_index(item)].add(rank)
            for index, ranks in sorted(holders.items()):
                if len(ranks) > 1:
                    raise ValueError(
                        f"ranks {sorted(ranks)} all hold tensors for {file_name(index, count)}: without "
                        "save_distributed=True the state dict must be whole on one rank (a full state dict), "
                        "or each rank would overwrite the others' file"
                    )
        shards = [rank + 1 if self.save_distributed else None for rank in range(len(plans))]
        return [dataclasses.replace(p, storage_data=_Files(s, count)) for p, s in zip(plans, shards, strict=True)]

    def _file_index(self, item: WriteItem) -> int:
        return self.fqn_to_index_mapping[item.index.fqn] if self.fqn_to_index_mapping else 1

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        start = time.perf_counter()
        results: list[WriteResult] = []
        names: list[str] = []
        if plan.items:
            files: _Files = plan.storage_data
            by_file: dict[int, list[WriteItem]] = defaultdict(list)
            for item in plan.items:
                by_file[self._file_index(item)].append(item)
            ctx = self._resources.context(SaveControls())
            token = secrets.token_hex(4)
            laid_out = []
            for index, items in sorted(by_file.items()):
                name = file_name(index, files.count, files.shard)
                placed, size = self._lay_out(name, items, planner, ctx, results)
                laid_out.append((os.path.join(self.path, f"{name}.{token}.tmp"), placed, size))
                names.append(name)
            ctx.copier.prepare(ctx.pool, [p.source for _, placed, _ in laid_out for p in placed])
            directs = write_laid_out(laid_out, ctx)
            for (tmp, _, _), name in zip(laid_out, names, strict=True):
                os.replace(tmp, os.path.join(self.path, name))
            fsync_directory(self.path)
            self.last_save = SaveSummary(
                bytes=sum(r.size_in_bytes for r in results),
                seconds=time.perf_counter() - start,
                files=tuple(names),
                engine=ctx.engine.describe(),
                direct_io=all(directs),
                staging=ctx.copier.describe(),
            )
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def _lay_out(
        self, name: str, items: list[WriteItem], planner: SavePlanner, ctx: WriteContext, results: list[WriteResult]
    ) -> tuple[list[Placed], int]:
        """The file's header and its items at their offsets, and its size; the items' results go to ``results``."""
        chunks = {}
        for item in items:
            assert item.tensor_data is not None  # prepare_local_plan refused the rest
            if item.index.fqn in chunks:
                raise ValueError(
                    f"this rank holds two chunks of {item.index.fqn!r} for {name}, which can hold each name once"
                )
            chunks[item.index.fqn] = item.tensor_data
        metadata = {
            SHARDING_KEY: json.dumps({fqn: {SAVED_OFFSETS: list(c.chunk.offsets)} for fqn, c in chunks.items()}),
            **DCP_METADATA,
        }
        header, offsets = encode_header(
            [(fqn, c.properties.dtype, c.chunk.sizes) for fqn, c in chunks.items()], metadata
        )
        slab = ctx.pool.size
        placed: list[Placed] = [Placed(ByteSource(io.BytesIO(header), slab))]
        size = len(header)
        for item in items:
            it = resolve(item, planner, slab, ctx.copier)
            it.offset = len(header) + offsets[item.index.fqn]
            placed.append(it)
            size += it.source.nbytes
            results.append(WriteResult(item.index, it.source.nbytes, (name, it.offset, it.source.nbytes)))
        return sorted(placed, key=lambda p: p.offset), size

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        if self.enable_consolidation:
            mapping = self.fqn_to_index_mapping or dict.fromkeys(metadata.state_dict_metadata, 1)
            consolidate_safetensors_files(
                input_dir=self.path,
                output_dir=self._path,
                fqn_to_index_mapping=mapping,
                num_threads=self.thread_count_consolidation,
            )
        elif not self.save_distributed:
            stored = [r for rs in results for r in rs]
            weight_map = {r.index.fqn: r.storage_data[0] for r in stored}
            index = encode_index(weight_map, sum(r.size_in_bytes for r in stored))
            write_durably(os.path.join(self.path, INDEX_NAME), index)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return FastPersistWriter.validate_checkpoint_id(checkpoint_id)  # the same directories

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self._path, save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str:
        return self._path

    # -------------------------------------------------------------- resources

    def close(self) -> None:
        """Release the staging buffers and the I/O engine."""
        self._resources.close()

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _needs_safetensors_package() -> None:
    try:
        import safetensors  # noqa: F401  (torch's consolidation imports it)
    except ImportError:
        raise ImportError(
            "enable_consolidation=True runs torch's consolidate_safetensors_files, which needs the safetensors "
            "package: pip install 'fp-dcp[safetensors]'"
        ) from None
