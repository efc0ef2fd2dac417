"""Where a checkpoint's data files live.

Without ``data_dirs`` every file is in the checkpoint directory. With
``data_dirs`` (directories on separate devices, typically the same list for
every checkpoint of a run), each checkpoint gets its own subdirectory in each
of them, named after the checkpoint directory plus a hash of its real path, so
checkpoints sharing ``data_dirs`` never share, or clean up, each other's
files. Each rank writes ``lanes_per_dir`` files into every directory, file
``k`` into directory ``k % len(dirs)`` (``auto_lanes`` picks how many where the
writer is not told); ``.metadata`` always stays in the
checkpoint directory and its footer records each file's directory index and
the subdirectory name, so a reader finds them (``fp_dcp.checkpoint``, also
after the checkpoint has moved). The footer records the data directories as
absolute paths: a relative one means nothing without the saving process's
working directory, which a reader does not know.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
from collections.abc import Iterable, Sequence
from typing import Any

from torch.distributed.checkpoint.planner import WriteItem

from ..config import IOConfig
from ..format import file_index
from ..io.files import fsync_directory, kernel_copies

__all__ = ["LANE_BYTES", "Placement", "auto_lanes", "data_directories", "planned_bytes"]

_MAX_AUTO_FILES = 8  # a rank's files at most where auto lanes add some: each gets two staging buffers
LANE_BYTES = 64 << 20  # auto lanes add a file for every this many bytes (a tenth of a second's copying or less)


def _subdir(checkpoint: str) -> str:
    real = os.path.realpath(checkpoint)
    return f"{os.path.basename(real) or 'checkpoint'}-{hashlib.sha1(real.encode()).hexdigest()[:8]}"


def data_directories(data_dirs: Sequence[str | os.PathLike[str]] | None) -> list[str]:
    """``data_dirs`` as absolute paths (relative ones from the working directory now), refusing one given twice."""
    directories = [os.path.abspath(d) for d in data_dirs or ()]
    if len(set(directories)) != len(directories):
        raise ValueError(f"data_dirs lists a directory twice: {directories}")
    return directories


class Placement:
    """The writer's view: how many files a rank writes, which directory file ``k`` of a rank goes to."""

    def __init__(
        self, checkpoint: str, data_dirs: Sequence[str | os.PathLike[str]] | None, lanes_per_dir: int | None = 1
    ) -> None:
        if lanes_per_dir is not None and lanes_per_dir < 1:
            raise ValueError(f"lanes_per_dir must be at least 1, got {lanes_per_dir}")
        self.checkpoint = checkpoint
        self.lanes_per_dir = lanes_per_dir  # None: auto_lanes
        self.data_dirs = data_directories(data_dirs)
        self.subdir = _subdir(checkpoint) if self.data_dirs else None
        self.directories = [os.path.join(d, self.subdir) for d in self.data_dirs] if self.subdir else [checkpoint]

    def make_directories(self) -> None:
        for directory in dict.fromkeys([self.checkpoint, *self.directories]):
            os.makedirs(directory, exist_ok=True)

    def files(self, nbytes: int, config: IOConfig) -> int:
        """How many files a rank writes ``nbytes`` into, once the directories exist."""
        lanes = self.lanes_per_dir or auto_lanes(self.directories, config, nbytes)
        return len(self.directories) * lanes

    def directory_of(self, file_index: int) -> str:
        return self.directories[file_index % len(self.directories)]

    def describe(self, file_index: int, size: int) -> dict[str, Any]:
        """The footer entry of a data file."""
        return {"size": size, "dir": file_index % len(self.data_dirs) if self.data_dirs else None}

    def footer(self) -> dict[str, Any]:
        return {"data_dirs": self.data_dirs, "data_subdir": self.subdir}

    def remove(self, names: Iterable[str]) -> None:
        """Remove the data files ``names`` (those this host can reach), durably."""
        directories = set()
        for name in names:
            directory = self.directory_of(file_index(name))
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, name))
                directories.add(directory)
        for directory in directories:
            fsync_directory(directory)


def auto_lanes(directories: Sequence[str], config: IOConfig, nbytes: int) -> int:
    """Files per directory for a writer not told (``lanes_per_dir=None``) and ``nbytes`` to write.

    One where files are written with O_DIRECT to a device: one file with a
    deep queue keeps it busy. Where the kernel copies every byte (tmpfs, or
    the page cache: ``direct_io=False``), writes into one file are copied
    one at a time (tmpfs's inode lock; io_uring runs a file's writes in
    order on one worker where the filesystem does not declare parallel
    direct writes, as ext4 and xfs do and tmpfs does not): there a rank writes
    twice as many files as it has ``host_threads`` (at most 8), spread over
    the directories, so that several copies run at once: one rank saved into
    tmpfs faster with four files than with one, and two ranks on two cores
    gained nothing from a second file each (both cores were busy), nor lost
    (docs/benchmarks.md, "Figures behind design comments"). A file is added
    only for every ``LANE_BYTES`` to write: a small state gains nothing from
    more files, each one more to create, preallocate and sync.
    """
    if not any(kernel_copies(d, config.direct_io) for d in directories):
        return 1
    files = min(_MAX_AUTO_FILES, 2 * config.threads(), nbytes // LANE_BYTES)
    return max(1, -(-files // len(directories)))


def planned_bytes(items: Iterable[WriteItem]) -> int:
    """The tensor bytes of a rank's write items, which ``auto_lanes`` deals files by (pickled items are small)."""
    return sum(
        math.prod(item.tensor_data.size) * item.tensor_data.properties.dtype.itemsize
        for item in items
        if item.tensor_data is not None
    )
