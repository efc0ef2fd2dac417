"""``Tiers``: the node-local fast tier's companions, run for ``CheckpointManager``.

After each step is published, ``Tiers``:

- gives every node the step's ``.metadata`` (each node's directory of the
  step then reads as the same checkpoint, holding that node's files);
- queues its peer replication (``replicas`` > 1) on one background thread
  and process group, and, every ``durable_every_n_steps`` published steps,
  its drain to durable storage on another;
- tells retention which steps those threads still need.

``restore`` brings the newest step that is whole somewhere onto every node
(``fetch_step``). Every rank makes the same calls in the same order, as
with the manager itself.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch.distributed as dist

from ..errors import DurableStorageError
from ..io.files import open_regular
from ..log import log
from ..names import METADATA_NAME, REPLICATED_NAME, parse_step_name, step_name
from ..net.group import Group
from ..net.transport import Transport, remove_partials
from .drain import Drained, drain, prune_durable
from .layout import mark_node, publish_metadata
from .nodes import Nodes, expand_root, node_name
from .replication import Replicated, replicate
from .restore import Fetched, fetch_step
from .store import DurableStore, open_store
from .worker import Worker

__all__ = ["Tiers"]


class Tiers:
    """Replication, drain and cross-tier restore for one run's node-local ``root`` (``{node}`` expanded here)."""

    def __init__(
        self,
        root: str,
        *,
        replicas: int,
        durable: str | os.PathLike[str] | DurableStore | None,
        durable_every_n_steps: int,
        keep_durable: int,
        process_group: dist.ProcessGroup | None,
    ) -> None:
        if replicas < 1:
            raise ValueError(f"replicas must be at least 1 (the node's own copy), got {replicas}")
        if durable_every_n_steps < 1 or keep_durable < 1:
            raise ValueError(
                f"durable_every_n_steps and keep_durable must be at least 1, got {durable_every_n_steps} and "
                f"{keep_durable} (the newest durable step is always kept)"
            )
        self.main = Group(process_group)
        self.nodes = Nodes.gather(self.main)
        self.nodes.replica_ranks(self.main.rank, replicas)  # refuses more replicas than nodes, on every rank
        self.node = node_name()
        self.root = expand_root(os.fspath(root), self.node)
        self.replicas = replicas
        self.store = open_store(durable) if durable is not None else None
        self.every = durable_every_n_steps
        self.keep_durable = keep_durable
        # the groups are made on every rank of the manager's group, in this order, whether or not this rank uses them
        self.replication = Transport(Group.new(process_group)) if replicas > 1 else None
        self.drainage = Group.new(process_group) if self.store is not None else None
        self.restoring = Transport(Group.new(process_group))
        self._replicator = Worker("replication") if self.replication is not None else None
        self._drainer = Worker("drain") if self.drainage is not None else None
        self._since_drain: int | None = None  # published steps since the last drain (None: none drained yet)
        self._owed: int | None = None  # the newest step, due a drain that had to wait for the one running
        self.durable_error: DurableStorageError | None = None
        self.last_drain: Drained | None = None
        self.last_replication: Replicated | None = None

    @property
    def is_leader(self) -> bool:
        """Whether this rank acts for its node (its local root's housekeeping)."""
        return self.main.rank == self.nodes.leader(self.node)

    def start(self) -> None:
        """Clear what transfers cut short by a crash left behind (call once the root exists)."""
        if self.is_leader:
            remove_partials(self.root)
        if self.store is not None and self.main.rank == 0:
            try:
                prune_durable(self.store, self.keep_durable)  # uploads of a drain that never committed
            except Exception as e:  # the store may be unreachable now: the next drain retries it
                log.warning("fp-dcp: cannot clean up %s now: %s", self.store.url, e)

    def published(self, step: int, *, drain: bool = False) -> None:
        """Step ``step`` was just published by the coordinator: copy its metadata to every node, queue its copies.

        ``drain``: drain this step whatever ``durable_every_n_steps`` says,
        queued behind a drain still running (a preemption's last step).
        """
        directory = os.path.join(self.root, step_name(step))
        data = None
        if self.main.rank == 0:
            with open_regular(os.path.join(directory, METADATA_NAME)) as f:
                data = f.read()
        due = self._drainer is not None and (drain or self._since_drain is None or self._since_drain + 1 >= self.every)
        # the coordinator's word: a drain still running makes a due step wait, on every rank alike
        data, busy = self.main.broadcast((data, bool(self._drainer and self._drainer.steps())))
        if self.is_leader:
            assert data is not None
            publish_metadata(directory, data)  # a no-op on the coordinator's node
            mark_node(directory, self.node)
        self.main.barrier()
        if self._replicator is not None:
            transport = self.replication
            assert transport is not None
            self._replicator.submit(step, lambda: self._replicate(step, directory, transport))
        busy = busy and not drain
        self._owed = step if due and busy else None  # drained when the drain is free: at the next step, or wait()
        if due and not busy:
            self._submit_drain(step)
        elif self._since_drain is not None:
            self._since_drain += 1

    def _submit_drain(self, step: int) -> None:
        assert self._drainer is not None
        self._since_drain = 0
        self._drainer.submit(step, lambda: self._drain(step, os.path.join(self.root, step_name(step))))

    def _replicate(self, step: int, directory: str, transport: Transport) -> None:
        self.last_replication = replicate(step, directory, self.nodes, self.replicas, transport)

    def _drain(self, step: int, directory: str) -> None:
        assert self.store is not None and self.drainage is not None
        result = drain(step, directory, self.store, self.nodes, self.drainage, self.keep_durable)
        self.last_drain = result
        if not result.ok:
            done = "was copied to {}, but" if result.committed else "was not copied to {}:"
            self.durable_error = DurableStorageError(
                f"step {step} {done.format(self.store.url)} {'; '.join(result.problems[:3])}"
            )

    def busy(self) -> set[int]:
        """The steps local retention must keep now, whatever its rule says.

        Those replication or the drain still read on this rank, and, with
        replicas, the newest step whose replication completed: until a newer
        one is replicated too, it is the newest step that survives losing
        this node.
        """
        kept = {self._owed} if self._owed is not None else set()
        if self.replicas > 1 and (replicated := self._newest_replicated()) is not None:
            kept.add(replicated)
        return kept.union(*(w.steps() for w in (self._replicator, self._drainer) if w is not None))

    def _newest_replicated(self) -> int | None:
        """The newest step of this node's root recorded as replicated (``.replicated``), read from the disk."""
        found = [
            step
            for name in (os.listdir(self.root) if os.path.isdir(self.root) else [])
            if (step := parse_step_name(name)) is not None
            and os.path.exists(os.path.join(self.root, name, REPLICATED_NAME))
            and os.path.exists(os.path.join(self.root, name, METADATA_NAME))
        ]
        return max(found, default=None)

    def wait(self, timeout: float | None = None) -> bool:
        """Until the replication and drain of every step published so far have finished (or failed).

        A step whose drain was due while another ran is drained now. With
        ``timeout``, returns after that many seconds at most: whether they
        all finished.
        """
        if self._owed is not None:
            self._submit_drain(self._owed)  # queued behind the drain running: the same on every rank
            self._owed = None
        deadline = None if timeout is None else time.monotonic() + timeout
        return all(
            worker.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
            for worker in (self._replicator, self._drainer)
            if worker is not None
        )

    def restore(self, state: dict[str, Any], exclude: set[int], verify: bool) -> Fetched | None:
        self.wait()  # the background groups go quiet before restore's transfers start
        return fetch_step(state, self.root, self.nodes, self.restoring, self.store, exclude=exclude, verify=verify)

    def close(self) -> None:
        for worker in (self._replicator, self._drainer):
            if worker is not None:
                worker.close()
