"""The shared libraries fp-dcp's native module can be built with: what each gives, what its absence costs, and
where it comes from.

One table for the build (setup.py loads this file by path, before the package exists, so it imports nothing
of fp-dcp), the import error of a build whose library has gone missing, and ``fp_dcp.engine_info()``.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Library", "LIBRARIES", "WHEEL", "by_name", "by_file", "by_symbol"]

WHEEL = "fp-dcp's manylinux wheel (`pip install fp-dcp`), which carries liburing, ISA-L and libxxhash inside it"


class Library(NamedTuple):
    name: str  # as fp_dcp._native._cio.LINKED_LIBRARIES names it
    link: str  # the linker's name: -l<link>, lib<link>.so.N
    symbol_prefix: str  # what its exported functions start with, for a loader's "undefined symbol" message
    gives: str
    without: str  # what a build without it does instead
    packages: str  # the packages that install it, at run time and to build against
    opt_out: str  # the environment variable that builds without it

    def absence(self) -> str:
        """What a build without this library costs, and the way to it."""
        return (
            f"fp-dcp was built without {self.name} ({self.gives}): {self.without}. Install {self.packages} "
            f"and rebuild, or install {WHEEL}"
        )


LIBRARIES = (
    Library(
        name="liburing",
        link="uring",
        symbol_prefix="io_uring_",
        gives="the io_uring engine: deep queues of direct reads and writes from one thread",
        without="saves and loads use the threads engine, one blocking request per host thread, not deep queues",
        packages="liburing2 and liburing-dev (Debian, Ubuntu), liburing and liburing-devel (Fedora, RHEL)",
        opt_out="FP_DCP_WITHOUT_LIBURING",
    ),
    Library(
        name="isa-l",
        link="isal",
        symbol_prefix="crc32_",
        gives="ISA-L's CRC-32C, folding with carry-less multiplies",
        without="CRC-32C runs on the SSE4.2 crc32 instruction: the same checksums, computed more slowly",
        packages="libisal2 and libisal-dev (Debian, Ubuntu), isa-l and isa-l-devel (Fedora, RHEL)",
        opt_out="FP_DCP_WITHOUT_ISAL",
    ),
    Library(
        name="libxxhash",
        link="xxhash",
        symbol_prefix="XXH",
        gives="XXH3-128 content hashes, which incremental saves compare items by",
        without="incremental saves refuse to start (full saves and loads are unaffected)",
        packages="libxxhash0 and libxxhash-dev (Debian, Ubuntu), xxhash-libs and xxhash-devel (Fedora, RHEL)",
        opt_out="FP_DCP_WITHOUT_XXHASH",
    ),
)


def by_name(name: str) -> Library:
    return next(library for library in LIBRARIES if library.name == name)


def by_file(file_name: str) -> Library | None:
    """The library a shared object's file name (``liburing.so.2``) belongs to."""
    return next((library for library in LIBRARIES if file_name.startswith(f"lib{library.link}.so")), None)


def by_symbol(symbol: str) -> Library | None:
    return next((library for library in LIBRARIES if symbol.startswith(library.symbol_prefix)), None)
