"""Tensors as byte streams: what can be stored, and how bytes get in and out.

An item's bytes are its elements in C (row-major) order, nothing else. A
``ByteSource`` yields them for writing and a ``ByteSink`` takes them when
reading; both expose ``memory`` (a memoryview of the whole item) when the
tensor itself can be transferred in place, so the pipelines can skip the
staging copy.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from ._native import _cio
from .errors import UnsupportedTensorError

if TYPE_CHECKING:
    from .io.host_threads import HostThreads

__all__ = ["QUANTIZED", "check_storable", "plain_layout", "byte_view", "ByteSource", "ByteSink"]

# Not in fp-dcp's format: a quantized tensor's value needs its quantizer, which DCP's metadata cannot hold.
QUANTIZED = frozenset({torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4})


def check_storable(tensor: torch.Tensor, fqn: str) -> None:
    """Raise ``UnsupportedTensorError`` naming ``fqn`` for tensors without plain element bytes."""
    problem = None
    if tensor.is_nested:
        problem = "it is a nested tensor: save its unbind() components instead"
    elif tensor.layout != torch.strided:
        problem = f"it has layout {tensor.layout}: convert it with .to_dense() first"
    elif tensor.dtype in QUANTIZED:  # a quantized tensor, or plain bytes viewed as one (is_quantized says False)
        problem = f"it is a quantized tensor ({tensor.dtype}): save its int_repr(), scale and zero point instead"
    elif tensor.device.type == "meta":
        problem = "it is a meta tensor, which holds no data: materialize it (e.g. to_empty() and initialize) first"
    if problem is not None:
        raise UnsupportedTensorError(f"cannot checkpoint {fqn!r}: {problem}")


def plain_layout(tensor: torch.Tensor) -> bool:
    """True when the tensor's memory holds its bytes in C order (contiguous, no lazy conjugate or negation)."""
    return tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg()


def _in_place(tensor: torch.Tensor) -> bool:
    """True when the tensor's memory already holds its bytes in C order on the host."""
    return tensor.device.type == "cpu" and plain_layout(tensor)


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return tensor.detach().reshape(-1).view(torch.uint8).numpy().data


def _slabs(tensor: torch.Tensor, max_bytes: int) -> Iterator[torch.Tensor]:
    """Sub-tensors, in C order, whose bytes follow one another and fit in ``max_bytes``."""
    if tensor.dim() == 0 or tensor.numel() * tensor.element_size() <= max_bytes:
        yield tensor
        return
    row = tensor[0].numel() * tensor.element_size()
    if row <= max_bytes:
        step = max_bytes // row
        for i in range(0, tensor.shape[0], step):
            yield tensor[i : i + step]
    else:
        for i in range(tensor.shape[0]):
            yield from _slabs(tensor[i], max_bytes)


