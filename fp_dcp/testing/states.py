"""State dicts for tests and benchmarks: versioned ones, their digests, targets to load into, and comparing two.

``make_state(size, version)`` is about ``size`` bytes in a few large tensors
and many small ones whose every byte depends on the version and the tensor,
so that a load that returns another save's bytes, or a mix, never passes
for the one it should have returned; ``digests`` names each tensor's bytes
by their SHA-256 (independent of fp-dcp's own checksums). ``differing``
compares two nested state dicts bit for bit (NaNs, every dtype, each rank's
part of a DTensor).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["tensor_layout", "make_state", "empty_state", "digests", "leaves", "differing"]


def tensor_layout(size: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Names, shapes and dtypes of a state dict of about ``size`` bytes: a few large tensors, many small ones."""
    big = max(size * 3 // 20 // 4096, 1)  # rows of 4 KiB: 6 tensors of 15 % each
    small = max(size // 10 // 64, 4)  # 64 small tensors share 10 %, sizes off the page grid
    layout: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for i in range(5):
        layout[f"layers.{i}.weight"] = ((big, 1024), torch.float32)
        layout[f"layers.{i}.bias"] = ((1024 + i,), torch.float32)
    layout["embedding"] = ((big, 2048), torch.bfloat16)
    for j in range(64):
        layout[f"small.{j}"] = ((small // 4 + 3 * j,), torch.int32)
    layout["step"] = ((), torch.int64)
    return layout


def _values(n_bytes: int, salt: int) -> torch.Tensor:
    """``n_bytes`` of int32 that differ at every position and for every salt (cheap: no random generator)."""
    n = n_bytes // 4
    return torch.arange(n, dtype=torch.int32).mul_(-1640531535).bitwise_xor_(salt)  # odd multiplier: a bijection


def make_state(size: int, version: int) -> dict[str, Any]:
    """The state dict saved as ``version``: every byte depends on the version and the tensor."""
    state: dict[str, Any] = {}
    for index, (name, (shape, dtype)) in enumerate(tensor_layout(size).items()):
        nbytes = max(1, torch.Size(shape).numel()) * dtype.itemsize
        salt = ((version & 0x7FFF) << 16) | (index + 1)
        state[name] = _values(max(nbytes, 4), salt).view(torch.uint8)[:nbytes].view(dtype).reshape(shape).clone()
    state["meta"] = {"version": version}
    return state


def empty_state(size: int) -> dict[str, Any]:
    """Load targets. Uninitialised memory is fine: a tensor the load skipped cannot hash to a saved one."""
    state: dict[str, Any] = {
        name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in tensor_layout(size).items()
    }
    state["meta"] = {"version": -1}
    return state


def digests(state: dict[str, Any]) -> dict[str, str]:
    """The SHA-256 of each tensor's bytes by name, and the version as ``meta.version``."""
    out = {}
    for name, value in state.items():
        if isinstance(value, torch.Tensor):
            out[name] = hashlib.sha256(value.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
    out["meta.version"] = str(state["meta"]["version"])
    return out


def leaves(state: Any, name: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted name, value) of every leaf of a nested state dict (dicts and lists), a DTensor as this rank's part."""
    if isinstance(state, dict):
        for key, value in state.items():
            yield from leaves(value, f"{name}.{key}" if name else str(key))
    elif isinstance(state, (list, tuple)):
        for index, value in enumerate(state):
            yield from leaves(value, f"{name}.{index}" if name else str(index))
    else:
        yield name, state.to_local() if isinstance(state, DTensor) else state


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if a.device != b.device:
            b = b.to(a.device)
        return bool(
            torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
        )
    return bool(a == b)


def differing(expected: Any, got: Any) -> list[str]:
    """The dotted names of the leaves of ``got`` that are not bit for bit those of ``expected`` (tensors: dtype,
    shape and bytes; anything else by ``==``), and of those either lacks; empty when they are the same."""
    want, have = dict(leaves(expected)), dict(leaves(got))
    return sorted(n for n in want.keys() | have.keys() if n not in want or n not in have or not _same(want[n], have[n]))
