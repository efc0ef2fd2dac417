"""The recipes of docs/frameworks.md: each framework checkpoints through fp-dcp with its own save and resume code.

Every test trains a tiny model, lets the framework save mid-run (the checkpoint on
disk must be fp-dcp's), keeps training to get the uninterrupted reference, then
resumes in fresh processes through the framework's resume code: parameters,
optimizer state and the losses after the checkpoint must match bit for bit.
A framework that is not installed skips its test (`make test` installs them all).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from fp_dcp.checkpoint import open_checkpoint
from fp_dcp.testing.ranks import run_ranks

pytestmark = pytest.mark.slow  # its tests start processes

WORLD = 2


def need(module: str, pin: str) -> None:
    pytest.importorskip(module, reason=f"{module} not installed: pip install {pin} (make test installs it)")


def local(obj: Any) -> Any:
    """``obj`` with every tensor (a DTensor as its local shard) copied, to pickle back to the test."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        return obj.to_local().detach().clone()
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: local(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(local(v) for v in obj)
    return obj


def assert_bit_equal(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_bit_equal(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_bit_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def assert_resumed_as_uninterrupted(full: list[Any], resumed: list[Any], steps: int, saved_at: int) -> None:
    """Per rank: the resumed run's losses are the uninterrupted run's after ``saved_at``; model and optimizer match."""
    for rank in range(WORLD):
        assert len(full[rank]["losses"]) == steps
        assert resumed[rank]["losses"] == full[rank]["losses"][saved_at:]
        assert_bit_equal(resumed[rank]["params"], full[rank]["params"], f"rank {rank} params")
        assert_bit_equal(resumed[rank]["optimizer"], full[rank]["optimizer"], f"rank {rank} optimizer")


def tiny_sharded_model(mesh: Any = None) -> torch.nn.Module:
    """The same small MLP on every rank and run, sharded with FSDP2."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    fully_shard(net, mesh=mesh)
    return net


def rank_batches(rank: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each rank's own (input, target) batches, the same in the uninterrupted and the resumed run."""
    g = torch.Generator().manual_seed(rank)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)) for _ in range(steps)]


def distributed_env(rank: int, world: int) -> None:
    """What a launcher (torchrun) would have set; the process group itself is already up (fp_dcp.testing.ranks)."""
    os.environ.update(
        LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world)
    )
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")


# ---- Lightning: ModelParallelStrategy (FSDP2) saves and loads with checkpoint_id only ----

LIGHTNING_STEPS, LIGHTNING_SAVE_AT = 6, 3


def lightning_rank(rank: int, world: int, root: str, resume: bool) -> dict[str, Any]:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.utils.data import DataLoader, TensorDataset

    import fp_dcp

    distributed_env(rank, world)
    fp_dcp.install()

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.losses: list[float] = []

        def configure_model(self) -> None:
            self.net = tiny_sharded_model(self.device_mesh["data_parallel"])

        def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    # Each rank reads its own batches (seeded by rank), and an epoch is exactly the steps before the
    # checkpoint: Lightning restarts an interrupted epoch from its first batch, so this way the resumed
    # run meets the batches the uninterrupted run met after the checkpoint.
    g = torch.Generator().manual_seed(rank)
    n = LIGHTNING_SAVE_AT * 4
    data = DataLoader(TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)), batch_size=4)
    every = ModelCheckpoint(
        dirpath=root,
        filename="step{step}",
        auto_insert_metric_name=False,
        every_n_train_steps=LIGHTNING_SAVE_AT,
        save_top_k=-1,
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
        max_steps=LIGHTNING_STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=not resume,
        use_distributed_sampler=False,
        callbacks=[] if resume else [every],
    )
    model = Tiny()
    ckpt = os.path.join(root, f"step{LIGHTNING_SAVE_AT}.ckpt") if resume else None
    trainer.fit(model, data, ckpt_path=ckpt)
    return {
        "losses": model.losses,
        "params": local(dict(model.named_parameters())),
        "optimizer": local(trainer.optimizers[0].state_dict()),
    }


def test_lightning_model_parallel_strategy_resumes_bit_exact_through_fp_dcp(tmp_path: Path) -> None:
    need("lightning", "lightning==2.6.6")
    full = run_ranks(WORLD, lightning_rank, str(tmp_path), False, timeout=180)
    ckpt = tmp_path / f"step{LIGHTNING_SAVE_AT}.ckpt"
    assert open_checkpoint(ckpt).kind == "fp"
    resumed = run_ranks(WORLD, lightning_rank, str(tmp_path), True, timeout=180)
    assert_resumed_as_uninterrupted(full, resumed, LIGHTNING_STEPS, LIGHTNING_SAVE_AT)


