"""What may name a checkpoint directory."""

from __future__ import annotations

import os

__all__ = ["checkpoint_directory"]


def checkpoint_directory(path: str | os.PathLike[str]) -> str:
    """``path`` as a string, refusing what can never be a checkpoint directory."""
    text = os.fspath(path)
    if not isinstance(text, str) or not text:
        raise ValueError(f"checkpoint path must be a non-empty filesystem path, got {path!r}")
    if "://" in text:
        raise ValueError(f"fp-dcp writes to local or mounted filesystems; {text!r} looks like a URL")
    if os.path.exists(text) and not os.path.isdir(text):
        raise NotADirectoryError(f"checkpoint path {text} exists and is not a directory")
    return text
