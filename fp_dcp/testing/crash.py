"""Crash trials: kill a save with SIGKILL at a random moment, then see what loads.

Each trial saves a state dict (``--size``, 1 GiB by default) with
``FastPersistWriter`` in a child process and kills the child with SIGKILL
while it saves, in one of two ways:

- ``time``: at a random time, uniform over the save's duration (measured by
  unkilled calibration saves), so kills fall where the time goes;
- ``step``: in a chosen step of the save (see ``STEPS``): at a random time
  within the step when it lasts long enough to aim into (planning, data
  writes of a large state), else at its very start (the child stops itself
  there, and is then killed), so that steps of microseconds (the rename) are
  hit as often as long ones.

Half of the ``step`` trials, and of the ``time`` ones, overwrite the
checkpoint already in the directory; the others save into an empty one. The
child reports each step as it enters it, through a pipe that outlives it, so
the step it died in is known exactly. A fresh process then loads the
directory, hashes every tensor (SHA-256, independent of fp-dcp's CRC-32C) and
runs ``verify_checkpoint``. The acceptable outcomes:

- ``new``: the checkpoint being saved, bit-exact;
- ``previous``: when overwriting, the checkpoint that was there, bit-exact;
- ``none``: when not overwriting, the load refuses with ``NotACheckpointError``
  ("holds no checkpoint").

Anything else is a failure: ``wrong`` (loads,
but not the bytes of either save), ``lost`` (an overwrite left no
checkpoint), ``error`` (any other load error), ``order`` (the outcome
contradicts the step: the new checkpoint before the rename, or the previous
one after it), ``verify`` (``verify_checkpoint`` disagrees with the load),
``hang`` (a load or save did not finish in time).

``benchmarks/crash_trials.py`` runs them (``--trials 100`` for the
figures), tests/test_crash.py a few. The state dicts are
``fp_dcp.testing.states``'s; the processes are forked from a server that
has imported torch once (``fp_dcp.testing.processes``), so a trial costs
its save, its load and the hashing, not interpreter start-up.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import logging
import os
import random
import shutil
import signal
import time
import warnings
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, cast

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from .. import FastPersistReader, FastPersistWriter, IOConfig, NotACheckpointError, engine_info, verify_checkpoint
from ..config import EngineChoice
from ..io import engine, files
from ..save import commit, writer
from .processes import context
from .states import digests, empty_state, make_state

__all__ = [
    "STEPS",
    "DONE",
    "ORDER",
    "PUBLISHED_AFTER",
    "GOOD",
    "BAD",
    "AIM_MIN",
    "Save",
    "Kill",
    "Trial",
    "Harness",
    "schedule",
    "run_trials",
    "summarize",
]

# The steps of a save, in order, each reported when the save enters it.
STEPS = {
    "plan": "planning, lock, reading the replaced checkpoint's file list",
    "write": "data files created, preallocated and written",
    "fsync-data": "data files fsynced",
    "fsync-dir": "directory fsynced (the data files' names)",
    "metadata": ".metadata encoded, written under a temporary name, fsynced",
    "rename": "temporary name renamed over .metadata",
    "fsync-dir-after": "directory fsynced after the rename",
    "cleanup": "replaced checkpoint's files removed (on a thread of their own, awaited by the writer's close)",
}
DONE = "done"  # the save returned before the kill
ORDER = [*STEPS, DONE]
PUBLISHED_AFTER = ORDER.index("fsync-dir-after")  # killed in this step or later: the new checkpoint exists
GOOD = ("new", "previous", "none")
BAD = ("wrong", "lost", "error", "order", "verify", "hang")
AIM_MIN = 0.02  # seconds: a step at least this long is killed at a random time within it


# ---------------------------------------------------------------- child processes


class _Steps:
    """Reports to the parent each step of the save in this process as it starts, once and in order."""

    def __init__(self, conn: Connection, stop_at: str | None) -> None:
        self.conn = conn
        self.stop_at = stop_at
        self.reached = -1

    def enter(self, step: str) -> None:
        if ORDER.index(step) <= self.reached:
            return  # a function of an earlier step called again (fsync_directory during cleanup)
        self.reached = ORDER.index(step)
        self.conn.send(("step", step, time.monotonic()))
        if step == self.stop_at:
            os.kill(os.getpid(), signal.SIGSTOP)  # the parent kills us here

    def install(self) -> None:
        """Wrap the fp-dcp functions that begin each step (in this child process only)."""
        renamed = ORDER.index("rename")

        def before(owner: Any, name: str, step: Callable[[], str]) -> None:
            real = getattr(owner, name)

            @functools.wraps(real)
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                self.enter(step())
                return real(*args, **kwargs)

            setattr(owner, name, wrapper)

        before(writer, "write_files", lambda: "write")
        for cls in (engine.UringEngine, engine.ThreadEngine):
            before(cls, "sync", lambda: "fsync-data")
        before(files, "fsync_directory", lambda: "fsync-dir-after" if self.reached >= renamed else "fsync-dir")
        before(writer.FastPersistWriter, "finish", lambda: "metadata")
        before(os, "replace", lambda: "rename")
        before(commit.Cleanup, "start", lambda: "cleanup")


def _quiet() -> None:
    """Children keep stderr for real failures: no DCP warnings, no logged tracebacks of expected load errors."""
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)


def _save_child(
    conn: Connection, directory: str, size: int, version: int, engine_name: str, stop_at: str | None
) -> None:
    _quiet()
    state = make_state(size, version)
    conn.send(("digests", digests(state)))
    steps = _Steps(conn, stop_at)
    steps.install()
    steps.enter("plan")
    with FastPersistWriter(directory, config=IOConfig(engine=cast(EngineChoice, engine_name))) as storage:
        dcp.save(state, storage_writer=storage)
    steps.enter(DONE)


def _load_child(conn: Connection, directory: str, size: int) -> None:
    _quiet()
    result: dict[str, Any] = {}
    try:
        # DCP re-raises a failed metadata read as its own AssertionError: ask the reader itself, for the type
        FastPersistReader(directory).read_metadata()
    except NotACheckpointError as e:
        result["none"] = str(e)
    if "none" not in result:
        target = empty_state(size)
        try:
            dcp.load(target, storage_reader=FastPersistReader(directory))
            result["digests"] = digests(target)
        except BaseException as e:  # CheckpointException is a BaseException
            err = next(iter(e.failures.values()))[0] if isinstance(e, CheckpointException) else e
            result["error"] = f"{type(err).__name__}: {err}"
    try:
        report = verify_checkpoint(directory)
        result["verify"] = "ok" if report.ok else f"problems: {report.problems[:3]}"
    except NotACheckpointError:
        result["verify"] = "none"
    except Exception as e:
        result["verify"] = f"{type(e).__name__}: {e}"
    conn.send(result)


# ---------------------------------------------------------------- the parent


@dataclasses.dataclass
class Save:
    """What the parent saw of one save: its version, its digests, the steps entered (with the child's clock)."""

    version: int
    digests: dict[str, str]
    steps: list[tuple[str, float]]

    @property
    def last(self) -> str:
        return self.steps[-1][0] if self.steps else "plan"

    def durations(self) -> dict[str, float]:
        return {a: tb - ta for (a, ta), (_, tb) in itertools.pairwise(self.steps)}


@dataclasses.dataclass(frozen=True)
class Kill:
    after: str  # step whose start the delay counts from
    delay: float  # seconds
    stop: bool  # the child stops itself at the start of ``after``


@dataclasses.dataclass
class Trial:
    number: int
    engine: str
    overwrite: bool
    mode: str  # "time" or "step"
    aimed: str | None  # the step aimed at (step mode)
    killed_in: str  # the step the child had entered last when it died; DONE if it finished first
    outcome: str
    detail: str
    seconds: float


class Harness:
    def __init__(self, directory: str, size: int, *, load_timeout: float, save_timeout: float) -> None:
        self.directory = directory
        self.size = size
        self.load_timeout = load_timeout
        self.save_timeout = save_timeout
        self.ctx = context()
        self.versions = 0
        self.current: Save | None = None  # the checkpoint the directory holds now, if known

    def save(self, engine_name: str, kill: Kill | None) -> Save:
        """Run one save in a child; kill it as ``kill`` says (None: let it finish, and require success)."""
        self.versions += 1
        receiver, sender = self.ctx.Pipe(duplex=False)
        stop_at = kill.after if kill is not None and kill.stop else None
        args = (sender, self.directory, self.size, self.versions, engine_name, stop_at)
        child = self.ctx.Process(target=_save_child, args=args, daemon=True)
        child.start()
        sender.close()
        run = Save(self.versions, {}, [])
        deadline = time.monotonic() + self.save_timeout
        kill_at = None
        try:
            while True:
                now = time.monotonic()
                if kill_at is not None and now >= kill_at:
                    break
                if now >= deadline:
                    raise TimeoutError(f"the save did not finish in {self.save_timeout} s (last step: {run.last})")
                if not receiver.poll((deadline if kill_at is None else min(kill_at, deadline)) - now):
                    continue
                if not self._receive(receiver, run):
                    break  # the child exited
                if kill is not None and kill_at is None and run.steps and run.steps[-1][0] == kill.after:
                    kill_at = run.steps[-1][1] + kill.delay
        finally:
            child.kill()
            child.join()
            while self._receive(receiver, run):  # steps the child reported before it died
                pass
            receiver.close()
        if kill is None and child.exitcode != 0:
            raise RuntimeError(f"an unkilled save failed (exit code {child.exitcode}; its traceback is above)")
        if child.exitcode not in (0, -signal.SIGKILL):
            raise RuntimeError(f"the save failed by itself (exit code {child.exitcode}) in step {run.last}")
        return run

    @staticmethod
    def _receive(receiver: Connection, run: Save) -> bool:
        try:
            if not receiver.poll():
                return False
            message = receiver.recv()
        except (EOFError, OSError):
            return False
        if message[0] == "digests":
            run.digests = message[1]
        else:
            run.steps.append((message[1], message[2]))
        return True

    def load(self) -> dict[str, Any] | None:
        """Load and verify in a child; None if it did not answer in time."""
        receiver, sender = self.ctx.Pipe(duplex=False)
        child = self.ctx.Process(target=_load_child, args=(sender, self.directory, self.size), daemon=True)
        child.start()
        sender.close()
        try:
            if not receiver.poll(self.load_timeout):
                return None
            try:
                result: dict[str, Any] = receiver.recv()
                return result
            except EOFError:
                return {"error": f"the loading process died (exit code {child.exitcode})", "verify": "?"}
        finally:
            child.kill()
            child.join()
            receiver.close()

    def fresh(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
        os.mkdir(self.directory)
        self.current = None

    def trial(self, number: int, engine_name: str, overwrite: bool, mode: str, aimed: str | None, kill: Kill) -> Trial:
        start = time.monotonic()
        if not overwrite:
            self.fresh()
        elif self.current is None:
            self.current = self.save(engine_name, None)
        previous = self.current
        try:
            run = self.save(engine_name, kill)
        except TimeoutError as e:
            self.fresh()
            return Trial(number, engine_name, overwrite, mode, aimed, "?", "hang", str(e), time.monotonic() - start)
        outcome, detail = self._judge(run, previous, self.load())
        self.current = {"new": run, "previous": previous}.get(outcome)
        if outcome not in GOOD:
            self.fresh()  # start again from a known state
        return Trial(number, engine_name, overwrite, mode, aimed, run.last, outcome, detail, time.monotonic() - start)

    @staticmethod
    def _judge(run: Save, previous: Save | None, result: dict[str, Any] | None) -> tuple[str, str]:
        if result is None:
            return "hang", "the load did not finish in time"
        if "digests" in result:
            got = result["digests"]
            outcome = "new" if got == run.digests else "previous" if previous and got == previous.digests else "wrong"
            detail = f"version {got['meta.version']}"
            if outcome != "wrong" and result["verify"] != "ok":
                return "verify", f"loaded {outcome}, but verify_checkpoint says {result['verify']}"
        elif "none" in result:
            outcome, detail = ("lost" if previous else "none"), result["none"]
            if result["verify"] != "none":
                return "verify", f"no checkpoint to load, but verify_checkpoint says {result['verify']}"
        else:
            return "error", result["error"]
        published = ORDER.index(run.last) >= PUBLISHED_AFTER
        if (outcome == "new" and ORDER.index(run.last) < ORDER.index("rename")) or (outcome != "new" and published):
            return "order", f"{outcome} after a kill in step {run.last}"
        return outcome, detail


def schedule(trials: int, rng: random.Random, time_share: float) -> list[tuple[str, str | None, bool]]:
    """(mode, aimed step, overwrite) per trial: every (step, overwrite) pair in turn, then random times."""
    timed = round(trials * time_share)
    pairs = [(step, overwrite) for overwrite in (False, True) for step in STEPS]
    aimed: list[tuple[str, bool]] = []
    while len(aimed) < trials - timed:
        rng.shuffle(pairs)
        aimed += pairs
    plan: list[tuple[str, str | None, bool]] = [("step", step, ow) for step, ow in aimed[: trials - timed]]
    plan += [("time", None, i % 2 == 1) for i in range(timed)]
    rng.shuffle(plan)
    return plan


def run_trials(
    directory: str,
    trials: int,
    size: int,
    *,
    seed: int = 0,
    engines: list[str] | None = None,
    time_share: float = 0.5,
    aim_min: float = AIM_MIN,
    load_timeout: float = 120.0,
    save_timeout: float = 600.0,
    log: Callable[[str], None] = print,
) -> tuple[list[Trial], dict[tuple[str, bool], Save]]:
    """Run the trials in ``directory`` (created, then removed); returns them and the calibration saves.

    Calibration saves are keyed by (engine, overwrite): a fresh save's cleanup has nothing to remove, an
    overwrite's removes the old files, so the two differ in how long their steps last.

    A step lasting at least ``aim_min`` seconds in calibration is killed at a random time within it, a
    shorter one at its start (``float("inf")``: every step at its start, which makes the coverage exact).
    """
    if engines is None:
        engines = ["io_uring", "threads"] if engine_info()["engine"] == "io_uring" else ["threads"]
    rng = random.Random(seed)
    os.makedirs(directory, exist_ok=True)
    harness = Harness(os.path.join(directory, "ckpt"), size, load_timeout=load_timeout, save_timeout=save_timeout)
    try:
        calibration = {}
        for name in engines:
            harness.fresh()
            calibration[name, False] = harness.save(name, None)
            calibration[name, True] = harness.current = harness.save(name, None)
            for overwrite in (False, True):
                steps = ", ".join(
                    f"{step} {seconds * 1000:.1f}" for step, seconds in calibration[name, overwrite].durations().items()
                )
                log(f"calibration ({name}, {'overwrite' if overwrite else 'fresh'}), ms per step: {steps}")
        results = []
        for number, (mode, aimed, overwrite) in enumerate(schedule(trials, rng, time_share), 1):
            name = engines[number % len(engines)]
            durations = calibration[name, overwrite].durations()
            if mode == "time":
                kill = Kill("plan", rng.uniform(0, sum(durations.values())), stop=False)
            else:
                assert aimed is not None
                aim = durations[aimed] >= aim_min
                kill = Kill(aimed, rng.uniform(0, durations[aimed]) if aim else 0.0, stop=not aim)
            trial = harness.trial(number, name, overwrite, mode, aimed, kill)
            results.append(trial)
            log(
                f"trial {number}/{trials}: {mode} {aimed or f'+{kill.delay * 1000:.0f} ms'}, {name}, "
                f"{'overwrite' if overwrite else 'fresh'}: killed in {trial.killed_in} -> {trial.outcome} "
                f"({trial.detail[:100]}) [{trial.seconds:.1f} s]"
            )
        return results, calibration
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def summarize(results: list[Trial]) -> str:
    """Counts per outcome, by the step the save was killed in, for fresh saves and overwrites."""
    outcomes = [o for o in (*GOOD, *BAD) if o in GOOD or any(t.outcome == o for t in results)]
    lines = []
    for overwrite in (False, True):
        subset = [t for t in results if t.overwrite == overwrite]
        title = "overwriting a checkpoint" if overwrite else "saving into an empty directory"
        lines.append(f"{title}: {len(subset)} trials")
        lines.append(f"  {'killed in step':<18}" + "".join(f"{o:>10}" for o in outcomes))
        for step in ORDER:
            row = collections.Counter(t.outcome for t in subset if t.killed_in == step)
            if row:
                lines.append(f"  {step:<18}" + "".join(f"{row[o]:>10}" for o in outcomes))
        total = collections.Counter(t.outcome for t in subset)
        lines.append(f"  {'all':<18}" + "".join(f"{total[o]:>10}" for o in outcomes))
    modes = collections.Counter(t.mode for t in results)
    engines = collections.Counter(t.engine for t in results)
    bad = sum(t.outcome in BAD for t in results)
    lines.append(f"kills: {dict(modes)}; engines: {dict(engines)}; bad outcomes: {bad}")
    return "\n".join(lines)
