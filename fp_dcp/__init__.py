"""fp-dcp: FastPersist-style storage for torch.distributed.checkpoint.

Use it as DCP's storage layer::

    import torch.distributed.checkpoint as dcp
    from fp_dcp import FastPersistWriter, FastPersistReader

    dcp.save(state_dict, storage_writer=FastPersistWriter("/nvme/ckpt/step-100"))
    dcp.load(state_dict, storage_reader=FastPersistReader("/nvme/ckpt/step-100"))
"""

from __future__ import annotations

from . import errors
from .config import IOConfig
from .errors import *  # noqa: F403  (the exception types are part of the public API)
from .info import engine_info
from .overlap import OverlappedCheckpointer
from .planner import FastPersistSavePlanner
from .reader import FastPersistReader, LoadSummary
from .staging import SaveCancelledError
from .writer import FastPersistWriter, SaveSummary

__version__ = "0.1.0"

__all__ = [
    "FastPersistWriter",
    "FastPersistReader",
    "IOConfig",
    "FastPersistSavePlanner",
    "SaveSummary",
    "LoadSummary",
    "engine_info",
    "OverlappedCheckpointer",
    "SaveCancelledError",
    *errors.__all__,
]
