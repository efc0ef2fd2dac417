"""Checkpointing every iteration of a GPT-style training loop: what it costs, synchronous or overlapped.

    python examples/train_demo.py                      # 2 ranks, gloo, CPU
    python examples/train_demo.py --device cuda        # one rank per GPU, NCCL (plus gloo for DCP)

Each rank trains a small GPT (token and position embeddings, pre-LN blocks of
causal self-attention and MLP, untied LM head) with AdamW under DDP on random
tokens, and the iteration time is measured in these modes, interleaved over
``--rounds`` rounds on the same model so that the ratios are fair:

- ``none``: no checkpoint;
- ``fs-sync``: ``dcp.save`` with torch's ``FileSystemWriter(thread_count=1)``
  after every ``--every``-th optimizer step;
- ``fs-async-thread`` / ``fs-async-process``: ``dcp.async_save`` with
  ``FileSystemWriter`` and torch's default stager (a host copy of the state,
  made before ``async_save`` returns), on DCP's thread or background-process
  executor; a save waits for the previous one first;
- ``fp-sync``: ``dcp.save`` with ``FastPersistWriter``;
- ``fp-async-process``: as ``fs-async-process`` with ``FastPersistWriter`` and
  plan caching (the writer is pickled to DCP's checkpoint process, which keeps
  its engine and buffers between saves);
- ``fp-overlap-streaming`` / ``fp-overlap-snapshot``:
  ``fp_dcp.OverlappedCheckpointer`` with plan caching (FastPersist's overlap:
  the save starts after the optimizer step on DCP's thread executor with the
  writer as stager, the next forward and backward run meanwhile, the loop
  waits, if at all, before the next optimizer step).

The overhead of a mode is its extra time per iteration over ``none``, as a
percentage of ``none``'s iteration time, and as a ratio to the overhead of
``fs-async-thread`` (stock DCP's asynchronous save). An iteration's time is
the slowest rank's. DCP's collectives use their own gloo group, training's
the default group. Every checkpoint goes to a directory of its own
(``step-N``), as in a run that keeps several; they are deleted after each
mode's measurement, off the clock. ``--json`` writes the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.nn.parallel import DistributedDataParallel

from fp_dcp import FastPersistSavePlanner, FastPersistWriter, OverlappedCheckpointer, engine_info

MODES = [
    "none",
    "fs-sync",
    "fs-async-thread",
    "fs-async-process",
    "fp-sync",
    "fp-async-process",
    "fp-overlap-streaming",
    "fp-overlap-snapshot",
]
STOCK_ASYNC = "fs-async-thread"


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class Checkpointing:
    """One mode's way of checkpointing after the optimizer step."""

    def __init__(self, mode: str, root: str, group: dist.ProcessGroup, every: int) -> None:
        self.mode, self.every, self.group = mode, every, group
        self.path = os.path.join(root, mode)
        self.writer: FastPersistWriter | None = None
        self.overlap: OverlappedCheckpointer | None = None
        self.executor: AsyncCheckpointerType | None = None
        self.pending: Any = None  # the async save in flight (fs-async-*, fp-async-process)
        self.blocked_seconds = 0.0  # waiting for the previous save before starting a new one
        if "-async-" in mode:
            self.executor = AsyncCheckpointerType.PROCESS if mode.endswith("process") else AsyncCheckpointerType.THREAD
        if mode.startswith("fp-"):
            stage_mode = "snapshot" if mode.endswith("snapshot") else "streaming"
            self.writer = FastPersistWriter(mode=stage_mode)
        if mode.startswith("fp-overlap"):
            assert self.writer is not None
            self.overlap = OverlappedCheckpointer(
                self.writer,
                every=every,
                checkpoint_id=self.step_path,
                planner=FastPersistSavePlanner(enable_plan_caching=True),
                process_group=group,
            )

    def step_path(self, step: int) -> str:
        return os.path.join(self.path, f"step-{step}")

    def before_update(self) -> None:
        if self.overlap is not None:
            self.overlap.before_update()

    def after_update(self, step: int, state: Callable[[], dict[str, Any]]) -> None:
        if self.overlap is not None:
            self.overlap.after_update(step, state)
            return
        if self.mode == "none" or step % self.every:
            return
        path, group = self.step_path(step), self.group
        writer: Any = self.writer if self.writer is not None else dcp.FileSystemWriter(path, thread_count=1)
        if self.executor is None:
            dcp.save(state(), checkpoint_id=path, storage_writer=writer, planner=self.planner(), process_group=group)
            return
        self.wait()
        self.pending = dcp.async_save(
            state(),
            checkpoint_id=path,
            storage_writer=writer,
            planner=self.planner(),
            process_group=group,
            async_checkpointer_type=self.executor,
        )

    def planner(self) -> Any:
        if self.writer is None:
            return None
        return FastPersistSavePlanner(enable_plan_caching=self.executor is not None)

    def wait(self) -> None:
        if self.overlap is not None:
            start = time.perf_counter()
            self.overlap.wait()
            self.blocked_seconds += time.perf_counter() - start
        elif self.pending is not None:
            start = time.perf_counter()
            self.pending.result()
            self.blocked_seconds += time.perf_counter() - start
            self.pending = None

    def blocked(self) -> float:
        return self.overlap.blocked_seconds if self.overlap is not None else self.blocked_seconds

    def reset_blocked(self) -> None:
        self.wait()
        self.blocked_seconds = 0.0
        if self.overlap is not None:
            self.overlap.blocked_seconds = 0.0

    def close(self) -> None:
        self.wait()
        if self.overlap is not None:
            self.overlap.close()
        if self.writer is not None:
            self.writer.close()
        dist.barrier(self.group)  # every rank is done with the files
        if dist.get_rank() == 0:
            shutil.rmtree(self.path, ignore_errors=True)


