"""Publishing a checkpoint atomically and durably, and cleaning up after it.

The protocol, in the order its steps reach the disk:

1. every rank writes its data files under names unique to this save, fsyncs
   them and then the directory (so their names are durable too);
2. the coordinator writes ``.metadata`` under a temporary name, fsyncs it,
   renames it over ``.metadata`` and fsyncs the directory: the single step
   that makes the new checkpoint exist;
3. only then are the files of the checkpoint it replaced, and leftovers of
   saves that died, removed.

A crash before step 2 leaves the previous checkpoint (or none) in place; a
crash after it leaves the new one. One save at a time per directory is
enforced with an advisory lock on ``.lock``, held by the coordinator from set
up to publish, so cleanup can never remove a concurrent save's files.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import weakref

from ..errors import CheckpointBusyError
from ..format import METADATA_NAME, parse_data_file_name
from ..io import files

__all__ = ["LOCK_NAME", "SaveLock", "publish", "remove_unreferenced"]

LOCK_NAME = ".lock"
_TMP_PREFIX = METADATA_NAME + "."
_TMP_SUFFIX = ".tmp"


class SaveLock:
    """Exclusive advisory lock on ``<directory>/.lock``.

    Released by ``release``, when the lock object is garbage-collected (a
    writer abandoned after a failed save must not block the next one), or at
    process exit.
    """

    def __init__(self, directory: str) -> None:
        path = os.path.join(directory, LOCK_NAME)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise CheckpointBusyError(f"another save to {directory} is in progress (it holds {path})") from None
        self._close = weakref.finalize(self, os.close, fd)  # closing drops the flock

    def release(self) -> None:
        self._close()


def publish(directory: str, metadata_bytes: bytes, token: str) -> None:
    """Make ``metadata_bytes`` the directory's ``.metadata`` atomically and durably.

    Raises ``fp_dcp.io.files.ReplaceFailedError`` (with errno and the file it
    could not write) when nothing was published; an error after the rename
    (the final directory fsync) is raised as it is, since the new
    ``.metadata`` is then in place.
    """

    tmp = os.path.join(directory, f"{_TMP_PREFIX}{token}{_TMP_SUFFIX}")
    files.write_durably(os.path.join(directory, METADATA_NAME), metadata_bytes, tmp)


def remove_unreferenced(directory: str, keep: set[str], replaced: set[str]) -> list[str]:
    """Remove the replaced checkpoint's files and dead saves' leftovers; never a file in ``keep``.

    Only names fp-dcp writes (data files, temporary metadata) and the files
    the replaced ``.metadata`` listed are candidates; anything else a user
    keeps in the directory stays.
    """
    removed = []
    for name in os.listdir(directory):
        if name in keep:
            continue
        ours = parse_data_file_name(name) is not None or (name.startswith(_TMP_PREFIX) and name.endswith(_TMP_SUFFIX))
        if ours or name in replaced:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, name))
                removed.append(name)
    if removed:
        files.fsync_directory(directory)
    return removed
