// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78, the value _cio.crc32c gives) of many device
// byte ranges in one launch, so that no host thread reads a GPU tensor's bytes to checksum them.
//
// Compiled at run time by fp_dcp.gpu.crc through cupy's RawModule (NVRTC); CI compiles it with nvcc
// for sm_90 and runs its __host__ __device__ routines on the CPU through a host harness that
// emulates every block and thread (tests/test_cuda_sources.py). No #include: NVRTC has no standard
// headers, and nothing here needs one.
//
// The arithmetic. A row of n bytes is cut from its END into chunks of FP_DCP_CRC_CHUNK bytes, and
// each chunk into FP_DCP_CRC_THREADS pieces of FP_DCP_CRC_PIECE bytes, again from the end: only the
// row's first piece and chunk may be short (or empty). Every thread computes the finished CRC-32C of
// its piece. A finished CRC is linear in the sense of zlib's crc32_combine:
//     crc(A || B) = crc(A) * x^(8|B|) ^ crc(B)         (products modulo P, in GF(2))
// so crc(row) is the XOR, over its pieces, of crc(piece) * x^(8 * bytes after the piece). Counted
// from the end, the bytes after piece p of chunk e are (e * THREADS + p) * PIECE: the multiplier of a
// thread is the same for every chunk, and the chunk's own one depends on e only. Each block XORs its
// threads' products, multiplies by the chunk's factor, and XORs that into the row's result
// (atomicXor: XOR is associative and commutative, so blocks may finish in any order and the result is
// still exact). Factors are products of powers[b] = x^(8 * PIECE * 2^b) mod P, passed in by the host.

#define FP_DCP_CRC_THREADS 256
#define FP_DCP_CRC_PIECE 256
#define FP_DCP_CRC_CHUNK (FP_DCP_CRC_THREADS * FP_DCP_CRC_PIECE)
#define FP_DCP_CRC_POWERS 48
#define FP_DCP_CRC_POLY 0x82F63B78u

// One row: the bytes [src, src + nbytes); its chunks are numbered from first_chunk on, in a
// numbering shared by all rows of the launch (the host fills the table: three uint64 per row).
struct fp_dcp_crc_row {
    unsigned long long src;
    unsigned long long nbytes;
    unsigned long long first_chunk;
};

// Entry i of the slicing-by-4 tables: tables[k][i] is the CRC register after byte i and k zero bytes.
// Called for every i with k = 0 first (each k reads all of tables[0]).
__host__ __device__ inline void fp_dcp_crc_table_entry(unsigned int (*tables)[256], unsigned int i, unsigned int k)
{
    if (k == 0) {
        unsigned int c = i;
        for (int bit = 0; bit < 8; bit++)
            c = (c & 1u) ? (c >> 1) ^ FP_DCP_CRC_POLY : c >> 1;
        tables[0][i] = c;
    } else {
        unsigned int c = tables[k - 1][i];
        tables[k][i] = (c >> 8) ^ tables[0][c & 0xFFu];
    }
}

// a * b modulo P; x^0 is bit 31 (the reflected domain, as in zlib's multmodp).
__host__ __device__ inline unsigned int fp_dcp_crc_multiply(unsigned int a, unsigned int b)
{
    unsigned int p = 0;
    for (unsigned int m = 1u << 31; m; m >>= 1) {
        if (a & m)
            p ^= b;
        b = (b & 1u) ? (b >> 1) ^ FP_DCP_CRC_POLY : b >> 1;
    }
    return p;
}

// x^(8 * PIECE * pieces) mod P: the factor that moves a CRC past `pieces` whole pieces.
__host__ __device__ inline unsigned int fp_dcp_crc_past_pieces(const unsigned int* powers,
                                                               unsigned long long pieces)
{
    unsigned int p = 1u << 31;
    for (int b = 0; pieces && b < FP_DCP_CRC_POWERS; b++, pieces >>= 1)
        if (pieces & 1ULL)
            p = fp_dcp_crc_multiply(powers[b], p);
    return p;
}

// The finished CRC-32C of [p, p + n): single bytes up to a 16-byte boundary, then 16-byte loads
// (four words through the slicing tables), then the tail. Any alignment, any length (0 gives 0).
__host__ __device__ inline unsigned int fp_dcp_crc_bytes(const unsigned int (*tables)[256],
                                                         const unsigned char* p, unsigned long long n)
{
    unsigned int c = 0xFFFFFFFFu;
    while (n && ((unsigned long long)p & 15ULL)) {
        c = tables[0][(c ^ *p++) & 0xFFu] ^ (c >> 8);
        n--;
    }
    for (; n >= 16; n -= 16, p += 16) {
        const uint4 v = *(const uint4*)p;
        const unsigned int words[4] = {v.x, v.y, v.z, v.w};
        for (int w = 0; w < 4; w++) {
            c ^= words[w];
            c = tables[3][c & 0xFFu] ^ tables[2][(c >> 8) & 0xFFu] ^ tables[1][(c >> 16) & 0xFFu] ^
                tables[0][c >> 24];
        }
    }
    while (n--)
        c = tables[0][(c ^ *p++) & 0xFFu] ^ (c >> 8);
    return ~c;
}

