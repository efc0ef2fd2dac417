"""Checkpoint tiers: a step on each node's own disk, copies on peer nodes, and a durable copy.

``Tiers`` runs them for ``CheckpointManager``; the pieces are modules of
their own: ``nodes`` (which ranks share a disk), ``transport`` (files between
ranks over a process group), ``replication``, ``store`` and ``drain`` (the
durable tier), ``restore`` (the newest step whole somewhere, each file from
the fastest intact copy).
"""

from __future__ import annotations

from .store import DurableStore, FsspecStore, PosixStore, Retry
from .tiers import Tiers

__all__ = [
    "Tiers",
    "DurableStore",
    "PosixStore",
    "FsspecStore",
    "Retry",
]
