"""I/O settings shared by the writer and the reader.

Every field has a default that suits NVMe and network-attached block
storage alike; ``docs/tuning.md`` explains each one's effect. Two of them can
also be forced from the environment, so a job can change engine without a
code change (and tests can exercise every path):

- ``FP_DCP_ENGINE``: ``auto`` | ``io_uring`` | ``threads`` | ``null``
- ``FP_DCP_DIRECT_IO``: ``auto`` | ``1`` | ``0``

An explicit argument wins over the environment.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from .units import PAGE, MiB

__all__ = ["IOConfig"]

_MAX_AUTO_THREADS = 8  # beyond this a rank's copies and checksums outrun its memory bandwidth share

EngineChoice = Literal["auto", "io_uring", "threads", "null"]
_ENGINES = ("auto", "io_uring", "threads", "null")


def _env_engine() -> EngineChoice:
    value = os.environ.get("FP_DCP_ENGINE", "auto").strip().lower() or "auto"
    if value not in _ENGINES:
        raise ValueError(f"FP_DCP_ENGINE must be auto, io_uring, threads or null, not {value!r}")
    return value  # type: ignore[return-value]


def _env_direct_io() -> bool | None:
    value = os.environ.get("FP_DCP_DIRECT_IO", "auto").strip().lower() or "auto"
    choices = {"auto": None, "1": True, "true": True, "0": False, "false": False}
    if value not in choices:
        raise ValueError(f"FP_DCP_DIRECT_IO must be auto, 1 or 0, not {value!r}")
    return choices[value]


@dataclass(frozen=True)
class IOConfig:
    """How fp-dcp moves bytes between memory and files.

    Attributes:
        engine: ``"io_uring"`` (asynchronous requests through the kernel ring),
            ``"threads"`` (positional reads/writes from a small thread pool), or
            ``"auto"``: io_uring when the kernel and the build allow it, else
            threads. A forced engine that cannot run is an error, never a
            silent fallback. ``"null"`` is for benchmarks only: writes complete
            at once and store nothing, and such a save publishes no
            checkpoint (it measures the pipeline without a device in the
            way). Default from ``FP_DCP_ENGINE``, else ``"auto"``.
        direct_io: ``True`` opens files with O_DIRECT (bypassing the page
            cache: no double copy, no cache pollution), ``False`` uses the page
            cache and fsync, ``None`` (auto) tries O_DIRECT and falls back per
            file when the filesystem refuses it. Default from
            ``FP_DCP_DIRECT_IO``, else auto.
        buffer_size: bytes in one staging buffer. Items that cannot be written
            straight from tensor memory (small, non-contiguous or unaligned)
            are packed into these. Larger buffers mean fewer, larger requests.
        num_buffers: staging buffers per writer or reader; one is filled while
            the others are on their way to disk. Host memory used for staging
            is ``buffer_size * num_buffers``, whatever the state dict's size.
            A writer that writes several files at once (``data_dirs`` x
            ``lanes_per_dir``) uses at least two buffers per file.
        block_size: largest single request handed to the kernel. 32 MiB keeps a
            device busy with few requests, for less CPU than more, smaller
            ones (docs/benchmarks.md, "Figures behind design comments").
        queue_depth: most requests in flight at once (io_uring engine).
        io_threads: worker threads of the ``threads`` engine; also the most threads that hash
            items in parallel in incremental saves (at most one per CPU).
        direct_min: smallest run of an item that is written or read straight
            from tensor memory instead of through a staging buffer.
        direct_writes: for files opened with O_DIRECT, ``True`` writes runs
            of at least ``direct_min`` bytes straight from tensor memory (no
            copy); ``False`` copies every byte into the staging buffers,
            whose huge pages let a request reach the device's largest size;
            ``None`` (auto) copies where the disk takes larger requests than
            memory in 4 KiB pages can fill (``fp_dcp.io.device``: virtio
            disks, for one) and the kernel has transparent huge pages
            enabled, and writes in place elsewhere.
            On a virtio disk the copy saved faster than writing in place (its
            requests reached the device's largest size, where scattered 4 KiB
            pages fill a fraction of it), for a little more CPU per GB
            (docs/benchmarks.md, "Slow disks").
        direct_reads: the same choice for loads: ``True`` reads runs of at
            least ``direct_min`` bytes straight into the target tensors,
            ``False`` reads every byte into the staging buffers and copies it
            into place (checksummed in the same pass), ``None`` (auto) decides
            as ``direct_writes`` does. Targets in GPU memory are always read
            through the (page-locked) staging buffers.
        staging_chunk: GPU tensors (see ``docs/gpu.md``) are copied
            device-to-host into the staging buffers in pieces of at most this
            many bytes, each followed by a CUDA event, so that a host checksum
            of one piece (where the device does not checksum it) overlaps the
            copy of the next. ``num_buffers`` is the
            depth of the device-to-disk pipeline: one buffer fills from the GPU
            while the others are written.
        gather_max: GPU tensor parts of at most this many bytes that share a
            staging buffer are gathered on the GPU (``cuda/gather.cu``) and
            copied to the host together, instead of one copy each; 0 copies
            every part on its own.
        host_threads: threads that copy and checksum large byte ranges
            together (the calling one among them), that fault load targets
            in ahead of the reads, that read files in memory into the
            targets, and that write a save's files where the kernel copies
            every byte (tmpfs, the page cache; each thread its own files). None (auto): the CPUs this process
            may run on, divided among the ranks of its node
            (``LOCAL_WORLD_SIZE``), at most 8; 1 does all of it in the calling
            thread.
        prepare_targets: before a load fills host memory (CPU targets, or
            host copies of targets it cannot fill in place), ask the kernel
            for huge pages on its untouched 2 MiB-aligned blocks and fault its
            pages in from ``host_threads`` helper threads, ahead of the reads
            (``fp_dcp.io.prefault``); reads then never wait on a page fault,
            and on disks whose requests scattered memory caps
            (``direct_reads`` auto) the huge-page parts are read in place at
            full request size instead of through the staging buffers; where
            every read of a load is staged, targets whose pages are all
            untouched are instead filled page by page without being cleared
            (userfaultfd, ``fp_dcp.io.userfault``). No byte changes; False
            leaves the targets' memory as it is.
    """

    engine: EngineChoice = field(default_factory=_env_engine)
    direct_io: bool | None = field(default_factory=_env_direct_io)
    buffer_size: int = 32 * MiB
    num_buffers: int = 4
    block_size: int = 32 * MiB
    queue_depth: int = 8
    io_threads: int = 4
    direct_min: int = 1 * MiB
    direct_writes: bool | None = None
    direct_reads: bool | None = None
    staging_chunk: int = 8 * MiB
    gather_max: int = 256 * 1024
    host_threads: int | None = None
    prepare_targets: bool = True

    def __post_init__(self) -> None:
        if self.engine not in _ENGINES:
            raise ValueError(f"engine must be 'auto', 'io_uring', 'threads' or 'null', not {self.engine!r}")
        page = PAGE
        for name in ("buffer_size", "block_size", "staging_chunk"):
            value = getattr(self, name)
            if value < page or value % page:
                raise ValueError(f"{name} must be a positive multiple of {page}, got {value}")
        for name in ("num_buffers", "queue_depth", "io_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.num_buffers < 2:
            raise ValueError("num_buffers must be at least 2 (one fills while one writes)")
        if self.block_size > 1 << 30:
            raise ValueError("block_size must be at most 1 GiB (the kernel's request limit)")
        if self.direct_min < page:
            raise ValueError(f"direct_min must be at least {page}, got {self.direct_min}")
        if self.gather_max < 0:
            raise ValueError(f"gather_max must be at least 0, got {self.gather_max}")
        if self.host_threads is not None and self.host_threads < 1:
            raise ValueError(f"host_threads must be at least 1 (or None: auto), got {self.host_threads}")

    def threads(self) -> int:
        """``host_threads``, or what auto gives on this machine."""
        if self.host_threads is not None:
            return self.host_threads
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        try:
            ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        except ValueError:
            ranks = 1
        return max(1, min(_MAX_AUTO_THREADS, cpus // ranks))
