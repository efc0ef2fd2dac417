"""What fp-dcp will use on this machine, for logs and bug reports."""

from __future__ import annotations

import tempfile
from typing import Any

from .._native import _cio, missing
from .._native.libraries import LIBRARIES
from ..config import IOConfig
from .engine import create_engine
from .files import probe_file

__all__ = ["engine_info"]


def engine_info(directory: str | None = None, config: IOConfig | None = None) -> dict[str, Any]:
    """The engine ``config`` resolves to here, and how files in ``directory`` will be accessed.

    Returns a dict with ``engine`` (``"io_uring"`` or ``"threads"``),
    ``fallback_reason`` (why not io_uring, or None), ``crc32c_hardware``,
    ``crc32c_engine`` (``"isa-l"``, ``"sse4.2"`` or ``"tables"``),
    ``libraries`` (each optional library of the native build: whether it is
    linked), ``missing`` (what each absent one costs, and the way to it), and
    ``direct_io`` and ``alignment`` for files created in ``directory`` (by
    default the temporary directory; pass the checkpoint directory, since
    filesystems differ).
    """
    config = config if config is not None else IOConfig()
    engine = create_engine(config)
    try:
        info: dict[str, Any] = {
            "engine": engine.name,
            "fallback_reason": engine.fallback_reason,
            "crc32c_hardware": bool(_cio.CRC32C_HARDWARE),
            "crc32c_engine": _cio.CRC32C_ENGINE,
            "libraries": {library.name: library.name in _cio.LINKED_LIBRARIES for library in LIBRARIES},
            "missing": {library.name: library.absence() for library in missing()},
        }
    finally:
        engine.close()
    probe = probe_file(directory or tempfile.gettempdir(), config.direct_io)
    info["direct_io"] = probe.direct
    info["alignment"] = probe.align
    return info
