"""I/O engines: move byte ranges between memory and files, asynchronously.

Two engines with one interface and the same on-disk result, and one that
stores nothing:

- ``UringEngine``: requests go through one io_uring ring (``fp_dcp._native._cio``),
  up to ``queue_depth`` in flight, pool buffers registered as fixed buffers.
  Submission never blocks; ``wait`` reaps completions with the GIL released.
- ``ThreadEngine``: positional reads and writes from a small thread pool, for
  kernels or sandboxes that refuse io_uring (Docker's default seccomp
  profile, ``kernel.io_uring_disabled``) and builds without liburing.
- ``NullEngine`` (``engine="null"``, benchmarks only): every write completes
  at once and stores nothing, so a save measures the pipeline (planning,
  copies, checksums, submission) without a device in the way. Such a save
  publishes no checkpoint; reads from it fail.

Requests larger than ``block_size`` are split; a short transfer is resumed;
a failure surfaces from ``wait`` as ``OSError`` carrying errno and the path.
A read may be told where the file may end (``end``): O_DIRECT reads whole
blocks, and a file whose size is not a multiple of them (safetensors) ends
inside its last one.
"""

from __future__ import annotations

import errno as errno_mod
import os
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from .._native import _cio, missing
from ..config import IOConfig
from ..log import log_once
from .files import DataFile, ShortReadError, preallocate, short_read

__all__ = [
    "ShortReadError",
    "Ticket",
    "Engine",
    "UringEngine",
    "ThreadEngine",
    "NullEngine",
    "create_engine",
    "engine_stores",
]

FAULT_ENV = "FP_DCP_FAULT_AT"


def _io_error(err: int, op: str, nbytes: int, offset: int, path: str) -> OSError:
    return OSError(err, f"{os.strerror(err)} ({op} of {nbytes} bytes at offset {offset})", path)


class Ticket:
    """Completion handle of one ``write``/``read``/``sync`` call."""

    __slots__ = ("pending", "error", "futures")

    def __init__(self) -> None:
        self.pending = 0
        self.error: BaseException | None = None
        self.futures: list[Future[None]] = []

    def fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error


class Engine(ABC):
    """Moves byte ranges between memory and ``DataFile`` objects.

    ``write``/``read`` queue the transfer and return at once; the memory must
    stay untouched until ``wait`` on the returned ticket has returned.
    ``fallback_reason`` says why ``auto`` did not pick io_uring (None if it did).
    ``stores``: whether what is written is kept, to be read back (not so for ``NullEngine``): a save through an
    engine that keeps nothing takes over no files, has no other hands write its files and publishes nothing.
    ``fault_at``: the request, counted from 1, that fails with EIO (``create_engine`` sets it from
    ``FP_DCP_FAULT_AT``); None: none does.
    """

    name: str
    stores = True

    def __init__(self, config: IOConfig) -> None:
        self.block_size = config.block_size
        self.fallback_reason: str | None = None
        self.fault_at: int | None = None
        self._requests = 0

    def write(self, file: DataFile, data: memoryview, offset: int) -> Ticket:
        return self._transfer(True, file, data, offset, offset + len(data))

    def read(self, file: DataFile, into: memoryview, offset: int, end: int | None = None) -> Ticket:
        """Fill ``into`` from ``offset``; a file ending at ``end`` or later (not before) stops it there,
        the rest of ``into`` left as it was. Without ``end`` the file must hold every byte asked for."""
        return self._transfer(False, file, into, offset, offset + len(into) if end is None else end)

    def _transfer(self, is_write: bool, file: DataFile, view: memoryview, offset: int, end: int) -> Ticket:
        ticket = Ticket()
        step = self.block_size
        for start in range(0, len(view), step):
            self._requests += 1
            block = view[start : start + step]
            if self._requests == self.fault_at:
                ticket.fail(
                    _io_error(errno_mod.EIO, "injected fault in request", len(block), offset + start, file.path)
                )
                continue
            self._queue(ticket, is_write, file, block, offset + start, end)
        self._kick()
        return ticket

    @abstractmethod
    def _queue(
        self, ticket: Ticket, is_write: bool, file: DataFile, view: memoryview, offset: int, end: int
    ) -> None: ...

    def _kick(self) -> None:  # noqa: B027 (optional hook: engines that queue in the kernel need none)
        """Hand queued requests to the kernel without waiting."""

    @abstractmethod
    def wait(self, ticket: Ticket) -> None:
        """Block until every request of ``ticket`` is done; raise its first error."""

    @abstractmethod
    def sync(self, files: Sequence[DataFile]) -> None:
        """fsync every file (in parallel where the engine can), raising the first error."""

    def preallocate(self, files: Sequence[DataFile], sizes: Sequence[int], threads: int) -> None:
        """Reserve each file's size now, so that a full disk fails cleanly before any data is written; up to
        ``threads`` files at once: on tmpfs an allocation clears the memory it takes."""
        if len(files) <= 1 or threads == 1:
            for f, size in zip(files, sizes, strict=True):
                preallocate(f, size)
            return
        with ThreadPoolExecutor(min(threads, len(files)), thread_name_prefix="fp-dcp-fallocate") as pool:
            for task in [pool.submit(preallocate, f, size) for f, size in zip(files, sizes, strict=True)]:
                task.result()

    @abstractmethod
    def drain(self) -> None:
        """Wait for every request in flight, ignoring errors (failure paths)."""

    def register_buffers(self, buffers: Sequence[memoryview]) -> None:  # noqa: B027 (optional hook)
        """Tell the engine which buffers will be used again and again."""

    @abstractmethod
    def close(self) -> None: ...

    def describe(self) -> str:
        return self.name if self.fallback_reason is None else f"{self.name} ({self.fallback_reason})"