# ---- accelerate: its FSDP checkpoint functions build torch's FileSystemWriter / FileSystemReader ----

ACCELERATE_STEPS, ACCELERATE_SAVE_AFTER = 6, 3


def accelerate_rank(rank: int, world: int, root: str, resume: bool) -> dict[str, Any]:
    from unittest import mock

    import torch.distributed.checkpoint as dist_cp
    from accelerate import Accelerator
    from accelerate.utils import (
        FullyShardedDataParallelPlugin,
        load_fsdp_model,
        load_fsdp_optimizer,
        save_fsdp_model,
        save_fsdp_optimizer,
    )

    import fp_dcp

    distributed_env(rank, world)
    # accelerate turns FSDP on only for accelerators (not MULTI_CPU), so the model is sharded here with
    # FSDP2's fully_shard and checkpointed through the functions Accelerator.save_state / load_state call
    # for FSDP.
    accelerator = Accelerator(cpu=True)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    net = tiny_sharded_model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    batches = rank_batches(rank, ACCELERATE_STEPS)
    losses = []
    with mock.patch.multiple(
        dist_cp, FileSystemWriter=fp_dcp.FastPersistWriter, FileSystemReader=fp_dcp.FastPersistReader
    ):
        if resume:
            load_fsdp_model(plugin, accelerator, net, root)
            load_fsdp_optimizer(plugin, accelerator, optimizer, net, root)
        for step in range(ACCELERATE_SAVE_AFTER if resume else 0, ACCELERATE_STEPS):
            x, y = batches[step]
            loss = torch.nn.functional.mse_loss(net(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            if step + 1 == ACCELERATE_SAVE_AFTER and not resume:
                save_fsdp_model(plugin, accelerator, net, root)
                save_fsdp_optimizer(plugin, accelerator, optimizer, net, root)
    return {"losses": losses, "params": local(dict(net.named_parameters())), "optimizer": local(optimizer.state_dict())}


def test_accelerate_fsdp_checkpoint_functions_resume_bit_exact_through_fp_dcp(tmp_path: Path) -> None:
    need("accelerate", "accelerate==1.15.0")
    full = run_ranks(WORLD, accelerate_rank, str(tmp_path), False, timeout=180)
    assert {p.name: open_checkpoint(p).kind for p in tmp_path.iterdir()} == {
        "pytorch_model_fsdp_0": "fp",
        "optimizer_0": "fp",
    }
    resumed = run_ranks(WORLD, accelerate_rank, str(tmp_path), True, timeout=180)
    assert_resumed_as_uninterrupted(full, resumed, ACCELERATE_STEPS, ACCELERATE_SAVE_AFTER)


# ---- torchtitan: CheckpointManager saves (async here) and loads with checkpoint_id only ----

TITAN_STEPS, TITAN_SAVE_AT = 6, 3


def torchtitan_rank(rank: int, world: int, root: str, resume: bool) -> dict[str, Any]:
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig

    import fp_dcp

    distributed_env(rank, world)
    fp_dcp.install()
    net = tiny_sharded_model()
    adamw = ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})
    optimizers = OptimizersContainer.Config(param_groups=[adamw]).build(model_parts=[net])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=TITAN_STEPS)
    checkpointer = CheckpointManager.Config(
        enable=True, folder="checkpoint", interval=TITAN_SAVE_AT, keep_latest_k=0, async_mode="async"
    ).build(
        dataloader=None,
        model_parts=[net],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={},
        sd_adapter=None,
        base_folder=root,
    )
    batches = rank_batches(rank, TITAN_STEPS)
    # The uninterrupted run also saves the last step, so the resume names the step it wants.
    if resume:
        assert checkpointer.load(step=TITAN_SAVE_AT)
    losses = []
    for step in range(TITAN_SAVE_AT + 1 if resume else 1, TITAN_STEPS + 1):
        x, y = batches[step - 1]
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        losses.append(loss.item())
        if not resume:
            checkpointer.save(step)
    checkpointer.close()
    return {
        "losses": losses,
        "params": local(dict(net.named_parameters())),
        "optimizer": local(optimizers.state_dict()),
    }


