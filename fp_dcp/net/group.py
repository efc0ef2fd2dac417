"""The ranks of a job as fp-dcp's background work sees them: a process group, or this process alone.

Work a library runs in the background (asynchronous saves, the tiers'
replication and drains) never shares a process group with the caller's
thread: two threads' collectives on one group interleave, and on gloo every
rank then hangs. Each kind of it gets a group of its own (``Group.new``):
gloo, whatever the training backend, since everything it sends lives in
host memory. Every rank makes the same calls on a group in the same order;
each group's work runs on one thread, in the order the caller queued it.
"""

from __future__ import annotations

import os
import socket
import threading
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ..compat import save_arguments
from ..log import log_once

__all__ = ["Group", "NODE_ENV", "SHARED_DEFAULT_GROUP", "background_group", "check_save_group", "node_name"]

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
    def new(cls, parent: dist.ProcessGroup | None = None) -> Group:
        """A gloo group of the ranks of ``parent`` (None: all ranks), for one kind of background work.

        Every rank of ``parent`` calls this, in the same order, and no other.
        A group of some ranks only is made by those ranks alone
        (``use_local_synchronization``): torch names it after its ranks and
        the number of groups the calling rank belongs to, so those ranks must
        belong to as many (ranks in overlapping subgroups may not).
        """
        if not (dist.is_available() and dist.is_initialized()):
            return cls(None)
        if parent is None or dist.get_world_size(parent) == dist.get_world_size():
            return cls(dist.new_group(backend="gloo"))
        ranks = dist.get_process_group_ranks(parent)
        return cls(dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True))

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


def background_group(process_group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The group a helper's asynchronous saves run DCP's collectives on: ``process_group`` if given, else a gloo
    group of all ranks made now (every rank calls this, in the same order); None where torch.distributed is not
    running (DCP then saves this process alone)."""
    return process_group if process_group is not None else Group.new().group


SHARED_DEFAULT_GROUP = (
    "fp-dcp: an asynchronous save runs DCP's collectives in DCP's thread on the default process group, which is "
    "gloo: collectives the training loop runs on that group meanwhile (any data-parallel step's) interleave with "
    "them, and every rank can hang. Give the saves a group of their own, made once on every rank: "
    'dcp.async_save(..., process_group=dist.new_group(backend="gloo")); CheckpointManager and '
    "OverlappedCheckpointer make one themselves"
)


def check_save_group() -> None:
    """Say once where a save runs DCP's collectives off the main thread (``dcp.async_save``) on a gloo default group.

    A save on the main thread (``dcp.save``), or on a group of its own, is left alone.
    """
    if (
        threading.current_thread() is not threading.main_thread()
        and dist.is_available()
        and dist.is_initialized()
        and dist.get_backend() == "gloo"
        and save_arguments() == {"process_group": None, "no_dist": False}
    ):
        log_once(SHARED_DEFAULT_GROUP)
