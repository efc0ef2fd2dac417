"""Check a directory of Hugging Face safetensors files without loading it: ``verify_safetensors``.

``verify_checkpoint`` (``fp-dcp verify``) comes here for a directory without
``.metadata`` that holds ``*.safetensors`` files. It checks:

- the structure, as a load does when it opens the directory
  (``fp_dcp.load.safetensors``), but every file, each problem reported
  rather than the first raised: the index, each file present, its header
  (length, JSON, dtypes, shapes, byte ranges that fill the data exactly, so
  a truncated or extended file is found and its tensor named), every tensor
  the index lists in its file; then, across files, no tensor stored twice
  and chunks that tile their tensor;
- every byte of every file, read once front to back through the engine
  (O_DIRECT where the filesystem allows, so the disk's bytes are read, not a
  cached copy): a file that cannot be read is named;
- the content, where Hugging Face recorded a hash of the file.
  safetensors itself stores none, nor does ``model.safetensors.index.json``.
  What ``huggingface_hub`` downloads carries one: in its cache
  (``snapshots/<revision>/<file>`` links to ``blobs/<hash>``), the blob's
  name; in a ``local_dir`` download, the etag in
  ``.cache/huggingface/download/<file>.metadata`` (unless the file changed
  after that record was written, which ``huggingface_hub`` itself takes
  for an outdated record: a file rewritten since is not the download's,
  and bit rot does not change a file's time). Either is the file's
  SHA-256 for files stored with Git LFS (every ``.safetensors`` file on the
  Hub) and git's SHA-1 of the blob for small files (the index). A file with
  neither is checked for structure and readability only, and the report
  says how many files had a hash (``checksums`` is True only when all had).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
from typing import NamedTuple

from ..errors import CorruptCheckpointError, IncompatibleCheckpointError, NotACheckpointError
from ..io.files import open_file, open_regular
from ..io.progress import Progress, ProgressCallback
from ..safetensors_format import INDEX_NAME
from .report import VerifyReport
from .safetensors import Header, catalogue, checkpoint_files, read_header, read_weight_map
from .stream_check import scan_ranges, scan_resources

__all__ = ["SafetensorsVerifyReport", "RecordedHash", "recorded_hash", "verify_safetensors"]

_SHA256 = re.compile(r"[0-9a-f]{64}")
_GIT_SHA1 = re.compile(r"[0-9a-f]{40}")
_LOCAL_DIR_METADATA = os.path.join(".cache", "huggingface", "download")


@dataclasses.dataclass(frozen=True)
class SafetensorsVerifyReport(VerifyReport):
    """What ``verify_safetensors`` found (``VerifyReport``'s fields, for a safetensors directory).

    Attributes:
        items: tensors (chunks) in the headers that could be read.
        bytes: bytes of the files whose content was checked against a hash Hugging Face recorded.
        files: the checkpoint's ``.safetensors`` files.
        checksums: every one of them had such a hash.
        read_bytes: bytes of all files read.
        hashed_files: ``.safetensors`` files checked against a recorded hash (the index is checked too where
            it has one, and a mismatch is a problem, but it is not counted here).
    """

    read_bytes: int = 0
    hashed_files: int = 0


class RecordedHash(NamedTuple):
    """A file's hash as Hugging Face recorded it: ``sha256`` or ``git-sha1``, its hex digest, and where it is."""

    algorithm: str
    digest: str
    source: str


def recorded_hash(path: str) -> RecordedHash | None:
    """The hash ``huggingface_hub`` recorded for the file at ``path`` when it downloaded it, None if none."""
    blob = os.path.realpath(path)
    if blob != os.path.abspath(path) and os.path.basename(os.path.dirname(blob)) == "blobs":
        found = _known(os.path.basename(blob), "its blob's name in the Hugging Face cache")
        if found is not None:
            return found
    here = os.path.abspath(path)
    root = os.path.dirname(here)
    while True:
        sidecar = os.path.join(root, _LOCAL_DIR_METADATA, os.path.relpath(here, root) + ".metadata")
        if os.path.isfile(sidecar):
            with open(sidecar, encoding="utf-8", errors="replace") as f:
                lines = f.read().splitlines()  # commit, etag, time of the download
            if len(lines) < 3 or not _current(lines[2], here):
                return None
            return _known(lines[1].strip(), sidecar)
        if os.path.dirname(root) == root:
            return None
        root = os.path.dirname(root)


def _current(recorded_at: str, path: str) -> bool:
    """Whether a ``local_dir`` record is as new as the file (huggingface_hub's rule, its second of slack)."""
    try:
        return float(recorded_at) >= os.path.getmtime(path) - 1
    except ValueError:
        return False


def _known(digest: str, source: str) -> RecordedHash | None:
    if _SHA256.fullmatch(digest):
        return RecordedHash("sha256", digest, source)
    if _GIT_SHA1.fullmatch(digest):
        return RecordedHash("git-sha1", digest, source)
    return None  # an etag of some other kind: nothing to check it against


class _Hashing:
    """A whole file, fed to the hash Hugging Face recorded for it (if any) as it is read."""

    __slots__ = ("start", "stop", "hasher")

    def __init__(self, size: int, recorded: RecordedHash | None) -> None:
        self.start, self.stop = 0, size
        self.hasher = None
        if recorded is not None and recorded.algorithm == "sha256":
            self.hasher = hashlib.sha256()
        elif recorded is not None:  # git's SHA-1 of a blob hashes a "blob <size>" prefix first
            self.hasher = hashlib.sha1(f"blob {size}\0".encode(), usedforsecurity=False)

    def feed(self, data: memoryview, at: int) -> None:
        if self.hasher is not None:
            self.hasher.update(data)


def verify_safetensors(
    path: str | os.PathLike[str], *, progress: ProgressCallback | None = None
) -> SafetensorsVerifyReport:
    """Check the structure of the safetensors checkpoint in directory ``path``, read every byte, check hashes.

    ``progress``: as for ``verify_checkpoint``, in bytes of the files.

    Returns a report: each problem names the file and, where there is one, the tensor.

    Raises:
        NotACheckpointError: no safetensors file there.
    """
    directory = os.fspath(path)
    problems: list[str] = []
    try:
        weight_map = read_weight_map(directory)
    except CorruptCheckpointError as e:
        problems.append(f"{e}; every .safetensors file in the directory is checked instead")
        weight_map = None
    try:
        names = checkpoint_files(directory, weight_map)
    except NotACheckpointError:
        if not problems:
            raise
        return SafetensorsVerifyReport(directory, False, problems, 0, 0, 0, checksums=False)  # only a bad index
    headers: list[Header] = []
    for name in names:
        try:
            headers.append(read_header(directory, name, weight_map))
        except (CorruptCheckpointError, IncompatibleCheckpointError) as e:
            problems.append(str(e))
    if not problems:  # across files; a damaged file would only add echoes of its own problem
        try:
            catalogue(directory, headers)
        except CorruptCheckpointError as e:
            problems.append(str(e))

    files = [os.path.join(directory, name) for name in names]
    sizes = {file: os.path.getsize(file) for file in files if os.path.exists(file)}  # the missing are named above
    tracker = Progress("verify", sum(sizes.values()), callback=progress)
    hashed: list[str] = []
    io = scan_resources(max(sizes.values(), default=1))
    try:
        ctx = io.context()
        for file, size in sizes.items():
            recorded = recorded_hash(file)
            whole = _Hashing(size, recorded)
            before = tracker.done
            try:
                f = open_file(file, create=False, direct=None)
                try:
                    scan_ranges(ctx, f, [whole], tracker, end=size)
                finally:
                    f.close()
            except OSError as e:
                problems.append(f"{file} could not be read ({e})")
                recorded = None
            tracker.advance(size - (tracker.done - before))  # what a failed read left unread
            if recorded is not None:
                assert whole.hasher is not None
                hashed.append(file)
                _compare(file, whole.hasher.hexdigest(), recorded, problems)
    finally:
        io.close()
    tracker.finish()
    index = os.path.join(directory, INDEX_NAME)
    index_hash = recorded_hash(index) if weight_map is not None else None
    if index_hash is not None:
        with open_regular(index) as stream:
            data = stream.read()
        whole = _Hashing(len(data), index_hash)
        whole.feed(memoryview(data), 0)
        assert whole.hasher is not None  # a recorded hash is of an algorithm _Hashing knows
        _compare(index, whole.hasher.hexdigest(), index_hash, problems)
    return SafetensorsVerifyReport(
        path=directory,
        ok=not problems,
        problems=problems,
        items=sum(len(h.entries) for h in headers),
        bytes=sum(sizes[file] for file in hashed),
        files=len(names),
        checksums=len(hashed) == len(names),
        read_bytes=tracker.done,
        hashed_files=len(hashed),
    )


def _compare(file: str, actual: str, recorded: RecordedHash, problems: list[str]) -> None:
    if actual != recorded.digest:
        problems.append(
            f"{file}: its {recorded.algorithm} is {actual}, but {recorded.source} records {recorded.digest}: "
            "the file changed after the download, or the download was damaged"
        )
