"""Read once, share: every stored item that several ranks need is read from storage by one rank only.

The coordinator sees every rank's load plan (``prepare_global_plan``) and
finds the stored items more than one rank reads whole: replicated
parameters and buffers, optimizer state every rank of a new job loads, one
model loaded by every inference worker. (Ranks that each need a different
part of an item read their parts themselves: together that is the item
once.) Each such item gets one reading rank, the bytes balanced over the
ranks (largest items first, each to the rank with the fewest bytes so far,
among the ranks that can open its file: on node-local disks, a rank on the
file's node; a rank that needs it wins ties). The plan each rank gets back
carries the whole exchange, identical everywhere.

At read time the shared items go in windows of at most ``WINDOW`` bytes: in
each, every reading rank reads its items whole (checking their CRC-32C),
then each sends, to each rank that needs some of them, those items' bytes as
one transfer (``fp_dcp.net``, gloo); receivers check every item's CRC-32C
again and copy out the part their plan asks for, so resharding works as
with a plain read. A damaged item is sent as zeros: every rank that needs it
fails, naming it, and the reading rank fails too, after the exchange is over
so that no rank waits forever. Memory: one window of items per rank. In a
format without checksums (``Catalog.checksums`` False) only the reading rank
can tell that an item is damaged (a short file, a failed read); its failure
then fails the load on every rank, through DCP.
"""

from __future__ import annotations

import dataclasses
import io
import math
from collections import defaultdict
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from ..errors import CorruptCheckpointError
from ..format import ItemLocation, describe_item
from ..io.host_threads import ONE_THREAD
from ..net.transport import MemorySink, MemorySource, Transfer, Transport
from ..units import PAGE, MiB
from .catalog import Catalog
from .context import ReadContext
from .pipeline import ReadCounts, read_items
from .targets import fill_from_bytes

__all__ = ["Exchange", "plan_exchange", "read_shared", "WINDOW"]

WINDOW = 64 * MiB

Key = tuple[str, int]  # (file, offset): one stored item


@dataclasses.dataclass(frozen=True)
class Exchange:
    """The shared items of one load: who reads each (``readers``), in the order every rank walks them."""

    readers: dict[Key, int]
    needers: dict[Key, list[int]]
    lengths: dict[Key, int]

    def windows(self) -> list[list[Key]]:
        """The shared items in windows of at most ``WINDOW`` bytes (an item larger than that alone)."""
        out: list[list[Key]] = []
        size = 0
        for key in sorted(self.readers):
            if not out or size + self.lengths[key] > WINDOW:
                out.append([])
                size = 0
            out[-1].append(key)
            size += self.lengths[key]
        return out


def plan_exchange(plans: list[LoadPlan], catalog: Catalog, visible: list[set[str]]) -> Exchange:
    """(coordinator) The items more than one rank's plan reads whole, and which rank reads each from storage.

    ``visible[r]``: the data files rank ``r`` can open; an item is read by a
    rank that sees its file (on node-local disks, one on the file's node).
    """
    needers: dict[Key, list[int]] = defaultdict(list)
    lengths: dict[Key, int] = {}
    for rank, plan in enumerate(plans):
        for req in plan.items:
            if not _whole_item(req, catalog):
                continue  # a part of it: reading just that part from storage costs no more than receiving it
            loc = catalog.location(req)
            key = (loc.file, loc.offset)
            if not needers[key] or needers[key][-1] != rank:
                needers[key].append(rank)
            lengths[key] = loc.length
    shared = {key: ranks for key, ranks in needers.items() if len(ranks) > 1}
    load = [0] * len(plans)
    readers: dict[Key, int] = {}
    for key in sorted(shared, key=lambda k: (-lengths[k], k)):
        seeing = [r for r in range(len(plans)) if key[0] in visible[r]] or list(range(len(plans)))
        rank = min(seeing, key=lambda r: (load[r], r not in shared[key], r))
        readers[key] = rank
        load[rank] += lengths[key]
    return Exchange(readers, shared, {k: lengths[k] for k in shared})


