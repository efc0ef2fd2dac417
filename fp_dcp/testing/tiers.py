"""Checkpoint tiers on one machine: 4 gloo ranks as 2 nodes, what each saves at a step, a slow durable store.

Ranks 0-1 are node "a", ranks 2-3 node "b" (``FP_DCP_NODE``); each node's
fast tier is ``<tmp>/local-{node}``. The tier tests, the tier crash trials
(``fp_dcp.testing.tier_crash``) and ``benchmarks/tiers_bench.py`` run
their managers through ``manager``.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from .. import CheckpointManager
from ..tiers import PosixStore

__all__ = ["NODES", "set_node", "local_root", "state_of", "empty_state", "manager", "same_state", "SlowStore"]

NODES = {0: "a", 1: "a", 2: "b", 3: "b"}


def set_node(rank: int) -> None:
    """This process is on rank ``rank``'s node (``FP_DCP_NODE``)."""
    os.environ["FP_DCP_NODE"] = NODES[rank]


def local_root(tmp: str, node: str | None = None) -> str:
    """The fast tier of ``node``, or the root whose ``{node}`` the manager fills in."""
    return os.path.join(tmp, f"local-{node or '{node}'}")


def state_of(step: int, rank: int, world: int = 4) -> dict[str, Any]:
    """What rank ``rank`` saves at ``step``: a tensor of its own (a file per rank), and one all share."""
    g = torch.Generator().manual_seed(step)
    shared = torch.randn(64, 128, generator=g)
    own = torch.randn(200_000 + 1000 * rank, generator=torch.Generator().manual_seed(1000 * step + rank))
    return {f"own{rank}": own, "shared": shared, "frozen": torch.arange(50_000, dtype=torch.float32)}


def empty_state(rank: int) -> dict[str, Any]:
    """Targets for ``state_of(step, rank)``, zeroed."""
    return {k: torch.zeros_like(v) for k, v in state_of(0, rank).items()}


def manager(tmp: str, rank: int, **options: Any) -> CheckpointManager:
    """Rank ``rank``'s manager on its node's fast tier (synchronous unless ``options`` say otherwise)."""
    set_node(rank)
    options.setdefault("asynchronous", False)
    return CheckpointManager(local_root(tmp), **options)


def same_state(got: dict[str, Any], step: int, rank: int) -> bool:
    """Whether ``got`` holds, bit for bit, what rank ``rank`` saved at ``step``."""
    want = state_of(step, rank)
    return all(torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)) for k in want)


class SlowStore(PosixStore):
    """A durable directory that takes ``delay`` seconds more for every file: a drain slower than the saves."""

    def __init__(self, root: str, delay: float) -> None:
        super().__init__(root)
        self.delay = delay

    def put_file(self, key: str, source: str, size: int, check: Any) -> list[str]:
        time.sleep(self.delay)
        return super().put_file(key, source, size, check)
