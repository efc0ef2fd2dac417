"""The ``crc`` section of gpu_check.py: CRC-32C on the GPU (``cuda/crc32c.cu``), the kernel's throughput, and GPU
saves and loads with it against the host.

    python benchmarks/gpu_check.py OUT_DIR --only crc [--memory-dir /dev/shm]

This was a script of its own (``gpu_crc.py [--gib 1]``), measuring what
gpu_check.py's ``crc`` section measures: the section is the one command now
(1 GiB, as the script's default was). Needs CUDA and cupy. Figures:

- the kernel on device memory, GB/s: one range, 32 MiB ranges (one staging
  buffer each, as a save launches it), 64 MiB in 4 KiB ranges (many small
  tensors), each launch timed with the table it builds on the host, each
  result checked against ``_cio.crc32c``; and ``_cio.crc32c`` on one host
  core over the same bytes;
- a streaming save of a GPU state into tmpfs and a load of it back into GPU
  tensors, with the device checksums and with the host's (the fallback), GB/s;
  both checkpoints must carry the same CRCs, and the loads be bit-exact.
"""

from __future__ import annotations

import contextlib
import shutil
import statistics
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from fp_dcp import FastPersistReader, FastPersistWriter
from fp_dcp._native import _cio
from fp_dcp.checkpoint import open_checkpoint
from fp_dcp.gpu.crc import Checksums, DeviceCrc
from fp_dcp.gpu.memory import SideStream
from fp_dcp.testing.measure import rates, timed
from fp_dcp.tools.workload import targets, tensor_bytes

GiB = 1 << 30
GB = 1e9


@contextlib.contextmanager
def host_checksums() -> Iterator[None]:
    """GPU bytes are checksummed on the host meanwhile, as where the kernel cannot run."""
    original = DeviceCrc.ready
    DeviceCrc.ready = lambda self, side: False  # type: ignore[method-assign]
    try:
        yield
    finally:
        DeviceCrc.ready = original  # type: ignore[method-assign]


class Running:
    def __init__(self) -> None:
        self.crc = 0


def kernel(nbytes: int, repeats: int = 5) -> dict[str, Any]:
    """GB/s of the kernel over ``nbytes`` of device memory cut three ways, and of the host CRC over the same bytes."""
    side = SideStream(torch.device("cuda", torch.cuda.current_device()), 0, False)
    crc = DeviceCrc()
    if not crc.ready(side):
        raise RuntimeError(f"the CRC kernel does not run here: {crc.backend}")
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    host = data.cpu().numpy()
    whole = _cio.crc32c(host)
    result: dict[str, Any] = {"bytes": nbytes, "host_crc32c_gbps": timed(lambda: _cio.crc32c(host)).gbps(nbytes)}
    # (bytes, range width): a launch's time includes building its table on the host, as in a save
    cuts = {"one range": (nbytes, nbytes), "32 MiB ranges": (nbytes, 32 << 20), "4 KiB ranges": (64 << 20, 4096)}
    for name, (used, width) in cuts.items():
        rows = list(data[:used].split(width))
        expected = whole if used == nbytes else _cio.crc32c(host[:used])
        rates = []
        for _ in range(repeats):
            check, total, keep = Checksums(crc, side), Running(), []
            for row in rows:
                check.add(total, row)
            side.wait_for(side.caller_event())
            began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            began.record(side.stream)
            check.launch(keep)
            ended.record(side.stream)
            ended.synchronize()
            rates.append(used / (began.elapsed_time(ended) / 1000) / GB)
            check.fold()
            if total.crc != expected:
                raise AssertionError(f"{name}: the kernel gave {total.crc:#010x}, the host {expected:#010x}")
        result[name] = {"gbps": max(rates), "bytes": used, "launch_rows": len(rows), "runs": rates}
    return result


def save_and_load(state: dict[str, Any], memory_dir: str, repeats: int = 3) -> dict[str, Any]:
    """Streaming saves into tmpfs and loads back into the GPU, with the device checksums and with the host's."""
    size = tensor_bytes(state)
    root = Path(tempfile.mkdtemp(prefix="crc-", dir=memory_dir))
    result: dict[str, Any] = {"bytes": size}
    crcs = {}
    try:
        for mode in ("device", "host"):
            path = root / mode
            with host_checksums() if mode == "host" else contextlib.nullcontext():
                with FastPersistWriter(path) as writer:
                    # the warm-up: the pool, page-locking, the kernel built
                    saves = rates(
                        lambda w=writer: dcp.save(state, storage_writer=w), size, repeats, device="cuda", warm_ups=1
                    )
                    staging = writer.last_save.staging if writer.last_save else "?"
                target = targets(state, "fresh")
                with FastPersistReader(path) as reader:
                    loads = rates(
                        lambda r=reader, t=target: dcp.load(t, storage_reader=r), size, repeats, device="cuda"
                    )
            exact = all(torch.equal(target[k], v) for k, v in state.items() if isinstance(v, torch.Tensor))
            crcs[mode] = {i.fqn: loc.crc32c for i, loc in open_checkpoint(path).metadata.storage_data.items()}
            result[mode] = {
                "save_gbps": statistics.median(saves),
                "load_gbps": statistics.median(loads),
                "bit_exact": exact,
                "staging": staging,
                "runs": {"save": saves, "load": loads},
            }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result["same_crcs"] = crcs["device"] == crcs["host"]
    return result


def measure(state: dict[str, Any], memory_dir: str, kernel_bytes: int = GiB) -> dict[str, Any]:
    return {"kernel": kernel(kernel_bytes), "tmpfs": save_and_load(state, memory_dir)}


def rows(r: dict[str, Any]) -> list[tuple[str, str]]:
    """(what, measured) rows of ``measure``'s result, for gpu_check.py's table."""
    k, t = r["kernel"], r["tmpfs"]
    cut = " / ".join(f"{k[name]['gbps']:.0f}" for name in ("one range", "32 MiB ranges", "4 KiB ranges"))
    return [
        ("CRC-32C on device: one range / 32 MiB / 4 KiB ranges", f"{cut} GB/s"),
        ("CRC-32C on one host core (_cio.crc32c)", f"{k['host_crc32c_gbps']:.1f} GB/s"),
        (
            "tmpfs save from GPU: device / host CRC",
            f"{t['device']['save_gbps']:.2f} / {t['host']['save_gbps']:.2f} GB/s",
        ),
        (
            "tmpfs load into GPU: device / host CRC",
            f"{t['device']['load_gbps']:.2f} / {t['host']['load_gbps']:.2f} GB/s",
        ),
        (
            "device and host CRC: same CRCs; loads exact",
            f"{t['same_crcs']}; {t['device']['bit_exact'] and t['host']['bit_exact']}",
        ),
    ]
