"""The names fp-dcp gives the entries of checkpoint and run directories, all in one place (docs/format.md and
docs/runs.md say what each entry is; ``format.data_file_name`` names the data files)."""

from __future__ import annotations

import re

__all__ = [
    "METADATA_NAME",
    "LOCK_NAME",
    "is_metadata_tmp",
    "metadata_tmp_name",
    "RETIRED_NAME",
    "NODE_MARKER",
    "DURABLE_NAME",
    "REPLICATED_NAME",
    "SPARE_NAME",
    "DELETING_PREFIX",
    "step_name",
    "parse_step_name",
]

# A checkpoint directory's own entries.
METADATA_NAME = ".metadata"  # publishing it makes the directory a checkpoint
LOCK_NAME = ".lock"  # held (flock) by the save in progress
_TMP_PREFIX = METADATA_NAME + "."
_TMP_SUFFIX = ".tmp"

# A step directory's markers.
RETIRED_NAME = ".retired"  # not a checkpoint (any more), kept for files newer steps use
NODE_MARKER = ".node"  # a node's copy of a step: the node's name (that copy may hold only its files)
DURABLE_NAME = ".durable"  # the step's drain to the durable tier committed (for `fp-dcp ls`)
REPLICATED_NAME = ".replicated"  # the step's copies to peer nodes done

# A run root's entries besides its step directories.
SPARE_NAME = ".spare"  # the step retired last, whose files the next save may take
DELETING_PREFIX = ".deleting-"  # a step moved aside to be removed

# as step_name writes N: [0-9], since \d and str.isdigit() take other scripts' digits too, and no leading zero
_STEP = re.compile(r"step-(0|[1-9][0-9]*)")


def metadata_tmp_name(token: str) -> str:
    """The name ``.metadata`` is written under before it is renamed into place."""
    return f"{_TMP_PREFIX}{token}{_TMP_SUFFIX}"


def is_metadata_tmp(name: str) -> bool:
    return name.startswith(_TMP_PREFIX) and name.endswith(_TMP_SUFFIX)


def step_name(step: int) -> str:
    return f"step-{step}"


def parse_step_name(name: str) -> int | None:
    """N of a name ``step_name`` gives (``step-`` and N's ASCII digits, without a leading zero), else None.

    ``step-007`` is no step: were it step 7, a root could hold two directories of one step (``step-7`` too),
    and the tiers' keys name step 7's files ``step-7/...`` in every root.
    """
    match = _STEP.fullmatch(name)
    return int(match.group(1)) if match else None
