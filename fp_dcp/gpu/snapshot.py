"""A whole state dict copied into one page-locked host arena (``FastPersistWriter(mode="snapshot")``).

Training may change the parameters as soon as the copy is done; the save
then writes from the arena, possibly over several steps. The arena is kept
and reused across saves while the tensors keep their shapes.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import torch

from .. import compat
from ..format import SMALL_ALIGN
from ..tensors import plain_layout
from ..units import PAGE, align_up
from .memory import HostArea, SideStream
from .route import DeviceRoute

__all__ = ["local_tensor", "leaves", "rebuild", "Snapshot"]


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor holding this rank's elements (a DTensor's local shard)."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def leaves(obj: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], torch.Tensor]]:
    """(path, tensor) of every tensor in nested dicts, lists and tuples, in a fixed order."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from leaves(value, (*path, key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from leaves(value, (*path, i))


def rebuild(obj: Any, copies: Iterator[torch.Tensor]) -> Any:
    """``obj`` with its tensors replaced by ``copies`` (in ``leaves`` order) and other values deep-copied."""
    if isinstance(obj, torch.Tensor):
        host = next(copies)
        if local_tensor(obj) is obj:
            return host
        return compat.dtensor_with_local(obj, host)
    if isinstance(obj, dict):
        return {key: rebuild(value, copies) for key, value in obj.items()}
    if isinstance(obj, list):
        return [rebuild(value, copies) for value in obj]
    if isinstance(obj, tuple):
        return tuple(rebuild(value, copies) for value in obj)
    return copy.deepcopy(obj)


class Snapshot:
    """A host copy of a state dict in one page-aligned arena, reused while the tensors stay alike.

    The arena is laid out once per set of (path, dtype, shape, device): each
    device's small tensors together (so that they are gathered and cross the
    bus in a few copies), then the large ones on page boundaries (so they are
    written to disk in place). It is page-locked when any tensor is on a GPU.
    Its tensors are valid until the next ``take``. It has side streams and
    scratch of its own, so a snapshot never shares device memory with a save
    streaming at the same time.
    """

    def __init__(self, route: DeviceRoute) -> None:
        self.route = route  # which tensors are copied from a device, and which memory is page-locked
        self.config = route.config
        self.gather = route.gather()
        self.streams: dict[torch.device, SideStream] = {}
        self.key: tuple[Any, ...] | None = None
        self.arena: HostArea | None = None
        self.offsets: list[int] = []
        self.copies: list[torch.Tensor] = []

    def _allocate(self, tensors: list[torch.Tensor]) -> None:
        self.close()
        small = min(self.config.gather_max, self.config.buffer_size)
        sizes = [t.numel() * t.element_size() for t in tensors]
        order = sorted(range(len(tensors)), key=lambda i: (sizes[i] > small, str(tensors[i].device)))
        self.offsets = [0] * len(tensors)
        cursor = 0
        for i in order:
            cursor = align_up(cursor, PAGE if sizes[i] > small else SMALL_ALIGN)
            self.offsets[i] = cursor
            cursor += sizes[i]
        devices = {t.device for t in tensors if self.route.on_device(t)}
        self.arena = HostArea(cursor, page_locked=any(map(self.route.page_locks, devices)))
        arena = self.arena.tensor
        self.copies = [
            arena[o : o + n].view(t.dtype).reshape(t.shape) if n else torch.empty(t.shape, dtype=t.dtype)
            for t, o, n in zip(tensors, self.offsets, sizes, strict=True)
        ]

    def take(self, state_dict: Any, ready: dict[torch.device, torch.cuda.Event]) -> Any:
        """Copy ``state_dict`` into the arena; return it rebuilt around the copies."""
        found = list(leaves(state_dict))
        tensors = [local_tensor(t) for _, t in found]
        key = tuple((path, t.dtype, tuple(t.shape), t.device) for (path, _), t in zip(found, tensors, strict=True))
        if key != self.key:
            self._allocate(tensors)
            self.key = key
        events = []
        by_device: dict[torch.device, list[int]] = {}
        for i, t in enumerate(tensors):
            if not self.route.on_device(t):
                self.copies[i].copy_(t)  # materializes conjugate and negative views too
            elif t.numel():
                by_device.setdefault(t.device, []).append(i)
        keep: list[Any] = []
        for device, indices in by_device.items():
            if device not in self.streams:
                self.streams[device] = SideStream(device, self.config.buffer_size, self.route.page_locks(device))
            side = self.streams[device]
            side.wait_for(ready.get(device) or side.caller_event())
            with side.context():
                self._copy_device(side, [tensors[i] for i in indices], indices, keep)
                events.append(side.record())
        for event in events:
            if event is not None:
                event.synchronize()
        return rebuild(state_dict, iter(self.copies))

    def _copy_device(self, side: SideStream, tensors: list[torch.Tensor], indices: list[int], keep: list[Any]) -> None:
        small = min(self.config.gather_max, side.capacity)
        assert self.arena is not None
        arena = self.arena.tensor
        rounds: list[list[tuple[torch.Tensor, int]]] = []
        base = -1
        for t, i in sorted(zip(tensors, indices, strict=True), key=lambda ti: self.offsets[ti[1]]):
            nbytes = t.numel() * t.element_size()
            if nbytes > small or not plain_layout(t):
                self.copies[i].copy_(t, non_blocking=True)
                continue
            if base < 0 or self.offsets[i] + nbytes - base > side.capacity:
                rounds.append([])
                base = self.offsets[i]
            rounds[-1].append((t.reshape(-1).view(torch.uint8), self.offsets[i]))
        keep.append(tensors)
        for segments in rounds:
            # Same stream: round k+1's gather into the scratch waits for round k's copy out of it.
            start = segments[0][1]
            end = segments[-1][1] + segments[-1][0].numel()
            self.gather(side, [(data, offset - start) for data, offset in segments], side.scratch, keep)
            arena[start:end].copy_(side.scratch[: end - start], non_blocking=True)

    def close(self) -> None:
        for side in self.streams.values():
            side.close()
        self.streams.clear()
        self.copies = []
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        self.key = None
