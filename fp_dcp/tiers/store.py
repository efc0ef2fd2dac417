"""Durable storage for drained steps: a POSIX directory (a shared filesystem) or an fsspec object store.

Both keep the layout of a run's root: ``step-N/<data file>`` and
``step-N/.metadata``. A stored object is never taken on trust: ``put_file``
reads back what was stored and checks it (every item's CRC-32C) before it
counts, and only then is the object under its final name (POSIX: renamed
into place; object stores: a ``put`` is atomic, an upload that fails is
aborted, never committed, and an object that fails its check is deleted).
Object stores cannot rename a directory, so a step's ``.metadata`` goes
last (``put_bytes``) and is its commit marker everywhere.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import os
import secrets
import time
from collections.abc import Callable, Iterator
from typing import Any

from .._native import _cio
from ..io.files import fsync_directory, open_regular, write_durably
from ..load.stream_check import StreamCheck
from ..names import METADATA_NAME, parse_step_name
from ..units import MiB
from .layout import list_tier

__all__ = ["DurableStore", "PosixStore", "FsspecStore", "Retry", "open_store", "retrying"]

_CHUNK = 8 * MiB


@dataclasses.dataclass(frozen=True)
class Retry:
    """How a store's calls are retried: ``attempts`` in all, waiting ``delay`` s, then twice as long each time.

    The default rides out about 7.5 s of trouble per file (a throttled or
    restarting object store) before the drain of that step is reported failed.
    """

    attempts: int = 5
    delay: float = 0.5
    sleep: Callable[[float], None] = time.sleep


class DurableStore(abc.ABC):
    """Where drained steps are kept; ``key`` is a path relative to the run's durable root (``step-N/name``).

    ``retry`` says how the drain retries its calls (a class attribute: set it
    on a subclass or an instance).
    """

    url: str
    retry: Retry = Retry()

    @abc.abstractmethod
    def inventory(self) -> dict[str, dict[str, int]]:
        """{step directory name: {object name: size}} for every step directory under the root."""

    @abc.abstractmethod
    def put_file(self, key: str, source: str, size: int, check: StreamCheck) -> list[str]:
        """Store the first ``size`` bytes of local file ``source`` as ``key``, read them back through ``check``.

        Returns the problems the read-back found ([]: stored and intact);
        a failed object is not left under ``key``. OSError for a failed write.
        """

    @abc.abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None:
        """Store ``data`` as ``key`` (whole or not at all), checked by reading it back."""

    @abc.abstractmethod
    def chunks(self, key: str) -> Iterator[memoryview | bytes]:
        """The bytes of ``key``, in order, a bounded chunk at a time."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key`` (no error if it is gone)."""

    @abc.abstractmethod
    def cleanup(self, step: str) -> None:
        """Remove the leftovers of interrupted uploads in step directory ``step``."""

    def get_bytes(self, key: str) -> bytes:
        return b"".join(bytes(c) for c in self.chunks(key))

    def _checked(self, key: str, data: bytes) -> None:
        back = self.get_bytes(key)
        if _cio.crc32c(back) != _cio.crc32c(data) or len(back) != len(data):
            self.delete(key)
            raise OSError(f"{self.url}/{key} read back differently from what was stored")


def _read_chunks(f: Any, size: int | None) -> Iterator[bytes]:
    left = size
    while left is None or left > 0:
        data = f.read(_CHUNK if left is None else min(_CHUNK, left))
        if not data:
            return
        if left is not None:
            left -= len(data)
        yield data


