"""OverlappedCheckpointer in training loops: every checkpoint holds exactly its step's state.

Writes are slowed down (``slow_writes``) so that a save is still reading the
parameters while the next forward and backward run: a helper that let the
optimizer step too early would leave the next step's values in the file.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from conftest import SMALL, empty_like, load, needs_torch
from test_staging import slow_writes  # noqa: F401  (fixture)
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.nn.parallel import DistributedDataParallel

from fp_dcp import FastPersistSavePlanner, FastPersistWriter, OverlappedCheckpointer, compat
from fp_dcp.names import METADATA_NAME
from fp_dcp.testing.ranks import run_ranks


def make_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def state_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def tensors(state, prefix=""):
    """Flat {path: clone} of every tensor in a nested state."""
    if isinstance(state, torch.Tensor):
        return {prefix: state.detach().clone()}
    if isinstance(state, dict):
        return {k: v for key, value in state.items() for k, v in tensors(value, f"{prefix}/{key}").items()}
    if isinstance(state, list):
        return {k: v for i, value in enumerate(state) for k, v in tensors(value, f"{prefix}/{i}").items()}
    return {}


def train(root, mode: str, steps: int, every: int) -> tuple[dict[int, dict], OverlappedCheckpointer]:
    model, optimizer = make_model()
    writer = FastPersistWriter(root, config=SMALL, mode=mode)
    ckpt = OverlappedCheckpointer(writer, every=every, checkpoint_id=lambda step: os.path.join(root, f"step-{step}"))
    saved = {}
    for step in range(steps):
        model(torch.randn(32, 64)).square().mean().backward()
        ckpt.before_update()
        optimizer.step()
        optimizer.zero_grad()
        if ckpt.after_update(step, lambda: state_of(model, optimizer)):
            saved[step] = tensors(state_of(model, optimizer))
    ckpt.close()
    return saved, ckpt


@pytest.mark.usefixtures("slow_writes")
@pytest.mark.parametrize("mode", ["streaming", "snapshot"])
def test_every_step_checkpoint_holds_that_steps_state(tmp_path, mode):
    saved, ckpt = train(tmp_path, mode, steps=4, every=1)
    assert sorted(saved) == [0, 1, 2, 3] and ckpt.saves == 4
    model, optimizer = make_model()
    for step, expected in saved.items():
        target = empty_like(state_of(model, optimizer))
        load(target, tmp_path / f"step-{step}")
        got = tensors(target)
        assert got.keys() == expected.keys()
        for key in expected:
            assert torch.equal(got[key], expected[key]), (step, key)


def test_every_n_steps(tmp_path):
    saved, ckpt = train(tmp_path, "streaming", steps=7, every=3)
    assert sorted(saved) == [0, 3, 6] and ckpt.saves == 3
    published = sorted(n for n in os.listdir(tmp_path) if os.path.exists(tmp_path / n / METADATA_NAME))
    assert published == ["step-0", "step-3", "step-6"]
    assert ckpt.blocked_seconds > 0
    with pytest.raises(ValueError):
        OverlappedCheckpointer(FastPersistWriter(tmp_path), every=0)


def test_a_failed_save_is_reported_and_training_goes_on(tmp_path, monkeypatch):
    monkeypatch.setenv("FP_DCP_FAULT_AT", "2")  # the writer's engine fails its 2nd request, once
    model, optimizer = make_model()
    ckpt = OverlappedCheckpointer(FastPersistWriter(tmp_path, config=SMALL), checkpoint_id=lambda s: tmp_path / f"s{s}")
    ckpt.after_update(0, state_of(model, optimizer))
    with pytest.raises(BaseException, match="injected fault"):
        ckpt.before_update()
    ckpt.before_update()  # reported once
    ckpt.after_update(1, state_of(model, optimizer))
    ckpt.close()
    assert not os.path.exists(tmp_path / "s0" / METADATA_NAME) and os.path.exists(tmp_path / "s1" / METADATA_NAME)


@needs_torch(compat.ASYNC_STAGING)  # (before, the save ends inside after_update: nothing in flight to cancel)
@pytest.mark.usefixtures("slow_writes")
def test_close_with_cancel_publishes_nothing(tmp_path):
    state = {"w": torch.randn(1024, 1024).t()}  # staged through SMALL's buffers: many slow writes
    ckpt = OverlappedCheckpointer(FastPersistWriter(tmp_path, config=SMALL))
    ckpt.after_update(0, state)
    ckpt.close(cancel=True)
    assert not os.path.exists(tmp_path / METADATA_NAME)
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".distcp")]


def _ddp_training(rank: int, world: int, root: str, mode: str) -> dict:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 32))
    model = DistributedDataParallel(net)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    # Training's gradients are all-reduced over the default gloo group; without a process_group the
    # checkpointer gives DCP's collectives a group of their own
    ckpt = OverlappedCheckpointer(
        FastPersistWriter(root, mode=mode),
        checkpoint_id=lambda step: os.path.join(root, f"step-{step}"),
        planner=FastPersistSavePlanner(),
    )
    assert ckpt.process_group is not None and ckpt.process_group != dist.group.WORLD
    g = torch.Generator().manual_seed(rank)
    for step in range(3):
        model(torch.randn(16, 32, generator=g)).square().mean().backward()
        ckpt.before_update()
        optimizer.step()
        optimizer.zero_grad()
        ckpt.after_update(step, lambda: {"model": net.state_dict()})
    ckpt.close()
    return {k: v.clone() for k, v in net.state_dict().items()}


@pytest.mark.parametrize("mode", ["streaming", "snapshot"])
def test_two_ranks_with_ddp(tmp_path, mode):
    finals = run_ranks(2, _ddp_training, str(tmp_path), mode, timeout=120)
    assert all(torch.equal(finals[0][k], finals[1][k]) for k in finals[0])  # DDP kept the replicas equal
    target = {"model": {k: torch.zeros_like(v) for k, v in finals[0].items()}}
    load(target, tmp_path / "step-2")
    for key, value in finals[0].items():
        assert torch.equal(target["model"][key], value), key
