"""Preemption: a signal on any rank makes every rank save the same step, durably, before the loop stops.

Schedulers end a job with a signal and a grace period before SIGKILL
(SLURM's ``--signal``, Kubernetes' ``terminationGracePeriodSeconds``, spot
instances' notice). ``CheckpointManager(save_on_preemption=True)`` then saves
one more step, on every rank, and says ``preempted``; the loop exits::

    for step in range(start, steps):
        train_step()
        if mgr.should_save(step):      # at every step: that is where the ranks agree
            mgr.save(step, state)
        if mgr.preempted:
            break                      # the step is published: close() and exit within the grace period

The signal handler only notes the signal and calls the handler that was
installed before (``SignalWatch``): the save runs in the training loop, in
``should_save`` / ``save``, never in the handler. Ranks agree on the step
through the process group's store, without a collective (``StepAgreement``;
keys under ``fp_dcp/preemption/<manager>/``):

- ``step``: the step every rank saves. A rank that got a signal, at its next
  ``should_save(t)``, proposes ``t + 1`` (``t`` itself in a one-rank job)
  with ``compare_set`` from "absent": the first proposal wins and later ones
  read it. A rank with nothing proposed yet looks for the key once per
  step: one ``check``, a round trip to the store, is all that preemption
  costs the loop while no signal comes.
- ``arrived/S`` and ``go/S``: at step ``S`` every rank adds 1 to
  ``arrived/S``; the rank that makes it the world size sets ``go/S``; each
  waits for ``go/S`` and saves if the count is the world size.
- A rank that learns of ``S`` only after passing it (it ran ahead) moves
  ``step`` past its own step (``compare_set`` from ``S``), then adds
  ``_PASSED`` to ``arrived/S`` and sets ``go/S``: those waiting at ``S`` see a
  count that can no longer be the world size, read the new ``step`` and go
  on to it. A count reaches the world size only when every rank arrived, and
  then none can have passed it: every rank makes the same choice, whatever
  the timing.

Why ``t + 1``: with a collective every step (DDP, FSDP, any data-parallel
loop), no rank can finish the ``should_save`` of step ``t + 1`` before the
proposing rank has finished that of ``t``, so every rank reads the proposal
by step ``t + 1`` and none passes it; in a loop with no collective at all,
the rule above sets things right. Only ranks that drift more than a step
apart and then wait for each other in a collective could wait for ever
(the grace period's SIGKILL ends that): keep a collective in every step whose
number you pass to ``should_save``.
"""

from __future__ import annotations

import dataclasses
import signal
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from ..compat import process_group_store
from ..log import log
from ..tiers import Tiers

__all__ = ["Preemption", "PreemptionSave", "SignalWatch", "StepAgreement"]

_PASSED = 1 << 40  # added to a step's arrivals by a rank that went past it: no count with it is the world size
_POLL = 0.002  # seconds between looks at the store while waiting for the other ranks at the agreed step
_PATIENCE = 10.0  # seconds between warnings while waiting there

Handler = Callable[[int, FrameType | None], Any] | int | None


class SignalWatch:
    """Notes ``signals`` as they come, then calls the handler each replaced (torchrun's, Lightning's, yours).

    Python runs signal handlers in the main thread, between two bytecodes,
    wherever it is: this one records the signal and does nothing else (no
    I/O, no lock, no save). A previous handler that only stood for the
    default, ``SIG_DFL`` (terminate) or ``default_int_handler``
    (``KeyboardInterrupt``), or ``SIG_IGN``, is not called: ending the
    process is what the preemption save replaces.
    """

    def __init__(self, signals: Sequence[int]) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise ValueError(
                "save_on_preemption: make the CheckpointManager in the main thread (Python's signal handlers run there)"
            )
        self.received: int | None = None  # the first signal noted
        self.received_at: float | None = None  # its time.monotonic()
        self.count = 0  # signals noted
        self._previous: dict[int, Handler] = {}
        for signum in dict.fromkeys(signals):
            try:
                self._previous[signum] = signal.signal(signum, self._note)
            except (OSError, ValueError, TypeError) as e:
                self.close()
                raise ValueError(f"preemption_signals: cannot handle signal {signum!r}: {e}") from None

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        if self.received is None:
            self.received, self.received_at = signum, time.monotonic()
        previous = self._previous.get(signum)
        if callable(previous) and previous is not signal.default_int_handler:
            previous(signum, frame)

    def close(self) -> None:
        """Put back the handlers replaced, where this one is still installed (one installed later keeps its own)."""
        if threading.current_thread() is not threading.main_thread():
            return  # signal.signal refuses other threads; the handler stays, noting signals and chaining
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._note:
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)


