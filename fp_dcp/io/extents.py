"""From item byte ranges to aligned disk transfers, and the window that runs them.

Both pipelines describe a file as ``Piece``s, byte ranges of items in file
order, and turn them into ``Extent``s, the transfers the engine performs:

- a *direct* extent moves an aligned run of an item straight between its
  memory and the file; it is used where the item's memory address and file
  offset agree modulo the alignment and the run is long enough to matter;
- a *staged* extent moves up to one staging buffer: the buffer holds the
  bytes of one or more ``Part``s at their file positions, and the rest of it
  (alignment gaps, padding) is zeros.

Extents start and end on the alignment, so O_DIRECT accepts them. A
``Window`` keeps several extents in flight and retires them oldest first,
which keeps each item's bytes, and so its running checksum, in order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple, TypeVar

from .._native import _cio
from ..units import PAGE
from .buffers import BufferPool
from .engine import Engine, Ticket
from .progress import Progress

T = TypeVar("T")

__all__ = ["Piece", "Part", "Direct", "Extent", "plan_extents", "interleave", "Window"]


class Piece(NamedTuple):
    """Bytes ``[owner_offset, owner_offset + length)`` of an item live at ``file_offset``.

    ``memory`` is exactly those bytes of the item when they may be transferred
    in place, else None.
    """

    file_offset: int
    length: int
    owner: Any
    owner_offset: int
    memory: memoryview | None


class Part(NamedTuple):
    """Bytes of an item at ``buf_offset`` in a staged extent's buffer."""

    owner: Any
    owner_offset: int
    buf_offset: int
    length: int


class Direct(NamedTuple):
    """An item run moved in place: bytes from ``owner_offset`` of ``owner``, whose memory is ``memory``."""

    owner: Any
    owner_offset: int
    memory: memoryview


class Extent(NamedTuple):
    file_offset: int
    length: int
    parts: list[Part]  # staged extents: what the buffer holds
    direct: Direct | None  # direct extents: the run moved in place

    @property
    def payload(self) -> int:
        """The item bytes it moves, without alignment gaps and padding."""
        return self.direct.memory.nbytes if self.direct else sum(p.length for p in self.parts)


def _align_down(n: int, a: int) -> int:
    return n - n % a


