"""The C extension on its own: CRC-32C, XXH3-128, the ring, the system helpers."""

from __future__ import annotations

import errno
import mmap
import os
import random
import shutil
import subprocess

import pytest
from conftest import needs_xxhash

from fp_dcp._native import _cio

needs_uring = pytest.mark.skipif(not _cio.HAVE_IO_URING, reason="built without liburing")


def crc32c_reference(data: bytes, crc: int = 0) -> int:
    """Bit-by-bit CRC-32C straight from the polynomial's definition."""
    crc ^= 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def test_crc32c_known_vector():
    assert _cio.crc32c(b"123456789") == 0xE3069283  # RFC 3720 check value
    assert _cio.crc32c(b"") == 0
    assert _cio.crc32c(bytes(32)) == 0x8A9136AA  # RFC 3720 B.4: 32 zero bytes


@pytest.mark.parametrize("length", [1, 7, 8, 63, 4096, 3 * 8192 - 1, 3 * 8192, 3 * 8192 + 9, 100_003])
def test_crc32c_matches_reference_at_every_alignment(length):
    rng = random.Random(length)
    raw = bytes(rng.getrandbits(8) for _ in range(length + 8))
    for shift in (0, 1, 3, 7):
        data = raw[shift : shift + length]
        expected = crc32c_reference(data) if length < 5000 else None
        got = _cio.crc32c(data)
        if expected is not None:
            assert got == expected
        cut = rng.randrange(length + 1)
        assert _cio.crc32c(data[cut:], _cio.crc32c(data[:cut])) == got  # chaining


def test_crc32c_lanes_match_reference():
    """Inputs long enough for the three interleaved lanes, checked bit by bit."""
    data = os.urandom(2 * 3 * 8192 + 77)
    assert _cio.crc32c(data) == crc32c_reference(data)
    assert _cio.crc32c(memoryview(data)[5:]) == crc32c_reference(data[5:])


@pytest.mark.parametrize("cut", [0, 1, 8191, 4 << 20])
def test_crc32c_combine_joins_pieces_checksummed_apart(cut):
    data = os.urandom((4 << 20) + 4099)
    a, b = data[:cut], data[cut:]
    assert _cio.crc32c_combine(_cio.crc32c(a), _cio.crc32c(b), len(b)) == _cio.crc32c(data)
    assert _cio.crc32c_combine(_cio.crc32c(data), 0, 0) == _cio.crc32c(data)
    small = b"123456789"
    assert _cio.crc32c_combine(crc32c_reference(small[:4]), crc32c_reference(small[4:]), 5) == 0xE3069283


@pytest.mark.parametrize("length", [(1 << 29) - 1, 1 << 29, (5 << 32) + 12_345, (1 << 63) + 77])
def test_crc32c_combine_shifts_past_half_a_gibibyte(length):
    # crc(A||B) depends on B's length through x^(8|B|): shifting past |B| in two steps must equal one shift,
    # also where 8|B| has bits at 2^32 and beyond (x^(2^32) is x^2 modulo this polynomial, not x).
    crc = _cio.crc32c(b"fp-dcp")
    half = length // 2
    in_two = _cio.crc32c_combine(_cio.crc32c_combine(crc, 0, half), 0, length - half)
    assert _cio.crc32c_combine(crc, 0, length) == in_two
    third = length // 3
    in_three = _cio.crc32c_combine(
        _cio.crc32c_combine(_cio.crc32c_combine(crc, 0, third), 0, third), 0, length - 2 * third
    )
    assert in_three == in_two


def test_crc32c_combine_refuses_values_beyond_32_bits():
    with pytest.raises(ValueError, match="32 bits"):
        _cio.crc32c_combine(1 << 32, 0, 1)


def test_copy_crc32c_copies_and_checksums():
    src = os.urandom(1_000_001)
    dst = bytearray(len(src))
    assert _cio.copy_crc32c(dst, src, 0) == _cio.crc32c(src)
    assert bytes(dst) == src
    with pytest.raises(ValueError, match="dst has"):
        _cio.copy_crc32c(bytearray(3), b"abcd")
    with pytest.raises(TypeError):
        _cio.copy_crc32c(b"read-only", b"read-only")
    with pytest.raises(ValueError, match="32 bits"):
        _cio.crc32c(b"x", 1 << 40)