class StepAgreement:
    """The step every rank saves for a preemption, agreed through ``store`` (the protocol in the module doc)."""

    def __init__(self, store: dist.Store, world: int) -> None:
        self.store = store
        self.world = world
        self.lead = 1 if world > 1 else 0  # steps between a signalled rank's step and the one it proposes
        self.target: int | None = None  # the step to save, as this rank last read it

    def propose(self, step: int) -> None:
        """This rank got a signal and is at ``step``: propose ``step + lead``, unless a rank proposed first."""
        self.target = int(self.store.compare_set("step", "", str(step + self.lead)))

    def look(self) -> None:
        """Read the agreed step if any rank proposed one (one round trip to the store)."""
        if self.store.check(["step"]):
            self.target = int(self.store.get("step"))

    def settle(self, step: int) -> bool:
        """Whether every rank saves at ``step`` (a target is known); moves a target this rank went past."""
        while True:
            target = self.target
            assert target is not None
            if step < target:
                return False
            if step == target:
                if self._arrive(target):
                    return True
                self.target = int(self.store.get("step"))  # moved by the rank that went past it, before it said so
                continue
            self.target = int(self.store.compare_set("step", str(target), str(step + 1)))
            self.store.add(f"arrived/{target}", _PASSED)
            self.store.set(f"go/{target}", "1")

    def _arrive(self, step: int) -> bool:
        """Wait at ``step`` until every rank arrived (True) or one went past it (False)."""
        arrived, go = f"arrived/{step}", f"go/{step}"
        if self.store.add(arrived, 1) == self.world:
            self.store.set(go, "1")
        warn_at = time.monotonic() + _PATIENCE
        while not self.store.check([go]):
            time.sleep(_POLL)
            if time.monotonic() >= warn_at:
                warn_at += _PATIENCE
                log.warning(
                    "fp-dcp: preemption: waiting at step %d for the other ranks to reach it (%d of %d there); "
                    "every rank must call should_save(step) or save(step, ...) at every step",
                    step,
                    self.store.add(arrived, 0),
                    self.world,
                )
        return int(self.store.add(arrived, 0)) == self.world


@dataclasses.dataclass
class PreemptionSave:
    """What the preemption save did on this rank (``CheckpointManager.preemption``)."""

    step: int
    signal: int | None  # the signal this rank got; None: another rank's signal brought it here
    seconds_to_step: float | None  # from that signal until the loop reached ``step`` (None: no signal here)
    seconds_waiting: float  # for the save in flight before it
    seconds_saving: float  # the save itself, until published
    seconds_copying: float = 0.0  # then for its replication and drain (tiers), up to the deadline
    durable: bool | None = None  # its drain committed within the deadline (None: no durable tier)

    @property
    def seconds(self) -> float | None:
        """From this rank's signal to the step published (None: no signal here)."""
        if self.seconds_to_step is None:
            return None
        return self.seconds_to_step + self.seconds_waiting + self.seconds_saving


