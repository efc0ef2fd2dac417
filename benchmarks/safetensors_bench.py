#!/usr/bin/env python3
"""Loading a Hugging Face safetensors checkpoint: fp-dcp against torch's HuggingFaceStorageReader, the
safetensors package, Run:ai's model streamer, fastsafetensors and the disk's limit, into fresh and into
touched targets; and on 4 gloo ranks as 2 nodes (FSDP2).

    sudo .venv/bin/pip install -r benchmarks/requirements-safetensors.txt   # the peers, once
    sudo .venv/bin/python benchmarks/safetensors_bench.py [--gb 4] [--shards 4] [--rounds 2] [--dir DIR]
        [--device cpu|cuda] [--targets fresh,touched] [--no-ranks]

The checkpoint: a Llama-shaped bf16 model (hidden 4096, intermediate 11008,
vocabulary 32000, as many layers as make ``--gb`` GiB) written by the
safetensors package in ``--shards`` files with ``model.safetensors.index.json``,
as the Hugging Face hub serves it. Every load is cold: the files' pages are
evicted (posix_fadvise DONTNEED, and drop_caches when root) before it, and
every loader is made anew.

1 rank, into a state dict of bf16 targets on ``--device``, of two kinds:

- fresh: ``torch.empty``, never written before the load, as a meta-device
  model's ``to_empty()`` gives them: the load pays the first touch of every
  page (on the CPU). Large allocations are mapped afresh each time
  (``fp_dcp.tools.workload.fresh_allocations``: glibc's threshold fixed at a
  new process's), so a load's targets are pages never touched, as in a new
  process;
- touched: zeroed before the load, untimed.

The loaders (``safetensors_peers.py``): fp-dcp (``dcp.load`` with
``FastPersistReader``); ``HuggingFaceStorageReader`` ``thread_count`` 1 and
4; ``safetensors.torch.load_file``; runai-model-streamer; fastsafetensors
without GDS. A peer that is not installed is named and left out. And fio
reading a file of the same size (``--rw=read --bs=8M --iodepth=32
--direct=1 --ioengine=io_uring``) from buffers in huge pages
(``--iomem=shmhuge``; ``fp_dcp.tools.fio`` reserves them as root and gives
them back; without them, fio's plain buffers, and the report says why).

Every load is checked bit for bit (untimed): the XXH3-128 of each target's
bytes against that of the tensor the safetensors package reads from the
files.

4 ranks (``FP_DCP_NODE`` puts ranks 0-1 and 2-3 on two nodes; not with
``--no-ranks``), each with the model built on the meta device, sharded by
``fully_shard`` and materialized, touched:
fp-dcp against ``HuggingFaceStorageReader``, wall time (slowest rank) and the
bytes the disk served during the load (``/proc/diskstats`` of the device
holding the directory, from when every rank is ready to load; other I/O to
that disk counts too), against the checkpoint's size: read once is 1.0x.
The two "nodes" share this machine's page cache, which serves
``HuggingFaceStorageReader``'s second reader of a page from memory; on two
real nodes each would read it from the storage. fp-dcp reads with O_DIRECT,
so its count is what each node would read from shared storage.

Reported: median GB/s of each loader (of the checkpoint's tensor bytes), its
ratio to fio, CPU-seconds per GB (this process and its children), whether
every load was bit-exact; methods alternate, ``--rounds`` times. The bars, for
each kind of target: fp-dcp at least 0.95x fio and ahead of every other
loader; where the best of them is below 0.8x fio, at least 1.2x it; into CUDA
targets, at least 0.9x the lesser of fio and the pinned host-to-device copy
peak (measured first, 1 GiB, best of 3). The exit
status is 1 if a load was not bit-exact.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import warnings
from collections.abc import Callable

import torch
import torch.distributed.checkpoint as dcp
from safetensors_peers import FpDcpLoad, Targets, loaders

from fp_dcp import FastPersistReader
from fp_dcp._native import _cio
from fp_dcp.io.device import disk_of
from fp_dcp.io.diskstats import DiskCounters
from fp_dcp.testing.llama import layers_for, llama_shapes, sharded_model
from fp_dcp.testing.measure import timed
from fp_dcp.testing.ranks import run_node
from fp_dcp.tools.fio import Fio, reference
from fp_dcp.tools.workload import copy_peaks, evict, fresh_allocations

GB = 1e9
INDEX = "model.safetensors.index.json"


def write_checkpoint(directory: str, shapes: dict[str, tuple[int, ...]], shards: int) -> int:
    """The model as the hub serves it, one shard in memory at a time; returns its tensor bytes."""
    from safetensors.torch import save_file

    total = sum(2 * torch.Size(s).numel() for s in shapes.values())
    g = torch.Generator().manual_seed(0)
    names = list(shapes)
    groups: list[list[str]] = [[] for _ in range(shards)]
    done = 0
    for name in names:  # consecutive tensors, about equal bytes per shard
        groups[min(shards - 1, done * shards // total)].append(name)
        done += 2 * torch.Size(shapes[name]).numel()
    weight_map = {}
    for k, group in enumerate(groups):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: torch.randn(shapes[n], generator=g).bfloat16() for n in group}
        save_file(part, os.path.join(directory, file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(group, file)
    with open(os.path.join(directory, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return total


def shard_files(directory: str) -> list[str]:
    return sorted(os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(".safetensors"))


# ------------------------------------------------------------------------------------------------- 1 rank

KINDS = ("fresh", "touched")


def make_targets(shapes: dict[str, tuple[int, ...]], kind: str, device: str) -> Targets:
    targets = {name: torch.empty(shape, dtype=torch.bfloat16, device=device) for name, shape in shapes.items()}
    if kind == "touched":
        for t in targets.values():
            t.zero_()  # every page written
    if device == "cuda":
        torch.cuda.synchronize()
    return targets


def digest(tensor: torch.Tensor) -> str:
    """XXH3-128 of the tensor's bytes (on the host); BLAKE2b where fp-dcp was built without libxxhash."""
    hasher = _cio.Hash128() if hasattr(_cio, "Hash128") else hashlib.blake2b(digest_size=16)
    hasher.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return hasher.hexdigest()


