"""Peer replication: each rank's files of a published step, copied to ranks on ``replicas - 1`` other nodes.

Runs on its own thread and process group (``Worker``, ``Group``) after the
step is published on every node. Copies land in the receiving node's own
directory of the step, under the same name, and only once their bytes passed
every CRC-32C of the step (``FileSink``). When every file has ``replicas``
intact copies on distinct nodes, each node records it in the step's
``.replicated`` file (``fp-dcp ls`` shows it); restore does not depend on
that record: it looks for the files themselves.
"""

from __future__ import annotations

import dataclasses
import json
import os

from ..errors import CheckpointError
from ..io.files import write_durably
from ..log import log
from ..names import REPLICATED_NAME
from ..net.group import Group
from ..net.transport import FileSink, Transfer, Transport
from .layout import StepLayout
from .nodes import Nodes

__all__ = ["Replicated", "plan", "replicate"]


@dataclasses.dataclass(frozen=True)
class Replicated:
    """What one step's replication achieved (the same on every rank)."""

    step: int
    copies: dict[str, list[str]]  # file key -> the nodes that hold an intact copy
    problems: list[str]
    bytes: int  # sent by this rank

    @property
    def ok(self) -> bool:
        return not self.problems


def plan(layout: StepLayout, nodes: Nodes, replicas: int) -> list[Transfer]:
    """Every copy of the step's own files to make, in the order all ranks walk them."""
    files = layout.files()
    return sorted(
        Transfer(key, writer, peer, files[key])
        for key in layout.own()
        if (writer := layout.writer(key)) is not None and writer < len(nodes.names)
        for peer in nodes.replica_ranks(writer, replicas)
    )


def replicate(step: int, directory: str, nodes: Nodes, replicas: int, transport: Transport) -> Replicated:
    """Copy this rank's files of the step in ``directory`` (its node's copy) to its peers; every rank calls this."""
    group: Group = transport.group
    try:
        layout: StepLayout | None = StepLayout.open(directory)
        problem = ""
    except (CheckpointError, OSError) as e:
        layout, problem = None, f"rank {group.rank} cannot open its node's copy of step {step}: {e}"
    # all or none: a rank that cannot take part would leave its peers waiting for it
    failures = [p for p in group.all_gather(problem) if p]
    if failures or layout is None:
        log.warning("fp-dcp: step %d not replicated: %s", step, "; ".join(failures[:3]))
        return Replicated(step, {}, failures, 0)
    transfers = plan(layout, nodes, replicas)
    root = os.path.dirname(directory)
    before = transport.sent
    outcome = transport.run(
        transfers,
        source=lambda t: layout.checkpoint.files[os.path.basename(t.key)],
        sink=lambda t: FileSink(os.path.join(root, t.key), layout.check(t.key)),
    )
    received = [(t.key, nodes.names[t.dst], problems) for t, problems in outcome.items()]
    copies = {t.key: [nodes.names[t.src]] for t in transfers}
    problems: list[str] = []
    for key, node, found in (entry for entries in group.all_gather(received) for entry in entries):
        problems += found
        if not found:
            copies[key].append(node)
    result = Replicated(step, copies, problems, transport.sent - before)
    if result.ok and group.rank == nodes.leader(nodes.names[group.rank]):
        record = json.dumps({"replicas": replicas, "copies": copies}, sort_keys=True)
        write_durably(os.path.join(directory, REPLICATED_NAME), record)
    if not result.ok:
        log.warning("fp-dcp: step %d is not fully replicated: %s", step, "; ".join(problems[:3]))
    return result
