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
    "DataDirectoryNotFoundError",
    "CheckpointExistsError",
    "CheckpointBusyError",
    "CheckpointReplacedError",
    "UnsupportedTensorError",
    "SaveCancelledError",
    "DurableStorageError",
]


class CheckpointError(Exception):
    """Base of every error fp-dcp raises about a checkpoint."""


class NotACheckpointError(CheckpointError, FileNotFoundError):
    """The directory holds no complete checkpoint (no published ``.metadata``)."""


class IncompatibleCheckpointError(CheckpointError, ValueError):
    """The checkpoint was written in a format this version cannot read."""


class CorruptCheckpointError(CheckpointError, ValueError):
    """Stored bytes disagree with their checksum, or a file is short or missing."""


class DataDirectoryNotFoundError(CheckpointError, FileNotFoundError):
    """A data directory recorded as a relative path (by an older fp-dcp) is nowhere near the checkpoint.

    Not damage: the files may be intact where the save's working directory put
    them, which the checkpoint does not say. Passing ``data_dirs=`` to the
    reader finds them.
    """


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


class DurableStorageError(CheckpointError, OSError):
    """A step could not be copied to durable storage (after retries); the local and peer copies are unaffected."""