def reference_digests(directory: str) -> dict[str, str]:
    """Each tensor's digest as the safetensors package reads it from the files (untimed)."""
    from safetensors.torch import load_file

    return {name: digest(t) for path in shard_files(directory) for name, t in load_file(path).items()}


def fio_read(fio: Fio, path: str, size: int) -> Callable[[], None]:
    fio.run(path, "write", size)  # the file, untimed

    def run() -> None:
        fio.run(path, "read", size)

    return run


def rate(load: Callable[[], None], size: int, device: str) -> tuple[float, float]:
    """GB/s and CPU-seconds per GB (this process and its children: fio) of one load."""
    took = timed(load, device=device, children=True)
    return took.gbps(size), took.cpu_s_per_gb(size)


Results = dict[str, dict[str, list[tuple[float, float]]]]  # kind -> method -> (GB/s, CPU-s/GB) per round
Staged = dict[str, list[float]]  # kind -> fp-dcp's bytes read through its staging buffers, a fraction, per round


def run_one_rank(
    directory: str, shapes: dict, size: int, rounds: int, scratch: str, device: str, kinds: list[str]
) -> tuple[Results, str, dict[str, int], Staged]:
    """The rounds; also fio's row name ("" without fio), per kind and loader the loads that were not exact, and
    per kind the share of fp-dcp's bytes that went through its staging buffers."""
    methods, missing = loaders(directory, shard_files(directory), device)
    for name, why in missing.items():
        print(f"{name}: {why}: left out")
    want = reference_digests(directory)
    results: Results = {kind: {name: [] for name in methods} for kind in kinds}
    staged: Staged = {kind: [] for kind in kinds}
    wrong: dict[str, int] = {}
    fio_file = os.path.join(scratch, "fio-file")
    with reference() as fio:  # huge pages, where reserved, are given back when the rounds end
        fio_name = ""
        if fio is not None:
            fio_name = f"fio read depth {fio.depth}, {fio.buffers}"
            read = fio_read(fio, fio_file, size)
        for r in range(rounds):
            if fio is not None:
                evict(fio_file)
                result = rate(read, size, "cpu")
                for kind in kinds:
                    results[kind].setdefault(fio_name, []).append(result)
                print(f"round {r + 1} {fio_name}: {result[0]:.3f} GB/s", flush=True)
            for kind in kinds:
                for name, load in methods.items():
                    target = make_targets(shapes, kind, device)
                    evict(directory)
                    results[kind][name].append(rate(functools.partial(load, target), size, device))
                    if isinstance(load, FpDcpLoad) and load.last is not None:
                        staged[kind].append(load.last.staged_bytes / load.last.bytes)
                    bad = sum(digest(target[n]) != want[n] for n in want)  # untimed
                    if bad:
                        wrong[f"{kind} {name}"] = wrong.get(f"{kind} {name}", 0) + 1
                        print(f"  NOT BIT-EXACT: {name} into {kind} targets: {bad} tensors differ", flush=True)
                    gbps = results[kind][name][-1][0]
                    print(f"round {r + 1} {kind} targets, {name}: {gbps:.3f} GB/s", flush=True)
                    del target  # before the next targets: one set in memory at a time
    return results, fio_name, wrong, staged


