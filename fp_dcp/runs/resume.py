"""Resuming a run: the newest step that is intact, loaded; an older one where a step fails on its bytes.

``CheckpointManager.restore`` runs this. The coordinating rank picks the
step (checking each only when it reaches it: with ``verify`` a check reads
the whole step) and every rank loads it; a load that fails on the
checkpoint's bytes on every rank that failed moves on to the next older
step, any other failure (the state asks for what the step does not hold) is
raised. With tiers, each node first fetches what its own root lacks.
"""

from __future__ import annotations

from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ..config import IOConfig
from ..errors import CheckpointError, CorruptCheckpointError, NotACheckpointError
from ..load.reader import FastPersistReader
from ..log import log
from ..net.group import Group
from ..tiers import Tiers
from .steps import inspect_if_present, step_directories, step_directory

__all__ = ["Resume"]


def _damaged(error: BaseException) -> bool:
    """Whether a failed load failed on the checkpoint's bytes (on every rank that failed)."""
    if isinstance(error, CheckpointException):
        return all(_damaged(failure[0]) for failure in error.failures.values())
    return isinstance(error, (CorruptCheckpointError, NotACheckpointError))


class Resume:
    """One ``restore`` of the run kept in ``root``, by every rank of ``group`` together."""

    def __init__(
        self,
        root: str,
        group: Group,
        tiers: Tiers | None,
        verify: bool,
        data_dirs: list[str] | None,
        config: IOConfig | None,
    ) -> None:
        self.root, self.group, self.tiers, self.verify = root, group, tiers, verify
        self.data_dirs, self.config = data_dirs, config

    def load(self, state: dict[str, Any]) -> int | None:
        """The step loaded into ``state``, or None when no step is intact."""
        if self.tiers is not None:
            return self._load_tiers(state)
        tried: set[int] = set()
        while True:
            step = self.group.broadcast(self._newest_intact(exclude=tried) if self.group.rank == 0 else None)
            if step is None:
                return None
            tried.add(step)
            if self._load(state, step):
                return step

    def _load(self, state: dict[str, Any], step: int) -> bool:
        """Load ``step`` into ``state``: False if its bytes are damaged (an older step may do)."""
        try:
            dcp.load(
                state,
                checkpoint_id=step_directory(self.root, step),
                storage_reader=FastPersistReader(
                    data_dirs=self.data_dirs, config=self.config, process_group=self.group.group
                ),
                process_group=self.group.group,
            )
        except (CheckpointException, CheckpointError) as e:
            if not _damaged(e):
                raise  # the state asked for something the step does not hold: not for an older step to fix
            log.warning("fp-dcp: step %d of %s did not load: %s", step, self.root, e)
            return False
        return True

    def _load_tiers(self, state: dict[str, Any]) -> int | None:
        """Across tiers: each node fetches what it lacks, then loads from its own root."""
        assert self.tiers is not None
        tried: set[int] = set()
        verify = self.verify
        while True:
            fetched = self.tiers.restore(state, exclude=tried, verify=verify)
            if fetched is None:
                return None
            if self._load(state, fetched.step):
                if self.tiers.is_leader:
                    log.warning(
                        "fp-dcp: restored step %d on node %s: %s", fetched.step, self.tiers.node, fetched.describe()
                    )
                return fetched.step
            if verify:
                tried.add(fetched.step)  # every copy was checked and still it fails: an older step
            verify = True  # a copy a node held is damaged: check them all, and fetch the damaged ones again

    def _newest_intact(self, exclude: set[int]) -> int | None:
        # Newest first, each step checked only when reached: with verify=True a check reads the whole step.
        for step, path in reversed(step_directories(self.root)):
            if step in exclude:
                continue
            info = inspect_if_present(step, path, self.verify)
            if info is None:
                continue  # pruned meanwhile by another rank of the node
            if info.status in ("complete", "verified"):
                return info.step
            if info.status == "retired":
                continue  # not a checkpoint by design: nothing to warn about
            log.warning("fp-dcp: skipping step %d of %s (%s): %s", info.step, self.root, info.status, info.problem)
        return None
