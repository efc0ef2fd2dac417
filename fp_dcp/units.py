"""Sizes and alignment every layer agrees on."""

from __future__ import annotations

__all__ = ["PAGE", "MiB", "align_up"]

# Files are laid out, and staging memory carved, in pages: a page is the largest
# alignment direct I/O asks for on the filesystems fp-dcp serves with O_DIRECT.
PAGE = 4096
MiB = 1 << 20


def align_up(n: int, a: int) -> int:
    """The smallest multiple of ``a`` that is at least ``n``."""
    return -(-n // a) * a