def report_one_rank(
    results: Results, fio_name: str, wrong: dict[str, int], staged: Staged, rounds: int, device: str, h2d: float | None
) -> None:
    for kind, table in results.items():
        what = "torch.empty, never written before the load" if kind == "fresh" else "zeroed before the load"
        print(f"\n1 rank, {kind} targets on {device} ({what}), median of {rounds}:")
        med = {name: statistics.median(g for g, _ in v) for name, v in table.items()}
        fio = med.get(fio_name)
        print(f"  {'loader':<44} {'GB/s':>7} {'x fio':>6} {'CPU-s/GB':>9}  bit-exact")
        for name, v in table.items():
            ratio = f"{med[name] / fio:6.2f}" if fio else f"{'-':>6}"
            exact = "-" if name == fio_name else "NO" if f"{kind} {name}" in wrong else "yes"
            cpu = statistics.median(c for _, c in v)
            print(f"  {name:<44} {med[name]:7.3f} {ratio} {cpu:9.2f}  {exact}")
        if staged[kind]:
            share = statistics.median(staged[kind])
            print(f"  fp-dcp read {share:.1%} of its bytes into staging buffers (then copied), the rest in place")
        others = {n: g for n, g in med.items() if n not in ("fp-dcp", fio_name)}
        best = max(others, key=lambda n: others[n])
        fp = med["fp-dcp"]
        if fio:
            print(f"  [{'ok' if fp >= 0.95 * fio else 'MISSED'}] fp-dcp >= 0.95 x fio ({fp / fio:.2f} x)")
        print(f"  [{'ok' if fp > others[best] else 'MISSED'}] fp-dcp ahead of every other loader "
              f"(best: {best}, {fp / others[best]:.2f} x)")  # fmt: skip
        if fio and others[best] < 0.8 * fio:
            ok = fp >= 1.2 * others[best]
            print(f"  [{'ok' if ok else 'MISSED'}] {best} is below 0.8 x fio: fp-dcp >= 1.2 x it")
        if fio and h2d:
            limit = min(fio, h2d)
            print(f"  [{'ok' if fp >= 0.9 * limit else 'MISSED'}] fp-dcp >= 0.9 x min(fio, pinned H2D {h2d:.1f} GB/s) "
                  f"({fp / limit:.2f} x)")  # fmt: skip


# ------------------------------------------------------------------------------------------------- 4 ranks


def load_fsdp2(rank: int, world: int, directory: str, shapes: dict, reader: str, check: bool) -> dict:
    import torch.distributed as dist
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.tensor import init_device_mesh

    os.environ["FP_DCP_NODE"] = f"node{rank // 2}"
    state = sharded_model(shapes, init_device_mesh("cpu", (world,))).state_dict()
    for v in state.values():
        v.to_local().zero_()  # touched: the load measures the disk and the exchange, not page faults
    storage = FastPersistReader(directory) if reader == "fp-dcp" else HuggingFaceStorageReader(directory)
    disk = disk_of(directory)
    dist.barrier()
    before = disk_read(disk)  # from here: every rank has started (imports read from the disk too)
    seconds = timed(lambda: dcp.load(state, storage_reader=storage), barrier=True).seconds
    after = disk_read(disk)
    ok = True
    if check:
        from safetensors import safe_open

        with open(os.path.join(directory, INDEX)) as f:
            weight_map = json.load(f)["weight_map"]
        for name, value in state.items():
            local = value.to_local()
            rows = value.__create_chunk_list__()[0].offsets[0] if local.numel() else 0
            with safe_open(os.path.join(directory, weight_map[name]), framework="pt") as f:
                want = f.get_slice(name)[rows : rows + local.shape[0]]
            ok = ok and torch.equal(local, want)
    last = getattr(storage, "last_load", None)
    disk = after - before if after is not None and before is not None else float("nan")
    return {"seconds": seconds, "ok": ok, "read": last.read_bytes if last else 0, "disk": disk}