class _Request:
    __slots__ = ("ticket", "is_write", "file", "view", "offset", "end")

    def __init__(
        self, ticket: Ticket, is_write: bool, file: DataFile, view: memoryview | None, offset: int, end: int = 0
    ) -> None:
        self.ticket = ticket
        self.is_write = is_write
        self.file = file
        self.view = view
        self.offset = offset
        self.end = end  # reads: where the file may end


class UringEngine(Engine):
    name = "io_uring"

    def __init__(self, config: IOConfig) -> None:
        super().__init__(config)
        self.ring = _cio.Ring(config.queue_depth)  # OSError when the kernel refuses
        self.backlog: deque[_Request] = deque()  # queued, not yet in the ring
        self.unregistered: list[memoryview] | None = None  # buffers to register once nothing is in flight

    def register_buffers(self, buffers: Sequence[memoryview]) -> None:
        # A pool maps its buffers at their first use, which may come while reads into targets are in flight, and
        # the ring takes buffers only between requests: until then, requests from them go unregistered.
        self.unregistered = list(buffers)
        self._register_if_idle()

    def _register_if_idle(self) -> None:
        if self.unregistered is None or self.ring.in_flight:
            return
        buffers, self.unregistered = self.unregistered, None
        try:
            self.ring.register_buffers(buffers)
        except OSError as e:  # e.g. RLIMIT_MEMLOCK for unprivileged users: plain requests work too
            log_once(f"fp-dcp: io_uring buffer registration refused ({e.strerror}); continuing without")

    def _queue(self, ticket: Ticket, is_write: bool, file: DataFile, view: memoryview, offset: int, end: int) -> None:
        ticket.pending += 1
        self.backlog.append(_Request(ticket, is_write, file, view, offset, end))

    def _kick(self) -> None:
        ring = self.ring
        backlog = self.backlog
        self._register_if_idle()
        while backlog and ring.in_flight < ring.depth:
            req = backlog.popleft()
            if req.view is None:
                ring.fsync(req.file.fd, req)
            # A transfer the kernel copies (the page cache, tmpfs also with O_DIRECT) is a memory copy it would
            # run in this thread at submission; its workers run several at once (from tmpfs, a GPU load's reads
            # then keep pace with the bus).
            elif req.is_write:
                ring.write(req.file.fd, req.view, req.offset, req, req.file.copied)
            else:
                ring.read(req.file.fd, req.view, req.offset, req, req.file.copied)
        self._complete(ring.wait(0))

    def _complete(self, completions: list[tuple[_Request, int]]) -> None:
        for req, res in completions:
            ticket = req.ticket
            view = req.view
            if res < 0:
                op = "fsync" if view is None else ("write" if req.is_write else "read")
                ticket.fail(_io_error(-res, op, len(view) if view else 0, req.offset, req.file.path))
            # a read that reached the end the caller allowed for is complete
            elif view is not None and res < len(view) and (req.is_write or req.offset + res < req.end):
                if res == 0:
                    ticket.fail(
                        _io_error(errno_mod.EIO, "write made no progress", len(view), req.offset, req.file.path)
                        if req.is_write
                        else short_read(req.file.path, len(view), req.offset)
                    )
                else:  # resume a short transfer where it stopped
                    req.view = view[res:]
                    req.offset += res
                    self.backlog.appendleft(req)
                    continue
            ticket.pending -= 1

    def wait(self, ticket: Ticket) -> None:
        while ticket.pending:
            self._kick()
            if not ticket.pending:
                break
            if self.ring.in_flight:
                self._complete(self.ring.wait(1))
            elif not self.backlog:
                raise RuntimeError("fp-dcp engine: a ticket is pending with nothing in flight")
        if ticket.error is not None:
            raise ticket.error

    def sync(self, files: Sequence[DataFile]) -> None:
        ticket = Ticket()
        for f in files:
            ticket.pending += 1
            self.backlog.append(_Request(ticket, True, f, None, 0))
        self.wait(ticket)

    def drain(self) -> None:
        self.backlog.clear()
        while self.ring.in_flight:
            self._complete(self.ring.wait(self.ring.in_flight))
        self.backlog.clear()  # resumptions queued while draining are dropped too

    def close(self) -> None:
        self.drain()
        self.ring.close()


