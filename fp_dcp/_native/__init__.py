"""fp-dcp's native module, ``_cio`` (built from cio/): the io_uring ring, CRC-32C, XXH3-128, userfaultfd fills and
system helpers.

Every byte fp-dcp moves or checks passes through it, so there is no pure-Python engine to fall back to. A build
whose shared library has gone missing (a source build moved to a machine or image without it) stops
``import fp_dcp`` here with an ImportError that names the library, the packages that provide it and the wheel
that carries it, rather than the loader's bare message (docs/install.md says why this and not a fallback).
"""

from __future__ import annotations

import re
from importlib.machinery import EXTENSION_SUFFIXES

from .libraries import LIBRARIES, WHEEL, Library, by_file, by_symbol

__all__ = ["_cio", "missing"]

# The loader names the file it could not load first: "liburing.so.2: cannot open shared object file: ...",
# or a path where the file is there but broken ("/usr/lib/.../liburing.so.2: file too short").
_UNLOADABLE_FILE = re.compile(r"^(?:\S*/)?(lib[\w+-]+\.so[\d.]*): ")
_UNDEFINED_SYMBOL = re.compile(r"undefined symbol: (\w+)")


def _explain(error: ImportError) -> str:
    said = str(error)
    if not (error.path or "").endswith(tuple(EXTENSION_SUFFIXES)):  # no extension file was found to load
        return (
            "fp-dcp's native module fp_dcp._native._cio is not built. In a source checkout run `make build` "
            f"(or `pip install -e .`); to use fp-dcp, install {WHEEL}. ({said})"
        )
    file = _UNLOADABLE_FILE.search(said)
    symbol = _UNDEFINED_SYMBOL.search(said)
    if file and (library := by_file(file.group(1))):
        problem = (
            f"{file.group(1)}, the shared library of {library.name} ({library.gives}), is missing or unreadable on "
            "this machine, and this fp-dcp was built from source against it"
        )
        remedy = (
            f"Install {library.packages}; or install {WHEEL}; or rebuild with {library.opt_out}=1 "
            f"(then {library.without})"
        )
    elif symbol and (library := by_symbol(symbol.group(1))):
        problem = (
            f"the {library.name} on this machine lacks {symbol.group(1)}, so it is older than the one this fp-dcp "
            "was built against"
        )
        remedy = f"Install a newer one ({library.packages}) or {WHEEL}"
    else:
        problem, remedy = (
            "the loader refused it",
            f"Rebuild it (`make build`, or `pip install -e .`) or install {WHEEL}",
        )
    return f"fp-dcp's native module cannot load: {problem}. {remedy}. The loader said: {said}"


try:
    from . import _cio
except ImportError as error:
    raise ImportError(_explain(error), name=error.name, path=error.path) from error


def missing() -> tuple[Library, ...]:
    """The optional libraries this build of ``_cio`` was made without."""
    return tuple(library for library in LIBRARIES if library.name not in _cio.LINKED_LIBRARIES)
