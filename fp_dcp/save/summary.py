"""``SaveSummary``: what one rank's part of a save did (``FastPersistWriter.last_save``)."""

from __future__ import annotations

import dataclasses

__all__ = ["SaveSummary"]


@dataclasses.dataclass(frozen=True)
class SaveSummary:
    """What one rank's part of a save did; ``FastPersistWriter.last_save`` after each save."""

    bytes: int  # item bytes this rank wrote
    seconds: float  # write_data, from first resolve to fsync
    files: tuple[str, ...]
    engine: str  # e.g. "io_uring", or "threads (io_uring refused by the kernel: ...)"
    direct_io: bool  # whether the data files were written with O_DIRECT
    staging: str = "none"  # how device tensors reached the host ("none" when the state was all on the CPU)
    referenced: int = 0  # incremental saves: item bytes found unchanged and referenced in the base, not written

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0

    def describe_io(self) -> str:
        """``io_uring, O_DIRECT``: the engine and how the files were opened."""
        return f"{self.engine}, {'O_DIRECT' if self.direct_io else 'page cache'}"
