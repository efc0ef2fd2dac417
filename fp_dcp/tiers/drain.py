"""The drain: a published step copied to durable storage in the background, every rank uploading its share.

1. The coordinator lists what the durable root already holds; an
   incremental step uploads only the files missing there (those it
   references in earlier steps were uploaded with them, under their keys).
2. Each missing file is uploaded by one rank whose node holds it (the rank
   that wrote it where it can), read back and checked item by item, and
   retried with backoff on any failure.
3. Only when every rank's uploads passed does the coordinator store the
   step's ``.metadata``, the commit marker: a drain cut short at any point
   leaves objects that no restore takes, and the next drain or manager
   removes them (``prune_durable``).
4. Durable retention keeps the newest ``keep`` steps, and every object they
   reference; the step just committed is always among them. Retention that
   fails leaves the step committed, and is reported on every rank like a
   failed drain: a rank that raised here would leave the others waiting.

A drain that fails is reported in its result and never raised here: the
training goes on, and the manager decides what to tell the user.
"""

from __future__ import annotations

import dataclasses
import functools
import os

from ..errors import CheckpointError
from ..io.files import open_regular, write_durably
from ..log import log
from ..names import DURABLE_NAME, METADATA_NAME, parse_step_name, step_name
from ..net.group import Group
from .layout import StepLayout, files_in_metadata
from .nodes import Nodes
from .store import DurableStore, retrying

__all__ = ["Drained", "drain", "prune_durable"]


@dataclasses.dataclass(frozen=True)
class Drained:
    """What one step's drain did (the same on every rank, but ``uploaded``)."""

    step: int
    problems: list[str]  # of a committed step: those of durable retention alone
    uploaded: int  # bytes this rank stored
    skipped: int  # files the durable root already held (an incremental step's references)
    committed: bool = False  # the step's .metadata is stored: a restore can take it

    @property
    def ok(self) -> bool:
        return not self.problems


def drain(step: int, directory: str, store: DurableStore, nodes: Nodes, group: Group, keep: int) -> Drained:
    """Copy the step in ``directory`` (this node's copy) to ``store``; every rank calls this."""
    name = step_name(step)
    layout: StepLayout | None = None
    files: dict[str, int] = {}
    missing: list[str] = []
    problem = ""
    try:
        layout = StepLayout.open(directory)
        files = layout.files()
        missing = _missing(store, files) if group.rank == 0 else []
    except Exception as e:  # the store unreachable, or this node's copy unreadable: reported below, on every rank
        problem = f"rank {group.rank}: {type(e).__name__}: {e}"
    missing = group.broadcast(missing)
    root = os.path.dirname(directory)
    holds = [key for key in missing if _holds(root, key, files.get(key))]
    everyone = group.all_gather((holds, problem))
    problems = [p for _, p in everyone if p]
    if problems or layout is None:
        return _failed(step, problems, group)
    assigned = _assign(missing, [set(h) for h, _ in everyone], layout, nodes)
    unheld = [key for key in missing if key not in assigned]
    uploaded = 0
    mine: list[str] = []
    pruning: list[str] = []
    for key in (k for k in missing if assigned.get(k) == group.rank):
        upload = functools.partial(_upload, store, key, os.path.join(root, key), files[key], layout)
        found = retrying(upload, store.retry)
        if found:
            mine += [f"{store.url}/{key}: {p}" for p in found[:2]]
        else:
            uploaded += files[key]
    problems = [p for ps in group.all_gather(mine) for p in ps]
    problems += [f"{key}: no node holds it any more" for key in unheld]
    if not problems and group.rank == 0:
        with open_regular(os.path.join(directory, METADATA_NAME)) as f:
            data = f.read()

        def commit() -> list[str]:
            store.put_bytes(f"{name}/{METADATA_NAME}", data)
            return []

        problems += retrying(commit, store.retry)
        if not problems:
            pruning = _prune(store, keep)
    problems, pruning = group.broadcast((problems, pruning))
    if problems:
        return _failed(step, problems, group)
    if group.rank == nodes.leader(nodes.names[group.rank]):
        write_durably(os.path.join(directory, DURABLE_NAME), b"")
    if pruning and group.rank == 0:
        log.warning("fp-dcp: step %d was drained to %s, but %s", step, store.url, pruning[0])
    return Drained(step, pruning, uploaded, len(files) - len(missing), committed=True)


def _missing(store: DurableStore, files: dict[str, int]) -> list[str]:
    """The keys of ``files`` the store does not hold (an object of the right size counts: it was checked)."""
    held = store.inventory()
    return sorted(
        key for key, size in files.items() if held.get(os.path.dirname(key), {}).get(os.path.basename(key)) != size
    )


def _prune(store: DurableStore, keep: int) -> list[str]:
    """``prune_durable``, its failure returned: the coordinator must still tell every rank how the drain went."""
    try:
        prune_durable(store, keep)
    except Exception as e:  # the store unreachable while pruning: the step stays committed, the next drain prunes
        return [f"older durable steps were not pruned (the next drain tries again): {type(e).__name__}: {e}"]
    return []


def _failed(step: int, problems: list[str], group: Group) -> Drained:
    if group.rank == 0:
        log.warning("fp-dcp: the drain of step %d to durable storage failed: %s", step, "; ".join(problems[:3]))
    return Drained(step, problems, 0, 0)


def _upload(store: DurableStore, key: str, source: str, size: int, layout: StepLayout) -> list[str]:
    return store.put_file(key, source, size, layout.check(key))  # a fresh check for every attempt


def _holds(root: str, key: str, size: int | None) -> bool:
    try:
        return size is not None and os.stat(os.path.join(root, key)).st_size >= size
    except OSError:
        return False


def _assign(missing: list[str], holds: list[set[str]], layout: StepLayout, nodes: Nodes) -> dict[str, int]:
    """Which rank uploads each missing file: its writer if that rank's node holds it, else the least loaded holder."""
    load = [0] * len(holds)
    assigned = {}
    for key in missing:
        ranks = [rank for rank, held in enumerate(holds) if key in held]
        if not ranks:
            continue
        writer = layout.writer(key)
        rank = writer if writer in ranks else min(ranks, key=lambda r: (load[r], r))
        assigned[key] = rank
        load[rank] += 1
    return assigned


def prune_durable(store: DurableStore, keep: int) -> None:
    """Keep the newest ``keep`` committed steps and what they reference; remove everything else.

    A step goes in two moves: its ``.metadata`` first (from then on no
    restore takes it), then its objects that no kept step references. Objects
    of drains that never committed go too, unless a kept step references them.
    """
    inventory = store.inventory()
    committed = sorted(
        (number, step)
        for step, names in inventory.items()
        if METADATA_NAME in names and (number := parse_step_name(step)) is not None
    )
    kept = [step for _, step in committed[-keep:]]
    used: set[str] = set()
    for step in kept:
        try:
            used |= set(files_in_metadata(step, store.get_bytes(f"{step}/{METADATA_NAME}")))
        except (CheckpointError, OSError) as e:
            log.warning("fp-dcp: not pruning %s: %s/%s cannot be read (%s)", store.url, step, METADATA_NAME, e)
            return
    for step, names in inventory.items():
        if step in kept:
            continue
        if METADATA_NAME in names:
            store.delete(f"{step}/{METADATA_NAME}")
        for name in names:
            if name != METADATA_NAME and f"{step}/{name}" not in used:
                store.delete(f"{step}/{name}")
        store.cleanup(step)
