"""GPU staging: device-to-host copies on a side stream, and the async-save protocol.

Two ways GPU tensors reach the disk (``FastPersistWriter(mode=...)``; see
docs/gpu.md for the trade-off):

- **streaming** (``Session``): the write pipeline (``fp_dcp.packer``) hands
  each staging buffer's GPU parts to ``Session.issue``; they are copied
  device-to-host on a dedicated CUDA stream straight into the writer's pool
  buffers (page-locked with cudaHostRegister), in pieces of ``staging_chunk``
  bytes so that the checksum of one piece overlaps the copy of the next, while
  the buffers filled before are on their way to disk. Small parts sharing a
  buffer are first gathered on the GPU (``cuda/gather.cu``) and cross the bus
  in one copy. Host memory: the pool, whatever the size of the state.
- **snapshot** (``Snapshot``): the whole state is copied into one page-locked
  host arena, kept and reused across saves while the tensors keep their
  shapes; the save then writes from it, and training may go on as soon as the
  copy is done.

Stream semantics: a side stream waits for an event recorded on the stream
that produced the values (the caller's current stream when the save starts),
never the other way round, so training kernels are not held up by it; every
source tensor, and every buffer a copy reads or writes, stays referenced until
the host has waited for that copy's event.

``Session`` also carries, for every save (CPU tensors included), the two
controls the pipeline honours: cancellation (``check``) and the signal that
the pipeline has read every source (``released``). ``AsyncSaves`` turns them
into the ``AsyncStager`` protocol of ``dcp.async_save``.
"""

from __future__ import annotations

import copy
import functools
import importlib
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from . import _cio
from .buffers import BufferPool
from .config import IOConfig
from .engine import log_once
from .errors import CheckpointError
from .extents import Extent, Part
from .format import PAGE, SMALL_ALIGN, align_up
from .tensors import ByteSource

__all__ = ["Mode", "SaveCancelledError", "ready_events", "Staging", "Session", "Batch", "Snapshot", "AsyncSaves"]

Mode = Literal["streaming", "snapshot"]

# The kernel source lives in the source tree's cuda/ folder (not a Python package).
KERNEL_SOURCE = Path(__file__).resolve().parent.parent / "cuda" / "gather.cu"
_KERNEL_NAME = "fp_dcp_gather"
_THREADS_PER_BLOCK = 256
_MAX_BLOCKS = 8192
_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every CUDA context
_WATCH_PERIOD = 0.05  # seconds between looks at a save thread that may have died


class SaveCancelledError(CheckpointError):
    """The save was stopped by ``FastPersistWriter.cancel()``; nothing of it was published."""


# ------------------------------------------------------------------ host memory


def _cudart() -> Any:
    return torch.cuda.cudart()  # type: ignore[no-untyped-call]  # (unannotated in torch)


def _pin(view: memoryview) -> None:
    """Page-lock host memory for the GPU, so that copies into it run asynchronously at full speed."""
    err = int(_cudart().cudaHostRegister(_cio.address(view), len(view), _HOST_REGISTER_PORTABLE))
    if err:
        # Raised, not logged: the runtime keeps the error as its "last error", and
        # torch would report it later against an unrelated kernel launch.
        raise RuntimeError(f"cudaHostRegister of {len(view)} bytes of staging memory failed (CUDA error {err})")


def _unpin(view: memoryview) -> None:
    _cudart().cudaHostUnregister(_cio.address(view))


class _HostArea:
    """One page-aligned, populated host buffer (a one-buffer ``BufferPool``), page-locked when ``pin``."""

    def __init__(self, nbytes: int, pin: bool) -> None:
        self.pool = BufferPool(align_up(max(nbytes, 1), PAGE), 1)
        self.view = self.pool.views[0]
        self.pinned = False
        if pin:
            _pin(self.view)
            self.pinned = True
        self.tensor = torch.frombuffer(self.view, dtype=torch.uint8)

    def close(self) -> None:
        if self.pinned:
            _unpin(self.view)
            self.pinned = False
        del self.tensor
        self.pool.close()


