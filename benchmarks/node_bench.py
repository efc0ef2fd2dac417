#!/usr/bin/env python3
"""A node on one machine: N ranks save and load their FSDP2 shards, against fio --numjobs=N and one rank alone.

    sudo .venv/bin/python benchmarks/node_bench.py [--ranks N] [--gb 2] [--dirs TARGET ...]
        [--device cpu|cuda] [--rounds 2] [--optimizer] [--json OUT]

N ranks (default: min(8, cores)), one process each, form a gloo process
group; with ``--device cuda`` every rank holds its state on ``cuda:0`` (NCCL
cannot put two ranks on one GPU; gloo carries DCP's plans). Each rank builds
a Llama-shaped bf16 model (``fp_dcp.testing.llama``; ``--gb`` GiB of state in
all, AdamW's two moments included with ``--optimizer``) on the meta device,
shards it with FSDP2's ``fully_shard``, materializes it (``to_empty``) and
fills its shard from a generator seeded by its rank (one AdamW step fills
the moments). It saves ``get_state_dict``'s state with ``dcp.save`` through
a ``FastPersistWriter`` made before the clock starts (its buffers ready, as
in a training loop), then loads it into fresh targets (a new model from the
meta device, a new reader) and checks them bit-exact against what it saved.
An untimed save and load of one small tensor first pays the process's
one-time costs (imports, DCP's first call).

Each ``--dirs`` entry is a target, measured on its own; by default a tmpfs
(``/dev/shm``) and the repository's disk. A target of one directory holds
the checkpoint, every rank's file beside ``.metadata``; a target of several
comma-separated directories (one per device, or 8 tmpfs directories) gets
them as ``data_dirs``, every rank writing a file into each. Each phase runs
from a barrier to a barrier: GB/s is the tensor bytes of all ranks over the
slowest rank's time, CPU-s/GB every rank's user + system time over the
phase, summed. Before each load the page cache is dropped (``posix_fadvise
DONTNEED`` per file, ``drop_caches`` as root); tmpfs has no cache to drop,
so its loads are warm, from memory.

References, each round, in the same directories: ``fio --numjobs=N`` writing
as many bytes (a file per job, jobs dealt round-robin over the target's
directories; per job 8 MiB requests, 32 in flight through io_uring, O_DIRECT
where fp-dcp gets it and buffered where the filesystem refuses it, an fsync
at the end; buffers in huge pages through ``fp_dcp.tools.fio``) and reading
them back, timed by fio itself: its start-up (about half a second, as long
as a GB moves through tmpfs) is left out, as fp-dcp's set-up is; the JSON
has the whole process's rate too. On tmpfs fio does not ``fallocate`` its
files while laying them out: that would allocate their pages off its clock,
about half of a write's cost there, where fp-dcp's saves pay it on theirs.
And on tmpfs every writer (fp-dcp's ranks, one rank alone, fio) starts right
after as many bytes were written there and removed (``recycle``): on a VM
that hands free memory back to its host, a tmpfs page unused for a few
seconds costs a host fault at its next write, and fio, run right after
fp-dcp's files were removed, used to get recycled pages where fp-dcp did not.
Loads into host memory fill fresh targets, so their second limit is the
memory's first touch: right after its load, its targets still held, each
rank faults in as many bytes of fresh memory as a load's helper threads do
(``first touch``, barrier to barrier); ``x slower`` is fp-dcp against the
slower of fio and the first touch. And one rank alone (world size 1) saving
and loading one rank's share, its GB/s times N. Medians of ``--rounds``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from fp_dcp import FastPersistReader, FastPersistWriter, engine_info
from fp_dcp.io.device import disk_of, filesystem_of
from fp_dcp.testing.llama import GiB, layers_for, llama_shapes, sharded_model, share_of
from fp_dcp.testing.measure import timed
from fp_dcp.testing.ranks import run_node
from fp_dcp.testing.states import differing, leaves
from fp_dcp.tools.bench import first_touch
from fp_dcp.tools.fio import BLOCK, DEPTH, Jobs, reference
from fp_dcp.tools.workload import cpu_seconds, evict, recycle

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9
PHASES = {"save": "write", "load": "read"}  # fp-dcp's phase: fio's
COLUMNS = {
    "fp_dcp": "fp-dcp GB/s",
    "fio": "fio GB/s",
    "ratio": "ratio",
    "first_touch": "first touch",
    "vs_slower": "x slower",
    "n_x_one": "N x one rank",
}


# ------------------------------------------------------------------------------------------------- the state


def widths(gib: float) -> tuple[int, int, int]:
    """Llama-7B's hidden, intermediate and vocabulary sizes, narrowed until the embeddings are at most half the
    state."""
    hidden, inter, vocab = 4096, 11008, 32000
    while hidden > 256 and 2 * 2 * vocab * hidden > gib * GiB / 2:
        hidden, inter = hidden // 2, inter // 2
    return hidden, inter, vocab


def training_state(shapes: dict[str, tuple[int, ...]], mesh: Any, optimizer: bool, seed: int | None) -> dict:
    """This rank's ``get_state_dict`` of an FSDP2 model (and AdamW): filled from ``seed``, or, with ``None``
    (a load's target), as ``to_empty`` left it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    model = sharded_model(shapes, mesh)
    if seed is not None:
        g = torch.Generator(mesh.device_type).manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().normal_(generator=g)
    if not optimizer:
        return {"model": get_model_state_dict(model)}
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if seed is not None:
        for p in model.parameters():
            p.grad = p.detach() * 0.5
        optim.step()
        optim.zero_grad()
    model_state, optim_state = get_state_dict(model, optim)  # a fresh optimizer's state made by a zero step
    return {"model": model_state, "optim": optim_state}


def tensor_bytes(state: dict) -> int:
    return sum(v.nbytes for _, v in leaves(state) if isinstance(v, torch.Tensor))


# ------------------------------------------------------------------------------------------------- one rank


def phase(device: str, step: Any) -> tuple[float, float]:
    """Seconds from a barrier before ``step`` to one after it (the slowest rank's), and this process's CPU-s."""
    took = timed(step, device=device, barrier=True)
    return took.seconds, took.cpu_seconds


def warm_up(saved: dict, writer: FastPersistWriter, path: str) -> None:
    """An untimed save and load of the smallest tensor: a process's one-time costs (imports, DCP's first call)
    paid before the clock starts, as a training loop's later saves and fio's own clock leave them out."""
    name, small = min(saved["model"].items(), key=lambda item: item[1].numel())
    dcp.save({"model": {name: small}}, storage_writer=writer, checkpoint_id=path)
    dcp.load({"model": {name: torch.empty_like(small)}}, storage_reader=FastPersistReader(path))


def save_and_load(
    rank: int, world: int, shapes: dict, dirs: list[str], device: str, optimizer: bool, touch_too: bool, tmpfs: bool
) -> dict:
    """A rank's part: save its shard, drop the page cache, load into fresh targets, compare with what it saved;
    ``touch_too``: then time the first touch of as many fresh bytes; ``tmpfs``: the target is memory, recycled
    before the save (``recycle``)."""
    from torch.distributed.device_mesh import init_device_mesh

    if device == "cuda":
        torch.cuda.set_device(0)  # every rank on the one GPU
    mesh = init_device_mesh(device, (world,))
    saved = training_state(shapes, mesh, optimizer, seed=rank + 1)
    if not all(t.count_nonzero() for _, t in leaves(saved["model"]) if t.numel()):
        raise AssertionError("a tensor was not filled: the bit-exact check could pass on memory never loaded")
    path, data_dirs = os.path.join(dirs[0], "checkpoint"), dirs if len(dirs) > 1 else None
    with FastPersistWriter(path, data_dirs=data_dirs) as writer:
        warm_up(saved, writer, os.path.join(dirs[0], "warm-up"))
        if tmpfs:
            recycle(dirs[rank % len(dirs)], tensor_bytes(saved), f"recycled.{rank}")
        save = phase(device, lambda: dcp.save(saved, storage_writer=writer, checkpoint_id=path))
    # untouched until the load, whose page faults count (with --optimizer, the zero step torch takes to make the
    # optimizer's state touches the parameters and the moments)
    fresh = training_state(shapes, mesh, optimizer, seed=None)
    if rank == 0:
        os.sync()
        for d in dirs:
            evict(d)
    reader = FastPersistReader(path)
    load = phase(device, lambda: dcp.load(fresh, storage_reader=reader))
    # host targets' other limit, the memory's: as many bytes faulted in, the way the load's helpers do it, while
    # the targets are still held (so it cannot be handed their pages)
    touch = phase(device, lambda: first_touch(tensor_bytes(saved))("")) if touch_too else None
    wrong = differing(saved, fresh)
    return {"bytes": tensor_bytes(saved), "save": save, "load": load, "touch": touch, "wrong": wrong[:3]}


# ------------------------------------------------------------------------------------------------- a target


def label(dirs: list[str]) -> str:
    disk = disk_of(dirs[0])
    return filesystem_of(dirs[0]) + (f" ({disk})" if disk else "") + (f" x{len(dirs)} dirs" if len(dirs) > 1 else "")


def fio_phases(fio: Jobs, work: list[str], total: int, tmpfs: bool) -> dict[str, dict[str, float]]:
    """fio's jobs writing ``total`` bytes into ``work``, then reading them back: GB/s by fio's own clock and as a
    whole process (its start-up, about half a second, counts there), and CPU-s/GB, per phase; ``tmpfs``: the
    target is memory, recycled before the write (``recycle``)."""
    each = -(-total // fio.jobs // BLOCK) * BLOCK
    rates = {}
    for phase, rw in PHASES.items():
        if rw == "write" and tmpfs:
            for w in work:
                recycle(w, total // len(work))
        if rw == "read":
            for w in work:
                evict(w)
        cpu, start = cpu_seconds(resource.RUSAGE_CHILDREN), time.perf_counter()
        done = fio.run(":".join(work), rw, each)
        seconds = time.perf_counter() - start
        rates[phase] = {
            "fio": done.gbps,
            "fio_process": done.bytes / seconds / GB,
            "fio_cpu_s_per_gb": (cpu_seconds(resource.RUSAGE_CHILDREN) - cpu) / (done.bytes / GB),
        }
    return rates


def clear(work: list[str]) -> None:
    for w in work:
        for name in os.listdir(w):
            shutil.rmtree(os.path.join(w, name))


def one_round(dirs: list[str], args: argparse.Namespace, shapes: dict, fio: Jobs | None) -> dict[str, Any]:
    """N ranks, one rank alone, fio: each phase's figures on one target."""
    work = [tempfile.mkdtemp(prefix="fp-dcp-node-", dir=d) for d in dirs]
    try:
        host = args.device == "cpu"  # host targets: the memory's first touch is a limit of their loads
        tmpfs = filesystem_of(work[0]) == "tmpfs"
        ranks = run_node(args.ranks, save_and_load, shapes, work, args.device, args.optimizer, host, tmpfs)
        clear(work)
        mine = share_of(shapes, args.ranks)
        one = run_node(1, save_and_load, mine, work, args.device, args.optimizer, False, tmpfs)[0]
        clear(work)
        for who, r in [*enumerate(ranks), ("alone", one)]:
            if r["wrong"]:
                raise AssertionError(f"rank {who} loaded wrong values into {r['wrong']}")
        total = sum(r["bytes"] for r in ranks)
        result: dict[str, Any] = {"bytes": total, "one_rank_bytes": one["bytes"]}
        for phase in PHASES:
            result[phase] = {
                "fp_dcp": total / max(r[phase][0] for r in ranks) / GB,
                "cpu_s_per_gb": sum(r[phase][1] for r in ranks) / (total / GB),
                "n_x_one": args.ranks * one["bytes"] / one[phase][0] / GB,
            }
        if fio is not None:
            direct = fio if engine_info(work[0])["direct_io"] else dataclasses.replace(fio, direct=False)
            direct = dataclasses.replace(direct, allocate_first=not tmpfs)
            result["fio_direct"] = direct.direct
            for phase, figures in fio_phases(direct, work, total, tmpfs).items():
                result[phase] |= figures
        if host:
            result["load"]["first_touch"] = total / max(r["touch"][0] for r in ranks) / GB
    finally:
        for w in work:
            shutil.rmtree(w, ignore_errors=True)
    return result


# ------------------------------------------------------------------------------------------------- report


def summary(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Medians over the rounds, per phase; the ratio of the medians."""
    rows = {}
    for phase in PHASES:
        keys = runs[0][phase].keys()
        rows[phase] = {k: statistics.median(r[phase][k] for r in runs) for k in keys}
        if "fio" in rows[phase]:
            rows[phase]["ratio"] = rows[phase]["fp_dcp"] / rows[phase]["fio"]
        if "first_touch" in rows[phase]:
            slower = min(rows[phase]["first_touch"], rows[phase].get("fio", math.inf))
            rows[phase]["vs_slower"] = rows[phase]["fp_dcp"] / slower
    return rows


def print_report(result: dict[str, Any], fio: Jobs | None) -> None:
    n, rounds = result["ranks"], result["rounds"]
    print(
        f"\n{n} ranks, {result['state_bytes'] / GB:.2f} GB Llama-shaped state ({result['one_rank_bytes'] / GB:.2f} GB "
        f"a rank), {result['device']}, median of {rounds} round{'s' if rounds > 1 else ''}, every load bit-exact"
    )
    width = max(len(t["label"]) for t in result["targets"]) + 2
    print(f"{'target':<{width}}{'phase':<7}" + "".join(f"{c:>14}" for c in COLUMNS.values()) + f"{'CPU-s/GB':>10}")
    for t in result["targets"]:
        for phase, row in t["rows"].items():
            cells = "".join(f"{row[k]:>14.2f}" if k in row else f"{'-':>14}" for k in COLUMNS)
            print(f"{t['label']:<{width}}{phase:<7}{cells}{row['cpu_s_per_gb']:>10.3f}")
    print(
        "GB/s: tensor bytes of all ranks over the slowest rank's time, barrier to barrier; CPU-s/GB: user + system "
        "time of every rank over the phase, summed, per GB."
    )
    print(
        f"N x one rank: one rank alone (world size 1) saving and loading one rank's share, its GB/s times {n}. "
        "ratio: fp-dcp / fio. first touch: each rank faulting in as many bytes of fresh memory after its load; "
        "x slower: fp-dcp / min(fio, first touch)."
    )
    if fio is not None:
        print(
            f"fio: --numjobs={n} into the same directories, as many bytes, depth {fio.depth} x {fio.block >> 20} MiB "
            f"per job, from {fio.buffers}, timed by fio itself (its start-up left out; as a whole process in the "
            "JSON); O_DIRECT where fp-dcp has it, else buffered: "
            + ", ".join(f"{t['label']} {t['fio']}" for t in result["targets"])
        )
    print("loads: " + "; ".join(f"{t['label']} {t['cold']}" for t in result["targets"]))
    for line in result["not_possible"]:
        print(f"not possible: {line}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=min(8, os.cpu_count() or 1), help="default: min(8, cores)")
    ap.add_argument("--gb", type=float, default=2.0, help="GiB of state, all ranks together (default 2)")
    ap.add_argument(
        "--dirs",
        nargs="+",
        default=["/dev/shm", str(ROOT)],
        help="targets, each measured on its own (default: /dev/shm and the repository's disk); "
        "DIR,DIR,... is one target over several directories (data_dirs)",
    )
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where every rank's state lives")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--optimizer", action="store_true", help="save and load AdamW's state too")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    hidden, inter, vocab = widths(args.gb)
    layers = layers_for(args.gb / (3 if args.optimizer else 1), hidden, inter, vocab)
    shapes = llama_shapes(layers, hidden, inter, vocab)
    targets = [d.split(",") for d in args.dirs]
    root = os.geteuid() == 0
    runs: list[list[dict[str, Any]]] = [[] for _ in targets]
    # huge pages for every job's buffers, and one more block's worth each for the page of alignment fio adds
    with reference(depth=(DEPTH + 1) * args.ranks) as ref:
        fio = Jobs(DEPTH, BLOCK, ref.huge_page, ref.why_plain, jobs=args.ranks) if ref else None
        for r in range(args.rounds):
            for dirs, target_runs in zip(targets, runs, strict=True):
                target_runs.append(one_round(dirs, args, shapes, fio))
                last = target_runs[-1]
                print(
                    f"round {r + 1} {label(dirs)}: save {last['save']['fp_dcp']:.2f} GB/s, "
                    f"load {last['load']['fp_dcp']:.2f} GB/s"
                    + (f" (fio {last['save']['fio']:.2f}, {last['load']['fio']:.2f})" if fio else ""),
                    file=sys.stderr,
                    flush=True,
                )
    not_possible = [] if fio else ["fio is not installed (Debian package fio): no fio column"]
    if fio and not fio.huge_page:
        not_possible.append(f"fio from huge pages: {fio.why_plain}")
    if not root:
        not_possible.append("drop_caches (not root): disk loads evicted with posix_fadvise DONTNEED only")
    device = "cuda:0 for every rank, gloo process group" if args.device == "cuda" else "CPU, gloo process group"
    result = {
        "ranks": args.ranks,
        "rounds": args.rounds,
        "device": device,
        "state_bytes": runs[0][0]["bytes"],
        "one_rank_bytes": runs[0][0]["one_rank_bytes"],
        "optimizer": args.optimizer,
        "not_possible": not_possible,
        "targets": [
            {
                "label": label(dirs),
                "directories": len(dirs),
                "cold": "warm, from memory (tmpfs)"
                if filesystem_of(dirs[0]) in ("tmpfs", "ramfs")
                else ("cold (drop_caches)" if root else "evicted (posix_fadvise)"),
                "fio": ("O_DIRECT" if target_runs[0]["fio_direct"] else "buffered") if fio else None,
                "rows": summary(target_runs),
                "runs": target_runs,
            }
            for dirs, target_runs in zip(targets, runs, strict=True)
        ],
    }
    print_report(result, fio)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
