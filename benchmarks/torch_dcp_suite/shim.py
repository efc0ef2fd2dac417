"""Make torch's filesystem storage classes be fp-dcp's, for running PyTorch's own DCP tests against fp-dcp.

Importing this module (``site/sitecustomize.py`` does it at interpreter
start-up when ``FP_DCP_TORCH_SUITE_SHIM=1``, so test modules and the worker
processes they spawn see it before any ``from torch.distributed.checkpoint
import FileSystemWriter``):

- calls ``fp_dcp.install()``, so ``checkpoint_id``-only ``dcp.save`` /
  ``dcp.load`` / ``dcp.async_save`` calls pick fp-dcp's classes;
- rebinds ``FileSystemWriter`` / ``FileSystemReader`` to ``FastPersistWriter`` /
  ``FastPersistReader`` where torch exports them
  (``torch.distributed.checkpoint`` and ``torch.distributed.checkpoint.filesystem``)
  and in ``torch.distributed.checkpoint.format_utils``, which copied the names
  at its import (``dcp_to_torch_save`` / ``torch_save_to_dcp`` use them).

The classes are substituted as they are, not wrapped: a test that constructs a
``FileSystemWriter`` with its keyword arguments gets a ``FastPersistWriter``
(which accepts them), so every difference a test finds is fp-dcp's.
``fp_dcp`` is imported first, so its own reference to torch's ``FileSystemReader``
(used to read stock DCP checkpoints) stays torch's. Subclasses torch defines
at import (the Hugging Face storage) keep torch's base classes.
"""

from __future__ import annotations

import importlib

import torch.distributed.checkpoint as dcp

import fp_dcp

__all__ = ["PATCHED_MODULES", "apply"]

# Modules whose FileSystemWriter / FileSystemReader names the shim rebinds.
PATCHED_MODULES = (
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.filesystem",
    "torch.distributed.checkpoint.format_utils",
)


def apply() -> None:
    """Install fp-dcp as DCP's default storage and rebind torch's filesystem class names (idempotent)."""
    fp_dcp.install()
    for name in PATCHED_MODULES:
        module = importlib.import_module(name)
        module.FileSystemWriter = fp_dcp.FastPersistWriter  # type: ignore[attr-defined]
        module.FileSystemReader = fp_dcp.FastPersistReader  # type: ignore[attr-defined]
    assert dcp.FileSystemWriter is fp_dcp.FastPersistWriter


apply()
