"""Every private torch API fp-dcp uses, and every protocol detail it relies on, in one place.

Checked against torch 2.13.0 (the version the project's set-up installs);
``tests/test_compat.py`` fails when one of these stops holding, so a torch
upgrade shows here first. The package declares ``torch>=2.6``.

Private names (torch offers no public equivalent):

- ``flatten_state_dict`` (``torch.distributed.checkpoint._nested_dict``):
  the flattening DCP applies before planning; ``convert`` uses it to list a
  state dict's entries the way DCP stores them.
- ``EmptyStateDictLoadPlanner`` (``default_planner._EmptyStateDictLoadPlanner``)
  and ``load_state_dict_no_dist`` (``state_dict_loader._load_state_dict``):
  loading a whole checkpoint without a target state dict, as torch's own
  ``format_utils.dcp_to_torch_save`` does.
- ``dtensor_with_local``: a DTensor rebuilt around a host copy of its local
  shard through ``DTensor(local, spec)``, as torch's state-dict utilities do
  (``DTensor.from_local`` would move the shard back to the mesh's device).

Protocol details (public API, but behaviour fp-dcp depends on):

- ``dcp.async_save`` uses the storage writer as its ``AsyncStager`` when
  ``isinstance(writer, AsyncStager)``; that runtime-checkable protocol also
  lists ``_synchronize_after_execute``, which ``FastPersistWriter`` leaves
  unset, so the check is False and the writer stages only when passed as
  ``async_stager=`` (``WRITER_IS_NOT_AN_ASYNC_STAGER`` names this).
- DCP retries a failed ``StorageReader.read_metadata`` with ``rank=...``
  only when the method has a parameter literally named ``kwargs``;
  ``FastPersistReader.read_metadata`` names its one differently, so its
  first error is the one reported (``READ_METADATA_KWARGS``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.planner import LoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.checkpoint.storage import StorageReader

__all__ = [
    "CHECKED_TORCH",
    "WRITER_IS_NOT_AN_ASYNC_STAGER",
    "READ_METADATA_KWARGS",
    "flatten_state_dict",
    "EmptyStateDictLoadPlanner",
    "load_state_dict_no_dist",
    "dtensor_with_local",
]

CHECKED_TORCH = ("2.13.0",)
WRITER_IS_NOT_AN_ASYNC_STAGER = "_synchronize_after_execute"  # the AsyncStager member the writer leaves unset
READ_METADATA_KWARGS = "kwargs"  # the parameter name that makes DCP retry read_metadata with rank=...

EmptyStateDictLoadPlanner = _EmptyStateDictLoadPlanner


def load_state_dict_no_dist(state_dict: dict[str, Any], reader: StorageReader, planner: LoadPlanner) -> None:
    """DCP's load in this one process, into ``state_dict`` (filled by ``planner``)."""
    _load_state_dict(state_dict, storage_reader=reader, planner=planner, no_dist=True)


def dtensor_with_local(dtensor: Any, local: torch.Tensor) -> Any:
    """A DTensor of the same placement as ``dtensor`` whose local shard is ``local`` (on any device)."""
    return type(dtensor)(local, dtensor._spec, requires_grad=False)