def _pwrite_all(fd: int, view: memoryview, offset: int, path: str) -> None:
    start = offset
    try:
        while view:
            n = os.pwrite(fd, view, offset)
            if n == 0:
                raise OSError(errno_mod.EIO, "write made no progress")
            view = view[n:]
            offset += n
    except OSError as e:
        raise _io_error(e.errno or errno_mod.EIO, "write", len(view), start, path) from None


def _pread_all(fd: int, view: memoryview, offset: int, path: str, end: int) -> None:
    try:
        while view and offset < end:
            n = os.preadv(fd, [view], offset)
            if n == 0:
                raise short_read(path, len(view), offset)
            view = view[n:]
            offset += n
    except ShortReadError:
        raise
    except OSError as e:
        raise _io_error(e.errno or errno_mod.EIO, "read", len(view), offset, path) from None


def _fsync(fd: int, path: str) -> None:
    try:
        os.fsync(fd)
    except OSError as e:
        raise _io_error(e.errno or errno_mod.EIO, "fsync", 0, 0, path) from None


class ThreadEngine(Engine):
    name = "threads"

    def __init__(self, config: IOConfig) -> None:
        super().__init__(config)
        self.pool = ThreadPoolExecutor(config.io_threads, thread_name_prefix="fp-dcp-io")
        self.outstanding: set[Future[None]] = set()

    def _track(self, ticket: Ticket, future: Future[None]) -> None:
        ticket.futures.append(future)
        self.outstanding.add(future)
        future.add_done_callback(self.outstanding.discard)

    def _queue(self, ticket: Ticket, is_write: bool, file: DataFile, view: memoryview, offset: int, end: int) -> None:
        if is_write:
            self._track(ticket, self.pool.submit(_pwrite_all, file.fd, view, offset, file.path))
        else:
            self._track(ticket, self.pool.submit(_pread_all, file.fd, view, offset, file.path, end))

    def wait(self, ticket: Ticket) -> None:
        for future in ticket.futures:
            try:
                future.result()
            except Exception as e:  # the first failure wins; the rest still finish
                ticket.fail(e)
        ticket.futures.clear()
        if ticket.error is not None:
            raise ticket.error

    def sync(self, files: Sequence[DataFile]) -> None:
        ticket = Ticket()
        for f in files:
            self._track(ticket, self.pool.submit(_fsync, f.fd, f.path))
        self.wait(ticket)

    def drain(self) -> None:
        for future in list(self.outstanding):
            future.exception()  # waits; the error belongs to a ticket already failed

    def close(self) -> None:
        self.drain()
        self.pool.shutdown(wait=True)


class NullEngine(Engine):
    """Writes complete at once and store nothing; reads fail. For measuring the pipeline (benchmarks)."""

    name = "null (stores nothing)"
    stores = False

    def _queue(self, ticket: Ticket, is_write: bool, file: DataFile, view: memoryview, offset: int, end: int) -> None:
        if not is_write:
            ticket.fail(OSError(errno_mod.EIO, "the null engine stores nothing, so nothing can be read", file.path))

    def wait(self, ticket: Ticket) -> None:
        if ticket.error is not None:
            raise ticket.error

    def sync(self, files: Sequence[DataFile]) -> None:
        pass

    def preallocate(self, files: Sequence[DataFile], sizes: Sequence[int], threads: int) -> None:
        pass  # nothing is kept, so nothing is reserved

    def drain(self) -> None:
        pass

    def close(self) -> None:
        pass


def engine_stores(config: IOConfig) -> bool:
    """Whether the engine ``config`` asks for keeps what is written (``Engine.stores``), known before it is made:
    every engine but the null sink."""
    return config.engine != "null"


def create_engine(config: IOConfig) -> Engine:
    """The engine ``config.engine`` asks for; ``auto`` falls back to threads, saying why once. The first engine
    of a process also says, once, what the build lacks: a source build's own report scrolls past in pip's
    hidden output. The test hook ``FP_DCP_FAULT_AT`` (docs/reliability.md) is read here, once per engine."""
    for library in missing():
        log_once(library.absence())
    engine = _make(config)
    fault = os.environ.get(FAULT_ENV)
    engine.fault_at = int(fault) if fault else None
    return engine


def _make(config: IOConfig) -> Engine:
    if config.engine == "threads":
        return ThreadEngine(config)
    if config.engine == "null":
        return NullEngine(config)
    if not _cio.HAVE_IO_URING:
        reason = "fp-dcp was built without liburing"
    else:
        try:
            return UringEngine(config)
        except OSError as e:
            reason = f"io_uring refused by the kernel: {e.strerror}"
    if config.engine == "io_uring":
        raise RuntimeError(f"engine='io_uring' was requested but {reason}")
    log_once(f"fp-dcp: using the threads engine because {reason}")
    engine = ThreadEngine(config)
    engine.fallback_reason = reason
    return engine
