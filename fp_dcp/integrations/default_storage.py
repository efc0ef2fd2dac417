"""``fp_dcp.install()``: fp-dcp as the storage of DCP calls that pass only a ``checkpoint_id``.

Frameworks (torchtitan, Lightning, ...) call ``dcp.save(sd, checkpoint_id=path)``
and ``dcp.load(sd, checkpoint_id=path)`` without a storage writer or reader;
torch then picks ``FileSystemWriter`` / ``FileSystemReader`` for local paths.
``install()`` makes it pick ``FastPersistWriter`` / ``FastPersistReader``
instead, for every such call in this process:

- It rebinds the two names DCP's storage choice looks up
  (``fp_dcp.compat.set_default_storage``; nothing else is patched). Calls
  that pass a storage writer or reader are untouched.
- URLs (``s3://...``, anything with ``://``) are refused by fp-dcp's
  ``validate_checkpoint_id`` and still go to torch's fsspec storage.
- The reader also loads stock DCP checkpoints (through torch's
  ``FileSystemReader``), so checkpoints saved before ``install()`` still load,
  and Hugging Face safetensors directories: ``dcp.load(sd,
  checkpoint_id=hf_dir)``, which torch's reader refuses (no ``.metadata``),
  then loads. Path-only saves stay fp-dcp checkpoints: a safetensors save
  needs ``SafetensorsWriter``'s arguments.
- ``uninstall()`` puts torch's classes back; ``with fp_dcp.installed(): ...``
  does both around a block.

Jobs that cannot change their code set ``FP_DCP_DEFAULT_STORAGE=1``: every
process that imports ``fp_dcp`` then installs it, and so does every Python
process started with the variable set where fp-dcp is installed from its
wheel (its ``fp_dcp_default_storage.pth`` imports ``fp_dcp`` at start-up when
the variable is ``1``), which covers spawned workers. Without ``install()``
or the variable nothing changes.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

from ..compat import default_storage, set_default_storage
from ..load.reader import FastPersistReader
from ..save.writer import FastPersistWriter

__all__ = ["ENV", "install", "uninstall", "installed", "is_installed", "install_from_environment"]

ENV = "FP_DCP_DEFAULT_STORAGE"

_lock = threading.Lock()
_stock: tuple[type, type] | None = None  # torch's classes while fp-dcp is installed


def install() -> None:
    """Make fp-dcp the storage of ``checkpoint_id``-only DCP calls in this process (idempotent)."""
    global _stock
    with _lock:
        if _stock is None:
            _stock = default_storage()
            set_default_storage(FastPersistWriter, FastPersistReader)


def uninstall() -> None:
    """Give ``checkpoint_id``-only DCP calls back to torch's storage (a no-op when not installed)."""
    global _stock
    with _lock:
        if _stock is not None:
            set_default_storage(*_stock)
            _stock = None


def is_installed() -> bool:
    return default_storage() == (FastPersistWriter, FastPersistReader)


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """fp-dcp as the default storage inside the block; as before after it."""
    was = is_installed()
    install()
    try:
        yield
    finally:
        if not was:
            uninstall()


def install_from_environment() -> bool:
    """``install()`` if ``FP_DCP_DEFAULT_STORAGE=1``; whether it did."""
    value = os.environ.get(ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{ENV} must be 1 (install fp-dcp as DCP's default storage) or 0, not {value!r}")
    if value == "1":
        install()
    return value == "1"
