"""Background collectives never share a process group with the training loop's (issue 48).

4 gloo ranks run a data-parallel loop (an ``all_reduce`` on the default group
every step) beside asynchronous saves. ``CheckpointManager`` with its
defaults (no ``process_group``) gives its saves a group of their own; on the
default group, the save thread's collectives and the loop's interleave and
every rank hangs. The launcher's deadline fails a hang, with every thread's
stack printed.

Spawning ranks is most of the cost, so one launch (``ranks``) runs every
part, one after another, and each test asserts on its own part's results.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from conftest import needs_xxhash, same_bytes
from test_docs_examples import ROOT, blocks, run_python
from test_preemption import Messages
from tiers_util import drop_node, restore, save_steps

from fp_dcp import CheckpointManager, FastPersistReader, FastPersistWriter, list_steps
from fp_dcp.net.group import SHARED_DEFAULT_GROUP
from fp_dcp.runs.steps import step_directory
from fp_dcp.testing.ranks import run_ranks
from fp_dcp.testing.tiers import same_state

pytestmark = [needs_xxhash, pytest.mark.slow]  # the loops include incremental runs

WORLD = 4
STEPS = 200
VICTIM = 2  # the rank that gets SIGTERM
# (every_n_steps, incremental, the step at which VICTIM gets SIGTERM or None): each pair of choices comes once
VARIANTS = [(1, False, None), (1, True, 40), (5, False, 120), (5, True, None)]
KEEP_LAST = 3  # the manager's default


def state_at(step: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s state after ``step``: a tensor all ranks share, one of its own, and one that never changes
    (an incremental save references it)."""
    return {
        "shared": torch.randn(16, generator=torch.Generator().manual_seed(step)),
        f"own{rank}": torch.randn(8, generator=torch.Generator().manual_seed(1000 * step + rank)),
        "frozen": torch.arange(16, dtype=torch.float32),
        "step": torch.tensor(step),
    }


def restores_bit_exact(reader: FastPersistReader, root: str, step: int) -> bool:
    """Whether ``step`` loads, in this process alone, as every rank's state at that step."""
    want = {k: v for rank in range(WORLD) for k, v in state_at(step, rank).items()}
    got = {k: torch.full_like(v, -1) for k, v in want.items()}
    dcp.load(got, checkpoint_id=step_directory(root, step), storage_reader=reader, no_dist=True)
    return all(same_bytes(got[k], want[k]) for k in want)


def _warnings(root: str) -> list[int]:
    """How often the shared-group warning was logged after each kind of save: sync on the default group, async on
    a group of its own, async on the default group twice (no collective runs beside them here)."""
    logged = Messages()
    said = []
    state = state_at(1, dist.get_rank())
    saves: list[tuple[Any, dict[str, Any]]] = [
        (dcp.save, {}),
        (dcp.async_save, {"process_group": dist.new_group(backend="gloo")}),
        (dcp.async_save, {}),
        (dcp.async_save, {}),
    ]
    for i, (save, options) in enumerate(saves):
        with FastPersistWriter(os.path.join(root, "warnings", str(i))) as writer:
            done = save(state, storage_writer=writer, **options)
            if save is dcp.async_save:
                done.result()
        said.append(logged.messages.count(SHARED_DEFAULT_GROUP))
    return said


def _loops(root: str, rank: int, world: int) -> list[dict[str, Any]]:
    """Each variant's loop with the manager's defaults: the steps saved, the preemption step, what restores."""
    runs = []
    for i, (every, incremental, signal_at) in enumerate(VARIANTS):
        run_root = os.path.join(root, "loops", str(i))
        mgr = CheckpointManager(run_root, every_n_steps=every, incremental=incremental, save_on_preemption=True)
        saved: list[int] = []
        restorable = []
        reader = FastPersistReader(share=False)
        for step in range(1, STEPS + 1):
            grads = torch.ones(4)
            dist.all_reduce(grads)  # a data-parallel step's collective, beside the save in flight
            assert torch.equal(grads, torch.full((4,), float(world))), (step, grads)  # no message went to DCP
            if step == signal_at and rank == VICTIM:
                os.kill(os.getpid(), signal.SIGTERM)
            if mgr.should_save(step):
                mgr.save(step, state_at(step, rank))  # the save before it is published by now
                if rank == 0 and saved:
                    restorable.append(restores_bit_exact(reader, run_root, saved[-1]))
                saved.append(step)
            if mgr.preempted:
                break
        mgr.close()
        if rank == 0:
            restorable.append(restores_bit_exact(reader, run_root, saved[-1]))
        preemption = mgr.preemption.step if mgr.preemption is not None else None
        runs.append({"saved": saved, "preemption": preemption, "restorable": restorable})
    return runs