class ByteSource:
    """An item's bytes for writing, read front to back by ``copy_into``.

    In-place CPU tensors and byte strings are one memory block; anything else
    (non-contiguous, conjugate views, other devices) is materialized on the
    host in slabs of at most ``slab_bytes``, one slab at a time. A tensor the
    write pipeline's ``DeviceCopier`` copies (``copied``: a GPU tensor) is
    kept as ``device_tensor``, so that the copier moves its bytes (side
    stream, pinned buffers) instead.
    """

    def __init__(self, data: torch.Tensor | io.BytesIO, slab_bytes: int, copied: bool = False) -> None:
        self.memory: memoryview | None
        self.device_tensor: torch.Tensor | None = None
        self._tensor: torch.Tensor | None = None  # when not in place: read again by checksum()
        self._slab_bytes = slab_bytes
        self._slabs: Iterator[torch.Tensor] | None = None
        self._slab = memoryview(b"")
        self._slab_start = 0
        if isinstance(data, io.BytesIO):
            self.memory = memoryview(data.getvalue())
            self.nbytes = self.memory.nbytes
        else:
            self.nbytes = data.numel() * data.element_size()
            if _in_place(data) and not copied:
                self.memory = byte_view(data)
            else:
                self.memory = None
                self._tensor = data.detach()
                self._slabs = _slabs(self._tensor, slab_bytes)
                if copied:
                    self.device_tensor = self._tensor

    @property
    def address(self) -> int | None:
        return _cio.address(self.memory) if self.memory is not None and self.nbytes else None

    def _slab_at(self, offset: int) -> tuple[memoryview, int]:
        while offset >= self._slab_start + len(self._slab):
            assert self._slabs is not None
            self._slab_start += len(self._slab)
            self._slab = _host_bytes(next(self._slabs))
        return self._slab, offset - self._slab_start

    def copy_into(
        self,
        dst: memoryview,
        offset: int,
        crc: int,
        hasher: _cio.Hash128 | None = None,
        host_threads: HostThreads | None = None,
    ) -> int:
        """Copy the bytes at ``offset`` into ``dst`` (filling it); return the running CRC-32C.

        ``hasher`` is fed the same bytes, in the same pass; ``host_threads``
        copy bytes in memory over several threads.
        """
        if self.memory is not None:
            src = self.memory[offset : offset + len(dst)]
            if host_threads is not None:
                return host_threads.copy_crc32c(dst, src, crc, hasher)
            return _cio.copy_crc32c(dst, src, crc, hasher)
        done = 0
        while done < len(dst):
            slab, start = self._slab_at(offset + done)
            n = min(len(dst) - done, len(slab) - start)
            crc = _cio.copy_crc32c(dst[done : done + n], slab[start : start + n], crc, hasher)
            done += n
        return crc

    def windows(self, offsets: list[int], width: int) -> bytes | None:
        """The bytes at ``offsets``, ``width`` from each, back to back; None unless cheap (in place, or contiguous
        on a device: one small gather and copy)."""
        if self.memory is not None:
            return b"".join(self.memory[o : o + width] for o in offsets)
        tensor = self.device_tensor
        if tensor is None or not plain_layout(tensor):
            return None
        flat = tensor.reshape(-1).view(torch.uint8)
        return bytes(byte_view(torch.cat([flat[o : o + width] for o in offsets]).cpu()))

    def checksum(self, hasher: _cio.Hash128 | None = None) -> int:
        """The CRC-32C of all the bytes, read independently of ``copy_into``; ``hasher`` is fed them too."""
        if self.memory is not None:
            return _cio.crc32c(self.memory, 0, hasher)
        assert self._tensor is not None
        crc = 0
        for slab in _slabs(self._tensor, self._slab_bytes):
            crc = _cio.crc32c(_host_bytes(slab), crc, hasher)
        return crc


def _host_bytes(slab: torch.Tensor) -> memoryview:
    """The C-order bytes of a slab, on the host."""
    slab = slab.resolve_conj().resolve_neg()
    return byte_view(slab.contiguous() if slab.device.type == "cpu" else slab.to("cpu"))


class ByteSink:
    """Where an item's bytes go when reading: ``memory`` (``nbytes`` long) or ``device``, then ``commit``.

    The target tensor is filled in place when it is a contiguous CPU tensor of
    the stored dtype and shape; one the read pipeline's device path fills
    (``on_device``: a GPU tensor) has its bytes as ``device`` instead, a flat
    uint8 view written by host-to-device copies, and no ``memory``. Otherwise
    a host tensor of ``shape`` is filled and ``commit`` copies it (or its
    ``region``: per-dimension offsets and lengths) into the target,
    converting dtype and device as needed.
    """

    def __init__(
        self,
        target: torch.Tensor,
        dtype: torch.dtype,
        shape: torch.Size,
        region: tuple[torch.Size, torch.Size] | None = None,
        on_device: bool = False,
    ) -> None:
        self.target = target
        self.region = region
        self.device: torch.Tensor | None = None
        self.memory: memoryview | None = None
        alike = region is None and target.dtype == dtype and target.shape == shape
        if alike and on_device and plain_layout(target):
            self.host = target
            self.device = target.reshape(-1).view(torch.uint8)
            self.nbytes = self.device.numel()
            return
        if alike and _in_place(target):
            self.host = target
        else:
            self.host = torch.empty(shape, dtype=dtype)
        self.memory = byte_view(self.host)
        self.nbytes = self.memory.nbytes

    def commit(self) -> torch.Tensor:
        if self.host is not self.target:
            source = self.host
            if self.region is not None:
                for dim, (start, length) in enumerate(zip(*self.region, strict=True)):
                    source = source.narrow(dim, start, length)
            self.target.copy_(source)
        return self.target
