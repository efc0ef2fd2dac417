"""Restore across tiers: the newest step that is whole somewhere, each file from the fastest copy that holds it.

Every rank calls ``fetch_step`` together. In turn:

1. Each node's leader lists its local root (step directories, their files
   and sizes); the coordinator lists the durable root.
2. The coordinator takes the newest step whose ``.metadata`` some tier holds
   and every file of which some tier holds (at its full size): the node's own
   disk, a peer's copy, or the durable root.
3. Every node gets that ``.metadata``; each rank works out which files its
   own load will read (DCP's load planner, so resharded loads fetch only what
   they need), and the coordinator assigns each file a node lacks to a source:
   another node that holds it (over the process group), else the durable
   root. Each arriving file is checked against the step's CRC-32Cs before it
   is published in the node's directory of the step; a copy that fails is
   struck from the sources and the file fetched again from the next one.
4. With ``verify``, the copies a node already holds are checked (read whole)
   first, and damaged ones are treated as absent.

The step is then loaded from each node's own directory by the caller.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from ..checkpoint import decode_checked
from ..errors import CheckpointError
from ..io.files import NotRegularFileError, open_regular
from ..load.stream_check import StreamCheck
from ..log import log
from ..names import METADATA_NAME, parse_step_name, step_name
from ..net.group import Group
from ..net.transport import DEFAULT_CHUNK, FileSink, Transfer, Transport
from .layout import StepLayout, files_in_metadata, list_tier, mark_node, mark_referenced, publish_metadata
from .nodes import Nodes
from .store import DurableStore

__all__ = ["Fetched", "fetch_step"]

DURABLE = "durable"  # a source that is not a node
_ROUNDS = 4  # fetch rounds: a damaged copy found in one round is replaced from another source in the next


@dataclasses.dataclass(frozen=True)
class Fetched:
    """The step chosen and where its files came from (the same on every rank)."""

    step: int
    sources: dict[str, str]  # file key -> "local", a node's name, or "durable", for this node's needs
    damaged: list[str]  # copies found damaged (and not used)

    def describe(self) -> str:
        counts = Counter(
            "this node's disk" if s == "local" else ("durable storage" if s == DURABLE else f"node {s}")
            for s in self.sources.values()
        )
        found = ", ".join(f"{n} file(s) from {where}" for where, n in sorted(counts.items()))
        damaged = f"; damaged copies not used: {'; '.join(self.damaged[:3])}" if self.damaged else ""
        return (found or "no file needed") + damaged


class _Tiers:
    """(coordinator) Every copy the tiers hold: {source: {key: size}}, a source being a node's name or DURABLE."""

    def __init__(self, leaders: dict[str, dict[str, dict[str, int]]], durable: dict[str, dict[str, int]]) -> None:
        self.holds = {
            source: {f"{step}/{name}": size for step, names in inventory.items() for name, size in names.items()}
            for source, inventory in [*leaders.items(), (DURABLE, durable)]
        }

    def newest(self, exclude: set[int]) -> tuple[int, str] | None:
        """The newest step not in ``exclude`` whose ``.metadata`` a source holds, and that source."""
        found = []
        for source, held in self.holds.items():
            for key in held:
                step_dir, _, name = key.partition("/")
                number = parse_step_name(step_dir)
                if name == METADATA_NAME and number is not None and number not in exclude:
                    found.append((number, source != DURABLE, source))  # the same step: a node's copy first
        return max(found)[::2] if found else None

    def holders(self, key: str, size: int) -> list[str]:
        """The sources with the file at its full size, nodes before the durable root."""
        return [s for s, held in self.holds.items() if held.get(key, -1) >= size]


