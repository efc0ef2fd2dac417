"""``dcp.async_save(..., async_stager=writer)``: the writer's side of DCP's ``AsyncStager`` protocol.

``stage`` (in the training thread) records a ``StagedSave`` and returns its
``Handoff``, the future DCP turns into ``staging_completion``: done once
training may change the parameters. The save that DCP then runs in its
executor begins with ``set_up_storage_writer``, where the writer takes the
oldest staged save that has not ended (``AsyncSaves.begin``) as its
per-save state: that record, not the thread the save runs on, is what ties
``write_data`` to its ``stage``. Staged saves of one writer run one at a
time in the order they were staged (``Handoff.result`` waits for the
previous one to end), so the oldest unended record is always the save now
beginning.

A save can end without reaching ``write_data`` (a planning error on any
rank). Its record then has to fail, or a training loop waiting for
``staging_completion`` would wait forever. DCP says nothing to the writer
then, but it runs every async save on a thread of its own, which ends with
the save: ``begin`` leaves a guard in that thread's local storage, and the
guard fails the record, if it has not ended, when the thread's locals are
released (no watcher thread, no polling).
"""

from __future__ import annotations

import itertools
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal

import torch

from .snapshot import Snapshot, leaves, local_tensor

__all__ = ["Mode", "ready_events", "StagedSave", "Handoff", "AsyncSaves"]

Mode = Literal["streaming", "snapshot"]


def ready_events(state_dict: Any) -> dict[torch.device, torch.cuda.Event]:
    """An event on the current stream of every CUDA device holding a tensor of ``state_dict``.

    Recorded where the save is requested: whatever that thread's streams have
    queued so far (the step that produced the values) completes before a side
    stream copies anything.
    """
    events = {}
    for _, tensor in leaves(state_dict):
        device = local_tensor(tensor).device
        if device.type == "cuda" and device not in events:
            events[device] = torch.cuda.current_stream(device).record_event()
    return events


class StagedSave:
    """One ``dcp.async_save`` through the writer, from ``stage`` to the end of its ``write_data``."""

    def __init__(
        self,
        token: int,
        ready: dict[torch.device, torch.cuda.Event],
        streaming_state: Any,
        previous: StagedSave | None,
    ) -> None:
        self.token = token  # stage order: names the save in errors and logs
        self.ready = ready
        self.previous = previous
        self.handoff = Handoff(self, streaming_state)
        self.begun = False
        self.ended = threading.Event()  # write_data is over, or the save ended without it

    def release(self) -> None:
        """The save has read every tensor: training may change them (streaming; snapshots are done earlier)."""
        self.handoff.resolve(self.handoff.streaming_state)

    def fail(self, error: BaseException) -> None:
        self.handoff.resolve(error=error)

    def end(self) -> None:
        self.ended.set()

    def end_without_writing(self) -> None:
        if not self.ended.is_set():
            self.fail(
                RuntimeError(f"async save #{self.token} ended before writing (its error is in upload_completion)")
            )
            self.end()


class Handoff(Future[Any]):
    """What ``stage`` returns to DCP: done once training may change the parameters.

    DCP's save thread calls ``result()`` for the state dict to save. In
    streaming mode that is the caller's own state dict, returned as soon as
    the previous staged save has ended: the save itself stages it and
    completes this future when it has read every tensor.
    """

    def __init__(self, save: StagedSave, streaming_state: Any) -> None:
        super().__init__()
        self.save = save
        self.streaming_state = streaming_state
        self._lock = threading.Lock()

    def result(self, timeout: float | None = None) -> Any:
        if self.streaming_state is not None and not self.done():
            previous = self.save.previous
            if previous is not None and not previous.ended.wait(timeout):
                raise TimeoutError(f"async save #{previous.token} of this writer is still running")
            return self.streaming_state
        return super().result(timeout)

    def resolve(self, value: Any = None, error: BaseException | None = None) -> None:
        """Complete once; later calls (a failure after the release) change nothing."""
        with self._lock:
            if self.done():
                return
            if error is not None:
                self.set_exception(error)
            else:
                self.set_result(value)


class _EndGuard:
    """Ends its save, if nothing else did, when the thread that runs the save lets go of it."""

    def __init__(self, save: StagedSave) -> None:
        self.save = save

    def __del__(self) -> None:
        self.save.end_without_writing()


_save_thread = threading.local()


class AsyncSaves:
    """A writer's staged saves, in stage order, and the staging thread that takes snapshots."""

    def __init__(self) -> None:
        self.saves: list[StagedSave] = []
        self._lock = threading.Lock()
        self._tokens = itertools.count(1)
        self._executor: ThreadPoolExecutor | None = None

    def stage(self, state_dict: Any, mode: Mode, snapshot: Snapshot) -> Future[Any]:
        ready = ready_events(state_dict)  # in the caller's thread, on its streams
        with self._lock:
            self.saves = [s for s in self.saves if not (s.ended.is_set() and s.handoff.done())]
            previous = self.saves[-1] if self.saves else None
            save = StagedSave(next(self._tokens), ready, state_dict if mode == "streaming" else None, previous)
            self.saves.append(save)
        if mode == "snapshot":
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="fp-dcp-stage")
            self._executor.submit(self._snapshot, save, state_dict, snapshot)
        return save.handoff

    @staticmethod
    def _snapshot(save: StagedSave, state_dict: Any, snapshot: Snapshot) -> None:
        try:
            if save.previous is not None:
                save.previous.ended.wait()  # it may still be writing from the arena
            save.handoff.resolve(snapshot.take(state_dict, save.ready))
        except BaseException as e:
            save.fail(e)

    def begin(self) -> StagedSave | None:
        """In ``set_up_storage_writer``: the staged save now beginning (None for ``dcp.save``)."""
        with self._lock:
            save = next((s for s in self.saves if not s.begun and not s.ended.is_set()), None)
            if save is None:
                return None
            save.begun = True
        _save_thread.guard = _EndGuard(save)  # replaces (and so ends) a guard of an earlier save on this thread
        return save

    def unbegun(self) -> list[StagedSave]:
        """Staged saves whose ``set_up_storage_writer`` has not run yet."""
        with self._lock:
            return [s for s in self.saves if not s.begun and not s.ended.is_set()]

    def pending(self) -> bool:
        with self._lock:
            return any(not s.ended.is_set() for s in self.saves)

    def synchronize(self) -> None:
        """Wait until every staged save lets training change the parameters."""
        with self._lock:
            handoffs = [s.handoff for s in self.saves]
        for handoff in handoffs:
            handoff.exception()  # waits; errors are the saves' to report

    def close(self) -> None:
        """Wait for the begun saves to finish writing, then stop the staging thread."""
        with self._lock:
            saves = list(self.saves)
        for save in saves:
            if save.begun:
                save.ended.wait()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
