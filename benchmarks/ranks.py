"""Run a function on N spawned ranks with a gloo process group (for the benchmark scripts beside this one)."""

from __future__ import annotations

import os
import pickle
import queue
import socket
import tempfile
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = 900  # the longest wait for the next rank's result


def _entry(rank: int, world: int, init: str, fn: Any, args: tuple, out: Any) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    # as torchrun sets them for ranks on one node: fp-dcp's host threads share the cores among the ranks
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        out.put((rank, pickle.dumps(fn(rank, world, *args))))
    finally:
        dist.destroy_process_group()


def spawn(world: int, fn: Any, *args: Any, tcp: bool = False) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` spawned ranks; their results in rank order.

    The ranks meet through a file, or with ``tcp`` through a TCPStore on
    127.0.0.1, as ``torchrun`` makes one; each has ``LOCAL_RANK`` and
    ``LOCAL_WORLD_SIZE`` set, as torchrun sets them for one node. A rank that dies ends the others at
    once (they would wait for it in a collective until gloo's timeout) and
    raises ``RuntimeError``.
    """
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"tcp://127.0.0.1:{_free_port()}" if tcp else f"file://{os.path.join(tmp, 'store')}"
        procs = [ctx.Process(target=_entry, args=(r, world, init, fn, args, out)) for r in range(world)]
        for p in procs:
            p.start()
        try:
            results = _collect(procs, out)
        except BaseException:  # Ctrl-C too: no rank outlives the call
            for p in procs:
                if p.is_alive():
                    p.terminate()
            raise
        for p in procs:
            p.join()
            if p.exitcode:
                raise RuntimeError(f"a rank exited with {p.exitcode}")
    return [pickle.loads(results[r]) for r in range(world)]


def _collect(procs: list[Any], out: Any) -> dict[int, bytes]:
    results: dict[int, bytes] = {}
    deadline = time.monotonic() + TIMEOUT_S
    while len(results) < len(procs):
        try:
            rank, data = out.get(timeout=1)
        except queue.Empty:
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode]
            if dead:
                raise RuntimeError(f"rank {dead[0][0]} exited with {dead[0][1]}") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"no rank reported for {TIMEOUT_S} s") from None
            continue
        results[rank] = data
        deadline = time.monotonic() + TIMEOUT_S
    return results


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
