"""Exceptions fp-dcp raises on bad input and bad checkpoints.

Each names the checkpoint, file or state-dict key at fault, so the message
alone says what to fix. They derive from the built-in type a caller would
already catch (ValueError, OSError, ...).
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "NotACheckpointError",
    "IncompatibleCheckpointError",
    "CorruptCheckpointError",
    "CheckpointExistsError",
    "CheckpointBusyError",
    "CheckpointReplacedError",
    "UnsupportedTensorError",
    "SaveCancelledError",
]


class CheckpointError(Exception):
    """Base of every error fp-dcp raises about a checkpoint."""


class NotACheckpointError(CheckpointError, FileNotFoundError):
    """The directory holds no complete checkpoint (no published ``.metadata``)."""


class IncompatibleCheckpointError(CheckpointError, ValueError):
    """The checkpoint was written in a format this version cannot read."""


class CorruptCheckpointError(CheckpointError, ValueError):
    """Stored bytes disagree with their checksum, or a file is short or missing."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A checkpoint is already published there and ``overwrite=False``."""


class CheckpointBusyError(CheckpointError, BlockingIOError):
    """Another save to the same directory is in progress."""


class CheckpointReplacedError(CheckpointError):
    """A newer save replaced the checkpoint while it was being loaded; loading again reads the new one."""


class UnsupportedTensorError(CheckpointError, TypeError):
    """A state-dict entry is a tensor kind fp-dcp cannot store as raw bytes."""


class SaveCancelledError(CheckpointError):
    """The save was stopped by ``FastPersistWriter.cancel()``; nothing of it was published."""