def fetch_step(
    state: dict[str, Any],
    root: str,
    nodes: Nodes,
    transport: Transport,
    store: DurableStore | None,
    *,
    exclude: set[int],
    verify: bool,
) -> Fetched | None:
    """Make the newest step not in ``exclude`` that is whole somewhere loadable from every node's ``root``.

    None when no tier holds such a step.
    """
    group = transport.group
    leader = group.rank == nodes.leader(nodes.names[group.rank])
    inventories = group.all_gather(list_tier(root) if leader else None)
    tiers: _Tiers | None = None
    if group.rank == 0:
        durable: dict[str, dict[str, int]] = {}
        if store is not None:
            try:
                durable = store.inventory()
            except Exception as e:  # an unreachable store is one tier fewer, not a failed restore
                log.warning("fp-dcp: the durable root %s cannot be listed, restoring without it: %s", store.url, e)
        tiers = _Tiers({nodes.names[r]: inv for r, inv in enumerate(inventories) if inv is not None}, durable)
    tried = set(exclude)
    while True:
        pick = group.broadcast(tiers.newest(tried) if tiers is not None else None)
        if pick is None:
            return None
        step, source = pick
        data = _metadata(step, source, root, nodes, group, store)
        if data is None:  # that copy is damaged or unreadable: the same step from another source, if any
            if tiers is not None:
                tiers.holds[source].pop(f"{step_name(step)}/{METADATA_NAME}", None)
            continue
        tried.add(step)
        files = files_in_metadata(step_name(step), data)
        lacking = [key for key, size in files.items() if not tiers.holders(key, size)] if tiers is not None else []
        if group.broadcast(lacking):
            if group.rank == 0:
                log.warning("fp-dcp: skipping step %d: no tier holds %s", step, ", ".join(lacking[:3]))
            continue
        fetched = _fetch(state, step, root, data, tiers, nodes, transport, store, verify)
        if fetched is not None:
            return fetched


def _metadata(
    step: int, source: str, root: str, nodes: Nodes, group: Group, store: DurableStore | None
) -> bytes | None:
    """The step's ``.metadata`` from ``source``, on every rank; None if it is unreadable or fails its checksums."""
    src = 0 if source == DURABLE else nodes.leader(source)
    data: bytes | None = None
    if group.rank == src:
        key = f"{step_name(step)}/{METADATA_NAME}"
        try:
            if source == DURABLE:
                assert store is not None
                data = store.get_bytes(key)
            else:
                with open_regular(os.path.join(root, key)) as f:
                    data = f.read()
            decode_checked(data, f"{source}:{key}")  # every check of opening it: checksums, tiling, locations
            files_in_metadata(step_name(step), data)  # and every owner a step of this root (its files have keys)
        except (CheckpointError, OSError) as e:
            log.warning("fp-dcp: the %s of step %d on %s cannot be used: %s", METADATA_NAME, step, source, e)
            data = None
    return group.broadcast(data, src=src)


def _needed(state: dict[str, Any], layout: StepLayout) -> set[str]:
    """The keys of the files this rank's load of ``state`` reads (all of them if it cannot tell)."""
    try:
        planner = DefaultLoadPlanner()
        planner.set_up_planner(state, layout.checkpoint.metadata, is_coordinator=False)
        plan = planner.create_local_plan()
        names = {layout.checkpoint.metadata.storage_data[item.storage_index].file for item in plan.items}
    except Exception:  # the load itself will say what is wrong with the state: fetch everything meanwhile
        return set(layout.files())
    return {layout.key(name) for name in names}