@pytest.mark.parametrize(
    "length", [158, 159, 160, 175, 255, 256, 1000, (64 << 10) - 1, 64 << 10, (64 << 10) + 143, (3 << 20) + 77]
)
def test_copy_crc32c_in_one_pass_matches_the_reference(length):
    """Copies that checksum as they go (the carry-less fold, where the CPU has one): every tail past the last
    128-byte block and 16-byte lane, destinations at every alignment to 32 bytes, streamed (64 KiB and up) or
    not, continuing a CRC; against the bit-by-bit reference (short ones) or crc32c's separate pass."""
    rng = random.Random(length)
    raw = rng.randbytes(length + 8)
    for shift in (0, 5):
        src = raw[shift : shift + length]
        for offset in (0, 1, 16, 31):
            start = rng.getrandbits(32)
            want = crc32c_reference(src, start) if length < 5000 else _cio.crc32c(src, start)
            buf = bytearray(length + 64)
            assert _cio.copy_crc32c(memoryview(buf)[offset : offset + length], src, start) == want
            assert bytes(buf[offset : offset + length]) == src
            assert not any(buf[:offset]) and not any(buf[offset + length :])  # nothing written around it


def test_copies_checksum_in_one_pass_where_the_cpu_can_fold():
    with open("/proc/cpuinfo") as f:
        flags = next((line.split(":")[1].split() for line in f if line.startswith("flags")), [])
    can = {"avx2", "vpclmulqdq", "sse4_2"} <= set(flags)
    assert _cio.COPY_CRC32C_ENGINE == ("vpclmulqdq" if can else _cio.CRC32C_ENGINE)


def aligned(n: int) -> mmap.mmap:
    return mmap.mmap(-1, n)


@needs_uring
def xxhsum(path) -> str:
    """XXH3-128 of a file by xxHash's own command line tool (Debian's xxhash package): an independent reference."""
    if shutil.which("xxhsum") is None:
        pytest.skip("xxhsum is not installed (make system-deps installs it)")
    return subprocess.run(["xxhsum", "-H2", str(path)], capture_output=True, text=True, check=True).stdout.split()[0]


@needs_xxhash
@pytest.mark.parametrize("length", [0, 1, 16, 128, 129, 240, 241, 1024, 100_003, 3 * (1 << 20) + 5])
def test_hash128_is_xxh3_128_as_xxhsum_computes_it(tmp_path, length):
    data = random.Random(length).randbytes(length)
    (tmp_path / "data").write_bytes(data)
    h = _cio.Hash128()
    h.update(data)
    assert h.hexdigest() == xxhsum(tmp_path / "data")


@needs_xxhash
def test_hash128_known_vector_and_streaming_in_pieces():
    assert _cio.Hash128().hexdigest() == "99aa06d3014798d86001c324468d497f"  # XXH3_128bits of no bytes
    data = random.Random(7).randbytes(1_000_003)
    whole = _cio.Hash128()
    whole.update(data)
    pieces = _cio.Hash128()
    cuts = sorted(random.Random(8).sample(range(1, len(data)), 40))
    for start, stop in zip([0, *cuts], [*cuts, len(data)], strict=True):
        pieces.update(memoryview(data)[start:stop])
    assert pieces.hexdigest() == whole.hexdigest()


@needs_xxhash
@pytest.mark.parametrize("length", [10, 300_000, 1_000_003])
def test_checksums_feed_the_hasher_the_same_bytes_in_the_same_pass(length):
    data = random.Random(length).randbytes(length)
    expected = _cio.Hash128()
    expected.update(data)
    fed = _cio.Hash128()
    assert _cio.crc32c(data, 0, fed) == _cio.crc32c(data)
    assert fed.hexdigest() == expected.hexdigest()
    dst = bytearray(length)
    copied = _cio.Hash128()
    half = length // 2
    crc = _cio.copy_crc32c(memoryview(dst)[:half], data[:half], 0, copied)
    crc = _cio.copy_crc32c(memoryview(dst)[half:], data[half:], crc, copied)
    assert bytes(dst) == data and crc == _cio.crc32c(data) and copied.hexdigest() == expected.hexdigest()


@needs_xxhash
def test_hasher_must_be_a_hash128():
    with pytest.raises(TypeError, match="hasher must be a Hash128"):
        _cio.crc32c(b"abc", 0, object())
    assert _cio.crc32c(b"abc", 0, None) == _cio.crc32c(b"abc")


