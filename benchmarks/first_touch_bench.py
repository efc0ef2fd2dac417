"""How fast this machine hands out memory nobody has written: the limit of every load into fresh targets.

    python benchmarks/first_touch_bench.py [--gib 16] [--chunk-gib 2] [--passes 2]

Maps ``--gib`` of fresh anonymous memory in chunks, holding every chunk, and
faults each in as a load faults in its targets (``fp_dcp.io.prefault``:
``MADV_POPULATE_WRITE`` from ``host_threads`` helper threads); prints GB/s
and CPU-s/GB per chunk, then unmaps everything and does it again
(``--passes``). On bare metal every chunk costs about the same. On a VM
whose host takes free guest memory back (free page reporting, a balloon:
``page_reporting`` on the kernel's command line, ``virtio_balloon`` loaded),
memory the guest used lately is still backed and faults in fast, while the
rest costs a fault in the host too, several times slower: a load's targets
land on one or the other by the allocator's choice, not the loader's.
"""

from __future__ import annotations

import argparse
import mmap
import sys

from fp_dcp import IOConfig
from fp_dcp.io.prefault import Prefaulter, populate_supported
from fp_dcp.testing.measure import timed
from fp_dcp.tools.bench import faulted_in
from fp_dcp.units import MiB

GiB = 1024 * MiB


def fault_in(nbytes: int, prefaulter: Prefaulter) -> tuple[mmap.mmap, float, float]:
    """A fresh mapping of ``nbytes``, faulted in: the mapping (still held), seconds, CPU seconds (all threads)."""
    held: list[mmap.mmap] = []
    took = timed(lambda: held.append(faulted_in(nbytes, prefaulter)))
    return held[0], took.seconds, took.cpu_seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=16, help="memory mapped and held in all (default 16)")
    ap.add_argument("--chunk-gib", type=float, default=2, help="size of each mapping (default 2)")
    ap.add_argument("--passes", type=int, default=2, help="times the whole is mapped, faulted in and unmapped")
    args = ap.parse_args()
    if not populate_supported():
        print("this kernel has no MADV_POPULATE_WRITE (Linux 5.14): nothing to measure", file=sys.stderr)
        return 1
    chunk = int(args.chunk_gib * GiB)
    threads = IOConfig().threads()
    prefaulter = Prefaulter(threads)
    print(f"fresh memory faulted in by {threads} helper threads, {args.chunk_gib:g} GiB at a time, all held")
    try:
        for p in range(args.passes):
            held = []
            for i in range(int(args.gib * GiB) // chunk):
                memory, seconds, cpu = fault_in(chunk, prefaulter)
                held.append(memory)
                print(
                    f"pass {p + 1}, {i * args.chunk_gib:5.1f}-{(i + 1) * args.chunk_gib:5.1f} GiB held: "
                    f"{chunk / seconds / 1e9:5.2f} GB/s, {cpu / (chunk / 1e9):.2f} CPU-s/GB",
                    flush=True,
                )
            for memory in held:
                memory.close()
    finally:
        prefaulter.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
