"""Incremental saves against full ones, side by side, on a fine-tuning-shaped state and on one that changes whole.

    .venv/bin/python benchmarks/incremental_bench.py [--frozen-gb 2] [--trained-mb 20] [--rounds 5] [--dir DIR]

Fine-tuning: ``--frozen-gb`` of frozen bf16 weights in 64 MiB tensors, plus
``--trained-mb`` of trained fp32 weights in 2 MiB tensors and their AdamW
moments (twice as much again), and the step. Every round updates the trained
tensors and saves the state three ways, each into a new directory:

- ``full``: a plain ``FastPersistWriter`` save (the reference);
- ``incremental``: ``FastPersistWriter(incremental=True)`` against the
  previous round's incremental checkpoint (the first round's, without a
  base, is left out: it is a full save that also hashes);
- ``hash only``: XXH3-128 + CRC-32C of the frozen bytes in the threads the
  writer uses: the floor of an incremental save of this state, which must
  read every frozen byte once.

Then the same for a state of ``--frozen-gb`` that changes entirely every
round (``changing``): ``full`` against ``incremental``; there, samples tell
every tensor changed and it is written at once, hashed in the same pass as
its checksum. Times are wall clock of ``dcp.save`` (medians over
``--rounds``), CPU seconds are the process's (user + system) per save, and
the last incremental checkpoint is loaded back and compared bit for bit.
Rows are interleaved within each round, so a drifting disk affects them alike.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from fp_dcp import FastPersistReader, FastPersistWriter
from fp_dcp._native import _cio
from fp_dcp.tensors import byte_view
from fp_dcp.testing.measure import timed
from fp_dcp.testing.states import differing

MiB = 1 << 20


def fine_tuning_state(frozen_gb: float, trained_mb: float) -> dict[str, Any]:
    frozen = {f"frozen.{i}": torch.randn(32 * MiB).to(torch.bfloat16) for i in range(round(frozen_gb * 1e9 / 64 / MiB))}
    n = max(1, round(trained_mb * 1e6 / 2 / MiB))
    trained = {f"lora.{i}": torch.randn(MiB // 2) for i in range(n)}
    optim = {f"{k}.{m}": torch.zeros_like(v) for k, v in trained.items() for m in ("exp_avg", "exp_avg_sq")}
    return {"model": {**frozen, **trained}, "optim": {"state": optim, "step": 0}}


def train(state: dict[str, Any]) -> None:
    """One AdamW-like update of the trained tensors and their moments."""
    model, optim = state["model"], state["optim"]
    for key, value in model.items():
        if key.startswith("lora."):
            grad = torch.randn_like(value)
            optim["state"][f"{key}.exp_avg"].mul_(0.9).add_(grad, alpha=0.1)
            optim["state"][f"{key}.exp_avg_sq"].mul_(0.999).addcmul_(grad, grad, value=0.001)
            value.sub_(optim["state"][f"{key}.exp_avg"], alpha=1e-3)
    optim["step"] += 1


def changing_state(gb: float) -> dict[str, torch.Tensor]:
    return {f"w.{i}": torch.randn(16 * MiB) for i in range(round(gb * 1e9 / 64 / MiB))}


def timed_save(state: dict[str, Any], path: str, writer: FastPersistWriter) -> tuple[float, float, int]:
    """(seconds, CPU seconds, bytes written) of one dcp.save."""
    took = timed(lambda: dcp.save(state, checkpoint_id=path, storage_writer=writer))
    assert writer.last_save is not None
    return took.seconds, took.cpu_seconds, writer.last_save.bytes


def hash_only(tensors: list[torch.Tensor], threads: int) -> float:
    def one(t: torch.Tensor) -> None:
        _cio.crc32c(byte_view(t), 0, _cio.Hash128())

    with ThreadPoolExecutor(threads) as pool:
        return timed(lambda: list(pool.map(one, tensors))).seconds


def zeros_like(state: Any) -> Any:
    if isinstance(state, dict):
        return {k: zeros_like(v) for k, v in state.items()}
    return torch.zeros_like(state) if isinstance(state, torch.Tensor) else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frozen-gb", type=float, default=2.0)
    ap.add_argument("--trained-mb", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    args = ap.parse_args()
    threads = min(4, os.cpu_count() or 1)  # IOConfig.io_threads, at most one per CPU: what the writer uses
    rows: dict[str, list[tuple[float, float, int]]] = {}
    state = fine_tuning_state(args.frozen_gb, args.trained_mb)
    frozen = [v for k, v in state["model"].items() if k.startswith("frozen.")]
    frozen_bytes = sum(t.numel() * t.element_size() for t in frozen)
    changed_bytes = sum(
        t.numel() * t.element_size()
        for part in (state["model"], state["optim"]["state"])
        for k, t in part.items()
        if not k.startswith("frozen.")
    )
    changing = changing_state(args.frozen_gb)
    total = {"fine-tuning": frozen_bytes + changed_bytes, "changing": sum(t.numel() * 4 for t in changing.values())}
    with tempfile.TemporaryDirectory(prefix="fp-dcp-incremental-", dir=args.dir) as tmp:
        plain = FastPersistWriter()
        incremental = FastPersistWriter(incremental=True)
        bases = {}
        for name, current in (("fine-tuning", state), ("changing", changing)):
            base = os.path.join(tmp, f"{name}-inc-0")
            timed_save(current, base, incremental)  # the first incremental save: no base, left out
            bases[name] = base
        for r in range(1, args.rounds + 1):
            train(state)
            for t in changing.values():
                t.add_(1.0)
            for name, current in (("fine-tuning", state), ("changing", changing)):
                full = os.path.join(tmp, f"{name}-full-{r}")
                rows.setdefault(f"{name} full", []).append(timed_save(current, full, plain))
                shutil.rmtree(full)
                incremental.base = bases[name]
                path = os.path.join(tmp, f"{name}-inc-{r}")
                rows.setdefault(f"{name} incremental", []).append(timed_save(current, path, incremental))
                bases[name] = path  # the previous one stays: the new one may reference it
            rows.setdefault("fine-tuning hash only", []).append((hash_only(frozen, threads), 0.0, 0))
        out = zeros_like(state)
        dcp.load(out, checkpoint_id=bases["fine-tuning"], storage_reader=FastPersistReader())
        exact_ft = not differing(state, out)
        del out
        out_c = zeros_like(changing)
        dcp.load(out_c, checkpoint_id=bases["changing"], storage_reader=FastPersistReader())
        exact_c = not differing(changing, out_c)
        plain.close()
        incremental.close()

    print(
        f"fine-tuning state: {frozen_bytes / 1e9:.2f} GB frozen (bf16), {changed_bytes / 1e6:.1f} MB changing"
        f" per round (trained weights and AdamW moments); changing state: {total['changing'] / 1e9:.2f} GB; "
        f"{args.rounds} rounds, medians"
    )
    print(f"{'save':<28} {'seconds':>8} {'GB/s':>7} {'CPU s':>7} {'CPU s/GB':>9} {'written MB':>11}")
    med: dict[str, tuple[float, float, float]] = {}
    for label, samples in rows.items():
        seconds = statistics.median(s for s, _, _ in samples)
        cpu = statistics.median(c for _, c, _ in samples)
        written = statistics.median(w for _, _, w in samples)
        med[label] = (seconds, cpu, written)
        size = total["changing" if label.startswith("changing") else "fine-tuning"]
        rate = f"{size / seconds / 1e9:7.2f}" if written or "hash" in label else f"{'-':>7}"
        per_gb = f"{cpu / (size / 1e9):9.3f}" if cpu else f"{'-':>9}"
        cpu_s = f"{cpu:7.3f}" if cpu else f"{'-':>7}"
        print(f"{label:<28} {seconds:8.3f} {rate} {cpu_s} {per_gb} {written / 1e6:11.1f}")
    ft_full, ft_inc = med["fine-tuning full"][0], med["fine-tuning incremental"][0]
    print(f"fine-tuning: incremental saves {ft_full / ft_inc:.1f}x as fast as full ones (bar: >= 20x)")
    print(
        f"fine-tuning: incremental writes {med['fine-tuning incremental'][2] / changed_bytes:.3f}x the changed bytes "
        f"(bar: <= 1.1x)"
    )
    print(f"fine-tuning: hashing the frozen bytes alone takes {med['fine-tuning hash only'][0]:.3f} s")
    c_full, c_inc = med["changing full"][0], med["changing incremental"][0]
    print(f"changing: incremental costs {c_inc / c_full:.3f}x a full save (bar: <= 1.05x)")
    print(f"loaded back bit-exact: fine-tuning {exact_ft}, changing {exact_c}")


if __name__ == "__main__":
    main()