# ------------------------------------------------------------------ devices


class _Lane:
    """A device's side stream and the scratch memory gathers need.

    For a CPU "device" (tests route CPU tensors through the staging engine)
    there is no stream: copies are synchronous and events are None.
    """

    def __init__(self, device: torch.device, capacity: int) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # type: ignore[no-untyped-call]
        self.capacity = capacity
        self._landing: _HostArea | None = None
        self._scratch: torch.Tensor | None = None

    def context(self) -> AbstractContextManager[Any]:
        """Make the side stream current for this device (work queued inside runs on it)."""
        return torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()

    def record(self) -> torch.cuda.Event | None:
        if self.stream is None:
            return None
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self.stream)
        return event

    def wait_for(self, event: torch.cuda.Event | None) -> None:
        if self.stream is not None and event is not None:
            self.stream.wait_event(event)

    @property
    def landing(self) -> _HostArea:
        """Host memory (page-locked) that a gather's one device-to-host copy lands in."""
        if self._landing is None:
            self._landing = _HostArea(self.capacity, pin=self.stream is not None)
        return self._landing

    @property
    def scratch(self) -> torch.Tensor:
        """Device memory the gather writes into, allocated on the side stream (stream-ordered reuse)."""
        if self._scratch is None:
            with self.context():
                self._scratch = torch.empty(self.capacity, dtype=torch.uint8, device=self.device)
        return self._scratch

    def close(self) -> None:
        if self._landing is not None:
            self._landing.close()
            self._landing = None
        self._scratch = None


def ready_events(state_dict: Any) -> dict[torch.device, torch.cuda.Event]:
    """An event on the current stream of every CUDA device holding a tensor of ``state_dict``.

    Recorded where the save is requested: whatever that thread's streams have
    queued so far (the step that produced the values) completes before a side
    stream copies anything.
    """
    events = {}
    for _, tensor in _leaves(state_dict):
        device = _local(tensor).device
        if device.type == "cuda" and device not in events:
            events[device] = torch.cuda.current_stream(device).record_event()
    return events


# ------------------------------------------------------------------ gather


class _Gather:
    """Copies device segments to offsets of one device buffer.

    The ``cuda/gather.cu`` kernel does it in one launch, compiled at run time
    through cupy (an optional dependency: ``pip install fp-dcp[cuda]``) when
    cupy and the kernel source are present; otherwise, and on CPU, each
    segment is one copy on the side stream (still one transfer to the host).
    """

    def __init__(self) -> None:
        self._functions: dict[int, Any] = {}
        self._cupy: Any = None
        self.backend = "copies"
        try:
            cupy = importlib.import_module("cupy")  # optional: pip install fp-dcp[cuda]
        except ImportError:
            self.backend = "copies (cupy is not installed)"
            return
        if not KERNEL_SOURCE.exists():
            self.backend = "copies (cuda/gather.cu is not in this installation)"
            return
        self._cupy = cupy
        self.backend = "cuda/gather.cu through cupy"

    def _function(self, index: int) -> Any:
        """The kernel for device ``index``, compiled on first use; None (logged once) if cupy cannot build it."""
        if index not in self._functions:
            try:
                with self._cupy.cuda.Device(index):
                    module = self._cupy.RawModule(code=KERNEL_SOURCE.read_text(), options=("--std=c++14",))
                    self._functions[index] = module.get_function(_KERNEL_NAME)
            except Exception as e:  # e.g. cupy without NVRTC: copies are slower, not wrong
                self.backend = f"copies (cupy could not build cuda/gather.cu: {e})"
                log_once(f"fp-dcp: {self.backend}")
                self._functions[index] = None
        return self._functions[index]

    def __call__(
        self, lane: _Lane, segments: list[tuple[torch.Tensor, int]], out: torch.Tensor, keep: list[Any]
    ) -> None:
        """Queue the copies of ``(source bytes, offset in out)`` on the lane's stream (the current one)."""
        stream, kernel, index = lane.stream, None, 0
        if self._cupy is not None and stream is not None:
            index = lane.device.index if lane.device.index is not None else torch.cuda.current_device()
            kernel = self._function(index)
        if kernel is None or stream is None:
            for source, offset in segments:
                out[offset : offset + source.numel()].copy_(source)
            return
        table = np.empty((len(segments), 3), dtype=np.uint64)  # struct fp_dcp_segment
        for row, (source, offset) in zip(table, segments, strict=True):
            row[:] = (source.data_ptr(), offset, source.numel())
        device_table = torch.from_numpy(table.view(np.int64)).to(lane.device, non_blocking=True)
        keep += [table, device_table]
        cupy = self._cupy
        with cupy.cuda.Device(index), cupy.cuda.ExternalStream(stream.cuda_stream, index):
            kernel(
                (min(len(segments), _MAX_BLOCKS),),
                (_THREADS_PER_BLOCK,),
                (np.uint64(device_table.data_ptr()), np.uint32(len(segments)), np.uint64(out.data_ptr())),
            )