class Preemption:
    """One manager's preemption handling: the signals watched, the step agreed, the save and its report."""

    def __init__(self, signals: Sequence[int], group: dist.ProcessGroup | None, name: str, deadline: float) -> None:
        if deadline < 0:
            raise ValueError(f"preemption_deadline must be 0 or more seconds, got {deadline}")
        if dist.is_available() and dist.is_initialized():
            store: dist.Store = dist.PrefixStore(f"fp_dcp/preemption/{name}/", process_group_store(group))
            world = dist.get_world_size(group)
        else:
            store, world = dist.HashStore(), 1
        self.deadline = deadline
        self.agreement = StepAgreement(store, world)
        self.signals = SignalWatch(signals)
        self.step: int | None = None  # the agreed step, once this rank reached it
        self.report: PreemptionSave | None = None
        self._looked: tuple[int, bool] | None = None  # (step, due): should_save and save look once per step
        self._reached_at = 0.0
        self._signal: tuple[int | None, float | None] = (None, None)  # this rank's signal before the step, and when

    def due(self, step: int) -> bool:
        """Whether ``step`` is the preemption step, on every rank alike."""
        if self.report is not None:
            return False
        if self.step is not None:
            return step == self.step
        if self._looked is not None and self._looked[0] == step:
            return self._looked[1]
        agreement = self.agreement
        if agreement.target is None:
            if self.signals.received is not None:
                agreement.propose(step)
            else:
                agreement.look()
        due = agreement.target is not None and agreement.settle(step)
        self._looked = (step, due)
        if due:
            self.step, self._reached_at = step, time.monotonic()
            self._signal = (self.signals.received, self.signals.received_at)  # not one that comes during the save
        return due

    def save(self, step: int, wait: Callable[[], None], write: Callable[[], None], tiers: Tiers | None) -> None:
        """The preemption save: the save in flight ends (``wait``), ``write`` saves synchronously, copies follow."""
        start = time.monotonic()
        try:
            wait()
        except (Exception, CheckpointException) as e:  # that save is no longer the last word: this one is
            log.warning("fp-dcp: preemption: the save in flight failed (%s); saving step %d now", e, step)
        waited = time.monotonic()
        write()
        saved = time.monotonic()
        durable = self._copies(step, tiers) if tiers is not None else None
        signum, signalled = self._signal
        self.report = PreemptionSave(
            step=step,
            signal=signum,
            seconds_to_step=None if signalled is None else max(0.0, self._reached_at - signalled),
            seconds_waiting=waited - start,
            seconds_saving=saved - waited,
            seconds_copying=time.monotonic() - saved,
            durable=durable,
        )
        log.warning("fp-dcp: preemption: step %d saved (%s)", step, _describe(self.report))

    def _copies(self, step: int, tiers: Tiers) -> bool | None:
        """Wait up to the deadline for the step's replication and drain; warn about what is not done."""
        done = tiers.wait(timeout=self.deadline)
        drain = tiers.last_drain
        drained = drain is not None and drain.step == step and drain.committed
        late = f"did not finish within preemption_deadline ({self.deadline:g} s)"
        if tiers.store is not None and not drained:
            log.warning(
                "fp-dcp: preemption: step %d is saved in %s, but its durable copy is not: its drain to %s %s; the "
                "durable root still ends at an older step",
                step,
                tiers.root,
                tiers.store.url,
                late if not done else f"failed: {tiers.durable_error}",
            )
        elif not done:
            log.warning(
                "fp-dcp: preemption: step %d is saved in %s, but its copies to other nodes %s", step, tiers.root, late
            )
        return drained if tiers.store is not None else None

    def close(self) -> None:
        self.signals.close()


def _describe(report: PreemptionSave) -> str:
    parts = [f"waited {report.seconds_waiting:.2f} s for the save in flight", f"saved in {report.seconds_saving:.2f} s"]
    if report.seconds is not None:
        parts.insert(0, f"published {report.seconds:.2f} s after signal {report.signal}")
    if report.durable is not None:
        parts.append("drained" if report.durable else "NOT drained")
    return ", ".join(parts)
