"""What the benchmarks run on: a Llama-shaped state dict, the targets a load fills, cold caches, CPU and memory used,
the GPU's pinned copy peaks.

Load targets come in the two kinds users have (``targets``):

- *fresh*: made by ``torch.empty_like`` just before the load, as a meta-device
  model's ``to_empty()`` or ``from_pretrained(low_cpu_mem_usage=True)`` makes
  them: memory nobody has written, each page's first write a fault;
- *touched*: written before (``zeros_like``), as a model that has trained.

glibc serves a large allocation from memory freed earlier in the process
once its threshold for fresh mappings has grown past it (up to 32 MiB), so
fresh targets would turn touched from the second round on;
``fresh_allocations`` fixes the threshold, as a new process has it, so that
every large tensor is mapped afresh.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import resource
import threading
from collections.abc import Iterator
from typing import Any, Literal

import torch

__all__ = [
    "llama_layer",
    "llm_state_dict",
    "tensor_bytes",
    "Targets",
    "targets",
    "fresh_allocations",
    "PeakRSS",
    "cpu_seconds",
    "drop_caches",
    "evict",
    "recycle",
    "copy_peaks",
]

Targets = Literal["fresh", "touched"]

_M_MMAP_THRESHOLD = -3  # mallopt's parameter (glibc's malloc.h)
_FRESH_THRESHOLD = 128 * 1024  # glibc's initial value: a new process's


def llama_layer(hidden: int, inter: int, kv: int) -> dict[str, tuple[int, ...]]:
    """A Llama layer's parameters, Hugging Face's names and shapes: ``kv`` rows of keys and values (``hidden``
    for multi-head attention, fewer for grouped-query)."""
    return {
        "self_attn.q_proj.weight": (hidden, hidden),
        "self_attn.k_proj.weight": (kv, hidden),
        "self_attn.v_proj.weight": (kv, hidden),
        "self_attn.o_proj.weight": (hidden, hidden),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
    }


def llm_state_dict(total_bytes: int, seed: int = 0, device: str = "cpu") -> dict[str, Any]:
    """About ``total_bytes`` of a Llama-shaped model's training state, its tensors made on ``device``."""
    g = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float32, device=device).to(dtype)

    h, ffn, vocab = 4096, 11008, 32000
    sd: dict[str, Any] = {
        "model.embed_tokens.weight": rand(vocab, h),
        "lm_head.weight": rand(vocab, h),
        "master.embed_tokens.weight": rand(vocab, h, dtype=torch.float32),
        "model.norm.weight": rand(h, dtype=torch.float32),
        "train_state": {"step": 1000, "lr": 3e-4, "data_position": list(range(64))},
    }
    used = sum(t.nbytes for t in sd.values() if isinstance(t, torch.Tensor))
    shapes = llama_layer(h, ffn, kv=h)  # multi-head attention, as Llama 2 7B
    layer = 0
    while used < total_bytes:
        p = f"model.layers.{layer}."
        for name, shape in shapes.items():
            if len(shape) == 1:  # the norms, kept in float32, and whole however far the budget is
                sd[p + name] = rand(*shape, dtype=torch.float32)
                used += sd[p + name].nbytes
            elif used < total_bytes:
                sd[p + name] = rand(*shape)
                used += sd[p + name].nbytes
        for k in range(24):  # small per-layer state: scales, biases, step counters
            sd[p + f"extra.{k}"] = rand(64, dtype=torch.float32)
        sd[p + "step"] = torch.tensor(float(layer))
        layer += 1
    return sd


def tensor_bytes(sd: dict[str, Any]) -> int:
    return sum(v.nbytes for v in sd.values() if isinstance(v, torch.Tensor))


def targets(sd: dict[str, Any], kind: Targets) -> dict[str, Any]:
    """Tensors shaped as ``sd``'s to load into: ``fresh`` (never written) or ``touched`` (zeroed)."""
    make = torch.empty_like if kind == "fresh" else torch.zeros_like
    return {k: make(v) if isinstance(v, torch.Tensor) else v for k, v in sd.items()}


def fresh_allocations() -> bool:
    """Make every allocation of 128 KiB or more a fresh mapping for the rest of this process (glibc's
    threshold fixed at a new process's value); False where this is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, _FRESH_THRESHOLD))
    except (OSError, AttributeError):
        return False


class PeakRSS:
    """Samples this process's resident set every few milliseconds while active."""

    def __init__(self) -> None:
        self.start = self.peak = 0
        self._stop = threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE")

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._rss())

    @contextlib.contextmanager
    def watch(self) -> Iterator[PeakRSS]:
        self.start = self.peak = self._rss()
        thread = threading.Thread(target=self._run, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            thread.join()
            self._stop.clear()
            self.peak = max(self.peak, self._rss())


def cpu_seconds(who: int = resource.RUSAGE_SELF) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def recycle(directory: str, nbytes: int, name: str = "recycled") -> None:
    """Write ``nbytes`` into a file ``name`` in ``directory`` (a tmpfs) and remove it, so that the next write
    there takes pages the guest used a moment ago. On a VM that hands free memory back to its host (free page
    reporting), a page unused for a few seconds costs a host fault again at its next touch: 2 ranks' first save
    into tmpfs ran at a fraction of the speed, for several times the CPU, of the same save after this
    (docs/benchmarks.md, "A node on one machine"), and fio, which wrote right after fp-dcp's files were removed,
    always had recycled pages. Every writer ``benchmarks/node_bench.py`` and ``fp-dcp bench`` measure on tmpfs
    (fp-dcp, fio) starts after this: they meet the same memory."""
    path = os.path.join(directory, name)
    block = bytes(64 << 20)
    with open(path, "wb") as f:
        for _ in range(-(-nbytes // len(block))):
            f.write(block)
    os.unlink(path)


def drop_caches(what: int = 1) -> bool:
    """As root, drop the kernel's clean caches (``/proc/sys/vm/drop_caches``): 1 the page cache, 2 dentries and
    inodes, 3 both; False where that is not allowed. Dirty pages stay: ``os.sync()`` first writes them back."""
    if os.geteuid() != 0:
        return False
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write(f"{what}\n")
    except OSError:
        return False
    return True


def evict(path: str) -> None:
    """Drop ``path``'s pages (a file or every file under a directory) from the page cache."""
    files = [path] if os.path.isfile(path) else [os.path.join(d, n) for d, _, ns in os.walk(path) for n in ns]
    for name in files:
        fd = os.open(name, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    drop_caches(1)


def copy_peaks(nbytes: int = 1 << 30, repeats: int = 5) -> dict[str, Any]:
    """Best pinned device-to-host and host-to-device GB/s of ``repeats`` copies of ``nbytes`` on a side stream."""
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    rates: dict[str, list[float]] = {"d2h": [], "h2d": []}
    for _ in range(repeats):
        for name, (dst, src) in {"d2h": (host, device), "h2d": (device, host)}.items():
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            with torch.cuda.stream(stream):
                start.record()
                dst.copy_(src, non_blocking=True)
                end.record()
            end.synchronize()
            rates[name].append(nbytes / (start.elapsed_time(end) / 1000) / 1e9)
    return {"d2h_gbps": max(rates["d2h"]), "h2d_gbps": max(rates["h2d"]), "runs": rates}
