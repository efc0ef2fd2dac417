"""Checkpointing a training loop every N steps, overlapped with the next step (FastPersist's third technique).

A save starts right after ``optimizer.step()``; the next forward and backward
passes run while it reads the parameters; the loop waits, if at all, just
before the next ``optimizer.step()``, the first moment the parameters change::

    def training_state():
        model_sd, optim_sd = torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)
        return {"model": model_sd, "optim": optim_sd}

    writer = FastPersistWriter(root, mode="streaming")
    ckpt = OverlappedCheckpointer(writer, every=1, checkpoint_id=lambda step: f"{root}/step-{step}")
    for step in range(steps):
        loss_fn(model(batch)).backward()
        ckpt.before_update()          # waits until the save in flight no longer reads the parameters
        optimizer.step()
        optimizer.zero_grad()
        ckpt.after_update(step, training_state)
    ckpt.close()                      # waits until the last checkpoint is published

With ``mode="streaming"`` the save's writes end before the next update, as in
FastPersist, and host memory stays at the writer's staging buffers; with
``mode="snapshot"`` only the copy into host memory must end by then, and the
write may go on for several steps (a new save waits for the previous one).
Distributed: the saves' collectives run in DCP's thread while training runs
its own, so they get a group of their own: without ``process_group`` the
checkpointer makes a gloo group of all ranks when it is constructed (every
rank constructs it, in the same order), whatever the training backend. On
one group, the save thread's collectives and training's would interleave,
and on gloo every rank then hangs.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import SavePlanner

from ..compat import ASYNC_STAGING, has
from ..log import log_once
from ..net.group import background_group
from ..save.writer import FastPersistWriter

__all__ = ["OverlappedCheckpointer"]

StateDict = dict[str, Any]


class OverlappedCheckpointer:
    """Starts a checkpoint every ``every`` steps and lets training run until the parameters must change.

    Args:
        writer: the ``FastPersistWriter`` of the run (its ``mode`` decides
            streaming or snapshot); it is also DCP's ``AsyncStager``.
        every: save after steps ``0, every, 2 * every, ...`` (1: every step).
        checkpoint_id: the checkpoint directory for a step; default: the
            writer's path, overwritten each time (the previous checkpoint stays
            loadable until the new one is published).
        planner: DCP save planner (e.g. ``FastPersistSavePlanner()``).
        process_group: the group DCP's collectives use. Default: a gloo group
            of all ranks made here, apart from those training uses (see the
            module doc); none where torch.distributed is not initialised. A
            group passed is used as it is: the default group
            (``dist.group.WORLD``) only where training runs no collectives
            on it while a save is in flight.

    ``blocked_seconds`` adds up the time the training loop spent in this
    helper (starting saves, waiting for them); ``saves`` counts saves started.
    A failed save raises its error from the next call.
    """

    def __init__(
        self,
        writer: FastPersistWriter,
        *,
        every: int = 1,
        checkpoint_id: Callable[[int], str | os.PathLike[str]] | None = None,
        planner: SavePlanner | None = None,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        if every < 1:
            raise ValueError(f"every must be at least 1, got {every}")
        self.writer = writer
        self.every = every
        self.checkpoint_id = checkpoint_id
        self.planner = planner
        self.process_group = background_group(process_group)
        self.blocked_seconds = 0.0
        self.saves = 0
        self._staging: Future[None] | None = None  # pending until the parameters may change
        self._upload: Future[Any] | None = None  # pending until the checkpoint is published

    def before_update(self) -> None:
        """Call right before ``optimizer.step()``: returns once the save in flight has released the parameters."""
        staging, upload = self._staging, self._upload
        if staging is None or upload is None:
            return
        start = time.perf_counter()
        wait([staging, upload], return_when=FIRST_COMPLETED)  # a save that failed early ends both
        self.blocked_seconds += time.perf_counter() - start
        if staging.done() and staging.exception() is None:
            self._staging = None
        else:
            self._raise_failure()

    def after_update(self, step: int, state_dict: StateDict | Callable[[], StateDict]) -> bool:
        """Call right after ``optimizer.step()``: starts a save on every ``every``-th step; True if it did.

        ``state_dict`` is the state to save, or a function returning it (called
        only when a save starts). The previous save must have been published
        first: one writer runs one save at a time.
        """
        if step % self.every:
            return False
        start = time.perf_counter()
        self._finish()
        state = state_dict() if callable(state_dict) else state_dict
        checkpoint_id = self.checkpoint_id(step) if self.checkpoint_id is not None else None
        options: dict[str, Any] = {"planner": self.planner, "process_group": self.process_group}
        if has(ASYNC_STAGING):
            response: Any = dcp.async_save(
                state, checkpoint_id=checkpoint_id, storage_writer=self.writer, async_stager=self.writer, **options
            )
            self._staging, self._upload = response.staging_completion, response.upload_completion
        else:  # the save runs here, to its end: torch's threaded async_save before 2.9 can hang at teardown
            log_once(f"{ASYNC_STAGING.refusal()}: saves run to their end before after_update returns instead")
            self._staging, self._upload = Future(), Future()
            try:
                self._upload.set_result(
                    dcp.save(state, checkpoint_id=checkpoint_id, storage_writer=self.writer, **options)
                )
                self._staging.set_result(None)
            except BaseException as e:  # reported by the next call (before_update too), as an async save's error is
                self._upload.set_exception(e)
                self._staging.set_exception(e)
        self.saves += 1
        self.blocked_seconds += time.perf_counter() - start
        return True

    def wait(self) -> None:
        """Block until the last save started is published (or raise its error)."""
        start = time.perf_counter()
        self._finish()
        self.blocked_seconds += time.perf_counter() - start

    def close(self, cancel: bool = False) -> None:
        """Wait for the save in flight (or, with ``cancel``, stop it, publishing nothing)."""
        if cancel and self._upload is not None:
            self.writer.cancel()
            wait([self._upload])
            self._staging = self._upload = None
            return
        self.wait()

    def _finish(self) -> None:
        if self._upload is not None:
            self._raise_failure()

    def _raise_failure(self) -> None:
        """Wait for the save in flight to end; raise its error, preferring the upload's (it names the rank)."""
        upload, staging = self._upload, self._staging
        self._upload = self._staging = None
        error = upload.exception() if upload is not None else None  # waits
        if error is None and staging is not None and staging.done():
            error = staging.exception()
        if error is not None:
            raise error
