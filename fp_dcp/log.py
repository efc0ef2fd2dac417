"""fp-dcp's logger, and warnings that should be said once per process, not once per file or save."""

from __future__ import annotations

import logging

__all__ = ["log", "log_once"]

log = logging.getLogger("fp_dcp")

_logged: set[str] = set()


def log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        log.warning(message)