# ------------------------------------------------------------------ the engine


class Staging:
    """A writer's staging engine: side streams, page-locked buffers, the gather kernel, the snapshot.

    Created cheaply with the writer; CUDA is touched only once a save holds
    GPU tensors. ``device_of`` and ``flat`` decide which sources it copies
    (CUDA tensors); tests override them to run the same code on CPU tensors.
    """

    def __init__(self, config: IOConfig) -> None:
        self.config = config
        self.snapshot = Snapshot(self)
        self._lanes: dict[torch.device, _Lane] = {}
        self._pinned: list[memoryview] = []  # pool buffers page-locked for the GPU
        self._pinned_pool: BufferPool | None = None
        self._gather: _Gather | None = None

    def device_of(self, source: ByteSource) -> torch.device | None:
        """The device this engine copies ``source`` from, or None when the host pipeline reads it."""
        return source.device_tensor.device if source.device_tensor is not None else None

    def flat(self, source: ByteSource) -> torch.Tensor | None:
        """The source's bytes as one flat uint8 tensor on its device, or None if they are not contiguous there."""
        t = source.device_tensor
        if t is None or not t.is_contiguous() or t.is_conj() or t.is_neg():
            return None
        return t.reshape(-1).view(torch.uint8)

    def lane(self, device: torch.device) -> _Lane:
        lane = self._lanes.get(device)
        if lane is None:
            lane = self._lanes[device] = _Lane(device, self.config.buffer_size)
        return lane

    def gather(self) -> _Gather:
        if self._gather is None:
            self._gather = _Gather()
        return self._gather

    @property
    def gather_backend(self) -> str:
        """How small GPU tensors are coalesced here (the kernel through cupy, or plain copies, and why)."""
        return self.gather().backend

    def pin(self, pool: BufferPool) -> None:
        """Page-lock the writer's pool buffers once, so device-to-host copies into them are asynchronous."""
        if pool is self._pinned_pool:
            return
        self._unpin_pool()
        for view in pool.views:
            _pin(view)
            self._pinned.append(view)
        self._pinned_pool = pool

    def _unpin_pool(self) -> None:
        for view in self._pinned:
            _unpin(view)
        self._pinned.clear()
        self._pinned_pool = None

    def session(
        self,
        ready: dict[torch.device, torch.cuda.Event] | None = None,
        on_released: Callable[[], None] | None = None,
        cancel: threading.Event | None = None,
    ) -> Session:
        return Session(self, ready or {}, on_released, cancel)

    def close(self) -> None:
        """Release page-locked memory and device scratch; call before the pool is unmapped."""
        self.snapshot.close()
        for lane in self._lanes.values():
            lane.close()
        self._lanes.clear()
        self._unpin_pool()


def _crc(owner: Any, region: memoryview) -> None:
    owner.crc = _cio.crc32c(region, owner.crc)


