"""Preemption: real signals to spawned gloo ranks; every rank saves the same step, which restores bit-exact."""

from __future__ import annotations

import contextlib
import logging
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import needs_torch, needs_xxhash, same_bytes
from tiers_util import drop_node

from fp_dcp import CheckpointManager, compat
from fp_dcp.testing.ranks import rank_results, run_ranks, spawned_ranks
from fp_dcp.testing.tiers import local_root, set_node
from fp_dcp.tiers import PosixStore

pytestmark = pytest.mark.slow  # its tests start processes

ROOT = Path(__file__).resolve().parents[1]


def state_at(step: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s state after ``step``: a tensor of its own, one all ranks share, and one that never changes."""
    return {
        "shared": torch.randn(64, 64, generator=torch.Generator().manual_seed(step)),
        f"own{rank}": torch.randn(5000 + 100 * rank, generator=torch.Generator().manual_seed(1000 * step + rank)),
        "frozen": torch.arange(20_000, dtype=torch.float32),
        "step": torch.tensor(step),
    }


class Counter:
    """A SIGTERM handler of the program's own, installed before the manager: counts the signals it gets."""

    def __init__(self) -> None:
        self.count = 0
        self.previous = signal.signal(signal.SIGTERM, self)

    def __call__(self, signum: int, frame: Any) -> None:
        self.count += 1


def _report(path: str | None, text: str) -> None:
    """Tell the test where this rank is (a file replaced whole: the test reads it while the rank runs)."""
    if path is not None:
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)


def _wait_for_step(path: Path, step: int, deadline: float = 120) -> None:
    """Until the rank reports that it is done with ``step`` or a later one."""
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        with contextlib.suppress(FileNotFoundError, ValueError):
            if int(path.read_text()) >= step:
                return
        time.sleep(0.005)
    raise TimeoutError(f"{path} never reached step {step}")


