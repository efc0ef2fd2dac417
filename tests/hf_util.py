"""Hugging Face-style checkpoints for tests: Llama-shaped weights written with the safetensors package."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch
from torch import nn

from fp_dcp.testing.llama import llama_shapes, module_with

safetensors_torch = pytest.importorskip("safetensors.torch", reason="safetensors is in the test extra")

INDEX = "model.safetensors.index.json"


def llama_state(layers: int = 2, hidden: int = 256, inter: int = 768, vocab: int = 2048) -> dict[str, torch.Tensor]:
    """A Llama model's weights (bf16) under Hugging Face's names, about 5 MB by default."""
    g = torch.Generator().manual_seed(0)
    shapes = llama_shapes(layers, hidden, inter, vocab)
    return {name: torch.randn(shape, generator=g).bfloat16() for name, shape in shapes.items()}


def write_model(directory: str | os.PathLike[str], state: dict[str, torch.Tensor], files: int = 1) -> list[str]:
    """``state`` as ``model.safetensors``, or as ``files`` shards with an index, as Hugging Face lays them out."""
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    if files == 1:
        safetensors_torch.save_file(state, os.path.join(directory, "model.safetensors"))
        return ["model.safetensors"]
    names = list(state)
    per = -(-len(names) // files)
    weight_map = {}
    shards = []
    for k in range(files):
        shard = f"model-{k + 1:05d}-of-{files:05d}.safetensors"
        part = {n: state[n] for n in names[k * per : (k + 1) * per]}
        safetensors_torch.save_file(part, os.path.join(directory, shard), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, shard)
        shards.append(shard)
    total = sum(t.numel() * t.element_size() for t in state.values())
    with open(os.path.join(directory, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return shards


def load_reference(directory: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of every ``*.safetensors`` file in ``directory``, read by the safetensors package."""
    out: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            out |= safetensors_torch.load_file(os.path.join(directory, name))
    return out


def module_for(state: dict[str, torch.Tensor]) -> nn.Module:
    """A module whose parameters have the names and shapes of ``state`` (zeros), to load into."""
    return module_with({name: torch.zeros_like(value) for name, value in state.items()})


def raw_file(path: str | os.PathLike[str], header: Any, data: bytes, length: int | None = None) -> None:
    """A safetensors file as given, well formed or not: ``header`` (JSON-encoded unless bytes), ``data``."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write((len(raw) if length is None else length).to_bytes(8, "little") + raw + data)