def _copy_crc(owner: Any, region: memoryview, landed: memoryview) -> None:
    owner.crc = _cio.copy_crc32c(region, landed, owner.crc)


def _copy_through_host(lane: _Lane, part: Part, region: memoryview) -> None:
    # Not contiguous on the device: the host path materializes it slab by slab,
    # here on the side stream, so it is ordered after the values were produced.
    with lane.context():
        part.owner.crc = part.owner.source.copy_into(region, part.owner_offset, part.owner.crc)


class Batch:
    """The device-to-host copies of one staging buffer's GPU parts, in flight until ``complete``."""

    def __init__(self) -> None:
        self.owners: set[int] = set()
        self.steps: list[tuple[torch.cuda.Event | None, Callable[[], None]]] = []
        self.keep: list[Any] = []  # what the queued copies read or write: referenced until they are done

    def __contains__(self, owner: object) -> bool:
        return id(owner) in self.owners

    def then(self, event: torch.cuda.Event | None, action: Callable[[], None]) -> None:
        """Run ``action`` (a checksum, a copy out of the landing area) once ``event`` has completed."""
        self.steps.append((event, action))

    def complete(self) -> None:
        """Wait for each copy in turn and checksum what it brought, while later copies still run."""
        for event, action in self.steps:
            if event is not None:
                event.synchronize()
            action()
        self.steps.clear()
        self.keep.clear()

    def wait(self) -> None:
        """Only wait for the copies (failure paths): no transfer may outlive the buffer it writes."""
        for event, _ in self.steps:
            if event is not None:
                event.synchronize()


class Session:
    """One save's use of the staging engine, and the save's controls for the write pipeline."""

    def __init__(
        self,
        staging: Staging,
        ready: dict[torch.device, torch.cuda.Event],
        on_released: Callable[[], None] | None,
        cancel: threading.Event | None,
    ) -> None:
        self.staging = staging
        self.ready = ready
        self.on_released = on_released
        self.cancel = cancel
        self.devices: set[torch.device] = set()

    def prepare(self, pool: BufferPool, sources: Iterable[ByteSource]) -> None:
        """Before the first transfer: side streams wait for the values; the pool gets page-locked."""
        staging = self.staging
        self.devices = {d for d in map(staging.device_of, sources) if d is not None}
        if any(d.type == "cuda" for d in self.devices):
            staging.pin(pool)
        for device in self.devices:
            event = self.ready.get(device)
            if event is None and device.type == "cuda":  # dcp.save: this thread's stream made the values
                event = torch.cuda.current_stream(device).record_event()
            staging.lane(device).wait_for(event)

    def check(self) -> None:
        """Raise ``SaveCancelledError`` once ``FastPersistWriter.cancel()`` was called."""
        if self.cancel is not None and self.cancel.is_set():
            raise SaveCancelledError("the save was cancelled (FastPersistWriter.cancel()); nothing was published")

    def released(self) -> None:
        """The pipeline has read every source's memory: parameters may change from now on."""
        if self.on_released is not None:
            self.on_released()
            self.on_released = None

    def issue(self, buffer: memoryview, extent: Extent) -> Batch | None:
        """Queue the copies of the extent's GPU parts into ``buffer``; None when it has none.

        The parts are then this batch's: the caller fills the other parts on
        the host meanwhile, and ``complete`` checksums these.
        """
        if not self.devices:
            return None
        staging = self.staging
        parts = [p for p in extent.parts if staging.device_of(p.owner.source) is not None]
        if not parts:
            return None
        batch = Batch()
        gather_max = min(staging.config.gather_max, staging.config.buffer_size)
        small: dict[_Lane, list[tuple[Part, torch.Tensor]]] = {}
        single: list[tuple[_Lane, Part, torch.Tensor]] = []
        for part in parts:
            batch.owners.add(id(part.owner))
            source = part.owner.source
            device = staging.device_of(source)
            assert device is not None
            lane = staging.lane(device)
            flat = staging.flat(source)
            if flat is None:
                region = buffer[part.buf_offset : part.buf_offset + part.length]
                batch.then(None, functools.partial(_copy_through_host, lane, part, region))
                continue
            data = flat[part.owner_offset : part.owner_offset + part.length]
            if part.length <= gather_max:
                small.setdefault(lane, []).append((part, data))
            else:
                single.append((lane, part, data))
        for lane, group in small.items():
            if len(group) == 1:  # nothing to coalesce
                single.append((lane, *group[0]))
            else:
                self._gather(batch, buffer, lane, group)
        for lane, part, data in single:
            self._copy(batch, buffer, lane, part, data)
        return batch

    def _gather(self, batch: Batch, buffer: memoryview, lane: _Lane, group: list[tuple[Part, torch.Tensor]]) -> None:
        # Parts keep their buffer offsets in the device scratch and in the landing
        # area (both one buffer long); the span between the first and last crosses
        # in one copy, and each part is then copied into place with its checksum.
        start = group[0][0].buf_offset
        end = group[-1][0].buf_offset + group[-1][0].length
        landing = lane.landing
        with lane.context():
            self.staging.gather()(lane, [(data, part.buf_offset) for part, data in group], lane.scratch, batch.keep)
            landing.tensor[start:end].copy_(lane.scratch[start:end], non_blocking=True)
            event = lane.record()
        batch.keep += [data for _, data in group]
        for part, _ in group:
            lo, hi = part.buf_offset, part.buf_offset + part.length
            batch.then(event, functools.partial(_copy_crc, part.owner, buffer[lo:hi], landing.view[lo:hi]))

    def _copy(self, batch: Batch, buffer: memoryview, lane: _Lane, part: Part, data: torch.Tensor) -> None:
        chunk = self.staging.config.staging_chunk
        with lane.context():
            for start in range(0, part.length, chunk):
                lo = part.buf_offset + start
                hi = min(lo + chunk, part.buf_offset + part.length)
                target = torch.frombuffer(buffer[lo:hi], dtype=torch.uint8)
                target.copy_(data[start : start + hi - lo], non_blocking=True)
                batch.keep += [target, data]
                batch.then(lane.record(), functools.partial(_crc, part.owner, buffer[lo:hi]))


