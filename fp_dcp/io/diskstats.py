"""What the block device under a directory did: requests, their sizes and how many were in flight.

From ``/proc/diskstats`` (Linux): the kernel's count of completed write and
read requests, sectors written and read, and the time-weighted number of
requests in flight ("weighted milliseconds doing I/O"), for the whole disk
under the directory. Two snapshots around a save (a load) give the average
queue depth the device saw and the average write (read) request size, which
tell a shallow queue or small requests from a slow disk. None where the
device cannot be found (no /proc/diskstats, a network or overlay
filesystem); other processes' I/O to the same disk counts too.
"""

from __future__ import annotations

import dataclasses

__all__ = ["DiskCounters"]


@dataclasses.dataclass(frozen=True)
class DiskCounters:
    """One snapshot of a disk's counters."""

    writes: int  # write requests completed
    sectors_written: int  # 512-byte sectors
    reads: int  # read requests completed
    sectors_read: int
    weighted_ms: int  # milliseconds x requests in flight, reads and writes

    @classmethod
    def read(cls, disk: str | None) -> DiskCounters | None:
        if disk is None:
            return None
        try:
            with open("/proc/diskstats") as f:
                for line in f:
                    fields = line.split()
                    if len(fields) > 13 and fields[2] == disk:
                        return cls(*(int(fields[i]) for i in (7, 9, 3, 5, 13)))  # the fields' order
        except OSError:
            return None
        return None

    def since(self, earlier: DiskCounters, seconds: float, *, reads: bool = False) -> tuple[float, float]:
        """(requests in flight on average over ``seconds``, average write request in KiB) since ``earlier``;
        with ``reads``, the average read request."""
        if reads:
            count, sectors = self.reads - earlier.reads, self.sectors_read - earlier.sectors_read
        else:
            count, sectors = self.writes - earlier.writes, self.sectors_written - earlier.sectors_written
        size = sectors * 512 / count / 1024 if count else 0.0
        return (self.weighted_ms - earlier.weighted_ms) / (seconds * 1000), size