def test_torchtitan_checkpoint_manager_async_resumes_bit_exact_through_fp_dcp(tmp_path: Path) -> None:
    need("torchtitan", "torchtitan==0.3.0")
    full = run_ranks(WORLD, torchtitan_rank, str(tmp_path), False, timeout=180)
    assert open_checkpoint(tmp_path / "checkpoint" / f"step-{TITAN_SAVE_AT}").kind == "fp"
    resumed = run_ranks(WORLD, torchtitan_rank, str(tmp_path), True, timeout=180)
    assert_resumed_as_uninterrupted(full, resumed, TITAN_STEPS, TITAN_SAVE_AT)


# ---- torchtune: DistributedCheckpointer builds torch's FileSystemWriter / FileSystemReader itself ----

TUNE_STEPS, TUNE_SAVE_AT = 6, 3


def torchtune_rank(rank: int, world: int, root: str, resume: bool) -> dict[str, Any]:
    from unittest import mock

    from torch.distributed.checkpoint.state_dict import _init_optim_state, set_state_dict
    from torchtune import training
    from torchtune.training.checkpointing import DistributedCheckpointer

    import fp_dcp

    distributed_env(rank, world)
    net = tiny_sharded_model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    batches = rank_batches(rank, TUNE_STEPS)
    # An async save runs DCP's collectives in a background thread while training runs FSDP's: on a
    # gloo-only job they need a group of their own (on GPUs torchtune's "cuda:nccl,cpu:gloo" separates them).
    group = torch.distributed.new_group(backend="gloo")
    checkpointer = DistributedCheckpointer(checkpoint_dir=root, output_dir=root, process_group=group)
    # DistributedCheckpointer names FileSystemWriter / FileSystemReader as imported into its (private)
    # module; rebinding them there is the whole recipe.
    fp_storage = mock.patch.multiple(
        "torchtune.training.checkpointing._checkpointer",
        FileSystemWriter=fp_dcp.FastPersistWriter,
        FileSystemReader=fp_dcp.FastPersistReader,
    )

    def state(epoch: int) -> dict[str, Any]:
        # What torchtune's CheckpointClient hands to DistributedCheckpointer.
        return {
            training.SEED_KEY: 0,
            training.EPOCHS_KEY: epoch,
            training.TOTAL_EPOCHS_KEY: TUNE_STEPS,
            training.MAX_STEPS_KEY: 1,
            training.MODEL_KEY: net.state_dict(),
            training.OPT_KEY: optimizer.state_dict(),
        }

    if resume:
        # CheckpointClient.load_distributed_checkpoint, step by step.
        _init_optim_state(optimizer)
        with fp_storage:
            loaded = checkpointer.load_checkpoint(
                state(0), checkpoint_path=os.path.join(root, f"dist_epoch_{TUNE_SAVE_AT}")
            )
        assert loaded[training.EPOCHS_KEY] == TUNE_SAVE_AT
        set_state_dict(
            net, optimizer, model_state_dict=loaded[training.MODEL_KEY], optim_state_dict=loaded[training.OPT_KEY]
        )
    losses = []
    for step in range(TUNE_SAVE_AT + 1 if resume else 1, TUNE_STEPS + 1):
        x, y = batches[step - 1]
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if not resume and step in (TUNE_SAVE_AT, TUNE_STEPS):
            # Intermediate checkpoints async, the last one sync (it first waits for the async one), as
            # torchtune's recipes do with enable_async_checkpointing.
            with fp_storage:
                checkpointer.save_checkpoint(state(step), epoch=step, save_async=step < TUNE_STEPS)
    return {"losses": losses, "params": local(dict(net.named_parameters())), "optimizer": local(optimizer.state_dict())}


def test_torchtune_distributed_checkpointer_resumes_bit_exact_through_fp_dcp(tmp_path: Path) -> None:
    need("torchtune", "torchtune==0.6.1 torchao==0.15.0")
    full = run_ranks(WORLD, torchtune_rank, str(tmp_path), False, timeout=180)
    assert {p.name: open_checkpoint(p).kind for p in tmp_path.iterdir()} == {
        f"dist_epoch_{TUNE_SAVE_AT}": "fp",
        f"dist_epoch_{TUNE_STEPS}": "fp",
    }
    resumed = run_ranks(WORLD, torchtune_rank, str(tmp_path), True, timeout=180)
    assert_resumed_as_uninterrupted(full, resumed, TUNE_STEPS, TUNE_SAVE_AT)
