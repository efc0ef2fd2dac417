"""The plan of a load's reads: which extent of which file is read, in what order, and where it goes.

Per file, items are visited in storage order, each resolved (``Target``)
``_LOOKAHEAD`` bytes before its reads, its host memory handed to the
prefaulter then. Their byte runs become extents (``io.extents``), holes
between runs read through while that adds at most ``_MAX_WASTE`` to the
bytes read. How a file's runs reach host targets is its ``Placement``; the
files' extents are interleaved, and each goes one ``Route``: read by the
engine into a staging buffer or straight into a target's memory, or, from a
file in memory, copied by the host threads.
"""

from __future__ import annotations

import enum
import itertools
import os
import stat
from collections import defaultdict, deque
from collections.abc import Iterator

from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem

from ..config import IOConfig
from ..errors import CorruptCheckpointError
from ..io.buffers import BufferPool
from ..io.extents import Extent, Piece, interleave, plan_extents
from ..io.files import DataFile, NotRegularFileError, from_memory, in_place, open_file
from ..io.userfault import UserfaultFiller
from .catalog import Catalog
from .context import ReadContext
from .targets import Target

__all__ = ["Placement", "Route", "ReadPlan"]

_MAX_WASTE = 0.05  # read through holes between needed runs while they add at most 5% to the bytes read
# Items are resolved, and their memory handed to the prefaulter, this far ahead of their reads: a second of
# reads on a fast disk, which a fault-in on one helper thread keeps up with (docs/benchmarks.md, "Figures
# behind design comments").
_LOOKAHEAD = 1 << 30


class Placement(enum.Enum):
    """How the runs of a file reach host targets (device targets' always cross through the staging buffers):
    ``IN_PLACE`` straight into the targets' memory; ``HUGE_IN_PLACE`` only the parts the prefaulter asked huge
    pages for, the rest staged (memory in 4 KiB pages caps this disk's requests, memory in 2 MiB ones does
    not); ``STAGED`` every run through the staging buffers."""

    IN_PLACE = "in place"
    HUGE_IN_PLACE = "huge in place"
    STAGED = "staged"

    @classmethod
    def of(cls, config: IOConfig, f: DataFile, pool: BufferPool) -> Placement:
        """``f``'s: in place where ``IOConfig.direct_reads`` and the file allow (``io.files.in_place``); where
        not, on auto, the huge-page parts in place."""
        if in_place(config.direct_reads, f, pool):
            return cls.IN_PLACE
        return cls.HUGE_IN_PLACE if config.direct_reads is None else cls.STAGED


class Route(enum.Enum):
    """Which executor moves an extent."""

    STAGED = "staged"  # the engine reads it into a staging buffer; its parts are copied out as it retires
    IN_PLACE = "in place"  # the engine reads it straight into a host target's memory
    # a file in memory: the host threads copy a run into its target, CRC in the same pass; an extent of small
    # items (host targets only) is read into scratch memory of the load's own and copied out as a staged one is
    FROM_MEMORY = "from memory"