def _whole_item(req: ReadItem, catalog: Catalog) -> bool:
    """Whether ``req`` asks for its stored item whole (an object, or a tensor chunk entire)."""
    if req.type == LoadItemType.BYTE_IO:
        return True
    chunk = catalog.chunks.get((req.storage_index.fqn, tuple(req.storage_index.offset or ())))
    return chunk is not None and not any(req.storage_offsets) and tuple(req.lengths) == tuple(chunk[0])


class _Capture(LoadPlanner):
    """A planner that keeps whole stored items as read (``read_items`` into memory of its own).

    A tensor chunk is read straight into a tensor this planner allocates, so
    its bytes are sent from there without a copy; an object arrives as bytes.
    Those tensors start where their item starts in its file, modulo a page, so
    that the engine can read them in place, not through a staging buffer
    (``_co_aligned``).
    """

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self.got: dict[MetadataIndex, memoryview] = {}

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        index = read_item.storage_index
        sizes, dtype = self.catalog.chunks[(index.fqn, tuple(index.offset or ()))]
        tensor = _co_aligned(sizes, dtype, self.catalog.location(read_item).offset)
        self.got[index] = tensor.reshape(-1).view(torch.uint8).numpy().data.cast("B")
        return tensor

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        """The bytes are already where ``resolve_tensor`` put them."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.got[read_item.storage_index] = memoryview(bytearray(value.getbuffer()))

    def set_up_planner(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    def create_local_plan(self) -> LoadPlan:
        raise NotImplementedError

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        raise NotImplementedError

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        raise NotImplementedError

    def whole(self, index: MetadataIndex) -> ReadItem:
        """A request for a stored item, whole: a tensor chunk as a tensor, an object as bytes."""
        if index.offset is None:
            empty = torch.Size([])
            return ReadItem(LoadItemType.BYTE_IO, index, empty, index, empty, empty)
        sizes, _ = self.catalog.chunks[(index.fqn, tuple(index.offset))]
        zeros = torch.Size([0] * len(sizes))
        return ReadItem(LoadItemType.TENSOR, index, zeros, index, zeros, torch.Size(sizes))


def _co_aligned(sizes: torch.Size, dtype: torch.dtype, file_offset: int) -> torch.Tensor:
    """An empty tensor whose memory agrees with ``file_offset`` modulo a page, where its element size allows:
    torch's allocator aligns to 64 bytes, and a safetensors tensor starts wherever its file's header ends, so a
    plain ``torch.empty`` never agrees with it and every byte would be staged, then copied."""
    nbytes = math.prod(sizes) * dtype.itemsize
    memory = torch.empty(nbytes + PAGE, dtype=torch.uint8)
    shift = (file_offset - memory.data_ptr()) % PAGE
    if shift % dtype.itemsize:
        return torch.empty(sizes, dtype=dtype)
    return memory[shift : shift + nbytes].view(dtype).view(sizes)


def read_shared(
    mine: list[ReadItem],
    exchange: Exchange,
    planner: LoadPlanner,
    catalog: Catalog,
    ctx: ReadContext,
    transport: Transport,
) -> tuple[ReadCounts, int]:
    """This rank's part of the exchange: read what it reads, send and receive, fill its own requests.

    ``mine``: this rank's requests for shared items. Returns the storage
    reads (with the bytes of ``mine``, as needed) and the bytes received from peers. Raises CorruptCheckpointError
    (after the exchange) if an item this rank read or needs is damaged.
    """
    rank = transport.group.rank
    wanted: dict[Key, list[ReadItem]] = defaultdict(list)
    for req in mine:
        loc = catalog.location(req)
        wanted[(loc.file, loc.offset)].append(req)
    index_of = {(loc.file, loc.offset): (index, loc) for index, loc in catalog.locations.items()}
    counts = ReadCounts(0, 0, 0)
    received = needed = 0
    errors: list[str] = []
    for window in exchange.windows():
        data, read = _read_window([k for k in window if exchange.readers[k] == rank], index_of, catalog, ctx, errors)
        counts += read
        received += _send_and_receive(window, exchange, data, transport, errors)
        for key in window:
            for req in wanted.get(key, []):
                try:
                    if key not in data:
                        raise CorruptCheckpointError(
                            f"{describe_item(*index_of[key])}: not read (see the errors above)"
                        )
                    needed += fill_from_bytes(req, planner, catalog, data[key], ctx)
                except CorruptCheckpointError as e:
                    errors.append(f"{e} (read by rank {exchange.readers[key]})")
    if errors:
        raise CorruptCheckpointError("; ".join(dict.fromkeys(errors)))
    return dataclasses.replace(counts, needed=needed), received


def _send_and_receive(
    window: list[Key], exchange: Exchange, data: dict[Key, memoryview], transport: Transport, errors: list[str]
) -> int:
    """Send what this rank read to the ranks needing it, receive what it needs into ``data``; returns bytes received.

    One transfer per (reader, needer) pair of the window, its items back to back.
    """
    pairs: dict[tuple[int, int], list[Key]] = defaultdict(list)
    for key in window:
        for needer in exchange.needers[key]:
            if needer != exchange.readers[key]:
                pairs[(exchange.readers[key], needer)].append(key)
    keys_of = {
        Transfer(
            f"{len(keys)} shared item(s) from {keys[0][0]}",
            src,
            dst,
            sum(exchange.lengths[k] for k in keys),
            tuple(exchange.lengths[k] for k in keys),
        ): keys
        for (src, dst), keys in sorted(pairs.items())
    }
    sinks: dict[Transfer, MemorySink] = {}

    def source(t: Transfer) -> MemorySource:
        # a damaged item goes as zeros: the receivers' checks name it
        return MemorySource([data.get(k, memoryview(bytearray(exchange.lengths[k]))) for k in keys_of[t]])

    def sink(t: Transfer) -> MemorySink:
        sinks[t] = MemorySink(t.size)
        return sinks[t]

    received = 0
    for t, problems in transport.run(list(keys_of), source, sink).items():
        received += t.size
        if problems:
            errors += problems
            continue
        at = 0
        whole = memoryview(sinks[t].buffer)
        for key in keys_of[t]:
            data[key] = whole[at : at + exchange.lengths[key]]
            at += exchange.lengths[key]
    return received


def _read_window(
    keys: list[Key],
    index_of: dict[Key, tuple[MetadataIndex, ItemLocation]],
    catalog: Catalog,
    ctx: ReadContext,
    errors: list[str],
) -> tuple[dict[Key, memoryview], ReadCounts]:
    """The items this rank reads in one window, whole and checked; a damaged one is left out (in ``errors``)."""
    capture = _Capture(catalog)
    # into memory of the capture's own, on the host: checked, copied and checksummed in this thread, not prefaulted
    whole = dataclasses.replace(ctx, host_threads=ONE_THREAD, prefaulter=None, device_loads=None, verify=True)
    try:
        counts = read_items([capture.whole(index_of[k][0]) for k in keys], capture, catalog, whole)
    except CorruptCheckpointError:
        # tell which items are damaged: read them one by one (rare: only a damaged checkpoint gets here)
        capture.got.clear()
        counts = ReadCounts(0, 0, 0)
        for key in keys:
            index = index_of[key][0]
            try:
                counts += read_items([capture.whole(index)], capture, catalog, whole)
            except CorruptCheckpointError as e:
                capture.got.pop(index, None)  # its memory was handed out before its check failed
                errors.append(str(e))
    return {k: capture.got[index_of[k][0]] for k in keys if index_of[k][0] in capture.got}, counts