# ------------------------------------------------------------------ snapshot


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor holding this rank's elements (a DTensor's local shard)."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _leaves(obj: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], torch.Tensor]]:
    """(path, tensor) of every tensor in nested dicts, lists and tuples, in a fixed order."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _leaves(value, (*path, key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _leaves(value, (*path, i))


def _rebuild(obj: Any, copies: Iterator[torch.Tensor]) -> Any:
    """``obj`` with its tensors replaced by ``copies`` (in ``_leaves`` order) and other values deep-copied."""
    if isinstance(obj, torch.Tensor):
        host = next(copies)
        if _local(obj) is obj:
            return host
        # A DTensor: same placement, local shard on the host. Built the way torch's own
        # state-dict utilities do (from_local would move the shard back to the mesh's device).
        dtensor: Any = obj
        return type(dtensor)(host, dtensor._spec, requires_grad=False)
    if isinstance(obj, dict):
        return {key: _rebuild(value, copies) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_rebuild(value, copies) for value in obj]
    if isinstance(obj, tuple):
        return tuple(_rebuild(value, copies) for value in obj)
    return copy.deepcopy(obj)


def _gatherable(tensor: torch.Tensor) -> bool:
    return tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg()


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

    def __init__(self, staging: Staging) -> None:
        self.staging = staging
        self.lanes: dict[torch.device, _Lane] = {}
        self.key: tuple[Any, ...] | None = None
        self.arena: _HostArea | None = None
        self.offsets: list[int] = []
        self.copies: list[torch.Tensor] = []

    def _allocate(self, tensors: list[torch.Tensor]) -> None:
        self.close()
        small = min(self.staging.config.gather_max, self.staging.config.buffer_size)
        sizes = [t.numel() * t.element_size() for t in tensors]
        order = sorted(range(len(tensors)), key=lambda i: (sizes[i] > small, str(tensors[i].device)))
        self.offsets = [0] * len(tensors)
        cursor = 0
        for i in order:
            cursor = align_up(cursor, PAGE if sizes[i] > small else SMALL_ALIGN)
            self.offsets[i] = cursor
            cursor += sizes[i]
        self.arena = _HostArea(cursor, pin=any(t.device.type == "cuda" for t in tensors))
        arena = self.arena.tensor
        self.copies = [
            arena[o : o + n].view(t.dtype).reshape(t.shape) if n else torch.empty(t.shape, dtype=t.dtype)
            for t, o, n in zip(tensors, self.offsets, sizes, strict=True)
        ]

    def take(self, state_dict: Any, ready: dict[torch.device, torch.cuda.Event]) -> Any:
        """Copy ``state_dict`` into the arena; return it rebuilt around the copies."""
        leaves = list(_leaves(state_dict))
        tensors = [_local(t) for _, t in leaves]
        key = tuple((path, t.dtype, tuple(t.shape), t.device) for (path, _), t in zip(leaves, tensors, strict=True))
        if key != self.key:
            self._allocate(tensors)
            self.key = key
        events = []
        by_device: dict[torch.device, list[int]] = {}
        for i, t in enumerate(tensors):
            if t.device.type == "cpu":
                self.copies[i].copy_(t)  # materializes conjugate and negative views too
            elif t.numel():
                by_device.setdefault(t.device, []).append(i)
        keep: list[Any] = []
        for device, indices in by_device.items():
            if device not in self.lanes:
                self.lanes[device] = _Lane(device, self.staging.config.buffer_size)
            lane = self.lanes[device]
            lane.wait_for(ready.get(device) or torch.cuda.current_stream(device).record_event())
            with lane.context():
                self._copy_device(lane, [tensors[i] for i in indices], indices, keep)
                events.append(lane.record())
        for event in events:
            if event is not None:
                event.synchronize()
        return _rebuild(state_dict, iter(self.copies))

    def _copy_device(self, lane: _Lane, tensors: list[torch.Tensor], indices: list[int], keep: list[Any]) -> None:
        small = min(self.staging.config.gather_max, lane.capacity)
        assert self.arena is not None
        arena = self.arena.tensor
        rounds: list[list[tuple[torch.Tensor, int]]] = []
        base = -1
        for t, i in sorted(zip(tensors, indices, strict=True), key=lambda ti: self.offsets[ti[1]]):
            nbytes = t.numel() * t.element_size()
            if nbytes > small or not _gatherable(t):
                self.copies[i].copy_(t, non_blocking=True)
                continue
            if base < 0 or self.offsets[i] + nbytes - base > lane.capacity:
                rounds.append([])
                base = self.offsets[i]
            rounds[-1].append((t.reshape(-1).view(torch.uint8), self.offsets[i]))
        keep.append(tensors)
        for segments in rounds:
            # Same stream: round k+1's gather into the scratch waits for round k's copy out of it.
            start = segments[0][1]
            end = segments[-1][1] + segments[-1][0].numel()
            self.staging.gather()(lane, [(data, offset - start) for data, offset in segments], lane.scratch, keep)
            arena[start:end].copy_(lane.scratch[: end - start], non_blocking=True)

    def close(self) -> None:
        for lane in self.lanes.values():
            lane.close()
        self.lanes.clear()
        self.copies = []
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        self.key = None


# ------------------------------------------------------------------ async saves


class _AsyncSave:
    """One ``dcp.async_save`` through the writer, from ``stage`` to the end of its ``write_data``."""

    def __init__(self, ready: dict[torch.device, torch.cuda.Event], state: Any) -> None:
        self.ready = ready
        self.handoff = _Handoff(self, state)
        self.written = threading.Event()  # write_data is over, or the save ended without it

    def release(self) -> None:
        """The save has read every tensor: training may change them (streaming; snapshots are done earlier)."""
        self.handoff.resolve(self.handoff.streaming_state)

    def fail(self, error: BaseException) -> None:
        self.handoff.resolve(error=error)


class _Handoff(Future[Any]):
    """What ``stage`` returns to DCP: done once training may change the parameters.

    DCP's save thread calls ``result()`` for the state dict to save. In
    streaming mode that is the caller's own state dict, returned at once: the
    save itself stages it and completes this future when it has read every
    tensor. The save thread is watched, so that if it ends without writing
    (a planning error on any rank) the future fails instead of leaving a
    training loop waiting for it.
    """

    def __init__(self, save: _AsyncSave, streaming_state: Any) -> None:
        super().__init__()
        self.save = save
        self.streaming_state = streaming_state
        self.thread: threading.Thread | None = None  # DCP's save thread
        self._resolver: threading.Thread | None = None
        self._lock = threading.Lock()

    def result(self, timeout: float | None = None) -> Any:
        me = threading.current_thread()
        # Callbacks (async_save's own, which builds staging_completion) run in the resolving thread.
        if self.thread is None and me is not self._resolver:
            self.thread = me
            threading.Thread(target=self._watch, args=(me,), name="fp-dcp-save-watch", daemon=True).start()
        if self.streaming_state is not None and not self.done():
            return self.streaming_state
        return super().result(timeout)

    def resolve(self, value: Any = None, error: BaseException | None = None) -> None:
        """Complete once; later calls (a failure after the release) change nothing."""
        with self._lock:
            if self.done():
                return
            self._resolver = threading.current_thread()
            if error is not None:
                self.set_exception(error)
            else:
                self.set_result(value)

    def _watch(self, thread: threading.Thread) -> None:
        while not self.save.written.wait(_WATCH_PERIOD):
            if not thread.is_alive():
                ended = RuntimeError("the checkpoint save ended before writing (its error is in upload_completion)")
                self.resolve(error=ended)
                self.save.written.set()
                return


class AsyncSaves:
    """A writer's side of ``dcp.async_save``: the ``AsyncStager`` calls and one record per save."""

    def __init__(self, staging: Staging) -> None:
        self.staging = staging
        self.saves: list[_AsyncSave] = []
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None

    def stage(self, state_dict: Any, mode: Mode) -> Future[Any]:
        ready = ready_events(state_dict)  # in the caller's thread, on its streams
        with self._lock:
            self.saves = [s for s in self.saves if not (s.written.is_set() and s.handoff.done())]
            previous = self.saves[-1] if self.saves else None
            save = _AsyncSave(ready, state_dict if mode == "streaming" else None)
            self.saves.append(save)
        if mode == "snapshot":
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="fp-dcp-stage")
            self._executor.submit(self._snapshot, save, state_dict, previous)
        return save.handoff

    def _snapshot(self, save: _AsyncSave, state_dict: Any, previous: _AsyncSave | None) -> None:
        try:
            if previous is not None:
                previous.written.wait()  # it may still be writing from the arena
            save.handoff.resolve(self.staging.snapshot.take(state_dict, save.ready))
        except BaseException as e:
            save.fail(e)

    def claim(self) -> _AsyncSave | None:
        """In ``write_data``: the async save this thread is running, if any (None for ``dcp.save``)."""
        me = threading.current_thread()
        with self._lock:
            return next((s for s in self.saves if s.handoff.thread is me and not s.written.is_set()), None)

    def pending(self) -> bool:
        with self._lock:
            return any(not s.written.is_set() for s in self.saves)

    def synchronize(self) -> None:
        """Wait until every staged save lets training change the parameters."""
        with self._lock:
            handoffs = [s.handoff for s in self.saves]
        for handoff in handoffs:
            handoff.exception()  # waits; errors are the saves' to report

    def close(self) -> None:
        """Wait for the saves in flight to finish writing, then stop the staging thread."""
        with self._lock:
            saves = list(self.saves)
        for save in saves:
            if save.handoff.thread is not None:
                save.written.wait()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
