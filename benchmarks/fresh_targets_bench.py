"""How a load prepares fresh targets: huge pages asked for and populated, populated only, or nothing.

    python benchmarks/fresh_targets_bench.py DIR [--gb 2] [--rounds 3]

Saves a Llama-shaped state into DIR once, then loads it cold into targets
made just before each load with ``torch.empty`` (never written, as
``to_empty()`` leaves a model), through a ``FastPersistReader`` made anew,
the three preparations alternating, and prints each one's GB/s and
CPU-s/GB per round. "huge pages" asks for them whatever the kernel's THP
``defrag`` setting, which fp-dcp itself does only where faults would not
compact memory (``fp_dcp.io.prefault.huge_pages_without_stalls``). Run it
with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed.checkpoint as dcp

from fp_dcp import FastPersistReader, FastPersistWriter, IOConfig
from fp_dcp.io import prefault
from fp_dcp.tools.workload import cpu_seconds, evict, fresh_allocations, llm_state_dict, tensor_bytes

PREPARATIONS = {  # name: (prepare_targets, huge pages asked for)
    "huge pages, populated": (True, True),
    "populated only": (True, False),
    "nothing": (False, False),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dir")
    parser.add_argument("--gb", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    state = llm_state_dict(int(args.gb * 1e9), seed=0)
    size = tensor_bytes(state)
    if not os.path.exists(os.path.join(args.dir, ".metadata")):
        dcp.save(state, storage_writer=FastPersistWriter(args.dir), no_dist=True)
    shapes = {k: (v.shape, v.dtype) for k, v in state.items() if isinstance(v, torch.Tensor)}
    del state
    fresh_allocations()
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in PREPARATIONS}
    for _ in range(args.rounds):
        for name, (prepare, huge) in PREPARATIONS.items():
            prefault.huge_pages_without_stalls = lambda huge=huge: huge  # what each reader's Prefaulter asks
            evict(args.dir)
            target = {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in shapes.items()}
            cpu, start = cpu_seconds(), time.perf_counter()
            reader = FastPersistReader(args.dir, config=IOConfig(prepare_targets=prepare))
            dcp.load(target, storage_reader=reader, no_dist=True)
            seconds, cpu = time.perf_counter() - start, cpu_seconds() - cpu
            results[name].append((size / seconds / 1e9, cpu / (size / 1e9)))
            del target, reader
    print(f"{size / 1e9:.2f} GB into fresh targets, {args.rounds} rounds, alternating, cold")
    print(f"{'preparation':24s} {'GB/s by round':28s} CPU-s/GB by round")
    for name, runs in results.items():
        rates = ", ".join(f"{r:.2f}" for r, _ in runs)
        cpus = ", ".join(f"{c:.2f}" for _, c in runs)
        print(f"{name:24s} {rates:28s} {cpus}")


if __name__ == "__main__":
    main()
