"""Where a checkpoint's data files live.

Without ``data_dirs`` every file is in the checkpoint directory. With
``data_dirs`` (directories on separate devices, typically the same list for
every checkpoint of a run), each checkpoint gets its own subdirectory in each
of them, named after the checkpoint directory plus a hash of its real path, so
checkpoints sharing ``data_dirs`` never share, or clean up, each other's
files. Each rank writes ``lanes_per_dir`` files into every directory, file
``k`` into directory ``k % len(dirs)``; ``.metadata`` always stays in the
checkpoint directory and its footer records each file's directory index and
the subdirectory name, so a reader finds them (``fp_dcp.checkpoint``, also
after the checkpoint has moved). The footer records the data directories as
absolute paths: a relative one means nothing without the saving process's
working directory, which a reader does not know.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from typing import Any

__all__ = ["Placement", "data_directories"]


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
    """The writer's view: which directory file ``k`` of a rank goes to."""

    def __init__(
        self, checkpoint: str, data_dirs: Sequence[str | os.PathLike[str]] | None, lanes_per_dir: int = 1
    ) -> None:
        if lanes_per_dir < 1:
            raise ValueError(f"lanes_per_dir must be at least 1, got {lanes_per_dir}")
        self.data_dirs = data_directories(data_dirs)
        self.subdir = _subdir(checkpoint) if self.data_dirs else None
        self.directories = [os.path.join(d, self.subdir) for d in self.data_dirs] if self.subdir else [checkpoint]
        self.files_per_rank = len(self.directories) * lanes_per_dir

    def directory_of(self, file_index: int) -> str:
        return self.directories[file_index % len(self.directories)]

    def describe(self, file_index: int, size: int) -> dict[str, Any]:
        """The footer entry of a data file."""
        return {"size": size, "dir": file_index % len(self.data_dirs) if self.data_dirs else None}

    def footer(self) -> dict[str, Any]:
        return {"data_dirs": self.data_dirs, "data_subdir": self.subdir}
