"""Opening files with or without O_DIRECT, and making files and renames durable.

Each data file is opened with O_DIRECT when the filesystem allows it
(checked, not assumed: some filesystems accept the flag and ignore it) and
through the page cache otherwise; ``DataFile.direct`` says which.
"""

from __future__ import annotations

import contextlib
import errno as errno_mod
import fcntl
import os
import secrets
import stat
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING, BinaryIO

from .._native import _cio
from ..log import log_once
from ..units import PAGE
from .device import filesystem_of, scatter_caps_requests

if TYPE_CHECKING:
    from .buffers import BufferPool

__all__ = [
    "DataFile",
    "ShortReadError",
    "short_read",
    "read_all",
    "start_writeback",
    "NotRegularFileError",
    "open_regular",
    "open_file",
    "probe_file",
    "kernel_copies",
    "in_memory",
    "from_memory",
    "in_place",
    "preallocate",
    "fsync_path",
    "fsync_directory",
    "ReplaceFailedError",
    "replace_durably",
    "write_durably",
]

# Our file layout guarantees co-alignment modulo one page; a filesystem that
# needs more than that for direct I/O is served through the page cache.
MAX_DIRECT_ALIGN = PAGE


class ShortReadError(OSError):
    """A read found the end of the file before the bytes it asked for (the file is shorter than expected)."""


def short_read(path: str, nbytes: int, offset: int) -> ShortReadError:
    return ShortReadError(errno_mod.EIO, f"file ends before byte {offset + nbytes} (truncated?)", path)


def read_all(f: DataFile, into: memoryview, offset: int) -> None:
    """Fill ``into`` from ``f`` at ``offset`` with ``pread``, however many calls it takes (a buffered file, or
    one in memory: no alignment applies); ShortReadError where the file ends first."""
    done = 0
    while done < into.nbytes:
        got = os.preadv(f.fd, [into[done:]], offset + done)
        if not got:
            raise short_read(f.path, into.nbytes, offset)
        done += got


class NotRegularFileError(OSError):
    """Where a file should be, something else is: a FIFO, a socket, a directory, a device. ``strerror`` says what."""


def open_regular(path: str) -> BinaryIO:
    """``path`` open for reading, or NotRegularFileError unless it is a regular file (FileNotFoundError and other
    OSErrors as ``open`` raises them).

    Opened without blocking, so that a FIFO where a file of a checkpoint, a
    run or a model should be does not wait for a writer (and a device does
    not stream forever); blocking again once it is known to be a file.
    """
    fd = _open(path, os.O_RDONLY | os.O_CLOEXEC, blocking=False)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        what = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
        raise NotRegularFileError(errno_mod.EISDIR if stat.S_ISDIR(mode) else errno_mod.EINVAL, what, path)
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


class DataFile:
    """An open file plus how it may be accessed.

    ``align`` is the alignment direct transfers keep to, for memory
    addresses, file offsets and lengths: what the kernel needs for O_DIRECT,
    and for files being written the filesystem's block too, up to a page
    (1 for buffered files). ``copied``: the kernel copies every byte moved
    (no device does): the file is buffered, or in memory (tmpfs, also with
    O_DIRECT).
    """

    __slots__ = ("path", "fd", "direct", "align", "copied")

    def __init__(self, path: str, fd: int, direct: bool, align: int) -> None:
        self.path = path
        self.fd = fd
        self.direct = direct
        self.align = align
        self.copied = not direct or in_memory(os.path.dirname(path) or ".")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __repr__(self) -> str:
        return f"DataFile({self.path!r}, direct={self.direct}, align={self.align})"


def _direct_alignment(fd: int, writing: bool) -> int | None:
    """Alignment direct transfers keep to on this open file, or None if O_DIRECT is not in effect."""
    if not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
        return None  # the filesystem silently dropped the flag
    reported = _cio.dio_alignment(fd)
    if reported is None:
        return MAX_DIRECT_ALIGN  # kernel cannot tell: a page is always enough
    mem_align, offset_align = reported
    if not mem_align or not offset_align:
        return None
    if max(mem_align, offset_align) > MAX_DIRECT_ALIGN:
        return None
    # For writes, what the device accepts is not enough: ext4 and XFS treat a
    # direct write that is not aligned to the filesystem's block as
    # "unaligned", take the inode lock exclusively and wait for it to
    # complete, so such writes to one file run one at a time (a handful of
    # requests in flight instead of a deep queue, and slower:
    # docs/benchmarks.md, "Slow disks"). Writes are therefore aligned to the
    # block too, up to a page; reads share the lock and need no more than the
    # device's alignment (less read around an item).
    block = min(os.fstat(fd).st_blksize, MAX_DIRECT_ALIGN) if writing else 512
    return max(mem_align, offset_align, 512, block)


