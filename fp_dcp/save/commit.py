"""Publishing a checkpoint atomically and durably, and cleaning up after it.

The protocol, in the order its steps reach the disk:

1. every rank writes its data files under names unique to this save, fsyncs
   them and then the directory (so their names are durable too);
2. the coordinator writes ``.metadata`` under a temporary name, fsyncs it,
   renames it over ``.metadata`` and fsyncs the directory: the single step
   that makes the new checkpoint exist;
3. only then are leftovers of saves that died removed, and the files of the
   checkpoint it replaced, the latter on a thread of their own (``Cleanup``):
   the save returns without waiting for the filesystem to free them.

A crash before step 2 leaves the previous checkpoint (or none) in place; a
crash after it leaves the new one. One save at a time per directory is
enforced with an advisory lock on ``.lock``, held by the coordinator from set
up to publish, so cleanup can never remove a concurrent save's files.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import weakref

from ..errors import CheckpointBusyError
from ..format import parse_data_file_name
from ..io import files
from ..names import LOCK_NAME, METADATA_NAME, is_metadata_tmp, metadata_tmp_name

__all__ = ["SaveLock", "publish", "remove_leftovers", "Cleanup"]


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

    tmp = os.path.join(directory, metadata_tmp_name(token))
    files.write_durably(os.path.join(directory, METADATA_NAME), metadata_bytes, tmp)


def remove_leftovers(directory: str, keep: set[str], spare: set[str]) -> list[str]:
    """Remove dead saves' leftovers: files named as fp-dcp names its own, never one in ``keep`` or ``spare``.

    Anything else a user keeps in the directory stays.
    """
    removed = []
    for name in os.listdir(directory):
        if name in keep or name in spare:
            continue
        if parse_data_file_name(name) is not None or is_metadata_tmp(name):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, name))
                removed.append(name)
    if removed:
        files.fsync_directory(directory)
    return removed


class Cleanup:
    """The replaced checkpoint's files, removed on a thread of their own after the new one is published.

    Freeing a large file's space is the filesystem's slowest step (a sizeable
    share of a save into tmpfs: docs/benchmarks.md, "Figures behind design
    comments"), and nothing needs to wait for it: the files belong to no
    checkpoint any more, and their names are this save's to forget. A crash
    before they are gone leaves them behind, unreferenced; the next save into
    the directory removes them as leftovers (``remove_leftovers``). The
    thread is not a daemon: an interpreter exiting waits for it.
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None

    def start(self, directories: list[str], names: set[str]) -> None:
        """Remove ``names`` from each of ``directories`` (after the removal started before, if any)."""
        self.wait()
        if names:
            self._thread = threading.Thread(target=_remove, args=(directories, names), name="fp-dcp-cleanup")
            self._thread.start()

    def wait(self) -> None:
        """Return once the removal started last is done."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None


def _remove(directories: list[str], names: set[str]) -> None:
    for directory in directories:
        removed = False
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, name))
                removed = True
        if removed:
            with contextlib.suppress(OSError):  # a removal that is not durable is redone by the next save
                files.fsync_directory(directory)
