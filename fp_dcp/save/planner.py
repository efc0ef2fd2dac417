"""``FastPersistSavePlanner``: every rank writes a near-equal share of the bytes.

DCP's default planner keeps each replicated tensor whole and gives it to one
rank, so a state dict dominated by one large replicated tensor (an embedding
table, DDP-style weights) leaves the other ranks idle while one writes. This
planner cuts replicated tensors above ``split_bytes`` into row chunks (the
checkpoint then describes them as chunked tensors, which DCP loads at any
world size), and the coordinator deals every replicated chunk to the least
loaded rank holding it, largest first. That is FastPersist's data-parallel
write partitioning at row granularity.

    dcp.save(state, storage_writer=FastPersistWriter(path), planner=FastPersistSavePlanner())

``byte_shares`` (on the coordinator, after planning) lists the bytes each rank
writes; they are also logged at INFO level on the ``fp_dcp`` logger.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor, Replicate

from ..compat import BALANCED_PLANS, has
from ..format import stored_nbytes
from ..io.dealing import deal
from ..log import log, log_once

__all__ = ["FastPersistSavePlanner", "balance"]


def _replicated(obj: Any) -> bool:
    """Whether every rank of the group (or of a mesh dimension) holds this same tensor data."""
    if isinstance(obj, DTensor):
        return any(isinstance(p, Replicate) for p in obj.placements)
    return isinstance(obj, torch.Tensor) and type(obj) in (torch.Tensor, torch.nn.Parameter)


def balance(plans: list[SavePlan]) -> tuple[list[SavePlan], list[int]]:
    """Keep each item in exactly one of the plans holding it, evening out bytes.

    Returns the plans and the bytes per plan.
    """
    holders: dict[MetadataIndex, list[int]] = {}
    sizes: dict[MetadataIndex, int] = {}
    for rank, plan in enumerate(plans):
        for item in plan.items:
            holders.setdefault(item.index, []).append(rank)
            sizes[item.index] = stored_nbytes(item) or 1  # byte items: small, unknown size
    indices = list(holders)
    owners, load = deal([sizes[i] for i in indices], [holders[i] for i in indices], len(plans))
    owner = dict(zip(indices, owners, strict=True))
    balanced = [
        dataclasses.replace(plan, items=[item for item in plan.items if owner[item.index] == rank])
        for rank, plan in enumerate(plans)
    ]
    return balanced, load


class FastPersistSavePlanner(DefaultSavePlanner):
    """A ``DefaultSavePlanner`` that balances the bytes each rank writes.

    Args:
        split_bytes: replicated tensors (or replicated DTensor chunks) at least
            this large are cut into row chunks; smaller ones are dealt whole.
        chunks_per_rank: a split tensor becomes about ``world_size *
            chunks_per_rank`` row chunks: more chunks balance more finely, at
            the cost of more (smaller) items in the metadata.
        **kwargs: passed to ``DefaultSavePlanner``.
    """

    def __init__(self, *args: Any, split_bytes: int = 16 << 20, chunks_per_rank: int = 4, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if chunks_per_rank < 1:
            raise ValueError(f"chunks_per_rank must be at least 1, got {chunks_per_rank}")
        self.split_bytes = split_bytes
        self.chunks_per_rank = chunks_per_rank
        self.byte_shares: list[int] = []
        if not has(BALANCED_PLANS):
            log_once(f"{BALANCED_PLANS.refusal()}: DCP's own de-duplication deals the items out instead")
        self._row_chunks: dict[tuple[str, tuple[int, ...]], tuple[int, int]] = {}

    def create_local_plan(self) -> SavePlan:
        sent = super().create_local_plan()
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if world == 1:
            return sent
        # With plan caching, an unchanged plan is sent as an empty "unusable" one and the
        # cached final plan is written; the row chunks it names must be known all the same.
        full = self.plan
        self._row_chunks = {}
        items: list[WriteItem] = []
        for item in full.items:
            items += self._split(item, world)
        self.plan = dataclasses.replace(full, items=items)
        return self.plan if sent.usable else sent

    def _split(self, item: WriteItem, world: int) -> list[WriteItem]:
        data = item.tensor_data
        if data is None or len(data.chunk.sizes) == 0 or (stored_nbytes(item) or 0) < self.split_bytes:
            return [item]
        if not _replicated(self.state_dict.get(item.index.fqn)):
            return [item]
        rows = data.chunk.sizes[0]
        step = math.ceil(rows / min(rows, world * self.chunks_per_rank))
        if step >= rows:
            return [item]
        pieces = []
        for r in range(0, rows, step):
            offsets = torch.Size([data.chunk.offsets[0] + r, *data.chunk.offsets[1:]])
            sizes = torch.Size([min(step, rows - r), *data.chunk.sizes[1:]])
            self._row_chunks[(item.index.fqn, tuple(offsets))] = (r, sizes[0])
            pieces.append(
                WriteItem(
                    index=MetadataIndex(item.index.fqn, offsets),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(ChunkStorageMetadata(offsets, sizes), data.properties, data.size),
                )
            )
        return pieces

    def _dedup_save_plans(self, all_plans: list[SavePlan]) -> list[SavePlan]:
        plans, self.byte_shares = balance(all_plans)
        mean = sum(self.byte_shares) / len(self.byte_shares)
        log.info(
            "fp-dcp: bytes written per rank %s (max/mean %.3f)",
            self.byte_shares,
            max(self.byte_shares) / mean if mean else 1.0,
        )
        return plans

    def lookup_object(self, index: MetadataIndex) -> Any:
        chunk = self._row_chunks.get((index.fqn, tuple(index.offset or ())))
        if chunk is None:
            return super().lookup_object(index)
        obj = self.state_dict[index.fqn]
        local = obj.to_local() if isinstance(obj, DTensor) else obj
        start, rows = chunk
        return local.narrow(0, start, rows)
