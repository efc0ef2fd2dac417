"""Bytes into staging buffers and files: a staged extent's buffer filled, a buffer written whole, a range zeroed.

Shared by the two ways a save writes its extents: through the engine's ring
(``save.pipeline``) and, where the kernel copies every byte, by the host
threads (``save.thread_writes``).
"""

from __future__ import annotations

import errno
import mmap
import os

from ..gpu.copier import DeviceCopier
from ..io.extents import Extent
from ..io.files import DataFile
from ..io.host_threads import HostThreads

__all__ = ["fill", "write_all", "zero_file", "zero_stale"]

_ZERO_PAGES = memoryview(mmap.mmap(-1, 1 << 20))  # page-aligned zeros, as an O_DIRECT write needs


def _zero(buf: memoryview, start: int, stop: int) -> None:
    while start < stop:
        n = min(stop - start, len(_ZERO_PAGES))
        buf[start : start + n] = _ZERO_PAGES[:n]
        start += n


def fill(buffer: memoryview, extent: Extent, copier: DeviceCopier, host_threads: HostThreads) -> memoryview:
    """Copy a staged extent's parts into ``buffer`` at their positions, each owner's CRC-32C continued as they go;
    zero the rest.

    Device parts are copied by the copier while the host fills the rest
    (over ``host_threads``), then checksummed as their copies complete.
    """
    batch = copier.issue(buffer, extent)
    try:
        cursor = 0
        for owner, owner_offset, buf_offset, length in extent.parts:
            _zero(buffer, cursor, buf_offset)
            cursor = buf_offset + length
            if batch is None or owner not in batch:
                owner.crc = owner.source.copy_into(
                    buffer[buf_offset:cursor], owner_offset, owner.crc, owner.hasher, host_threads
                )
        _zero(buffer, cursor, extent.length)
    except BaseException:
        if batch is not None:
            batch.wait()  # no device copy may outlive the buffer it writes into
        raise
    if batch is not None:
        batch.complete()
    return buffer


def write_all(f: DataFile, data: memoryview, offset: int) -> None:
    """Write ``data`` at ``offset`` of ``f``, however many calls it takes; a write that writes nothing is EIO."""
    done = 0
    while done < len(data):
        written = os.pwrite(f.fd, data[done:], offset + done)
        if written <= 0:
            raise OSError(errno.EIO, f"writing bytes {offset + done}-{offset + len(data)} wrote nothing", f.path)
        done += written


def zero_file(f: DataFile, start: int, stop: int) -> None:
    """Write zeros over ``f``'s bytes ``start`` to ``stop``: a reused file's old bytes between the extents.

    Written, not punched out: on tmpfs a punched page is freed, and taking
    its memory back at the next save is what reusing the file avoids. The
    range lies between extents, so it is aligned as O_DIRECT needs.
    """
    while start < stop:
        n = min(stop - start, len(_ZERO_PAGES))
        write_all(f, _ZERO_PAGES[:n], start)
        start += n


def zero_stale(f: DataFile, stale: dict[DataFile, int], extent: Extent) -> None:
    """Before ``extent`` is written into ``f``: where ``f`` is a reused file (a key of ``stale``, which maps it to
    where its old bytes start), zero its old bytes up to the extent and move the mark past it."""
    if f in stale:
        zero_file(f, stale[f], extent.file_offset)
        stale[f] = extent.file_offset + extent.length
