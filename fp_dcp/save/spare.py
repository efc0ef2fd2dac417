"""Reusing a retired checkpoint's data files: a save overwrites them instead of making new ones.

Where the kernel copies every byte written (tmpfs, the page cache), a new
file's memory is taken page by page as the save writes it: the kernel
clears every page first, and on a VM whose host took freed memory back (free
page reporting) each page also costs a fault on the host: a save into tmpfs
ran at a fraction of the speed it reached into pages freed a moment before
(docs/benchmarks.md, "A node on one machine", and "Saves into tmpfs minutes
apart"). A file overwritten keeps its pages. ``CheckpointManager``
therefore moves a step it prunes to a *spare* directory (``SPARE_NAME`` in
its root) instead of removing it, and its next save takes this rank's files
from there (``take_spares``): each is renamed to a new data file's name and
overwritten, every byte of it (``fp_dcp.save.pipeline``). What the save does
not take is removed with the spare at the next pruning.

A spare directory is not a checkpoint (the manager never lists or restores
it); its ``.metadata`` stays only to say where its data files are. Where
data files get O_DIRECT to a device, nothing is gained (the disk's blocks
are written either way) and the spare only holds space: the manager keeps
none there (``worth_reusing``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence

from ..checkpoint import open_checkpoint
from ..config import IOConfig
from ..errors import CheckpointError
from ..format import parse_data_file_name
from ..io.files import kernel_copies

__all__ = ["take_spares", "worth_reusing"]


def worth_reusing(directories: Sequence[str], config: IOConfig) -> bool:
    """Whether files written into ``directories`` (which exist) keep memory worth reusing: the kernel copies
    into them."""
    return any(kernel_copies(d, config.direct_io) for d in directories)


def take_spares(spare: str, rank: int, paths: Sequence[str]) -> set[str]:
    """Rename data files of ``rank`` in the spare checkpoint ``spare`` to ``paths``, each to one on its
    filesystem; returns the paths that got one. Where there is no spare, or it cannot be read, none do."""
    try:
        own = open_checkpoint(spare).own_files()
    except (CheckpointError, OSError):
        return set()
    candidates: dict[int, list[str]] = {}  # st_dev: this rank's spare files there
    for name, path in sorted(own.items()):
        parsed = parse_data_file_name(name)
        if parsed is None or parsed[0] != rank:
            continue
        with contextlib.suppress(OSError):
            candidates.setdefault(os.stat(path).st_dev, []).append(path)
    taken: set[str] = set()
    for path in paths:
        directory = os.path.dirname(path)
        files = candidates.get(os.stat(directory).st_dev, [])
        while files and path not in taken:
            with contextlib.suppress(OSError):  # gone, or another mount of the filesystem (EXDEV)
                os.rename(files.pop(0), path)
                taken.add(path)
    return taken  # the save makes the new names durable with its files