def worker(rank: int, world: int, store: str, args: argparse.Namespace, out: str) -> None:
    warnings.filterwarnings("ignore")
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        device = torch.device("cpu")
    dist.init_process_group(
        "cpu:gloo,cuda:nccl" if cuda else "gloo", init_method=f"file://{store}", rank=rank, world_size=world
    )
    group = dist.new_group(backend="gloo")  # DCP's collectives, apart from training's
    torch.manual_seed(0)
    model = GPT(args.vocab, args.dim, args.layers, args.heads, args.seq).to(device)
    ddp = DistributedDataParallel(model, device_ids=[rank] if cuda else None)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    g = torch.Generator(device=device).manual_seed(1000 + rank)

    def state() -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(ddp, optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def iteration(ckpt: Checkpointing, step: int) -> float:
        start = time.perf_counter()
        idx = torch.randint(0, args.vocab, (args.batch, args.seq + 1), device=device, generator=g)
        logits = ddp(idx[:, :-1])
        F.cross_entropy(logits.reshape(-1, args.vocab), idx[:, 1:].reshape(-1)).backward()
        ckpt.before_update()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ckpt.after_update(step, state)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    params = sum(p.numel() for p in model.parameters())
    times: dict[str, list[float]] = {m: [] for m in args.modes}
    blocked: dict[str, float] = dict.fromkeys(args.modes, 0.0)
    iteration(Checkpointing("none", args.dir, group, args.every), 0)  # optimizer state exists from here on
    for _ in range(args.rounds):
        for mode in args.modes:
            ckpt = Checkpointing(mode, args.dir, group, args.every)
            for step in range(args.warmup):
                iteration(ckpt, step)
            ckpt.reset_blocked()
            measured = [iteration(ckpt, args.warmup + i) for i in range(args.iters)]
            blocked[mode] += ckpt.blocked()
            ckpt.close()
            slowest = torch.tensor(measured, dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
            times[mode] += slowest.tolist()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"params": params, "times": times, "blocked": blocked}, f)
    dist.barrier(group)
    dist.destroy_process_group()


def report(args: argparse.Namespace, raw: dict[str, Any], state_bytes: int) -> dict[str, Any]:
    base = statistics.median(raw["times"]["none"]) if "none" in raw["times"] else None
    rows = {}
    for mode, samples in raw["times"].items():
        t = statistics.median(samples)
        waits = "-async-" in mode or "overlap" in mode
        rows[mode] = {
            "iteration_s": t,
            "overhead_pct": 100 * (t - base) / base if base else None,
            "blocked_s_per_iteration": raw["blocked"][mode] / len(samples) if waits else None,
            "samples_s": samples,
        }
    ratios = {}
    stock = rows[STOCK_ASYNC]["overhead_pct"] if base and STOCK_ASYNC in rows else None
    if stock and stock > 0:
        for mode, row in rows.items():
            if mode not in ("none", STOCK_ASYNC):
                ratios[f"{mode} overhead / {STOCK_ASYNC} overhead"] = row["overhead_pct"] / stock
    return {
        "device": args.device,
        "world_size": args.world_size,
        "params": raw["params"],
        "checkpoint_bytes": state_bytes,
        "every": args.every,
        "engine": engine_info(args.dir),
        "modes": rows,
        "ratios": ratios,
    }


def print_report(r: dict[str, Any]) -> None:
    e = r["engine"]
    print(
        f"\nGPT-style model, {r['params'] / 1e6:.1f} M parameters, checkpoint {r['checkpoint_bytes'] / 1e9:.2f} GB "
        f"(model + AdamW), {r['world_size']} ranks on {r['device']}, a checkpoint every {r['every']} iteration(s)"
    )
    print(
        f"engine: {e['engine']}{' (' + e['fallback_reason'] + ')' if e['fallback_reason'] else ''}, "
        f"O_DIRECT: {e.get('direct_io')}\n"
    )
    print(f"{'mode':<24}{'iteration ms':>14}{'overhead':>10}{'blocked ms/it':>15}")
    for mode, row in r["modes"].items():
        overhead = f"{row['overhead_pct']:.1f}%" if row["overhead_pct"] is not None else "-"
        held = f"{1000 * row['blocked_s_per_iteration']:.1f}" if row["blocked_s_per_iteration"] is not None else "-"
        print(f"{mode:<24}{1000 * row['iteration_s']:>14.1f}{overhead:>10}{held:>15}")
    for name, value in r["ratios"].items():
        print(f"{name}: {value:.2f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--world-size", type=int, help="ranks (default: 2 on CPU, every GPU on CUDA)")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank and iteration")
    ap.add_argument("--every", type=int, default=1, help="checkpoint every N iterations")
    ap.add_argument("--warmup", type=int, default=2, help="iterations before measuring, per mode and round")
    ap.add_argument("--iters", type=int, default=4, help="measured iterations per mode and round")
    ap.add_argument("--rounds", type=int, default=2, help="rounds over all modes, interleaved")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the checkpoints go")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    args.modes = args.modes.split(",")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device")
    args.world_size = args.world_size or (torch.cuda.device_count() if args.device == "cuda" else 2)
    args.dir = tempfile.mkdtemp(prefix="fp-dcp-demo-", dir=args.dir)
    try:
        store, out = os.path.join(args.dir, "store"), os.path.join(args.dir, "result.json")
        mp.spawn(worker, args=(args.world_size, store, args, out), nprocs=args.world_size)
        with open(out) as f:
            raw = json.load(f)
        # Parameters and AdamW's two moments in fp32, plus the step counters.
        result = report(args, raw, 3 * 4 * raw["params"])
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    print_report(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
