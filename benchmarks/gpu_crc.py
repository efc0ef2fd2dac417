"""CRC-32C on the GPU (``cuda/crc32c.cu``): the kernel's throughput, and GPU saves and loads with it against the host.

    python benchmarks/gpu_crc.py [--gib 1] [--memory-dir /dev/shm]

``benchmarks/gpu_check.py`` runs the same as its ``crc`` section. Needs CUDA
and cupy. Figures:

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

import argparse
import contextlib
import json
import shutil
import statistics
import tempfile
import time
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
from fp_dcp.tools.workload import llm_state_dict, tensor_bytes

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
    start = time.perf_counter()
    whole = _cio.crc32c(host)
    result: dict[str, Any] = {"bytes": nbytes, "host_crc32c_gbps": nbytes / (time.perf_counter() - start) / GB}
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
                saves, loads = [], []
                with FastPersistWriter(path) as writer:
                    dcp.save(state, storage_writer=writer)  # warm-up: pool, page-locking, the kernel built
                    for _ in range(repeats):
                        torch.cuda.synchronize()
                        start = time.perf_counter()
                        dcp.save(state, storage_writer=writer)
                        saves.append(size / (time.perf_counter() - start) / GB)
                    staging = writer.last_save.staging if writer.last_save else "?"
                target = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
                with FastPersistReader(path) as reader:
                    for _ in range(repeats):
                        start = time.perf_counter()
                        dcp.load(target, storage_reader=reader)
                        torch.cuda.synchronize()
                        loads.append(size / (time.perf_counter() - start) / GB)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="state for the saves and loads, and bytes for the kernel")
    ap.add_argument("--memory-dir", default="/dev/shm", help="tmpfs directory")
    args = ap.parse_args()
    nbytes = int(args.gib * GiB)
    result = measure(llm_state_dict(nbytes, device="cuda"), args.memory_dir, nbytes)
    for what, measured in rows(result):
        print(f"  {what:<55}  {measured}")
    print(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