def open_file(path: str, *, create: bool, direct: bool | None, reuse: bool = False) -> DataFile:
    """Open ``path`` for writing (``create``: a new file, never an existing one; with ``reuse``, the existing
    file whose bytes the writer will overwrite) or reading.

    ``direct``: True requires O_DIRECT, False forbids it, None tries it and
    falls back to the page cache when the filesystem refuses, and, for
    reading, where every page of the file is in the page cache already (a
    direct read would fetch from the disk what is in memory).
    """
    if reuse and not create:
        raise ValueError("open_file: reuse=True opens a file for writing, so needs create=True")
    flags = (os.O_WRONLY | (0 if reuse else os.O_CREAT | os.O_EXCL)) if create else os.O_RDONLY
    flags |= os.O_CLOEXEC
    if direct is not False:
        try:
            fd = _open(path, flags | os.O_DIRECT)
        except OSError as e:
            if e.errno != errno_mod.EINVAL:
                raise
            if direct:
                raise OSError(e.errno, "filesystem refuses O_DIRECT and direct_io=True", path) from None
            log_once(f"fp-dcp: O_DIRECT refused on {os.path.dirname(path) or '.'}; using the page cache")
        else:
            align = _direct_alignment(fd, writing=create)
            if align is not None and (create or direct or not _all_cached(fd)):
                return DataFile(path, fd, True, align)
            os.close(fd)
            if create and not reuse:
                os.unlink(path)
            if direct:
                raise OSError(errno_mod.EINVAL, "direct I/O is not in effect and direct_io=True", path)
            if align is None:
                log_once(f"fp-dcp: direct I/O not in effect on {os.path.dirname(path) or '.'}; using the page cache")
    return DataFile(path, _open(path, flags), False, 1)


def _open(path: str, flags: int, *, blocking: bool = True) -> int:
    """``os.open``; for reading without blocking, so that a FIFO where a file should be does not wait for a
    writer (the reader's ``fstat`` then finds no regular file), and ``blocking`` again once open (io_uring may
    fail reads of a file left non-blocking with EAGAIN). A socket cannot be opened: NotRegularFileError."""
    if flags & os.O_WRONLY:
        return os.open(path, flags, 0o644)
    try:
        fd = os.open(path, flags | os.O_NONBLOCK)
    except OSError as e:
        if e.errno != errno_mod.ENXIO:  # ENXIO: a socket
            raise
        raise NotRegularFileError(errno_mod.ENXIO, "a socket", path) from None
    if blocking:
        os.set_blocking(fd, True)
    return fd


def probe_file(directory: str, direct: bool | None) -> DataFile:
    """A file created in ``directory`` as a data file would be, and removed again: its ``direct`` and ``align``
    say how that directory's data files will be accessed (the returned file is closed)."""
    fd, probe = tempfile.mkstemp(prefix=".fp-dcp-probe-", dir=directory)
    os.close(fd)
    os.unlink(probe)
    f = open_file(probe, create=True, direct=direct)
    f.close()
    os.unlink(probe)
    return f


_COPIES_BY_DEVICE: dict[int, bool] = {}  # st_dev: whether the kernel copies what is written there
_MEMORY_BY_DEVICE: dict[int, bool] = {}  # st_dev: whether it is a memory filesystem
_MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")


def in_memory(directory: str) -> bool:
    """Whether ``directory`` (which exists) is on a memory filesystem (tmpfs, ramfs). Asked once per device and
    process."""
    device = os.stat(directory).st_dev
    if device not in _MEMORY_BY_DEVICE:
        _MEMORY_BY_DEVICE[device] = filesystem_of(directory) in _MEMORY_FILESYSTEMS
    return _MEMORY_BY_DEVICE[device]


