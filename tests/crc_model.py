"""A numpy model of ``cuda/crc32c.cu``'s arithmetic, for machines without a GPU.

It cuts every row as the kernel does (chunks of ``CHUNK`` bytes and pieces of
``PIECE`` bytes, both counted from the row's end), checksums every piece with
the byte table, multiplies each by its thread's factor, XORs a chunk's
pieces, multiplies by the chunk's factor and XORs the chunks into the row:
all pieces of all rows of a launch at once, as the kernel's blocks and
threads do. The factors are the ``powers`` fp-dcp passes to the kernel. Tests
check it against ``_cio.crc32c``, and the CPU route runs it in place of the
kernel's launch (``cuda_double.ModelCrc``).
"""

from __future__ import annotations

import numpy as np

from fp_dcp.gpu.crc import CHUNK, PIECE, THREADS, powers

POLY = np.uint32(0x82F63B78)
X0 = np.uint32(1 << 31)  # x^0 in the reflected domain


def slicing_tables() -> np.ndarray:
    """The kernel's tables: tables[k][i] is the CRC register after byte i and k zero bytes."""
    tables = np.empty((4, 256), dtype=np.uint32)
    c = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        c = np.where(c & 1, (c >> 1) ^ POLY, c >> 1)
    tables[0] = c
    for k in range(1, 4):
        tables[k] = (tables[k - 1] >> 8) ^ tables[0][tables[k - 1] & 0xFF]
    return tables


TABLES = slicing_tables()
POWERS = np.array(powers(), dtype=np.uint32)


def multiply(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a * b modulo P, element-wise (fp_dcp_crc_multiply): b * x^k for every k, XORed where a has x^k."""
    a, b = np.broadcast_arrays(np.asarray(a, dtype=np.uint32), np.asarray(b, dtype=np.uint32))
    shifted = np.empty((32, *b.shape), dtype=np.uint32)
    shifted[0] = b
    for k in range(1, 32):
        prev = shifted[k - 1]
        shifted[k] = (prev >> 1) ^ (prev & 1) * POLY
    degrees = (31 - np.arange(32, dtype=np.uint32)).reshape((32,) + (1,) * a.ndim)
    has = (a >> degrees) & 1 == 1  # x^k is bit 31 - k
    return np.bitwise_xor.reduce(np.where(has, shifted, np.uint32(0)), axis=0)


def past_pieces(pieces: np.ndarray) -> np.ndarray:
    """x^(8 * PIECE * pieces) mod P, element-wise (fp_dcp_crc_past_pieces)."""
    pieces = np.asarray(pieces, dtype=np.uint64)
    p = np.full(pieces.shape, X0, dtype=np.uint32)
    for b, power in enumerate(POWERS):
        selected = (pieces >> np.uint64(b)) & 1 == 1
        if selected.any():
            p = np.where(selected, multiply(power, p), p)
    return p


FACTORS = past_pieces(np.arange(THREADS))  # each thread's, by its piece's place from the chunk's end


def _bytes_in_step(c: np.ndarray, pieces: np.ndarray, lead: np.ndarray) -> np.ndarray:
    """Byte by byte, every piece (a row of ``pieces``) in step: the registers ``c`` after each piece's bytes,
    which start at column ``lead``."""
    for j in range(pieces.shape[1]):
        c = np.where(j >= lead, TABLES[0][(c ^ pieces[:, j]) & 0xFF] ^ (c >> 8), c)
    return c


def _words_in_step(c: np.ndarray, words: np.ndarray) -> np.ndarray:
    """Four bytes at a time through the slicing tables (the kernel's 16-byte loads), every piece in step."""
    t = TABLES
    for j in range(words.shape[1]):
        c = c ^ words[:, j]
        c = t[3][c & 0xFF] ^ t[2][(c >> 8) & 0xFF] ^ t[1][(c >> 16) & 0xFF] ^ t[0][c >> 24]
    return c


def piece_crcs(rows: list[np.ndarray]) -> list[np.ndarray]:
    """The finished CRC-32C of each piece of each row (with bytes), piece q counted from the row's end.

    A row's first piece (at its start: 1 to PIECE bytes) is the only short
    one; the others are read through views, so no row's bytes are copied.
    """
    heads = [len(row) - (-(-len(row) // PIECE) - 1) * PIECE for row in rows]
    first = np.zeros((len(rows), PIECE), dtype=np.uint8)
    for i, (row, head) in enumerate(zip(rows, heads, strict=True)):
        first[i, PIECE - head :] = row[:head]
    start = np.full(len(rows), 0xFFFFFFFF, dtype=np.uint32)
    first_crcs = ~_bytes_in_step(start, first, PIECE - np.array(heads))
    crcs = []
    for row, head, first_crc in zip(rows, heads, first_crcs, strict=True):
        words = row[head:].view("<u4").reshape(-1, PIECE // 4)[::-1]  # whole pieces, from the row's end
        whole = ~_words_in_step(np.full(len(words), 0xFFFFFFFF, dtype=np.uint32), words) if len(words) else []
        crcs.append(np.append(whole, first_crc).astype(np.uint32))
    return crcs


def crc32c_rows(rows: list[np.ndarray]) -> np.ndarray:
    """The CRC-32C (uint32) of every row (uint8 arrays), as one launch of the kernel computes them."""
    result = np.zeros(len(rows), dtype=np.uint32)
    filled = [r for r, row in enumerate(rows) if len(row)]  # a row of no bytes keeps 0, the CRC of nothing
    if not filled:
        return result
    crcs = piece_crcs([rows[r] for r in filled])
    owner = np.concatenate([np.full(len(c), r) for r, c in zip(filled, crcs, strict=True)])
    q = np.concatenate([np.arange(len(c)) for c in crcs])
    lanes = multiply(FACTORS[q % THREADS], np.concatenate(crcs))
    chunk = q // THREADS  # e: the chunk, counted from the row's end
    group = owner * (1 << 40) + chunk  # (row, chunk): runs of consecutive pieces
    starts = np.flatnonzero(np.r_[True, group[1:] != group[:-1]])
    chunk_crcs = np.bitwise_xor.reduceat(lanes, starts)
    shifted = multiply(past_pieces(chunk[starts] * THREADS), chunk_crcs)
    np.bitwise_xor.at(result, owner[starts], shifted)
    return result


__all__ = ["CHUNK", "PIECE", "THREADS", "crc32c_rows", "multiply", "past_pieces"]
