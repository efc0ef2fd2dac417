"""Llama-shaped models for tests and benchmarks: Hugging Face's tensor names and shapes, modules with those
parameters, FSDP2-sharded models built on the meta device."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..tools.workload import llama_layer

__all__ = ["GiB", "llama_shapes", "layers_for", "share_of", "module_with", "sharded_model"]

GiB = 1 << 30


def llama_shapes(layers: int, hidden: int, inter: int, vocab: int) -> dict[str, tuple[int, ...]]:
    """Hugging Face's Llama tensor names and shapes."""
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        # grouped-query attention: a quarter of the heads for keys and values
        shapes |= {f"model.layers.{i}.{name}": shape for name, shape in llama_layer(hidden, inter, hidden // 4).items()}
    return shapes | {"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}


def layers_for(gb: float, hidden: int, inter: int, vocab: int) -> int:
    """How many layers make about ``gb`` GiB of bf16."""
    per_layer = 2 * sum(torch.Size(s).numel() for s in llama_layer(hidden, inter, hidden // 4).values())
    return max(1, round((gb * GiB - 2 * (2 * vocab * hidden + hidden)) / per_layer))


def share_of(shapes: dict[str, tuple[int, ...]], ranks: int) -> dict[str, tuple[int, ...]]:
    """Rank 0's share of each tensor under FSDP2 (dim 0 cut in ``ranks`` chunks, the first the largest)."""
    return {name: (-(-shape[0] // ranks), *shape[1:]) for name, shape in shapes.items()}


def module_with(params: dict[str, torch.Tensor]) -> nn.Module:
    """A module whose parameters are ``params``, under their dotted names."""
    root = nn.Module()
    for name, value in params.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, nn.Parameter(value, requires_grad=value.is_floating_point()))
    return root


def sharded_model(shapes: dict[str, tuple[int, ...]], mesh: DeviceMesh) -> nn.Module:
    """A bf16 model of ``shapes`` built on the meta device, sharded by FSDP2's ``fully_shard`` over ``mesh``
    and materialized on the mesh's device by ``to_empty``: its memory is not touched yet."""
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = module_with({name: torch.empty(shape, dtype=torch.bfloat16) for name, shape in shapes.items()})
    fully_shard(model, mesh=mesh)
    return model.to_empty(device=mesh.device_type)