class ReadPlan:
    """The reads of ``requests``: their targets by file, the files opened and checked, and (``extents``) every
    extent in the order it is issued, with its route. ``filler``: the userfaultfd that fills untouched host
    targets page by page, where the load prefaults and no file is read in place; ``close`` closes the files
    and the filler."""

    def __init__(self, requests: list[ReadItem], catalog: Catalog, ctx: ReadContext) -> None:
        self.catalog = catalog
        self.ctx = ctx
        self.verify = ctx.verify and catalog.checksums
        self.by_file: dict[str, list[Target]] = defaultdict(list)
        for req in requests:
            loc = catalog.location(req)
            self.by_file[loc.file].append(Target(req, loc))
        self.files = _open_all([t for targets in self.by_file.values() for t in targets], catalog, ctx.config.direct_io)
        # where each file may end, by path: a safetensors file ends inside its last block
        self.ends = {self.files[name].path: catalog.file_sizes.get(name) for name in self.by_file}
        self.filler: UserfaultFiller | None = None
        try:
            self.placements = {name: Placement.of(ctx.config, self.files[name], ctx.pool) for name in self.by_file}
            self.in_memory = {f.path for f in self.files.values() if from_memory(f)}
            if ctx.prefaulter is not None and Placement.IN_PLACE not in self.placements.values():
                self.filler = UserfaultFiller()  # fills untouched targets page by page: no read goes straight into them
        except BaseException:
            self.close()
            raise

    @property
    def total(self) -> int:
        """The bytes of the stored items asked for."""
        return sum(t.location.length for targets in self.by_file.values() for t in targets)

    @property
    def needed(self) -> int:
        """The bytes of the regions asked for."""
        return sum(t.total for targets in self.by_file.values() for t in targets)

    def extents(self, planner: LoadPlanner) -> Iterator[tuple[DataFile, Extent, Route]]:
        """Every extent to read, the files' in turn, with its route; targets are resolved (through ``planner``)
        as their extents come near, and those with nothing to read are finished."""
        lookahead = _LOOKAHEAD // max(1, len(self.by_file))
        # where the rest is read in place, the staged extents are small items only: from memory, read by the CPU too
        in_place = {self.files[name].path for name, p in self.placements.items() if p is Placement.IN_PLACE}
        streams = []
        for name, targets in self.by_file.items():
            f = self.files[name]
            targets.sort(key=lambda t: t.location.offset)
            ahead = self._ahead(targets, planner, lookahead)
            pieces = _pieces(ahead, self.placements[name])
            align = 1 if f.path in self.in_memory else f.align  # memory takes any offset, also with O_DIRECT
            extents = plan_extents(pieces, align, self.ctx.pool.size, self.ctx.config.direct_min, _MAX_WASTE)
            streams.append(zip(itertools.repeat(f), extents))
        for f, extent in interleave(streams):
            on_host = extent.direct is not None or (
                f.path in in_place and all(part.owner.device is None for part in extent.parts)
            )
            if f.path in self.in_memory and on_host:
                yield f, extent, Route.FROM_MEMORY
            else:
                yield f, extent, Route.STAGED if extent.direct is None else Route.IN_PLACE

    def _ahead(self, targets: list[Target], planner: LoadPlanner, lookahead: int) -> Iterator[Target]:
        """The targets, each resolved ``lookahead`` bytes before it is yielded, its host memory handed to the
        prefaulter then, so that its pages are in before its reads (or registered with the filler, where there
        is one: every read is staged); targets with nothing to read are finished."""
        prefaulter = self.ctx.prefaulter
        waiting: deque[Target] = deque()
        queued = 0
        for target in targets:
            target.resolve(planner, self.catalog, self.ctx, self.verify)
            if not target.total:
                waiting.append(target)
                continue
            if prefaulter is not None and target.device is None:
                target.prepared = prefaulter.prepare(target.memory, self.filler)
            waiting.append(target)
            queued += target.total
            while waiting and queued - waiting[0].total >= lookahead:
                queued -= waiting[0].total
                yield from _ready(waiting.popleft(), planner)
        while waiting:
            yield from _ready(waiting.popleft(), planner)

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        if self.filler is not None:
            self.filler.close()  # after the last copy: no page of a target waits on a fill from here on


def _ready(target: Target, planner: LoadPlanner) -> Iterator[Target]:
    if target.total:
        yield target
    else:
        target.finish(planner)


def _pieces(targets: Iterator[Target], placement: Placement) -> Iterator[Piece]:
    """The targets' runs, in order, those of host targets with their memory where ``placement`` reads them in
    place."""
    for target in targets:
        memory = target.memory if placement is not Placement.STAGED and target.device is None else None
        direct = [(0, target.total)] if placement is Placement.IN_PLACE else target.prepared.huge
        at = 0
        for start, length in target.runs:
            for lo, hi, inside in _cut(at, at + length, direct if memory is not None else []):
                run = memory[lo:hi] if inside and memory is not None else None
                yield Piece(target.location.offset + start + lo - at, hi - lo, target, lo, run)
            at += length


def _cut(lo: int, hi: int, spans: list[tuple[int, int]]) -> Iterator[tuple[int, int, bool]]:
    """``[lo, hi)`` cut at the edges of ``spans`` (sorted ``(offset, length)``): (start, end, inside a span)."""
    for offset, length in spans:
        start, end = max(lo, offset), min(hi, offset + length)
        if start >= end:
            continue
        if start > lo:
            yield lo, start, False
        yield start, end, True
        lo = end
    if lo < hi:
        yield lo, hi, False


def _open_all(targets: list[Target], catalog: Catalog, direct: bool | None) -> dict[str, DataFile]:
    files: dict[str, DataFile] = {}
    sizes: dict[str, int] = {}
    try:
        for target in targets:
            name = target.location.file
            if name in files:
                continue
            path = catalog.paths.get(name)
            if path is None:
                raise CorruptCheckpointError(
                    f"the checkpoint footer does not list data file {name}, which holds {target.describe()}"
                )
            try:
                f = open_file(path, create=False, direct=direct)
            except FileNotFoundError:
                raise CorruptCheckpointError(f"data file {path} is missing; it holds {target.describe()}") from None
            except NotRegularFileError as e:
                raise CorruptCheckpointError(
                    f"data file {path} is {e.strerror}, not a regular file; it holds {target.describe()}"
                ) from None
            files[name] = f
            status = os.fstat(f.fd)
            if not stat.S_ISREG(status.st_mode):  # a directory where the rules find the file
                raise CorruptCheckpointError(f"data file {path} is not a regular file; it holds {target.describe()}")
            sizes[name] = status.st_size
            expected = catalog.file_sizes.get(name)
            if expected is not None and sizes[name] < expected:
                raise CorruptCheckpointError(
                    f"data file {path} is truncated: {sizes[name]} bytes, written as {expected}; "
                    f"it holds {target.describe()}"
                )
        for target in targets:
            if sizes[target.location.file] < target.location.offset + target.location.length:
                raise CorruptCheckpointError(
                    f"data file {target.location.file} ends before the end of {target.describe()}"
                )
    except BaseException:
        for f in files.values():
            f.close()
        raise
    return files