@pytest.mark.parametrize("length, step", [(0, 4096), (1, 4096), (300_001, 4096), (300_001, 1 << 20)])
def test_write_crc32c_writes_step_by_step_and_checksums_what_it_wrote(tmp_path, length, step):
    data = random.Random(length).randbytes(length)
    fd = os.open(tmp_path / "f", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        assert _cio.write_crc32c(fd, 7, data, step, 0x1234) == _cio.crc32c(data, 0x1234)
        assert os.pread(fd, length + 8, 0) == (bytes(7) + data if length else b"")  # nothing written: no file extended
        if hasattr(_cio, "Hash128"):
            fed, expected = _cio.Hash128(), _cio.Hash128()
            expected.update(data)
            assert _cio.write_crc32c(fd, 0, data, step, 0, fed) == _cio.crc32c(data)
            assert fed.hexdigest() == expected.hexdigest()
        with pytest.raises(ValueError, match="step must be positive"):
            _cio.write_crc32c(fd, 0, data, 0)
    finally:
        os.close(fd)
    with pytest.raises(OSError) as e:
        _cio.write_crc32c(fd, 0, b"x", 4096)  # closed
    assert e.value.errno == errno.EBADF
    read_only = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        with pytest.raises(OSError) as e:
            _cio.write_crc32c(read_only, 0, b"x", 4096)
        assert e.value.errno == errno.EBADF
    finally:
        os.close(read_only)


def test_ring_write_read_fsync_roundtrip(tmp_path):
    path = tmp_path / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT)
    try:
        ring = _cio.Ring(4)
        out, back = aligned(1 << 16), aligned(1 << 16)
        out[:] = os.urandom(1 << 16)
        ring.register_buffers([out])
        assert ring.fixed_buffers == 1
        ring.write(fd, memoryview(out)[:8192], 0, "a")  # fixed buffer
        ring.write(fd, memoryview(out)[8192:], 8192, "b")
        done = dict(ring.wait(2))
        assert done == {"a": 8192, "b": (1 << 16) - 8192}
        ring.fsync(fd, "sync", datasync=True)
        assert ring.wait(1) == [("sync", 0)]
        ring.read(fd, memoryview(back), 0, "r")  # not registered: plain read
        assert ring.wait(1) == [("r", 1 << 16)]
        assert back[:] == out[:]
        assert ring.in_flight == 0
        ring.close()
        with pytest.raises(ValueError, match="closed"):
            ring.wait(0)
    finally:
        os.close(fd)


@needs_uring
def test_ring_punts_page_cache_transfers_to_the_kernels_workers(tmp_path):
    """Punted (IOSQE_ASYNC) writes and reads move the same bytes; errors come back the same way."""
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    try:
        ring = _cio.Ring(8)
        out = bytearray(os.urandom(1 << 20))
        for i in range(4):
            ring.write(fd, memoryview(out)[i << 18 : (i + 1) << 18], i << 18, i, True)
        assert sorted(ring.wait(4)) == [(i, 1 << 18) for i in range(4)]
        back = bytearray(1 << 20)
        ring.read(fd, memoryview(back), 0, "r", True)
        assert ring.wait(1) == [("r", 1 << 20)] and back == out
        ring.read(-1, memoryview(back), 0, "bad-fd", True)
        assert ring.wait(1) == [("bad-fd", -errno.EBADF)]
        ring.close()
    finally:
        os.close(fd)


@needs_uring
def test_ring_reports_errno_and_bounds_depth(tmp_path):
    ring = _cio.Ring(2)
    buf = aligned(4096)
    ring.read(-1, memoryview(buf), 0, "bad-fd")
    assert ring.wait(1) == [("bad-fd", -errno.EBADF)]
    fd = os.open(tmp_path / "g", os.O_RDWR | os.O_CREAT | os.O_DIRECT)
    try:
        ring.write(fd, memoryview(buf)[:1000], 0, "unaligned")  # O_DIRECT refuses odd lengths
        assert ring.wait(1) == [("unaligned", -errno.EINVAL)]
        ring.write(fd, memoryview(buf), 0, 1)
        ring.write(fd, memoryview(buf), 4096, 2)
        with pytest.raises(BlockingIOError):
            ring.write(fd, memoryview(buf), 8192, 3)
        assert sorted(tag for tag, _ in ring.wait(2)) == [1, 2]
        with pytest.raises(TypeError):
            ring.read(fd, b"immutable", 0, "x")
        with pytest.raises(ValueError, match="depth"):
            _cio.Ring(0)
    finally:
        ring.close()
        os.close(fd)


