"""Moving bytes from one rank to another over a process group, with bounded memory.

One mechanism serves every use: replication (a rank's new files to its
peers), restore (what a node lacks, from a node that has it), and loads
that read an item once and send it to the other ranks needing it. A
transfer's bytes come from a file or from memory and go to a file or to
memory (``Sink``). A transfer list is the same on every rank; each rank walks it in order, taking part in
the transfers that name it. Since a pair meets at the first transfer either
still has to do, the walk cannot deadlock, and each pair's messages arrive in
order.

Per transfer the sender sends a header (how many bytes follow, or that it
has nothing to send) and then the bytes in chunks of ``chunk`` bytes from two
reused buffers, reading one while the other is on the wire; the receiver
likewise receives one chunk while writing the previous one into its sink.
Memory: four chunks per rank, whatever the files' sizes.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import io
import itertools
import os
import secrets
from collections.abc import Callable, Sequence
from typing import BinaryIO, Protocol

import torch
import torch.distributed as dist

from ..io.files import fsync_directory, fsync_path, start_writeback
from ..units import MiB
from .group import Group

__all__ = [
    "Transfer",
    "Sink",
    "FileSink",
    "MemorySink",
    "MemorySource",
    "Transport",
    "DEFAULT_CHUNK",
    "remove_partials",
]

DEFAULT_CHUNK = 8 * MiB


@dataclasses.dataclass(frozen=True, order=True)
class Transfer:
    """``size`` bytes named ``key`` (e.g. a file's ``step-N/name``) from rank ``src`` to rank ``dst``."""

    key: str
    src: int
    dst: int
    size: int  # the bytes to send (a longer file sends only these)
    parts: tuple[int, ...] = ()  # a stream from memory: the sizes of its pieces, which no message spans

    def messages(self, chunk: int) -> list[tuple[int, int]]:
        """(offset, length) of each message, the same on both sides: at most ``chunk`` bytes, within a part."""
        out = []
        at = 0
        for part in self.parts or (self.size,):
            out += [(at + start, min(chunk, part - start)) for start in range(0, part, chunk)]
            at += part
        return out


class Check(Protocol):
    """What a sink checks the bytes with as they arrive (``fp_dcp.load.stream_check.StreamCheck``)."""

    def feed(self, data: memoryview | bytes) -> None: ...

    def problems(self, where: str) -> list[str]: ...


class Sink(Protocol):
    """Where a received transfer goes."""

    def write(self, data: memoryview) -> None: ...

    def done(self, where: str) -> list[str]:
        """The transfer is complete: keep it if it is intact; returns the problems found."""
        ...

    def abort(self) -> None:
        """The transfer failed: keep nothing of it."""
        ...


class MemorySink:
    """Receives into a buffer of the transfer's size, straight from the wire; checks nothing (the caller does)."""

    def __init__(self, size: int) -> None:
        self.buffer = bytearray(size)
        self._at = 0

    def tensor(self, at: int, n: int) -> torch.Tensor:
        """Bytes ``at`` to ``at + n`` of the buffer, as a tensor to receive into."""
        return torch.frombuffer(self.buffer, dtype=torch.uint8, count=n, offset=at)

    def filled(self, n: int) -> None:
        self._at = n

    def write(self, data: memoryview) -> None:
        self.buffer[self._at : self._at + len(data)] = data
        self._at += len(data)

    def done(self, where: str) -> list[str]:
        return [] if self._at == len(self.buffer) else [f"{where}: {self._at} of {len(self.buffer)} bytes arrived"]

    def abort(self) -> None:
        self.buffer = bytearray()


class MemorySource:
    """Pieces of memory sent one after another as one stream, straight from where they are.

    The transfer's ``parts`` must be the pieces' sizes.
    """

    def __init__(self, pieces: Sequence[memoryview]) -> None:
        self._pieces = [memoryview(p).cast("B") for p in pieces]
        self._starts = list(itertools.accumulate([0] + [len(p) for p in self._pieces]))

    @property
    def parts(self) -> tuple[int, ...]:
        return tuple(len(p) for p in self._pieces)

    def tensor(self, at: int, n: int) -> torch.Tensor:
        """Bytes ``at`` to ``at + n`` of the stream (within one piece), as a tensor to send."""
        k = bisect.bisect_right(self._starts, at) - 1
        offset = at - self._starts[k]
        return torch.frombuffer(self._pieces[k], dtype=torch.uint8, count=n, offset=offset)


class FileSink:
    """Receives one file into ``path``: under a temporary name, checked, then renamed into place.

    Only a file whose bytes passed ``check`` (every item's CRC-32C, its size)
    ever appears under its own name, and it is fsynced with its directory
    first: a copy cut short, or damaged on the way, leaves nothing behind but
    a temporary name that ``remove_partials`` clears.
    """

    PART = ".part"

    def __init__(self, path: str, check: Check) -> None:
        self.path = path
        self.check = check
        self.tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{secrets.token_hex(4)}{self.PART}")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self._file: BinaryIO | None = open(self.tmp, "xb")
        self._written = 0

    def write(self, data: memoryview) -> None:
        """Check and write a chunk, and start its writeback: it goes to the disk while the next one crosses, not
        all of the file at the fsync that publishes it (docs/benchmarks.md, "Hugging Face loads and the memory
        tier")."""
        assert self._file is not None
        self.check.feed(data)
        self._file.write(data)
        self._file.flush()
        start_writeback(self._file.fileno(), self._written, len(data))
        self._written += len(data)

    def abort(self) -> None:
        """Remove the temporary file: the copy will not be published."""
        if self._file is not None:
            self._file.close()
            self._file = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.tmp)

    def done(self, where: str) -> list[str]:
        """Publish the file if it arrived whole and intact; else remove it. Returns the problems found."""
        problems = self.check.problems(where)
        try:
            if self._file is not None:
                self._file.close()
                self._file = None
            if not problems:
                fsync_path(self.tmp)
                os.replace(self.tmp, self.path)
                fsync_directory(os.path.dirname(self.path))
        except OSError as e:
            problems.append(f"cannot store {self.path}: {e}")
        if problems:
            self.abort()
        return problems


