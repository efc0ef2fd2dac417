"""The transport's file sink, on its own: what a received copy does to the disk before it is published."""

from __future__ import annotations

import errno
import os

from fp_dcp._native import _cio
from fp_dcp.net import transport
from fp_dcp.net.transport import FileSink


class Accept:
    """A check that finds every byte fine (the sink's own concern here is the file)."""

    def feed(self, data: memoryview | bytes) -> None:
        pass

    def problems(self, where: str) -> list[str]:
        return []


def received(path, chunks: list[bytes]) -> list[str]:
    sink = FileSink(str(path), Accept())
    for chunk in chunks:
        sink.write(memoryview(chunk))
    return sink.done("test")


def test_each_chunk_received_starts_its_writeback_before_the_next_arrives(tmp_path, monkeypatch):
    """The fsync that publishes a copy then waits only for what is left, not for the whole file."""
    asked: list[tuple[int, int]] = []
    sizes: list[int] = []
    real = transport.start_writeback

    def spy(fd: int, offset: int, length: int) -> None:
        sizes.append(os.fstat(fd).st_size)  # the chunk is in the kernel already: written, not buffered
        asked.append((offset, length))
        real(fd, offset, length)

    monkeypatch.setattr(transport, "start_writeback", spy)
    chunks = [os.urandom(n) for n in (1 << 20, 1 << 20, 12345)]
    assert received(tmp_path / "f", chunks) == []
    assert (tmp_path / "f").read_bytes() == b"".join(chunks)
    assert asked == [(0, 1 << 20), (1 << 20, 1 << 20), (2 << 20, 12345)]
    assert sizes == [1 << 20, 2 << 20, (2 << 20) + 12345]


def test_a_writeback_the_kernel_refuses_leaves_the_copy_to_its_fsync(tmp_path, monkeypatch):
    def refuse(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EIO, "refused")

    monkeypatch.setattr(_cio, "start_writeback", refuse)
    chunks = [os.urandom(4096), os.urandom(100)]
    assert received(tmp_path / "f", chunks) == []
    assert (tmp_path / "f").read_bytes() == b"".join(chunks)
