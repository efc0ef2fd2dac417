"""The ranks of a job as the tiers see them: a process group, or this process alone.

Tiers move bytes in the background while training uses its own collectives,
so they get process groups of their own (``Group.new``): gloo, whatever the
training backend, since everything they send lives in host memory. Every
rank makes the same calls on a group in the same order; the tiers keep to
that by running each group's work on one thread, in the order the manager
queued it.
"""

from __future__ import annotations

import os
import socket
from typing import Any, TypeVar

import torch
import torch.distributed as dist

__all__ = ["Group", "NODE_ENV", "node_name"]

NODE_ENV = "FP_DCP_NODE"


def node_name() -> str:
    """This process's node (what shares a local disk): ``FP_DCP_NODE`` if set, else the host name."""
    return os.environ.get(NODE_ENV) or socket.gethostname()


T = TypeVar("T")


class Group:
    """Collectives over ``group`` (None: the default group), or no-ops when torch.distributed is not running."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world = dist.get_world_size(group) if self.distributed else 1

    @classmethod
    def new(cls) -> Group:
        """A gloo group of all ranks, for one kind of background work (every rank must call this together)."""
        if not (dist.is_available() and dist.is_initialized()):
            return cls(None)
        return cls(dist.new_group(backend="gloo"))

    def global_rank(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank

    def all_gather(self, value: T) -> list[T]:
        if not self.distributed:
            return [value]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, value, group=self.group)
        return out

    def broadcast(self, value: T, src: int = 0) -> T:
        """``value`` of rank ``src`` (of this group), on every rank."""
        if not self.distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=self.global_rank(src), group=self.group)
        return box[0]

    def send(self, tensor: torch.Tensor, dst: int) -> dist.Work:
        work = dist.isend(tensor, self.global_rank(dst), group=self.group)
        assert work is not None
        return work

    def irecv(self, tensor: torch.Tensor, src: int) -> dist.Work:
        work = dist.irecv(tensor, self.global_rank(src), group=self.group)
        assert work is not None
        return work

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(self.group)