class Messages(logging.Handler):
    """What fp-dcp logs in this rank."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []
        logging.getLogger("fp_dcp").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _train(rank: int, world: int, root: str, knobs: dict[str, Any]) -> dict[str, Any]:
    """A training loop that saves every few steps and stops once preempted; the test signals it from outside."""
    prior = Counter()
    if knobs.get("nodes"):
        set_node(rank)  # ranks 0-1 are node "a", 2-3 node "b"
    group = dist.new_group(backend="gloo")  # checkpoints' own group: training's all_reduce runs beside async saves
    mgr = CheckpointManager(root, process_group=group, save_on_preemption=True, **knobs.get("manager", {}))
    report = knobs["report"] if rank == knobs.get("victim") else None
    logged = Messages()
    now = {"step": 0}
    write_data = mgr.writer.write_data

    def write_data_with_a_hook(plan: Any, planner: Any) -> Any:
        if knobs.get("hold_step") == now["step"] and report is not None:
            while prior.count == 0:  # the save stays in flight until the signal has come
                time.sleep(0.001)
        if knobs.get("signal_during_save") and mgr.preempted:
            os.kill(os.getpid(), signal.SIGTERM)  # a second signal in the middle of the preemption save
        return write_data(plan, planner)

    mgr.writer.write_data = write_data_with_a_hook  # type: ignore[method-assign]
    saved, noticed = [], None
    coupled = knobs.get("coupled", True)
    for step in range(1, 100_000):
        now["step"] = step
        if coupled:
            dist.all_reduce(torch.ones(1))  # the collective of a data-parallel step
        time.sleep(knobs.get("step_seconds", {}).get(rank, 0.003))
        if noticed is None and prior.count:
            noticed = step
        if mgr.should_save(step):
            mgr.save(step, state_at(step, rank))
            saved.append(step)
        if mgr.preempted:
            break
        _report(report, str(step))
    preemption = mgr.preemption
    assert preemption is not None
    steps = {s.step: (s.status, s.references) for s in mgr.steps()}
    if knobs.get("open_gate") and rank == 0:
        Path(knobs["open_gate"]).touch()  # the drain may go on now
    mgr.close()
    return {
        "step": preemption.step,
        "signal": preemption.signal,
        "durable": preemption.durable,
        "saved": saved,
        "noticed": noticed,
        "prior": prior.count,
        "handler_after_close": signal.getsignal(signal.SIGTERM) is prior,
        "steps": steps,
        "messages": logged.messages,
    }


def _restore(rank: int, world: int, root: str, options: dict[str, Any]) -> tuple[int | None, bool]:
    set_node(rank)
    state = {k: torch.full_like(v, -1) for k, v in state_at(0, rank).items()}
    with CheckpointManager(root, verify=True, **options) as mgr:
        step = mgr.restore(state)
    want = state_at(step if step is not None else 0, rank)
    return step, all(same_bytes(state[k], want[k]) for k in want)


def _restore_here(root: Path, world: int) -> tuple[int | None, bool]:
    """Restore in this process: one rank loading what ``world`` ranks saved."""
    expected = [state_at(0, rank) for rank in range(world)]
    state = {k: torch.full_like(v, -1) for want in expected for k, v in want.items()}
    with CheckpointManager(root, verify=True) as mgr:
        step = mgr.restore(state)
    wanted = {k: v for rank in range(world) for k, v in state_at(step or 0, rank).items()}
    return step, all(same_bytes(state[k], wanted[k]) for k in wanted)


def _preempt(
    tmp_path: Path,
    world: int,
    knobs: dict[str, Any],
    at: int,
    signals: int = 1,
    victim: int = 0,
    fn: Any = None,
    root: str | None = None,
) -> list[dict[str, Any]]:
    """Run ``_train`` on ``world`` ranks; once ``victim`` is done with step ``at``, send it ``signals`` SIGTERMs."""
    report = tmp_path / "report"
    knobs = {**knobs, "victim": victim, "report": str(report)}
    with spawned_ranks(world, fn or _train, root or str(tmp_path / "run"), knobs) as ranks:
        _wait_for_step(report, at)
        for _ in range(signals):
            os.kill(ranks.pids[victim], signal.SIGTERM)
        return rank_results(ranks.outcomes(timeout=180))


def _one_step_for_all(results: list[dict[str, Any]], victim: int) -> int:
    steps = {r["step"] for r in results}
    assert len(steps) == 1, [r["step"] for r in results]
    step = steps.pop()
    assert all(r["saved"][-1] == step for r in results)  # the preemption save is each rank's last
    assert results[victim]["signal"] == signal.SIGTERM
    assert all(r["signal"] is None for rank, r in enumerate(results) if rank != victim)  # told through the store
    return step


def test_a_signal_to_one_of_four_ranks_makes_all_save_the_same_step_which_restores_bit_exact(tmp_path):
    # 2 nodes of 2 ranks, each node's own root, every rank's files on both nodes and in a durable directory
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    at, victim = rng.randrange(2, 25), rng.randrange(4)
    tiers = {"replicas": 2, "durable": str(tmp_path / "durable")}
    manager = {"every_n_steps": 7, "keep_last": 2, "preemption_deadline": 600, **tiers}
    results = _preempt(tmp_path, 4, {"manager": manager, "nodes": True}, at, victim=victim, root=local_root(tmp_path))
    step = _one_step_for_all(results, victim)
    assert step > at, seed  # the next step the loop passes, not one it already passed
    assert all(r["prior"] == (1 if rank == victim else 0) for rank, r in enumerate(results)), seed
    assert all(r["durable"] for r in results), seed  # drained whatever durable_every_n_steps says
    drop_node(tmp_path, "b")  # the step is whole on node "a" (replicas) and in the durable directory
    assert run_ranks(4, _restore, local_root(tmp_path), tiers) == [(step, True)] * 4, seed


@needs_xxhash
@needs_torch(compat.ASYNC_STAGING)  # (before, the manager's saves end inside save(): none is ever in flight)
@pytest.mark.parametrize("incremental", [False, True], ids=["full", "incremental"])
def test_a_signal_during_an_async_save_lets_it_finish_then_saves_the_preemption_step(tmp_path, incremental):
    # rank 1's save of step 5 stays in flight until its signal has come
    knobs = {"manager": {"every_n_steps": 5, "incremental": incremental}, "hold_step": 5}
    results = _preempt(tmp_path, 2, knobs, 5, victim=1)
    step = _one_step_for_all(results, victim=1)
    assert step > 5
    steps = results[0]["steps"]
    assert steps[5][0] == "complete" and steps[step][0] == "complete"  # the save in flight is whole, and the next
    if incremental:
        assert steps[step][1] == ("step-5",)  # the frozen tensor is referenced in the step saved before it
    assert _restore_here(tmp_path / "run", 2) == (step, True)


def test_signals_back_to_back_and_during_the_save_make_one_intact_save_and_reach_the_handler_installed_before(
    tmp_path,
):
    knobs = {"manager": {"every_n_steps": 1000}, "signal_during_save": True}
    results = _preempt(tmp_path, 2, knobs, 3, signals=2)
    step = _one_step_for_all(results, victim=0)
    assert [r["saved"] for r in results] == [[step], [step]]
    # each signal reached the handler installed before: two from outside (that the kernel or Python may merge
    # into one, as they do with a standard signal already pending) and one during the rank's own save
    assert results[0]["prior"] in (2, 3) and results[1]["prior"] == 1
    assert all(r["handler_after_close"] for r in results)  # close() put the handler back
    assert _restore_here(tmp_path / "run", 2) == (step, True)


def test_a_rank_far_ahead_of_the_signalled_one_moves_the_step_and_all_save_it(tmp_path):
    # no collective in the loop: rank 1 runs ~20x faster and has passed the step rank 0 proposes
    knobs = {"manager": {"every_n_steps": 10**6}, "coupled": False, "step_seconds": {0: 0.05, 1: 0.002}}
    results = _preempt(tmp_path, 2, knobs, 3)
    step = _one_step_for_all(results, victim=0)
    assert step > results[0]["noticed"] + 1  # not the step rank 0 proposed: rank 1 had passed it
    assert _restore_here(tmp_path / "run", 2) == (step, True)


class HeldStore(PosixStore):
    """A durable directory whose uploads wait until ``gate`` exists: a drain slower than any deadline."""

    def __init__(self, root: str, gate: str) -> None:
        super().__init__(root)
        self.gate = gate

    def put_file(self, key: str, source: str, size: int, check: Any) -> list[str]:
        while not os.path.exists(self.gate):
            time.sleep(0.01)
        return super().put_file(key, source, size, check)


def _train_with_a_held_drain(rank: int, world: int, root: str, knobs: dict[str, Any]) -> dict[str, Any]:
    manager = {**knobs["manager"], "durable": HeldStore(knobs["durable"], knobs["open_gate"])}
    result = _train(rank, world, root, {**knobs, "manager": manager})
    result["drained"] = sorted(os.listdir(knobs["durable"]))
    return result


def test_a_deadline_shorter_than_the_drain_leaves_the_local_step_complete_and_says_the_durable_one_is_not(tmp_path):
    manager = {"every_n_steps": 1000, "preemption_deadline": 0.2}
    knobs = {"manager": manager, "durable": str(tmp_path / "durable"), "open_gate": str(tmp_path / "gate")}
    results = _preempt(tmp_path, 2, knobs, 3, fn=_train_with_a_held_drain)
    step = _one_step_for_all(results, victim=0)
    for r in results:
        assert r["durable"] is False
        assert r["steps"][step][0] == "complete"  # the local step is whole
        assert any(f"step {step} is saved in" in m and "its durable copy is not" in m for m in r["messages"])
        assert any("did not finish within preemption_deadline (0.2 s)" in m for m in r["messages"])
        assert f"step-{step}" in r["drained"]  # close() waited for the drain once the gate opened
    assert _restore_here(tmp_path / "run", 2) == (step, True)


@needs_xxhash
def test_sigkill_during_the_preemption_save_leaves_the_last_good_step(tmp_path):
    # benchmarks/manager_crash_trials.py is the harness: SIGTERM, then SIGKILL a random grace period later
    script = ROOT / "benchmarks" / "manager_crash_trials.py"
    options = ["--preemption", "--trials", "4", "--mib", "4", "--max-delay", "0.6", "--dir", str(tmp_path)]
    run = subprocess.run(
        [sys.executable, str(script), *options],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert re.search(r"4 kills, 4 MiB state, SIGTERM first: .*ok [1-4]", run.stdout), run.stdout


def test_the_manager_refuses_to_watch_signals_outside_the_main_thread(tmp_path):
    errors: list[BaseException] = []

    def make() -> None:
        try:
            CheckpointManager(tmp_path / "run", save_on_preemption=True)
        except ValueError as e:
            errors.append(e)

    thread = threading.Thread(target=make)
    thread.start()
    thread.join()
    assert len(errors) == 1 and "main thread" in str(errors[0])


def test_a_signal_that_cannot_be_handled_is_refused_by_name(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(ValueError, match="cannot handle signal"):
        CheckpointManager(
            tmp_path / "run", save_on_preemption=True, preemption_signals=(signal.SIGTERM, signal.SIGKILL)
        )
    assert signal.getsignal(signal.SIGTERM) is before  # the handler installed first is taken back