def _fetch(
    state: dict[str, Any],
    step: int,
    root: str,
    data: bytes,
    tiers: _Tiers | None,
    nodes: Nodes,
    transport: Transport,
    store: DurableStore | None,
    verify: bool,
) -> Fetched | None:
    """Bring every node the files of ``step`` its ranks will read; None if some file has no intact copy left."""
    group = transport.group
    node = nodes.names[group.rank]
    directory = os.path.join(root, step_name(step))
    if group.rank == nodes.leader(node):
        publish_metadata(directory, data)
        mark_node(directory, node)
    group.barrier()
    layout = StepLayout.open(directory)
    files = layout.files()
    needs = group.all_gather(sorted(_needed(state, layout)))
    wanted = {n: sorted({k for r in nodes.ranks_on(n) for k in needs[r]}) for n in nodes.distinct()}
    damaged: list[str] = []
    if verify and group.rank == nodes.leader(node):
        damaged = [k for k in wanted[node] if _damaged_copy(os.path.join(root, k), layout.check(k))]
    damaged = [f"{key} on {nodes.names[r]}" for r, keys in enumerate(group.all_gather(damaged)) for key in keys]
    if tiers is not None:
        for where in damaged:
            key, _, source = where.partition(" on ")
            tiers.holds[source].pop(key, None)
    sources: dict[str, str] = {}
    for _ in range(_ROUNDS):
        plan = group.broadcast(_plan(tiers, wanted, files, nodes) if tiers is not None else None)
        if plan is None:
            if group.rank == 0:
                log.warning("fp-dcp: step %d has files with no intact copy left: %s", step, "; ".join(damaged[:3]))
            return None
        transfers, downloads, chosen = plan
        # a file fetched in an earlier round is "local" now: keep where it came from
        sources.update({k: v for k, v in chosen[node].items() if v != "local" or k not in sources})
        if not transfers and not downloads:
            return Fetched(step, sources, damaged)
        outcome = transport.run(
            transfers,
            source=lambda t: os.path.join(root, t.key),
            sink=lambda t: _sink(root, t.key, layout),
        )
        arrived = [(t.key, nodes.names[t.dst], nodes.names[t.src], p) for t, p in outcome.items()]
        for key, dst in downloads:
            if dst == group.rank:
                arrived.append((key, node, DURABLE, _download(store, key, root, layout)))
        for key, dst_node, src_node, problems in (a for got in group.all_gather(arrived) for a in got):
            if tiers is None:
                continue
            if problems:
                damaged.append(f"{key} on {src_node}: {problems[0]}")
                tiers.holds[src_node].pop(key, None)
            else:
                tiers.holds[dst_node][key] = files[key]
        damaged = group.broadcast(damaged)
    return None


def _damaged_copy(path: str, check: StreamCheck) -> bool:
    """Whether the local copy at ``path`` exists and fails its checks (it is then removed: it would be loaded)."""
    try:
        with open_regular(path) as f:
            while chunk := f.read(DEFAULT_CHUNK):
                check.feed(chunk)
    except FileNotFoundError:
        return False
    except NotRegularFileError as e:
        problem = f"it is {e.strerror}"
    else:
        problems = check.problems(path)
        if not problems:
            return False
        problem = problems[0]
    log.warning("fp-dcp: %s is damaged (%s); fetching another copy", path, problem)
    os.unlink(path)
    return True


def _sink(root: str, key: str, layout: StepLayout) -> FileSink:
    """Where a fetched file lands; in the directory of an earlier step it is marked as kept for references."""
    owner = os.path.join(root, os.path.dirname(key))
    if os.path.dirname(key) != os.path.basename(layout.checkpoint.path):
        mark_referenced(owner, os.path.basename(key))
    return FileSink(os.path.join(root, key), layout.check(key))


def _download(store: DurableStore | None, key: str, root: str, layout: StepLayout) -> list[str]:
    try:
        assert store is not None
        sink = _sink(root, key, layout)
        for chunk in store.chunks(key):
            sink.write(memoryview(chunk))
        return sink.done(f"{store.url}/{key}")
    except Exception as e:  # the store failed: this source is struck off, like a damaged copy
        return [f"{type(e).__name__}: {e}"]


def _plan(
    tiers: _Tiers, wanted: dict[str, list[str]], files: dict[str, int], nodes: Nodes
) -> tuple[list[Transfer], list[tuple[str, int]], dict[str, dict[str, str]]] | None:
    """(coordinator) The transfers and downloads that give every node what it lacks, spreading them over ranks.

    Also where each node's files come from. None if a wanted file has no source left.
    """
    transfers, downloads = [], []
    chosen: dict[str, dict[str, str]] = {n: {} for n in wanted}
    sent: Counter[str] = Counter()
    for node, keys in wanted.items():
        ranks = nodes.ranks_on(node)
        for k, key in enumerate(keys):
            size = files[key]
            if tiers.holds[node].get(key, -1) >= size:
                chosen[node][key] = "local"
                continue
            peers = [s for s in tiers.holders(key, size) if s not in (node, DURABLE)]
            if peers:
                source = min(peers, key=lambda s: (sent[s], s))  # spread the sending over the nodes that can
                senders = nodes.ranks_on(source)
                transfers.append(Transfer(key, senders[sent[source] % len(senders)], ranks[k % len(ranks)], size))
                sent[source] += 1
            elif DURABLE in tiers.holders(key, size):
                downloads.append((key, ranks[k % len(ranks)]))
                source = DURABLE
            else:
                return None
            chosen[node][key] = source
    return sorted(transfers), downloads, chosen