def _docs_examples(root: str) -> int:
    """Run docs/runs.md's manager examples as written, an all_reduce in every forward pass as DDP runs one in
    every step; the tier examples are left out (a store in this process's memory, one machine's disk removed)."""
    examples = [b for b in blocks(ROOT / "docs" / "runs.md") if b.info in ("python", "output")]
    namespace: dict[str, Any] = {"__name__": "__doc_example__"}
    sandbox = Path(root) / "docs"
    hook = torch.nn.modules.module.register_module_forward_hook(lambda *_: dist.all_reduce(torch.ones(1)))
    ran = 0
    try:
        for i, block in enumerate(examples):
            if block.info != "python" or "CheckpointManager(" not in block.text or "{node}" in block.text:
                continue
            after = examples[i + 1] if i + 1 < len(examples) else None
            run_python(block, sandbox, namespace, after if after is not None and after.info == "output" else None)
            ran += 1
    finally:
        hook.remove()
    return ran


def _subgroup_tiers(root: str, rank: int) -> tuple[dict[str, Any], tuple[int | None, bool]] | None:
    """Ranks 0 and 2 (nodes "a" and "b") alone run a tiered manager on a group of theirs; 1 and 3 make none.

    The group holds global rank 0: torch 2.7's DCP broadcasts on a group from global rank 0, whatever the group, so
    its saves on a group without global rank 0 fail in DCP itself (2.13's broadcasts from the group's coordinator).
    """
    tmp = os.path.join(root, "subgroup")
    group = dist.new_group([0, 2])  # torch's rule: every rank takes part in making it
    outcome = None
    if rank in (0, 2):
        options = {"process_group": group, "replicas": 2, "durable": os.path.join(tmp, "durable")}
        copies = save_steps(rank, 2, tmp, [1, 2], options)
        if rank == 0:
            drop_node(tmp, "b")  # rank 2's restore fetches its node's files from node "a"
        dist.barrier(group)
        step, state = restore(rank, 2, tmp, options)
        outcome = copies, (step, step is not None and same_state(state, step, rank))
    dist.barrier()
    return outcome


def _rank(rank: int, world: int, root: str) -> dict[str, Any]:
    return {
        "warnings": _warnings(root),
        "loops": _loops(root, rank, world),
        "docs": _docs_examples(root),
        "subgroup": _subgroup_tiers(root, rank),
    }


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("groups")
    return root, run_ranks(WORLD, _rank, str(root), timeout=240)


def test_async_saves_with_the_managers_defaults_beside_a_collective_every_step_never_hang(ranks):
    root, results = ranks
    for i, (every, incremental, signal_at) in enumerate(VARIANTS):
        due = range(every, STEPS + 1, every)
        saved, preemption = list(due), None
        if signal_at is not None:  # a collective every step: every rank reads the proposal by the next step
            saved, preemption = [*(s for s in due if s <= signal_at), signal_at + 1], signal_at + 1
        variant = (every, incremental, signal_at)
        assert [(r["loops"][i]["saved"], r["loops"][i]["preemption"]) for r in results] == [(saved, preemption)] * WORLD
        assert results[0]["loops"][i]["restorable"] == [True] * len(saved), variant  # each step, once published
        steps = list_steps(root / "loops" / str(i))
        assert [s.step for s in steps if s.status == "complete"] == saved[-KEEP_LAST:], variant
        # incremental: the first step holds the frozen tensor every later step references
        assert [s.step for s in steps if s.status == "retired"] == (saved[:1] if incremental else []), variant


def test_an_async_save_on_a_gloo_default_group_is_warned_about_once_and_no_other_save(ranks):
    _, results = ranks
    # dcp.save, async_save on a group of its own, then twice on the default group: said once, at the first
    assert [r["warnings"] for r in results] == [[0, 0, 1, 1]] * WORLD


def test_the_runs_page_manager_examples_run_on_4_ranks_with_a_collective_every_step(ranks):
    _, results = ranks
    # each printed what the page shows (step numbers aside: the preemption step is one later with several ranks)
    assert [r["docs"] for r in results] == [4] * WORLD  # the first run, its resume, incremental, preemption


def test_a_subgroup_alone_runs_a_tiered_manager_whose_groups_are_made_over_its_ranks(ranks):
    _, results = ranks
    assert [r["subgroup"] for r in results[1::2]] == [None, None]
    for r in results[0::2]:
        copies, restored = r["subgroup"]
        assert copies["replication"] == [] and copies["error"] is None, copies
        assert restored == (2, True)
