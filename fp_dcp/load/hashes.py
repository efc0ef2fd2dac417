"""The XXH3-128 hashes of an incremental save's item, checked as its bytes pass by in order.

An item of an incremental save carries ``xxh3_128`` (of all its bytes) and,
over 64 KiB, ``xxh3_sample`` (of 16 windows of 4 KiB, docs/format.md). Its
CRC-32C already tells damage; the hashes are what later saves compare to
decide an item is unchanged, so one that disagrees with the bytes would
make a later save reference bytes that differ from what it holds. ``verify``
(and every copy the tiers check) checks both, fed in the same pass as the
CRC-32C. Without libxxhash in the build they cannot be computed: they are
then skipped, with a warning once per process.
"""

from __future__ import annotations

from .._native import _cio
from ..format import HASHING, SAMPLE_MIN, SAMPLE_WINDOW, ItemLocation, sample_offsets
from ..log import log_once

__all__ = ["ItemHashes"]


class ItemHashes:
    """The hashes of one item, computed from its bytes fed in order; ``hasher`` is fed with its CRC-32C."""

    __slots__ = ("location", "hasher", "windows", "sample")

    def __init__(self, location: ItemLocation) -> None:
        self.location = location
        self.hasher = _cio.Hash128() if location.xxh3_128 is not None else None
        sampled = location.xxh3_sample is not None and location.length > SAMPLE_MIN
        self.windows = sample_offsets(location.length) if sampled else []
        self.sample = bytearray(SAMPLE_WINDOW * len(self.windows))

    @classmethod
    def of(cls, location: ItemLocation) -> ItemHashes | None:
        """The hashes to check for ``location``; None if it has none (or they cannot be computed here)."""
        if location.xxh3_128 is None and location.xxh3_sample is None:
            return None
        if not HASHING:
            log_once(
                "fp-dcp: fp_dcp._native._cio was built without libxxhash: the XXH3-128 hashes of incremental saves "
                "are not checked (their CRC-32C is)"
            )
            return None
        return cls(location)

    def feed_sample(self, data: memoryview, at: int) -> None:
        """Bytes ``at`` (from the item's start) onwards: keep what falls in the sample's windows."""
        stop = at + len(data)
        for k, start in enumerate(self.windows):
            lo, hi = max(start, at), min(start + SAMPLE_WINDOW, stop)
            if lo < hi:
                into = k * SAMPLE_WINDOW + lo - start
                self.sample[into : into + hi - lo] = data[lo - at : hi - at]

    def problems(self) -> list[str]:
        """What disagrees, once every byte was fed (``describe`` names the item in each line)."""
        found = []
        if self.hasher is not None and self.hasher.hexdigest() != self.location.xxh3_128:
            found.append(f"xxh3_128 stored {self.location.xxh3_128}, read {self.hasher.hexdigest()}")
        if self.location.xxh3_sample is not None and not self.windows:
            found.append(f"xxh3_sample stored for {self.location.length} bytes (only items over {SAMPLE_MIN} have one)")
        if self.windows:
            sample = _cio.Hash128()
            sample.update(self.sample)
            if sample.hexdigest() != self.location.xxh3_sample:
                found.append(f"xxh3_sample stored {self.location.xxh3_sample}, read {sample.hexdigest()}")
        return found
