"""The block device under a directory: its name, and whether scattered memory caps its requests.

Linux describes each disk's request limits under ``/sys/block/<disk>/queue``:
``max_sectors_kb`` is the largest request the block layer sends it and
``max_segments`` the most runs of contiguous physical memory one request may
gather. A transfer from memory scattered over 4 KiB pages, as a tensor's is,
needs a segment per page, so where ``max_segments`` pages hold less than
``max_sectors_kb`` the device never gets a full-size request from it: a
virtio disk with 254 segments and 4 MiB requests got requests under 1 MiB.
From 2 MiB huge pages (``io.buffers``) it gets 4 MiB requests; on such
disks, where every request has a fixed cost, that saved faster
(docs/benchmarks.md, "Slow disks").
"""

from __future__ import annotations

import os

from ..units import PAGE

__all__ = ["disk_of", "filesystem_of", "scatter_caps_requests"]


def disk_of(directory: str) -> str | None:
    """The name in /sys/block (and /proc/diskstats) of the disk holding ``directory``; not a partition."""
    dev = os.stat(directory).st_dev
    sys_path = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
    try:
        real = os.path.realpath(sys_path)
    except OSError:
        return None
    if not os.path.exists(real):
        return None
    # a partition's directory sits inside its disk's
    if os.path.exists(os.path.join(real, "partition")):
        real = os.path.dirname(real)
    return os.path.basename(real)


def filesystem_of(directory: str) -> str:
    """The type of the filesystem holding ``directory`` (``ext4``, ``tmpfs``, ...): its mount point's, the
    longest in ``/proc/mounts`` above it; ``unknown`` where none is."""
    real, best, kind = os.path.realpath(directory), "", "unknown"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                point, fs = line.split()[1:3]
                if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) > len(best):
                    best, kind = point, fs
    except OSError:
        pass
    return kind


def _queue_value(disk: str, name: str) -> int | None:
    try:
        with open(f"/sys/block/{disk}/queue/{name}") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def scatter_caps_requests(directory: str) -> bool:
    """Whether the disk under ``directory`` takes larger requests than memory in 4 KiB pages can fill.

    False where it cannot be told (no block device: tmpfs, network and
    overlay filesystems).
    """
    disk = disk_of(directory)
    if disk is None:
        return False
    segments = _queue_value(disk, "max_segments")
    max_kib = _queue_value(disk, "max_sectors_kb")
    return segments is not None and max_kib is not None and segments * PAGE < max_kib * 1024
