"""How a load prepares fresh targets: filled page by page through a userfaultfd, huge pages asked for and
populated, populated only, or nothing.

    python benchmarks/fresh_targets_bench.py DIR [--gb 2] [--rounds 3] [--hold]

Saves a Llama-shaped state into DIR once, then loads it cold into targets
made just before each load with ``torch.empty`` (never written, as
``to_empty()`` leaves a model), through a ``FastPersistReader`` made anew,
the preparations alternating (each round in the order of the last one
reversed: a load meets memory the one before it just freed, which a VM
that hands free memory back to its host faults in faster), and prints each
one's GB/s and CPU-s/GB per round. "huge pages" asks for them whatever the
kernel's THP ``defrag`` setting, which fp-dcp itself does only where faults
would not compact memory (``fp_dcp.io.prefault.huge_pages_without_stalls``);
"userfaultfd" is what fp-dcp does where every read is staged and the kernel
allows it (``fp_dcp.io.userfault``); the others have it refused.
``--hold`` keeps every load's targets until the end, so each load meets
memory nobody used lately (needs rounds x 4 x ``--gb`` GB of free memory,
and more). Run it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed.checkpoint as dcp

from fp_dcp import FastPersistReader, FastPersistWriter, IOConfig
from fp_dcp.io import prefault, userfault
from fp_dcp.testing.measure import timed
from fp_dcp.tools.workload import evict, fresh_allocations, llm_state_dict, tensor_bytes

PREPARATIONS = {  # name: (prepare_targets, huge pages asked for, userfaultfd allowed)
    "userfaultfd": (True, False, True),
    "huge pages, populated": (True, True, False),
    "populated only": (True, False, False),
    "nothing": (False, False, False),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dir")
    parser.add_argument("--gb", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hold", action="store_true", help="keep every load's targets until the end")
    args = parser.parse_args()
    state = llm_state_dict(int(args.gb * 1e9), seed=0)
    size = tensor_bytes(state)
    if not os.path.exists(os.path.join(args.dir, ".metadata")):
        dcp.save(state, storage_writer=FastPersistWriter(args.dir), no_dist=True)
    shapes = {k: (v.shape, v.dtype) for k, v in state.items() if isinstance(v, torch.Tensor)}
    del state
    fresh_allocations()
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in PREPARATIONS}
    held = []
    order = list(PREPARATIONS)
    for _ in range(args.rounds):
        for name in order:
            prepare, huge, uffd = PREPARATIONS[name]
            prefault.huge_pages_without_stalls = lambda huge=huge: huge  # what each reader's Prefaulter asks
            userfault._refused = not uffd
            evict(args.dir)
            target = {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in shapes.items()}

            def load(target: dict = target, prepare: bool = prepare) -> None:
                reader = FastPersistReader(args.dir, config=IOConfig(prepare_targets=prepare))  # made anew, timed
                dcp.load(target, storage_reader=reader, no_dist=True)

            took = timed(load)
            results[name].append((took.gbps(size), took.cpu_s_per_gb(size)))
            if args.hold:
                held.append(target)
            del target, load  # freed before the next targets are made
        order.reverse()
    held.clear()
    print(f"{size / 1e9:.2f} GB into fresh targets, {args.rounds} rounds, alternating, cold")
    print(f"{'preparation':24s} {'GB/s by round':28s} CPU-s/GB by round")
    for name, runs in results.items():
        rates = ", ".join(f"{r:.2f}" for r, _ in runs)
        cpus = ", ".join(f"{c:.2f}" for _, c in runs)
        print(f"{name:24s} {rates:28s} {cpus}")


if __name__ == "__main__":
    main()
