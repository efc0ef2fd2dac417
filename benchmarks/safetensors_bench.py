#!/usr/bin/env python3
"""Loading a Hugging Face safetensors checkpoint: fp-dcp against torch's HuggingFaceStorageReader, the
safetensors package and the disk's limit, on 1 rank and on 4 gloo ranks as 2 nodes (FSDP2).

    sudo .venv/bin/python benchmarks/safetensors_bench.py [--gb 4] [--shards 4] [--rounds 2] [--dir DIR]

The checkpoint: a Llama-shaped bf16 model (hidden 4096, intermediate 11008,
vocabulary 32000, as many layers as make ``--gb`` GiB) written by the
safetensors package in ``--shards`` files with ``model.safetensors.index.json``,
as the Hugging Face hub serves it. Every load is cold: the files' pages are
evicted (posix_fadvise DONTNEED, and drop_caches when root) before it.

1 rank, into a state of bf16 tensors allocated and touched once:

- fp-dcp: ``dcp.load(..., storage_reader=FastPersistReader(dir))``;
- ``HuggingFaceStorageReader(dir, thread_count=1)`` and ``thread_count=4``;
- the safetensors package: ``load_file`` per shard, copied into the state;
  and ``safe_open`` with ``get_slice(name)[:]`` per tensor (its slicing API);
- fio reading a file of the same size (``--rw=read --bs=8M --iodepth=32
  --direct=1 --ioengine=io_uring``) from buffers in huge pages
  (``--iomem=shmhuge``; ``fp_dcp.tools.fio`` reserves the huge pages as root
  and gives them back; without them, fio's plain buffers, and the report
  says why).

4 ranks (``FP_DCP_NODE`` puts ranks 0-1 and 2-3 on two nodes), each with the
model built on the meta device, sharded by ``fully_shard`` and materialized:
fp-dcp against ``HuggingFaceStorageReader``, wall time (slowest rank) and the
bytes the disk served during the load (``/proc/diskstats`` of the device
holding the directory, from when every rank is ready to load; other I/O to
that disk counts too), against the checkpoint's size: read once is 1.0x.
The two "nodes" share this machine's page cache, which serves
``HuggingFaceStorageReader``'s second reader of a page from memory; on two
real nodes each would read it from the storage. fp-dcp reads with O_DIRECT,
so its count is what each node would read from a shared filesystem.

Reported: median GB/s of each method (of the checkpoint's tensor bytes),
CPU-seconds per GB (this process and its children), ratios side by side.
Methods alternate, ``--rounds`` times. The goals: 1 rank at least 0.9x fio
and 2x ``HuggingFaceStorageReader``; 4 ranks reading each byte once.
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed.checkpoint as dcp
from llama import layers_for, llama_shapes, sharded_model
from ranks import spawn

from fp_dcp import FastPersistReader
from fp_dcp.io.device import disk_of
from fp_dcp.io.diskstats import DiskCounters
from fp_dcp.tools.bench import cpu_seconds, evict
from fp_dcp.tools.fio import Fio, reference

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


def one_rank_methods(directory: str, target: dict[str, torch.Tensor]) -> dict[str, Callable[[], None]]:
    from safetensors import safe_open
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    def fp() -> None:
        dcp.load(target, storage_reader=FastPersistReader(directory), no_dist=True)

    def hf(threads: int) -> Callable[[], None]:
        return lambda: dcp.load(target, storage_reader=HuggingFaceStorageReader(directory, threads), no_dist=True)

    def whole_files() -> None:
        for path in shard_files(directory):
            for name, tensor in load_file(path).items():
                target[name].copy_(tensor)

    def slices() -> None:
        for path in shard_files(directory):
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    target[name].copy_(f.get_slice(name)[:])

    return {
        "fp-dcp": fp,
        "HuggingFaceStorageReader t=1": hf(1),
        "HuggingFaceStorageReader t=4": hf(4),
        "safetensors load_file": whole_files,
        "safetensors safe_open slices": slices,
    }


def fio_read(fio: Fio, path: str, size: int) -> Callable[[], None]:
    fio.run(path, "write", size)  # the file, untimed

    def run() -> None:
        fio.run(path, "read", size)

    return run


def run_one_rank(directory: str, size: int, rounds: int, scratch: str) -> dict[str, list[tuple[float, float]]]:
    target = {}
    with open(os.path.join(directory, INDEX)) as f:
        names = json.load(f)["weight_map"]
    from safetensors import safe_open

    for path in shard_files(directory):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                target[name] = torch.zeros(f.get_slice(name).get_shape(), dtype=torch.bfloat16)
    assert set(target) == set(names)
    methods = one_rank_methods(directory, target)
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in methods}
    fio_file = os.path.join(scratch, "fio-file")
    with reference() as fio:  # huge pages, where reserved, are given back when the rounds end
        fio_name = ""
        if fio is not None:
            fio_name = f"fio read depth {fio.depth}, {fio.buffers}"
            methods[fio_name] = fio_read(fio, fio_file, size)
            results[fio_name] = []
        for r in range(rounds):
            for name, load in methods.items():
                checked = r == 0 and name == "fp-dcp"
                if checked:
                    for tensor in target.values():
                        tensor.zero_()  # untimed: what the check then finds, fp-dcp wrote
                evict(fio_file if name == fio_name else directory)
                cpu0 = cpu_seconds() + cpu_seconds(-1)
                start = time.perf_counter()
                load()
                seconds = time.perf_counter() - start
                cpu = cpu_seconds() + cpu_seconds(-1) - cpu0
                results[name].append((size / seconds / GB, cpu / (size / GB)))
                print(f"round {r + 1} 1 rank {name}: {results[name][-1][0]:.3f} GB/s", flush=True)
                if checked:
                    check_one_rank(directory, target)
    return results


def check_one_rank(directory: str, target: dict[str, torch.Tensor]) -> None:
    """What was loaded equals what the safetensors package reads (untimed)."""
    from safetensors.torch import load_file

    for path in shard_files(directory):
        for name, tensor in load_file(path).items():
            assert torch.equal(target[name], tensor), f"{name} differs"


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
    start = time.perf_counter()
    dcp.load(state, storage_reader=storage)
    dist.barrier()
    seconds = time.perf_counter() - start
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
            ranks = spawn(4, load_fsdp2, directory, shapes, reader, r == 0)
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
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=11008)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
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
        one = run_one_rank(model, size, args.rounds, work)
        four = run_four_ranks(model, shapes, size, args.rounds)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\n1 rank, median of {args.rounds}:")
    med = {name: statistics.median(g for g, _ in v) for name, v in one.items()}
    for name, v in one.items():
        print(f"  {name:<48} {med[name]:6.3f} GB/s  {statistics.median(c for _, c in v):5.2f} CPU-s/GB")
    fio = next((m for n, m in med.items() if n.startswith("fio")), None)
    print(
        "  fp-dcp: "
        + (f"{med['fp-dcp'] / fio:.2f}x fio, " if fio else "")
        + f"{med['fp-dcp'] / med['HuggingFaceStorageReader t=1']:.2f}x HuggingFaceStorageReader t=1, "
        + f"{med['fp-dcp'] / med['HuggingFaceStorageReader t=4']:.2f}x t=4"
    )
    print(f"4 ranks as 2 nodes, FSDP2, median of {args.rounds}:")
    for reader, v in four.items():
        seconds = statistics.median(s for s, _ in v)
        disk = statistics.median(d for _, d in v)
        print(f"  {reader:<48} {seconds:6.2f} s  disk read {disk / size:4.2f}x the checkpoint")
    ratio = statistics.median(s for s, _ in four["fp-dcp"]) / statistics.median(
        s for s, _ in four["HuggingFaceStorageReader"]
    )
    print(f"  wall time fp-dcp / HuggingFaceStorageReader: {ratio:.2f}x")


if __name__ == "__main__":
    main()