@needs_uring
def test_ring_keeps_buffer_alive_while_in_flight(tmp_path):
    """An in-flight request holds its buffer: the mapping cannot be closed under it."""
    fd = os.open(tmp_path / "h", os.O_RDWR | os.O_CREAT)
    ring = _cio.Ring(1)
    buf = aligned(4096)
    ring.write(fd, memoryview(buf), 0, "w")
    with pytest.raises(BufferError):
        buf.close()
    ring.wait(1)
    buf.close()  # released with the completion
    ring.close()
    os.close(fd)


def test_dio_alignment_and_fallocate(tmp_path):
    fd = os.open(tmp_path / "i", os.O_RDWR | os.O_CREAT)
    try:
        reported = _cio.dio_alignment(fd)
        assert reported is None or all(isinstance(v, int) for v in reported)
        _cio.fallocate(fd, 0, 1 << 20)
        assert os.fstat(fd).st_size == 1 << 20
        with pytest.raises(OSError) as e:
            _cio.fallocate(-1, 0, 10)
        assert e.value.errno == errno.EBADF
    finally:
        os.close(fd)
    buf = aligned(8192)
    assert _cio.address(buf) % mmap.PAGESIZE == 0
    assert _cio.address(memoryview(buf)[100:]) == _cio.address(buf) + 100


def test_cached_pages_counts_what_the_page_cache_holds(tmp_path):
    path = tmp_path / "c"
    path.write_bytes(os.urandom(5 * mmap.PAGESIZE + 1))
    fd = os.open(path, os.O_RDONLY)
    try:
        if _cio.cached_pages(fd, 0, 1) is None:
            pytest.skip("the kernel has no cachestat (Linux 6.5)")
        assert _cio.cached_pages(fd, 0, 1 << 40) == 6  # just written: every page, the partial last one too
        assert _cio.cached_pages(fd, mmap.PAGESIZE, 2 * mmap.PAGESIZE) == 2
        assert _cio.cached_pages(fd, 0, 0) == 0  # an empty range, not cachestat's "to the end"
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert _cio.cached_pages(fd, 0, 1 << 40) == 0
        os.pread(fd, 10, 2 * mmap.PAGESIZE)
        assert 1 <= _cio.cached_pages(fd, 0, 1 << 40) <= 6  # the page read, and what readahead brought with it
    finally:
        os.close(fd)
    with pytest.raises(OSError) as e:
        _cio.cached_pages(-1, 0, 10)
    assert e.value.errno == errno.EBADF


def _anonymous(size: int) -> mmap.mmap:
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def test_advise_huge_names_only_untouched_blocks_and_populate_touches_them():
    huge = 2 << 20
    m = _anonymous(16 * huge)
    view = memoryview(m)
    start = -_cio.address(view) % huge  # the first 2 MiB boundary inside the mapping
    blocks = (len(m) - start) // huge
    view[start + 3 * huge + 17] = 1  # touches one block (one page of it, or all of it where huge pages are on)
    runs = _cio.advise_huge(view)
    if not runs:  # a kernel without transparent huge pages advises nothing, and says so by returning none
        assert (
            not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled")
            or "[never]" in open("/sys/kernel/mm/transparent_hugepage/enabled").read()
        )
    else:
        assert runs == [(start, 3 * huge), (start + 4 * huge, (blocks - 4) * huge)]
    before = bytes(view[start + 3 * huge : start + 3 * huge + 32])
    faulted = _cio.populate(view)
    assert bytes(view[start + 3 * huge : start + 3 * huge + 32]) == before  # populating changes no byte
    # every page but those the write above brought in (one, or a whole huge page)
    assert len(m) - huge <= faulted <= len(m) - mmap.PAGESIZE
    assert _cio.populate(view) == 0  # pages already there are not walked again
    assert _cio.advise_huge(view) == []  # every block holds pages now
    assert _cio.advise_huge(view[:4096]) == []  # less than a whole aligned block: nothing to ask for
    view.release()
    m.close()


def test_populate_and_advise_huge_refuse_read_only_memory():
    with pytest.raises(BufferError, match="not writable"):
        _cio.populate(b"immutable")
    with pytest.raises(BufferError, match="not writable"):
        _cio.advise_huge(b"immutable")
    _cio.populate(bytearray())  # nothing to do
