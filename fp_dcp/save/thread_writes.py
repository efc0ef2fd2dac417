"""Saves whose every byte the kernel copies (tmpfs, the page cache): the host threads write the files, each
thread its own.

A write into tmpfs or the page cache is the kernel copying out of the
caller's memory, one copy at a time per file (the inode lock). Through the
ring, those copies run on the kernel's workers while the calling thread and
a helper checksum the same bytes again from memory: four busy threads on two
cores, short of ``fio --numjobs=2`` into tmpfs, and a process's first save
into ext4's page cache (``direct_io=False``) through the ring was slower
still, for much more CPU (docs/benchmarks.md, "Saves the kernel copies").
Here each host thread takes its share of the files and writes their
extents in order: runs of tensor memory with ``_cio.write_crc32c``, a step
of 256 KiB at a time, checksummed while the step is still in the core's
cache; staged extents through a ``ScratchBuffer`` of its own (the staging
pool is never mapped for such a save). Each file's extents
stay in one thread and in order, so every item's running CRC-32C (and XXH3
in incremental saves) is what the ring's path computes.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence

from .._native import _cio
from ..io.buffers import ScratchBuffer
from ..io.dealing import deal
from ..io.extents import Direct, Extent
from ..io.files import DataFile
from ..io.host_threads import BOUNCE, ONE_THREAD
from ..io.progress import Progress
from .context import WriteContext
from .filling import fill, write_all, zero_stale

__all__ = ["threads_write", "write_by_threads"]

STEP = BOUNCE  # bytes per pwrite: the kernel's copy and the CRC after it share a core's cache


def threads_write(ctx: WriteContext, files: Sequence[DataFile], sources_on_host: bool) -> bool:
    """Whether the host threads write ``files`` (``write_by_threads``) rather than the engine: the engine stores
    what it is given (not a sink that measures the pipeline), the kernel copies every byte of every file (a
    memory filesystem, or the page cache: ``DataFile.copied``), no byte comes from a device (its copies belong
    to the save's thread), and there are at least two files and two threads to write them."""
    return (
        ctx.engine.stores
        and sources_on_host
        and min(len(files), ctx.host_threads.count) >= 2
        and all(f.copied for f in files)
    )


def write_by_threads(
    files: Sequence[DataFile],
    extents: Sequence[Sequence[Extent]],
    stale: dict[DataFile, int],
    ctx: WriteContext,
    progress: Progress,
) -> None:
    """Write each file's ``extents`` (file order), the files dealt over the host threads by bytes.

    ``stale`` maps reused files to where their old bytes start, as the
    ring's path keeps it: the old bytes between extents are zeroed on the
    way. On a failure or ``ctx.controls`` cancelling, every thread stops at
    its next extent and the first error is raised once all have ended.
    """
    controls, copier = ctx.controls, ctx.copier
    lanes = min(ctx.host_threads.count, len(files))
    owners, _ = deal(
        [sum(e.length for e in file_extents) for file_extents in extents], [range(lanes)] * len(files), lanes
    )
    work: list[list[int]] = [[] for _ in range(lanes)]
    for index, owner in enumerate(owners):
        work[owner].append(index)
    failed = threading.Event()
    counted = threading.Lock()

    def write_lane(indices: list[int]) -> None:
        scratch = ScratchBuffer()
        try:
            for index in indices:
                f = files[index]
                for extent in extents[index]:
                    if failed.is_set():
                        return
                    controls.check()
                    zero_stale(f, stale, extent)
                    if extent.direct is not None:
                        _write_run(f, extent.file_offset, extent.direct)
                    else:  # the lanes are the threads: a copy inside one is not split again
                        buffer = scratch.take(extent.length)
                        write_all(f, fill(buffer, extent, copier, ONE_THREAD), extent.file_offset)
                    with counted:
                        progress.advance(extent.payload)
        except BaseException:
            failed.set()
            raise

    ctx.host_threads.run_all([functools.partial(write_lane, indices) for indices in work if indices])


def _write_run(f: DataFile, offset: int, run: Direct) -> None:
    """Write a run of an item's memory at ``offset``, its CRC-32C (and hash) continued step by step."""
    it = run.owner
    try:
        it.crc = _cio.write_crc32c(f.fd, offset, run.memory, STEP, it.crc, it.hasher)
    except OSError as e:
        where = f"writing {run.memory.nbytes} bytes at {offset}"
        raise OSError(e.errno, f"{e.strerror} ({where})", f.path) from None
