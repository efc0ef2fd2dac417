"""Where a streaming GPU save into tmpfs, and a load from tmpfs into GPU tensors, spend their time (cProfile).

    python benchmarks/gpu_profile.py [--gib 4] [--dirs 8]

Prints the host checksum and copy rates of this machine, each variant's GB/s,
and the top functions by their own time.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import shutil
import tempfile
import warnings

import torch.distributed.checkpoint as dcp

from fp_dcp import FastPersistReader, FastPersistWriter, IOConfig
from fp_dcp._native import _cio
from fp_dcp.testing.measure import timed
from fp_dcp.tools.workload import llm_state_dict, targets, tensor_bytes


def rate(fn, nbytes: int) -> float:
    return timed(fn, device="cuda").gbps(nbytes)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=4)
    ap.add_argument("--dirs", type=int, default=8)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    buf = bytearray(1 << 30)
    _cio.crc32c(buf)
    print(f"crc32c, one thread: {timed(lambda: _cio.crc32c(buf)).gbps(len(buf)):.1f} GB/s")
    dst = bytearray(1 << 30)
    print(f"copy_crc32c, one thread: {timed(lambda: _cio.copy_crc32c(dst, buf)).gbps(len(buf)):.1f} GB/s")
    state = llm_state_dict(int(args.gib * (1 << 30)), device="cuda")
    size = tensor_bytes(state)
    root = tempfile.mkdtemp(dir="/dev/shm")
    dirs = [os.path.join(root, f"d{i}") for i in range(args.dirs)]
    for d in dirs:
        os.makedirs(d)
    try:
        for name, config in (("default", IOConfig()), ("queue_depth 32", IOConfig(queue_depth=32))):
            with FastPersistWriter(os.path.join(root, "ck"), data_dirs=dirs, config=config) as writer:
                dcp.save(state, storage_writer=writer)
                runs = [rate(lambda w=writer: dcp.save(state, storage_writer=w), size) for _ in range(2)]
                print(f"save into {args.dirs} tmpfs dirs, {name}: {max(runs):.2f} GB/s", flush=True)
                if name == "default":
                    profile = cProfile.Profile()
                    profile.enable()
                    dcp.save(state, storage_writer=writer)
                    profile.disable()
                    pstats.Stats(profile).sort_stats("tottime").print_stats(14)
        target = targets(state, "fresh")
        with FastPersistReader(os.path.join(root, "ck")) as reader:
            dcp.load(target, storage_reader=reader)
            runs = [rate(lambda: dcp.load(target, storage_reader=reader), size) for _ in range(2)]
            print(f"load from tmpfs into CUDA: {max(runs):.2f} GB/s", flush=True)
            profile = cProfile.Profile()
            profile.enable()
            dcp.load(target, storage_reader=reader)
            profile.disable()
            pstats.Stats(profile).sort_stats("tottime").print_stats(14)
        with FastPersistReader(os.path.join(root, "ck"), verify_checksums=False) as reader:
            runs = [rate(lambda: dcp.load(target, storage_reader=reader), size) for _ in range(2)]
            print(f"load from tmpfs into CUDA, checksums off: {max(runs):.2f} GB/s", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
