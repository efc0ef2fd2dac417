"""Every kernel in cuda/ compiles with nvcc for sm_90 (H100/H200), and the gather's and the CRC's logic is right.

No GPU needed: the kernels are compiled, not run, and their routines
(``__host__ __device__``) run on the CPU through small host programs that
emulate every thread of a block: the gather's copy against memcpy, the
CRC-32C's pieces and their combination against ``_cio.crc32c``. Skipped only
where nvcc is missing (CI machines have it).
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CUDA_DIR = ROOT / "cuda"
SOURCES = sorted(CUDA_DIR.glob("*.cu"))


def find_nvcc() -> str | None:
    return shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if os.access(p, os.X_OK)), None)


NVCC = find_nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc (CUDA toolkit) is not installed")


def test_cuda_folder_is_not_a_python_package():
    assert SOURCES, "cuda/ holds no kernels"
    assert not list(CUDA_DIR.rglob("__init__.py")), "a package named cuda would shadow NVIDIA's cuda module"


@needs_nvcc
@pytest.mark.parametrize("source", SOURCES, ids=[s.name for s in SOURCES])
def test_kernel_compiles_for_sm90(source, tmp_path):
    assert NVCC is not None
    done = subprocess.run(
        [NVCC, "-arch=sm_90", "-Werror", "all-warnings", "-c", str(source), "-o", str(tmp_path / "kernel.o")],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr


HARNESS = r"""
#include "gather.cu"
#include <cstdio>
#include <cstdlib>
#include <cstring>

// Emulate one block per segment, every lane in turn, over random sizes and
// alignments; compare with memcpy, and check nothing outside the segment moved.
int main() {
    static unsigned char src[1 << 16], out[1 << 17], expected[1 << 17];
    unsigned int seed = 12345;
    for (unsigned i = 0; i < sizeof src; i++) {
        seed = seed * 1103515245u + 12345u;
        src[i] = (unsigned char)(seed >> 16);
    }
    const unsigned lanes_choices[] = {1, 3, 32, 256};
    for (int trial = 0; trial < 4000; trial++) {
        seed = seed * 1103515245u + 12345u; unsigned long long from = (seed >> 8) % 4096;
        seed = seed * 1103515245u + 12345u; unsigned long long to = (seed >> 8) % 4096;
        seed = seed * 1103515245u + 12345u; unsigned long long n = (seed >> 8) % 5000;
        unsigned lanes = lanes_choices[trial % 4];
        memset(out, 0xAB, sizeof out);
        memset(expected, 0xAB, sizeof expected);
        memcpy(expected + to, src + from, n);
        for (unsigned lane = 0; lane < lanes; lane++)
            fp_dcp_copy_segment(src + from, out + to, n, lane, lanes);
        if (memcmp(out, expected, sizeof out) != 0) {
            printf("mismatch: from %llu to %llu n %llu lanes %u\n", from, to, n, lanes);
            return 1;
        }
    }
    printf("ok\n");
    return 0;
}
"""


def host_program(tmp_path: Path, source: str) -> Path:
    """``source`` (a host program that includes kernels of cuda/) built with nvcc."""
    assert NVCC is not None
    (tmp_path / "harness.cu").write_text(source)
    built = subprocess.run(
        [NVCC, "-I", str(CUDA_DIR), str(tmp_path / "harness.cu"), "-o", str(tmp_path / "harness")],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert built.returncode == 0, built.stderr
    return tmp_path / "harness"


@needs_nvcc
def test_gather_copy_routine_on_the_cpu(tmp_path):
    ran = subprocess.run([str(host_program(tmp_path, HARNESS))], capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0 and ran.stdout.strip() == "ok", ran.stdout + ran.stderr


CRC_HARNESS = r"""
#include "crc32c.cu"
#include <cstdio>
#include <cstdlib>
#include <vector>