def remove_partials(directory: str) -> None:
    """Remove the temporary files of transfers that were cut short (a killed rank) under ``directory``."""
    for parent, _, names in os.walk(directory):
        for name in names:
            if name.startswith(".") and name.endswith(FileSink.PART):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(parent, name))


class Transport:
    """File transfers between the ranks of ``group``."""

    def __init__(self, group: Group, chunk: int = DEFAULT_CHUNK) -> None:
        self.group = group
        self.chunk = chunk
        self._buffers: list[torch.Tensor] = []
        self.sent = 0  # bytes, since this transport was made
        self.received = 0

    def run(
        self,
        transfers: Sequence[Transfer],
        source: Callable[[Transfer], str | MemorySource],
        sink: Callable[[Transfer], Sink],
    ) -> dict[Transfer, list[str]]:
        """Do this rank's part of ``transfers``, in their order.

        ``source(t)`` is what this rank sends ``t`` from: a file's path, or
        memory; ``sink(t)`` where it receives ``t``. Returns, for each
        transfer this rank received, the problems with it ([] when it
        arrived intact and is in place).
        """
        outcome: dict[Transfer, list[str]] = {}
        for t in transfers:
            if t.src == t.dst:
                raise ValueError(f"transfer of {t.key} from rank {t.src} to itself")
            if t.src == self.group.rank:
                self._send(t, source(t))
            elif t.dst == self.group.rank:
                outcome[t] = self._receive(t, sink)
        return outcome

    def _buffer(self, k: int) -> torch.Tensor:
        while len(self._buffers) <= k:
            self._buffers.append(torch.empty(self.chunk, dtype=torch.uint8))
        return self._buffers[k]

    def _send(self, t: Transfer, origin: str | MemorySource) -> None:
        if isinstance(origin, MemorySource):  # straight from memory: no copy
            self.group.send(torch.tensor([t.size], dtype=torch.int64), t.dst).wait()
            works = [self.group.send(origin.tensor(at, n), t.dst) for at, n in t.messages(self.chunk)]
            for work in works:
                work.wait()
            self.sent += t.size
            return
        f: io.BufferedReader | None = None
        try:
            f = open(origin, "rb")
            readable = os.fstat(f.fileno()).st_size >= t.size
        except OSError:
            readable = False
        try:
            self.group.send(torch.tensor([t.size if readable else -1], dtype=torch.int64), t.dst).wait()
            if not readable:
                return
            assert f is not None
            pending: list[dist.Work | None] = [None, None]
            for k, (_, n) in enumerate(t.messages(self.chunk)):
                previous = pending[k % 2]
                if previous is not None:
                    previous.wait()
                buf = self._buffer(k % 2)
                view = buf.numpy().data[:n]
                got = 0
                with contextlib.suppress(OSError):
                    while got < n:
                        r = f.readinto(view[got:])
                        if not r:
                            break
                        got += r
                if got < n:
                    buf[got:n] = 0  # a read error now: the receiver's checks fail on these bytes
                pending[k % 2] = self.group.send(buf[:n], t.dst)
            for last in pending:
                if last is not None:
                    last.wait()
            self.sent += t.size
        finally:
            if f is not None:
                f.close()

    def _receive(self, t: Transfer, sink: Callable[[Transfer], Sink]) -> list[str]:
        header = torch.empty(1, dtype=torch.int64)
        self.group.irecv(header, t.src).wait()
        size = int(header[0])
        if size < 0:
            return [f"rank {t.src} had no readable copy of {t.key} to send"]
        if size != t.size:
            raise RuntimeError(f"rank {t.src} sends {size} bytes for {t.key}, {t.size} expected: the ranks disagree")
        target: Sink | None = None
        problems: list[str] = []
        try:
            target = sink(t)
        except OSError as e:
            problems.append(f"cannot create the copy of {t.key}: {e}")
        messages = t.messages(self.chunk)
        if isinstance(target, MemorySink):  # straight into its memory: no copy
            works = [self.group.irecv(target.tensor(at, n), t.src) for at, n in messages]
            for work in works:
                work.wait()
            target.filled(size)
        else:
            pending = self.group.irecv(self._buffer(2)[: messages[0][1]], t.src) if messages else None
            for k, (_, n) in enumerate(messages):
                assert pending is not None
                pending.wait()
                buf = self._buffer(2 + k % 2)[:n]
                if k + 1 < len(messages):  # the next chunk arrives while this one is written
                    pending = self.group.irecv(self._buffer(2 + (k + 1) % 2)[: messages[k + 1][1]], t.src)
                if target is not None and not problems:
                    try:
                        target.write(buf.numpy().data)
                    except OSError as e:  # keep receiving: the sender's messages must all be taken
                        problems.append(f"cannot write the copy of {t.key}: {e}")
        self.received += size
        if target is None:
            return problems
        if problems:
            target.abort()
            return problems
        return target.done(f"{t.key} (from rank {t.src})")
