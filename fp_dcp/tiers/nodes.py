"""Which ranks share a node, and where each node keeps its fast tier.

A node is whatever shares a local disk: by default the host name, gathered
from every rank. ``FP_DCP_NODE`` overrides it per process, so that one
machine can play several nodes (tests, or containers that share a host name).
A root path may contain ``{node}``, which each rank expands to its node's name,
so that simulated nodes get a directory each.
"""

from __future__ import annotations

import dataclasses

from ..net.group import NODE_ENV, Group, node_name

__all__ = ["NODE_ENV", "Nodes", "node_name", "expand_root"]


def expand_root(root: str, node: str) -> str:
    """``root`` with ``{node}`` replaced by ``node``."""
    return root.replace("{node}", node)


@dataclasses.dataclass(frozen=True)
class Nodes:
    """The node of every rank (``names[rank]``), as all ranks agreed on it."""

    names: tuple[str, ...]

    @classmethod
    def gather(cls, group: Group) -> Nodes:
        return cls(tuple(group.all_gather(node_name())))

    def distinct(self) -> list[str]:
        """The nodes, in the order of their first rank."""
        return list(dict.fromkeys(self.names))

    def ranks_on(self, node: str) -> list[int]:
        return [rank for rank, name in enumerate(self.names) if name == node]

    def leader(self, node: str) -> int:
        """The rank that acts for ``node`` where one rank must (its lowest)."""
        return self.ranks_on(node)[0]

    def replica_ranks(self, rank: int, replicas: int) -> list[int]:
        """The ranks that keep copies of ``rank``'s files: one on each of the ``replicas - 1`` next nodes.

        Nodes are taken in a ring from ``rank``'s own, so every node sends to
        and receives from as many as it can; on each, the rank of the same
        local index (modulo its size), so a node's ranks share the receiving.
        """
        nodes = self.distinct()
        if replicas > len(nodes):
            raise ValueError(
                f"replicas={replicas} needs that many nodes, but the job runs on {len(nodes)} ({', '.join(nodes)}); "
                f"set {NODE_ENV} per process to say which ranks share a disk"
            )
        home = self.names[rank]
        local = self.ranks_on(home).index(rank)
        start = nodes.index(home)
        targets = []
        for hop in range(1, replicas):
            ranks = self.ranks_on(nodes[(start + hop) % len(nodes)])
            targets.append(ranks[local % len(ranks)])
        return targets