// Emulate one launch of fp_dcp_crc32c: every block (chunk) and every thread of it, the warp and block
// XORs and the atomicXor into the row's result, through the kernel's own __host__ __device__ routines.
// Input (stdin): 48 powers, the row count, per row its offset into the data and its length, the data size
// and the data; output: one CRC per row, in hex.
int main() {
    unsigned int powers[FP_DCP_CRC_POWERS];
    for (int b = 0; b < FP_DCP_CRC_POWERS; b++)
        if (scanf("%x", &powers[b]) != 1) return 2;
    unsigned int count;
    if (scanf("%u", &count) != 1) return 2;
    std::vector<unsigned long long> offsets(count), sizes(count);
    for (unsigned int r = 0; r < count; r++)
        if (scanf("%llu %llu", &offsets[r], &sizes[r]) != 2) return 2;
    unsigned long long size;
    if (scanf("%llu", &size) != 1 || getchar() != '\n') return 2;
    unsigned char* data = (unsigned char*)aligned_alloc(64, size + 64);
    if (fread(data, 1, size, stdin) != size) return 2;
    std::vector<fp_dcp_crc_row> rows(count);
    unsigned long long chunks = 0;
    for (unsigned int r = 0; r < count; r++) {
        rows[r].src = (unsigned long long)(data + offsets[r]);
        rows[r].nbytes = sizes[r];
        rows[r].first_chunk = chunks;
        chunks += (sizes[r] + FP_DCP_CRC_CHUNK - 1) / FP_DCP_CRC_CHUNK;
    }
    static unsigned int tables[4][256];
    for (unsigned int k = 0; k < 4; k++)
        for (unsigned int i = 0; i < 256; i++)
            fp_dcp_crc_table_entry(tables, i, k);
    std::vector<unsigned int> out(count, 0);
    for (unsigned long long chunk = 0; chunk < chunks; chunk++) {
        const unsigned int r = fp_dcp_crc_find_row(rows.data(), count, chunk);
        const unsigned long long in_row = (rows[r].nbytes + FP_DCP_CRC_CHUNK - 1) / FP_DCP_CRC_CHUNK;
        const unsigned long long e = in_row - 1 - (chunk - rows[r].first_chunk);
        unsigned int chunk_crc = 0;
        for (unsigned int thread = 0; thread < FP_DCP_CRC_THREADS; thread++) {
            const unsigned int p = FP_DCP_CRC_THREADS - 1 - thread;
            chunk_crc ^= fp_dcp_crc_lane(tables, (const unsigned char*)rows[r].src,
                                         fp_dcp_crc_chunk_end(rows[r].nbytes, e), p,
                                         fp_dcp_crc_past_pieces(powers, p));
        }
        out[r] ^= fp_dcp_crc_multiply(fp_dcp_crc_past_pieces(powers, e * FP_DCP_CRC_THREADS), chunk_crc);
    }
    for (unsigned int r = 0; r < count; r++)
        printf("%08x\n", out[r]);
    return 0;
}
"""


@needs_nvcc
def test_crc_kernel_routines_on_the_cpu_give_the_host_crc(tmp_path):
    """The kernel's own arithmetic, every thread of every block emulated on the CPU, against ``_cio.crc32c``."""
    from fp_dcp._native import _cio
    from fp_dcp.gpu.crc import CHUNK, PIECE, powers

    harness = host_program(tmp_path, CRC_HARNESS)
    rng = random.Random(7)
    data = rng.randbytes((6 << 20) + 4096)
    sizes = [0, 1, 3, 15, 16, 17, PIECE - 1, PIECE, PIECE + 1, CHUNK - 1, CHUNK, CHUNK + 1, 0, 5 * CHUNK + 77]
    sizes += [rng.randrange(1, 3 * CHUNK) for _ in range(40)] + [(5 << 20) + 3]
    rows = [(rng.randrange(4096), n) for n in sizes]  # unaligned starts: the kernel's byte head and tail
    lines = [" ".join(f"{p:x}" for p in powers()), str(len(rows)), *(f"{o} {n}" for o, n in rows), str(len(data))]
    ran = subprocess.run(
        [str(harness)], input="\n".join(lines).encode() + b"\n" + data, capture_output=True, timeout=120
    )
    assert ran.returncode == 0, ran.stderr
    got = [int(line, 16) for line in ran.stdout.split()]
    assert got == [_cio.crc32c(data[o : o + n]) for o, n in rows]