def disk_read(disk: str | None) -> int | None:
    """Bytes read so far from the disk, None where /proc/diskstats does not list it (tmpfs, overlay)."""
    counters = DiskCounters.read(disk)
    return counters.sectors_read * 512 if counters is not None else None


def run_four_ranks(directory: str, shapes: dict, size: int, rounds: int) -> dict[str, list[tuple[float, float]]]:
    results: dict[str, list[tuple[float, float]]] = {"fp-dcp": [], "HuggingFaceStorageReader": []}
    for r in range(rounds):
        for reader in results:
            evict(directory)
            ranks = run_node(4, load_fsdp2, directory, shapes, reader, r == 0)
            disk = ranks[0]["disk"]  # the disk's count over the load, all ranks together
            assert all(x["ok"] for x in ranks), (reader, ranks)
            results[reader].append((max(x["seconds"] for x in ranks), disk))
            print(
                f"round {r + 1} 4 ranks {reader}: {results[reader][-1][0]:.2f} s, disk read {disk / size:.2f}x"
                + (f" (fp-dcp's own count {sum(x['read'] for x in ranks) / size:.2f}x)" if reader == "fp-dcp" else ""),
                flush=True,
            )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=4.0, help="GiB of bf16 tensors")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the 1-rank targets are")
    parser.add_argument("--targets", default=",".join(KINDS), help="fresh, touched or both (fresh,touched)")
    parser.add_argument("--no-ranks", action="store_true", help="leave out the 4-rank FSDP2 loads")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=11008)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()
    kinds = [k for k in KINDS if k in args.targets.split(",")]
    if not kinds or set(args.targets.split(",")) - set(KINDS):
        parser.error(f"--targets: a comma-separated list of {', '.join(KINDS)}")
    warnings.filterwarnings("ignore")
    if not fresh_allocations():
        print("note: not glibc: fresh targets may reuse memory touched by an earlier load")
    work = tempfile.mkdtemp(prefix="fp-dcp-st-bench-", dir=args.dir)
    try:
        model = os.path.join(work, "model")
        os.mkdir(model)
        sizes = (args.hidden, args.intermediate, args.vocab)
        shapes = llama_shapes(layers_for(args.gb, *sizes), *sizes)
        size = write_checkpoint(model, shapes, args.shards)
        print(f"{size / GB:.2f} GB of bf16 in {args.shards} shards, {len(shapes)} tensors; {args.rounds} rounds")
        if os.geteuid() != 0:
            print("not root: the page cache is evicted with posix_fadvise only (no drop_caches)")
        h2d = copy_peaks(repeats=3)["h2d_gbps"] if args.device == "cuda" else None
        one, fio_name, wrong, staged = run_one_rank(model, shapes, size, args.rounds, work, args.device, kinds)
        four = None if args.no_ranks else run_four_ranks(model, shapes, size, args.rounds)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report_one_rank(one, fio_name, wrong, staged, args.rounds, args.device, h2d)
    if four is not None:
        print(f"\n4 ranks as 2 nodes, FSDP2, touched targets, median of {args.rounds}:")
        for reader, v in four.items():
            seconds = statistics.median(s for s, _ in v)
            disk = statistics.median(d for _, d in v)
            print(f"  {reader:<44} {seconds:6.2f} s  disk read {disk / size:4.2f}x the checkpoint")
        ratio = statistics.median(s for s, _ in four["fp-dcp"]) / statistics.median(
            s for s, _ in four["HuggingFaceStorageReader"]
        )
        print(f"  wall time fp-dcp / HuggingFaceStorageReader: {ratio:.2f}x")
    if wrong:
        sys.exit(f"not bit-exact: {', '.join(f'{k} ({n} loads)' for k, n in wrong.items())}")


if __name__ == "__main__":
    main()
