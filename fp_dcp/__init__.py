"""fp-dcp: FastPersist-style storage for torch.distributed.checkpoint.

Use it as DCP's storage layer::

    import torch.distributed.checkpoint as dcp
    from fp_dcp import FastPersistWriter, FastPersistReader

    dcp.save(state_dict, storage_writer=FastPersistWriter("/nvme/ckpt/step-100"))
    dcp.load(state_dict, storage_reader=FastPersistReader("/nvme/ckpt/step-100"))

The package is layered (docs/design.md has the map): ``io`` moves bytes and
knows nothing of torch; ``format`` turns bytes into objects; ``checkpoint``
opens a checkpoint; ``save`` and ``load`` are the two DCP sides; ``gpu`` stages
device memory; ``runs`` checkpoint a training run step after step; ``tools`` are the CLI.
"""

from __future__ import annotations

from . import errors
from .compat import TorchVersionError
from .config import IOConfig
from .errors import *  # noqa: F403  (the exception types are part of the public API)
from .integrations.default_storage import install, install_from_environment, installed, is_installed, uninstall
from .io.info import engine_info
from .load.reader import FastPersistReader, LoadSummary
from .load.safetensors_verify import SafetensorsVerifyReport
from .load.verify import VerifyReport, verify_checkpoint
from .runs.manager import CheckpointManager, StepInfo, list_steps
from .runs.overlap import OverlappedCheckpointer
from .runs.retention import clean_unfinished, unfinished
from .runs.steps import remove_leftovers
from .save.planner import FastPersistSavePlanner
from .save.safetensors import SafetensorsWriter
from .save.summary import SaveSummary
from .save.writer import FastPersistWriter

__version__ = "0.1.0"

__all__ = [
    "FastPersistWriter",
    "FastPersistReader",
    "SafetensorsWriter",
    "IOConfig",
    "FastPersistSavePlanner",
    "SaveSummary",
    "LoadSummary",
    "engine_info",
    "verify_checkpoint",
    "VerifyReport",
    "SafetensorsVerifyReport",
    "OverlappedCheckpointer",
    "CheckpointManager",
    "StepInfo",
    "list_steps",
    "remove_leftovers",
    "clean_unfinished",
    "unfinished",
    "install",
    "uninstall",
    "installed",
    "is_installed",
    "TorchVersionError",
    *errors.__all__,
]

install_from_environment()  # FP_DCP_DEFAULT_STORAGE=1: see fp_dcp.integrations.default_storage