class PosixStore(DurableStore):
    """A directory, typically on a shared filesystem; uploads are fsynced, re-read from the disk, renamed."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.url = self.root
        os.makedirs(self.root, exist_ok=True)

    def _path(self, key: str) -> str:
        return os.path.join(self.root, key)

    def inventory(self) -> dict[str, dict[str, int]]:
        return list_tier(self.root)

    def put_file(self, key: str, source: str, size: int, check: StreamCheck) -> list[str]:
        target = self._path(key)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        tmp = os.path.join(os.path.dirname(target), f".{os.path.basename(target)}.{secrets.token_hex(4)}.part")
        try:
            with open(source, "rb") as src, open(tmp, "xb") as dst:
                for data in _read_chunks(src, size):
                    dst.write(data)
                dst.flush()
                os.fsync(dst.fileno())
                # the read-back must come from the disk, not from the pages just written
                os.posix_fadvise(dst.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            with open(tmp, "rb") as back:
                for data in _read_chunks(back, None):
                    check.feed(data)
            problems = check.problems(f"{self.url}/{key}")
            if not problems:
                os.replace(tmp, target)
                fsync_directory(os.path.dirname(target))
            return problems
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def put_bytes(self, key: str, data: bytes) -> None:
        target = self._path(key)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        write_durably(target, data, f"{target}.{secrets.token_hex(4)}.part")
        self._checked(key, data)

    def chunks(self, key: str) -> Iterator[bytes]:
        with open_regular(self._path(key)) as f:
            yield from _read_chunks(f, None)

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(key))
            if os.path.basename(key) == METADATA_NAME:
                fsync_directory(os.path.dirname(self._path(key)))  # a step's end is durable before its files go

    def cleanup(self, step: str) -> None:
        directory = self._path(step)
        for name in os.listdir(directory) if os.path.isdir(directory) else []:
            if name.endswith(".part"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(directory, name))
        with contextlib.suppress(OSError):
            os.rmdir(directory)  # only if nothing else is left in it


class FsspecStore(DurableStore):
    """An fsspec filesystem by URL (``s3://bucket/run``: s3fs); extra keyword arguments go to the filesystem."""

    def __init__(self, url: str, **options: Any) -> None:
        import fsspec  # type: ignore[import-untyped]  # optional: only object-store users need it

        self.url = url.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **options)

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}"

    def inventory(self) -> dict[str, dict[str, int]]:
        self.fs.invalidate_cache()  # listings are cached by the filesystem object; others may have written since
        found: dict[str, dict[str, int]] = {}
        try:
            listed = self.fs.find(self.root, detail=True)
        except FileNotFoundError:
            return found
        for path, info in listed.items():
            step, _, name = os.path.relpath(path, self.root).partition("/")
            if parse_step_name(step) is not None and name and "/" not in name:
                found.setdefault(step, {})[name] = int(info["size"])
        return found

    def put_file(self, key: str, source: str, size: int, check: StreamCheck) -> list[str]:
        # An fsspec file commits what it holds however it is closed, by an exception too. With autocommit off,
        # closing only uploads: the object appears at commit() (S3: the multipart upload completes) or never
        # (discard() aborts the upload, dropping its parts). _open, not open: open(autocommit=False) also
        # queues the file on the filesystem's transaction, which nothing here would ever empty.
        dst = self.fs._open(self._path(key), "wb", block_size=_CHUNK, autocommit=False)
        try:
            with open(source, "rb") as src, dst:
                for data in _read_chunks(src, size):
                    dst.write(data)
            dst.commit()
        except BaseException:
            with contextlib.suppress(Exception):
                dst.discard()
            with contextlib.suppress(Exception):
                self.delete(key)  # a filesystem without deferred commits (memory://) shows what was written
            raise
        for data in self.chunks(key):
            check.feed(data)
        problems = check.problems(f"{self.url}/{key}")
        if problems:
            self.delete(key)
        return problems

    def put_bytes(self, key: str, data: bytes) -> None:
        self.fs.pipe_file(self._path(key), data)
        self._checked(key, data)

    def chunks(self, key: str) -> Iterator[bytes]:
        with self.fs.open(self._path(key), "rb", block_size=_CHUNK, cache_type="none") as f:
            yield from _read_chunks(f, None)

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._path(key))

    def cleanup(self, step: str) -> None:
        """Object stores keep no partial objects: an interrupted upload left nothing to remove."""


def open_store(durable: str | os.PathLike[str] | DurableStore) -> DurableStore:
    """A store for ``durable``: a ``DurableStore`` as it is, a URL with a scheme through fsspec, else a directory."""
    if isinstance(durable, DurableStore):
        return durable
    text = os.fspath(durable)
    return FsspecStore(text) if "://" in text else PosixStore(text)


def retrying(action: Callable[[], list[str]], retry: Retry) -> list[str]:
    """Run ``action`` until it returns no problem, ``retry.attempts`` times at most, waiting longer each time.

    An exception counts as a problem of that attempt (network and server
    errors are transient more often than not); the last attempt's problems are returned.
    """
    problems: list[str] = []
    for attempt in range(retry.attempts):
        if attempt:
            retry.sleep(retry.delay * 2 ** (attempt - 1))
        try:
            problems = action()
        except Exception as e:  # any failure of a store call: retried, then reported, never raised into training
            problems = [f"{type(e).__name__}: {e}"]
        if not problems:
            return []
    return problems