def _all_cached(fd: int) -> bool:
    """Whether every page of the open file is in the page cache (cachestat, Linux 6.5); False where the kernel
    cannot tell."""
    size = os.fstat(fd).st_size
    pages = _cio.cached_pages(fd, 0, size)
    return pages is not None and pages >= -(-size // PAGE)


def from_memory(f: DataFile) -> bool:
    """Whether reads of ``f`` are served from memory, so that the CPU copies every byte and no device waits:
    it is on a memory filesystem, or it is read through the page cache and every page of it is there."""
    return in_memory(os.path.dirname(f.path) or ".") or (not f.direct and _all_cached(f.fd))


def kernel_copies(directory: str, direct: bool | None) -> bool:
    """Whether the kernel copies every byte written to data files created in ``directory`` (which exists): they
    go through the page cache (``direct`` False, or a filesystem that refuses O_DIRECT), or the filesystem is
    memory (tmpfs, which takes O_DIRECT from Linux 6.6 on and copies then too). Asked once per device and
    process."""
    if direct is False or in_memory(directory):
        return True
    device = os.stat(directory).st_dev
    if device not in _COPIES_BY_DEVICE:
        try:
            _COPIES_BY_DEVICE[device] = not probe_file(directory, direct).direct
        except OSError:
            return False  # direct=True where the filesystem refuses: the save itself says so
    return _COPIES_BY_DEVICE[device]


def in_place(setting: bool | None, f: DataFile, pool: BufferPool) -> bool:
    """Whether runs of ``f`` move straight between tensor memory and the file, not through ``pool``.

    ``setting`` is ``IOConfig.direct_writes`` or ``direct_reads``; None (auto)
    copies through the pool only where that gets the disk larger requests:
    O_DIRECT files on a disk whose requests scattered memory caps, from
    buffers in huge pages (which saved faster on a virtio disk:
    docs/benchmarks.md, "Slow disks").
    """
    if not f.direct:
        return True  # the page cache copies the bytes anyway
    if setting is not None:
        return setting
    return not (pool.huge and scatter_caps_requests(os.path.dirname(f.path)))


def preallocate(f: DataFile, size: int) -> None:
    """Reserve ``size`` bytes for ``f`` now: a full disk fails here, cleanly, before any data is written."""
    if size == 0:
        return  # a file of empty items only; fallocate refuses a length of 0 (EINVAL)
    try:
        _cio.fallocate(f.fd, 0, size)
    except OSError as e:
        if e.errno == errno_mod.ENOSPC:
            raise OSError(e.errno, f"no space left for a {size}-byte checkpoint file", f.path) from None
        if e.errno not in (errno_mod.EOPNOTSUPP, errno_mod.ENOSYS):
            raise OSError(e.errno, e.strerror, f.path) from None
        os.ftruncate(f.fd, size)


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Have the kernel start writing a range just written through the page cache to the disk, without waiting
    (``_cio.start_writeback``): a file written piece by piece then has most of its bytes on the disk by the time
    its fsync comes, which waits only for the rest. Best effort: a failure here is the fsync's to report."""
    with contextlib.suppress(OSError):
        _cio.start_writeback(fd, offset, length)


def fsync_path(path: str, *, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_directory(directory: str) -> None:
    """Make the names in ``directory`` (new files, renames, removals) durable."""
    fsync_path(directory, directory=True)


class ReplaceFailedError(OSError):
    """The new file could not be put in place: the target still holds what it held before."""


def replace_durably(path: str, tmp: str, write: Callable[[str], None]) -> None:
    """Make ``path`` hold what ``write(tmp)`` writes into the new file ``tmp``, atomically and durably.

    ``tmp`` (in ``path``'s directory) is written, fsynced and renamed over
    ``path``, then the directory is fsynced. A failure before the rename
    removes ``tmp`` and raises ``ReplaceFailedError`` for an OSError (the
    target is untouched); a failure of the final directory fsync is raised
    as it is, since the new file is then in place.
    """
    try:
        write(tmp)
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise ReplaceFailedError(e.errno, f"{e.strerror} (writing {os.path.basename(path)})", tmp) from e
        raise
    fsync_directory(os.path.dirname(os.path.abspath(path)))


def write_durably(path: str, data: bytes | str, tmp: str | None = None) -> None:
    """Make ``path`` hold ``data``, atomically and durably (``replace_durably``; ``tmp`` defaults to a unique name)."""
    content = data.encode() if isinstance(data, str) else data

    def write(name: str) -> None:
        with open(name, "xb") as f:
            f.write(content)

    replace_durably(path, tmp or f"{path}.{secrets.token_hex(4)}.tmp", write)