def plan_extents(
    pieces: Iterable[Piece], align: int, capacity: int, direct_min: int, max_waste: float | None
) -> Iterator[Extent]:
    """Aligned extents covering ``pieces`` (sorted by file offset).

    ``max_waste`` None means writing: pieces never overlap, and the bytes
    between them inside an extent are padding (blocks between extents are
    not written at all). A fraction means reading: a hole between pieces is
    read through (one request instead of two) only while the holes read so far
    stay within that fraction of the bytes needed; longer holes are skipped.
    Pieces may overlap when reading; overlapping blocks are then read twice.
    """
    start = -1  # file offset of the staged extent being filled; -1: none
    end = 0  # end of the data placed in it
    parts: list[Part] = []
    needed = 0  # bytes of pieces seen so far
    waste = 0  # hole bytes read through so far

    def flush() -> Iterator[Extent]:
        # End at the block holding the last byte placed: what lies beyond, up to the
        # next extent, is left alone (zeros from preallocation when writing).
        nonlocal start, parts
        if parts:
            yield Extent(start, -(-end // align) * align - start, parts, None)
        start, parts = -1, []

    def stage(offset: int, length: int, owner: Any, owner_offset: int) -> Iterator[Extent]:
        nonlocal start, end, waste
        while length:
            if start >= 0 and max_waste is not None:
                # Blocks already covered by alignment cost nothing to read through.
                hole = _align_down(offset, align) - -(-end // align) * align
                if offset < end or (hole > 0 and waste + hole > max_waste * needed):
                    yield from flush()
                elif hole > 0:
                    waste += hole
            if start >= 0 and offset >= start + capacity:
                yield from flush()
            if start < 0:
                start = _align_down(offset, align)
            take = min(length, start + capacity - offset)
            parts.append(Part(owner, owner_offset, offset - start, take))
            end = offset + take
            offset += take
            owner_offset += take
            length -= take
            if end == start + capacity:
                yield from flush()

    for p in pieces:
        offset, length, owner, owner_offset, memory = p
        needed += length
        if memory is not None and length >= direct_min and (_cio.address(memory) - offset) % align == 0:
            head = -offset % align
            body = _align_down(length - head, align)
            if body >= direct_min:
                yield from stage(offset, head, owner, owner_offset)
                yield from flush()
                yield Extent(offset + head, body, [], Direct(owner, owner_offset + head, memory[head : head + body]))
                offset, length, owner_offset = offset + head + body, length - head - body, owner_offset + head + body
        yield from stage(offset, length, owner, owner_offset)
    yield from flush()


def interleave(streams: Iterable[Iterator[T]]) -> Iterator[T]:
    """Items of several iterators in turn, one from each, until all are exhausted.

    Files on different devices then have transfers in flight at the same time.
    """
    active = list(streams)
    while active:
        for stream in list(active):
            try:
                yield next(stream)
            except StopIteration:
                active.remove(stream)


class Window:
    """Extents in flight, retired oldest first.

    Staged extents get their memory from ``stage``, which carves it out of one
    pool buffer after another, so many small extents share a buffer; a buffer
    returns to the pool once every extent carved from it has retired.
    ``retire(extent, staged)`` runs after an extent's transfer completed (the
    read pipeline copies out there); ``progress`` counts the item bytes moved. ``abort`` waits out everything in flight
    and reclaims all buffers, so no transfer can outlive a failed save or load.
    """

    def __init__(
        self,
        engine: Engine,
        pool: BufferPool,
        retire: Callable[[Extent, memoryview | None], None],
        depth: int,
        progress: Progress,
    ) -> None:
        self.engine = engine
        self.pool = pool
        self.retire = retire
        self.depth = depth
        self.progress = progress
        self.inflight: deque[tuple[Ticket, Extent, memoryview | None, memoryview | None]] = deque()
        self.arena: memoryview | None = None  # the pool buffer being carved
        self.used = 0
        self.users: dict[int, int] = {}  # id(pool buffer) -> extents in flight carved from it

    def stage(self, nbytes: int) -> memoryview:
        """``nbytes`` (at most a buffer) of page-aligned staging memory for the next ``push``."""
        start = -(-self.used // PAGE) * PAGE  # every carve page-aligned: files may differ in alignment
        if self.arena is None or start + nbytes > len(self.arena):
            self._next_arena()
            start = 0
        assert self.arena is not None
        self.used = start + nbytes
        return self.arena[start : self.used]

    def _next_arena(self) -> None:
        old, self.arena = self.arena, None
        if old is not None and not self.users[id(old)]:
            self.pool.free.append(old)
        while not self.pool.free:
            self._retire_oldest()
        self.arena = self.pool.free.pop()
        self.users[id(self.arena)] = 0
        self.used = 0

    def push(self, ticket: Ticket, extent: Extent, staged: memoryview | None) -> None:
        """Track a transfer; ``staged`` is the memory ``stage`` just returned for it, if any."""
        arena = self.arena if staged is not None else None
        if arena is not None:
            self.users[id(arena)] += 1
        self.inflight.append((ticket, extent, staged, arena))
        while len(self.inflight) > self.depth:
            self._retire_oldest()

    def _retire_oldest(self) -> None:
        ticket, extent, staged, arena = self.inflight[0]
        self.engine.wait(ticket)  # on failure the extent stays for abort() to reclaim
        self.inflight.popleft()
        self.count(extent)
        try:
            self.retire(extent, staged)
        finally:
            if arena is not None:
                self.users[id(arena)] -= 1
                if not self.users[id(arena)] and arena is not self.arena:
                    self.pool.free.append(arena)

    def settle(self) -> None:
        """Retire every transfer in flight."""
        while self.inflight:
            self._retire_oldest()

    def count(self, extent: Extent) -> None:
        """Count ``extent``'s item bytes as moved: as it retires, or where the caller moved them itself (after
        ``settle``, so that retires keep file order)."""
        self.progress.advance(extent.payload)

    def finish(self) -> None:
        self.settle()
        self.progress.finish()
        if self.arena is not None:
            self.pool.free.append(self.arena)
            self.arena = None

    def abort(self) -> None:
        self.engine.drain()
        self.inflight.clear()
        self.arena = None
        self.pool.free[:] = self.pool.views
