"""Checkpoint tiers: a step on each node's own disk, copies on peer nodes, and a durable copy.

``Tiers`` runs them for ``CheckpointManager``; the pieces are modules of
their own: ``nodes`` (which ranks share a disk), ``transport`` (files between
ranks over a process group), ``replication``, ``store`` and ``drain`` (the
durable tier), ``restore`` (the newest step whole somewhere, each file from
the fastest intact copy).
"""

from __future__ import annotations

from .drain import DURABLE_NAME
from .layout import NODE_MARKER, parse_step_name, step_name
from .replication import REPLICATED_NAME
from .store import DurableStore, FsspecStore, PosixStore, Retry
from .tiers import Tiers

__all__ = [
    "Tiers",
    "DurableStore",
    "PosixStore",
    "FsspecStore",
    "Retry",
    "REPLICATED_NAME",
    "DURABLE_NAME",
    "NODE_MARKER",
    "step_name",
    "parse_step_name",
]
