"""Loads of a checkpoint whose data files are all in the page cache, as after a download, a copy, a save through
the cache or an earlier read: fp-dcp reads them there, through its host threads, where it used to read them from
the disk again with O_DIRECT.

    python benchmarks/warm_load_bench.py DIR [--gb 2] [--rounds 3]

Saves a Llama-shaped state into DIR once (fp-dcp's checkpoint, torch's
and fio's files, each in a folder of its own), then per round runs each method
(alternating, each round in the reverse order of the one before), each
load into targets made just before it, touched (``zeros_like``) and fresh
(``empty_like``, never written), through a reader made anew:

- ``fp-dcp``: ``FastPersistReader(DIR)``, as the README shows;
- ``fp-dcp, O_DIRECT``: the same with the cache's state hidden from it
  (``_cio.cached_pages`` answering "cannot tell", as before Linux 6.5):
  what fp-dcp did before it looked;
- ``FileSystemReader``: torch's own reader (reading what ``FileSystemWriter``
  saved), which reads through the cache;
- fio, buffered, ``--invalidate=0``, as many jobs as fp-dcp has host
  threads, reading files it wrote into DIR through the cache, 1 MiB
  requests, 4 in flight (the fastest from the cache of the settings tried
  on our 2-core VM: 17-19 GB/s, where 8 MiB requests 32 deep, whose
  buffers spill out of the CPU's cache, ran at 4-9). It reads into buffers
  it reuses, so it writes no memory it has not touched: a bound, not a
  peer.

Before each load every data file is read through once more, so that the
load finds it whole in the cache (checked with ``cachestat``). Prints
GB/s and CPU-s/GB (medians), and each method's GB/s against fio's. Run it
with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch
import torch.distributed.checkpoint as dcp

from fp_dcp import FastPersistReader, FastPersistWriter
from fp_dcp._native import _cio
from fp_dcp.config import IOConfig
from fp_dcp.testing.measure import timed
from fp_dcp.tools.fio import Jobs, installed
from fp_dcp.tools.workload import fresh_allocations, llm_state_dict, targets, tensor_bytes
from fp_dcp.units import PAGE, MiB

KINDS = ("touched", "fresh")


def data_files(directory: str) -> Iterator[str]:
    for folder, _, names in sorted(os.walk(directory)):
        for name in sorted(names):
            if name.endswith(".distcp") or name.startswith("fio."):
                yield os.path.join(folder, name)


def read_into_cache(directory: str) -> list[str]:
    """Read every data file of ``directory`` through the page cache; the files not all there after."""
    block = bytearray(16 << 20)
    partly = []
    for path in data_files(directory):
        with open(path, "rb", buffering=0) as f:
            while f.readinto(block):
                pass
            size = os.fstat(f.fileno()).st_size
            pages = _cio.cached_pages(f.fileno(), 0, size)
            if pages is None or pages < -(-size // PAGE):
                partly.append(f"{os.path.relpath(path, directory)} ({pages} of {-(-size // PAGE)} pages)")
    return partly


@contextlib.contextmanager
def cache_hidden() -> Iterator[None]:
    with mock.patch.object(_cio, "cached_pages", lambda fd, offset, length: None):
        yield


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dir")
    parser.add_argument("--gb", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    state = llm_state_dict(int(args.gb * 1e9), seed=0)
    size = tensor_bytes(state)
    ours, torchs, fios = (os.path.join(args.dir, name) for name in ("fp-dcp", "torch", "fio"))
    if not os.path.exists(os.path.join(ours, ".metadata")):
        dcp.save(state, storage_writer=FastPersistWriter(ours), no_dist=True)
    if not os.path.exists(os.path.join(torchs, ".metadata")):
        dcp.save(state, storage_writer=dcp.FileSystemWriter(torchs), no_dist=True)
    threads = IOConfig().threads()
    fio = Jobs(depth=4, block=MiB, jobs=threads, direct=False, cached=True) if installed() else None
    if fio is not None:
        os.makedirs(fios, exist_ok=True)
        fio.run(fios, "write", -(-size // threads))  # its own files, through the cache
    fresh_allocations()

    def fp_load(hidden: bool) -> Callable[[dict[str, Any]], None]:
        def load(target: dict[str, Any]) -> None:
            with cache_hidden() if hidden else contextlib.nullcontext():
                dcp.load(target, storage_reader=FastPersistReader(ours), no_dist=True)

        return load

    def torch_load(target: dict[str, Any]) -> None:
        dcp.load(target, storage_reader=dcp.FileSystemReader(torchs), no_dist=True)

    methods = {"fp-dcp": fp_load(False), "fp-dcp, O_DIRECT": fp_load(True), "FileSystemReader": torch_load}
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    fio_gbps: list[float] = []
    order = list(methods)
    for _ in range(args.rounds):
        for name in order:
            for kind in KINDS:
                for partly in read_into_cache(args.dir):
                    print(f"warning: not every page in the page cache: {partly}")
                target = targets(state, kind)
                took = timed(functools.partial(methods[name], target))
                assert all(torch.equal(target[k], v) for k, v in state.items() if isinstance(v, torch.Tensor))
                results.setdefault((name, kind), []).append((took.gbps(size), took.cpu_s_per_gb(size)))
                del target
        if fio is not None:
            read_into_cache(args.dir)
            fio_gbps.append(fio.run(fios, "read", -(-size // threads)).gbps)
        order.reverse()
    bound = statistics.median(fio_gbps) if fio_gbps else None
    print(f"{size / 1e9:.2f} GB, every data file in the page cache, {args.rounds} rounds, alternating")
    print(f"{'method':18s} {'targets':8s} {'GB/s (median)':>13s} {'CPU-s/GB':>9s} {'x fio':>6s}  GB/s by round")
    for (name, kind), runs in results.items():
        gbps = statistics.median(r for r, _ in runs)
        ratio = f"{gbps / bound:6.2f}" if bound else "     -"
        rounds = ", ".join(f"{r:.2f}" for r, _ in runs)
        print(f"{name:18s} {kind:8s} {gbps:13.2f} {statistics.median(c for _, c in runs):9.3f} {ratio}  {rounds}")
    if bound is not None:
        rounds = ", ".join(f"{g:.2f}" for g in fio_gbps)
        print(f"fio, {threads} jobs, 1 MiB requests 4 deep, from the cache: {bound:.2f} GB/s median ({rounds})")
    else:
        print("fio is not installed: no bound")


if __name__ == "__main__":
    main()
