"""CRC-32C of GPU tensors' bytes, computed on their GPU: no host thread reads those bytes to checksum them.

Saves checksum each staging buffer's GPU parts on the device before they
cross to the host; loads checksum what landed in a GPU target after its
copies. The kernel is ``cuda/crc32c.cu`` (``fp_dcp.gpu.kernel``: built at
run time through cupy); one launch checksums every range of a staging
buffer on one device, and one small copy brings the results back. Each
result continues its item's running CRC-32C with ``_cio.crc32c_combine``,
so an item checksummed in parts, some on a device and some on the host,
has the value ``_cio.crc32c`` gives for its bytes: a checkpoint saved from
a GPU verifies on a CPU-only machine, and the other way round.

Where the kernel cannot run (no cupy, no NVRTC, a CPU tensor), the host
checksums as before, and ``backend`` says why.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch

from .._native import _cio
from .kernel import Kernel
from .memory import SideStream

__all__ = ["THREADS", "PIECE", "CHUNK", "powers", "Checksummed", "DeviceCrc", "Checksums"]

THREADS = 256  # FP_DCP_CRC_THREADS: threads of a block, one piece each
PIECE = 256  # FP_DCP_CRC_PIECE: bytes a thread checksums
CHUNK = THREADS * PIECE  # bytes of a block
_POWERS = 48  # FP_DCP_CRC_POWERS: enough for rows of 2^56 bytes
_MAX_BLOCKS = 4096  # blocks stride over the chunks beyond this (a few per multiprocessor)


def powers() -> list[int]:
    """x^(8 * PIECE * 2^b) mod P for b < 48, the kernel's factors: ``crc32c_combine(x^0, 0, n)`` is x^(8n)."""
    return [_cio.crc32c_combine(1 << 31, 0, PIECE << b) for b in range(_POWERS)]


class Checksummed(Protocol):
    """An item whose running CRC-32C the device continues (a save's placed item, a load's item in flight)."""

    crc: int


class DeviceCrc:
    """CRC-32Cs of device byte ranges, many per launch of ``cuda/crc32c.cu``.

    ``ready`` says whether it runs for a side stream's device; tests replace
    the launch with a CPU model of the same arithmetic (``tests/cuda_double.py``).
    """

    def __init__(self) -> None:
        self.kernel = Kernel("crc32c.cu", "fp_dcp_crc32c", fallback="on the host")
        self._powers = np.array(powers(), dtype=np.uint32)

    @property
    def backend(self) -> str:
        """Where GPU tensors' bytes are checksummed (the kernel through cupy, or the host, and why)."""
        return self.kernel.backend

    def ready(self, side: SideStream) -> bool:
        """Whether ranges on the side stream's device are checksummed there (the kernel is built on first use)."""
        return self.kernel.function(side) is not None

    def __call__(self, side: SideStream, rows: list[torch.Tensor], keep: list[Any]) -> torch.Tensor:
        """Queue the CRC-32C of every row (flat uint8, on the side stream's device) on the side stream.

        Returns them, one int32 (the CRC's bits) per row, on the device: read
        once the stream has run the launch. What the launch reads goes to ``keep``.
        """
        sizes = np.array([row.numel() for row in rows], dtype=np.uint64)
        chunks = -(-sizes // CHUNK)
        table = np.empty(_POWERS // 2 + 3 * len(rows), dtype=np.uint64)
        table[: _POWERS // 2] = self._powers.view(np.uint64)
        entries = table[_POWERS // 2 :].reshape(-1, 3)  # struct fp_dcp_crc_row
        entries[:, 0] = [row.data_ptr() for row in rows]
        entries[:, 1] = sizes
        entries[:, 2] = np.cumsum(chunks) - chunks
        total = int(chunks.sum())
        with side.context():
            device_table = torch.from_numpy(table.view(np.int64)).to(side.device, non_blocking=True)
            out = torch.zeros(len(rows), dtype=torch.int32, device=side.device)
            if total:
                base = device_table.data_ptr()
                args = (
                    np.uint64(base + _POWERS * 4),
                    np.uint32(len(rows)),
                    np.uint64(total),
                    np.uint64(base),
                    np.uint64(out.data_ptr()),
                )
                self.kernel.launch(side, min(total, _MAX_BLOCKS), THREADS, args)
        keep += [table, device_table, rows]
        return out


class Checksums:
    """Device ranges to checksum in one launch on one side stream, each continuing its owner's CRC-32C in order."""

    def __init__(self, crc: DeviceCrc, side: SideStream) -> None:
        self.crc = crc
        self.side = side
        self.owners: list[Checksummed] = []
        self.rows: list[torch.Tensor] = []
        self.results: torch.Tensor | None = None

    def add(self, owner: Checksummed, data: torch.Tensor) -> None:
        """The next bytes of ``owner`` (flat uint8 on the device), after those added before."""
        self.owners.append(owner)
        self.rows.append(data)

    def launch(self, keep: list[Any]) -> None:
        self.results = self.crc(self.side, self.rows, keep)

    def fold(self) -> None:
        """Once the side stream has run the launch: continue each owner's CRC-32C with its ranges', in order."""
        assert self.results is not None
        with self.side.context():  # a few bytes, on the side stream: never behind the caller's work
            values = self.results.cpu().numpy().view(np.uint32)
        for owner, row, value in zip(self.owners, self.rows, values, strict=True):
            owner.crc = _cio.crc32c_combine(owner.crc, int(value), row.numel())
        self.owners, self.rows, self.results = [], [], None