// The row holding launch-wide chunk number `chunk`: the last row whose first_chunk <= chunk (rows
// without bytes own no chunk, and share their first_chunk with the row after them).
__host__ __device__ inline unsigned int fp_dcp_crc_find_row(const fp_dcp_crc_row* rows, unsigned int count,
                                                            unsigned long long chunk)
{
    unsigned int lo = 0, hi = count;
    while (hi - lo > 1) {
        const unsigned int mid = lo + (hi - lo) / 2;
        if (rows[mid].first_chunk <= chunk)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

// Chunk e (counted from the row's end) of a row of n bytes: where it ends, from the row's start.
__host__ __device__ inline unsigned long long fp_dcp_crc_chunk_end(unsigned long long n, unsigned long long e)
{
    return n - e * FP_DCP_CRC_CHUNK;
}

// What one thread adds to its chunk: the CRC of its piece (piece p from the chunk's end) times the
// factor for the bytes after it in the chunk (`factor`, the same in every chunk).
__host__ __device__ inline unsigned int fp_dcp_crc_lane(const unsigned int (*tables)[256], const unsigned char* row,
                                                        unsigned long long chunk_end, unsigned int p,
                                                        unsigned int factor)
{
    const unsigned long long after = (unsigned long long)p * FP_DCP_CRC_PIECE;
    if (chunk_end <= after)
        return 0; // the row starts after this piece: it is empty
    const unsigned long long end = chunk_end - after;
    const unsigned long long start = end > FP_DCP_CRC_PIECE ? end - FP_DCP_CRC_PIECE : 0;
    return fp_dcp_crc_multiply(factor, fp_dcp_crc_bytes(tables, row + start, end - start));
}

// One block per chunk (grid-stride over the launch's chunks), FP_DCP_CRC_THREADS threads each.
// out[row] must be zero before the launch; a row of no bytes keeps 0, the CRC-32C of nothing.
extern "C" __global__ void __launch_bounds__(FP_DCP_CRC_THREADS)
    fp_dcp_crc32c(const fp_dcp_crc_row* __restrict__ rows, unsigned int count, unsigned long long chunks,
                  const unsigned int* __restrict__ powers, unsigned int* __restrict__ out)
{
    __shared__ unsigned int tables[4][256];
    __shared__ unsigned int warps[FP_DCP_CRC_THREADS / 32];
    for (unsigned int k = 0; k < 4; k++) {
        for (unsigned int i = threadIdx.x; i < 256; i += blockDim.x)
            fp_dcp_crc_table_entry(tables, i, k);
        __syncthreads();
    }
    const unsigned int p = FP_DCP_CRC_THREADS - 1 - threadIdx.x; // pieces run from the chunk's end
    const unsigned int factor = fp_dcp_crc_past_pieces(powers, p);
    for (unsigned long long chunk = blockIdx.x; chunk < chunks; chunk += gridDim.x) {
        const unsigned int r = fp_dcp_crc_find_row(rows, count, chunk);
        const fp_dcp_crc_row row = rows[r];
        const unsigned long long in_row = (row.nbytes + FP_DCP_CRC_CHUNK - 1) / FP_DCP_CRC_CHUNK;
        const unsigned long long e = in_row - 1 - (chunk - row.first_chunk);
        unsigned int v = fp_dcp_crc_lane(tables, (const unsigned char*)row.src, fp_dcp_crc_chunk_end(row.nbytes, e),
                                         p, factor);
        for (int lanes = 16; lanes; lanes >>= 1)
            v ^= __shfl_xor_sync(0xFFFFFFFFu, v, lanes);
        if ((threadIdx.x & 31u) == 0)
            warps[threadIdx.x >> 5] = v;
        __syncthreads();
        if (threadIdx.x == 0) {
            unsigned int chunk_crc = 0;
            for (int w = 0; w < FP_DCP_CRC_THREADS / 32; w++)
                chunk_crc ^= warps[w];
            atomicXor(out + r, fp_dcp_crc_multiply(fp_dcp_crc_past_pieces(powers, e * FP_DCP_CRC_THREADS), chunk_crc));
        }
        __syncthreads(); // warps[] is rewritten by the next chunk
    }
}
