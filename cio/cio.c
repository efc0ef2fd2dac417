/*
 * fp_dcp._native._cio: the native half of fp-dcp.
 *
 * - Ring: a thin wrapper over one liburing ring. Requests are queued with
 *   write()/read()/fsync(), submitted and reaped with wait(). The ring holds a
 *   buffer export and the caller's tag for every request until its completion
 *   is reaped, so memory under an in-flight request can never be freed. It
 *   never retries, splits or interprets results: completions carry the raw
 *   result (bytes or -errno) and the policy lives in Python.
 * - crc32c / copy_crc32c: CRC-32C (Castagnoli) through ISA-L's folding kernels
 *   (PCLMULQDQ/VPCLMULQDQ) where built with libisal, else the SSE4.2
 *   instruction (three interleaved streams), else tables; copies fold as they
 *   go where the CPU has VPCLMULQDQ (copy_fold); GIL released; given a
 *   Hash128, they feed it the same bytes in the same pass. crc32c_combine
 *   joins the CRCs of pieces checksummed apart. read_crc32c reads a file in
 *   memory through a small buffer and copies it on, checksummed the same way;
 *   write_crc32c writes one step by step, checksumming each step after it.
 * - Hash128: a running XXH3-128 (libxxhash), the content hash incremental
 *   saves compare items by. Absent when built without libxxhash.
 * - dio_alignment / fallocate / cached_pages / address: small system
 *   helpers; populate and advise_huge prepare memory a load is about to
 *   fill; userfaultfd, register_untouched, fill_crc32c, serve_faults and
 *   unregister fill untouched memory page by page (UFFDIO_COPY), without
 *   the kernel clearing it first.
 *
 * Every libc/liburing return code is checked; errors become OSError.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>

#ifdef FP_DCP_HAVE_LIBURING
#include <liburing.h>
#endif

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#ifdef FP_DCP_HAVE_ISAL
#include <isa-l/crc.h>
#endif

#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#if defined(__linux__) && __has_include(<linux/userfaultfd.h>)
#include <linux/userfaultfd.h>
#include <poll.h>
#include <sys/ioctl.h>
#define FP_DCP_HAVE_USERFAULTFD 1
#ifndef UFFD_USER_MODE_ONLY
#define UFFD_USER_MODE_ONLY 1 /* Linux 5.11: faults in user mode only, allowed without privileges */
#endif
#endif

#ifdef FP_DCP_HAVE_XXHASH
#include <xxhash.h>
#if defined(__x86_64__)
#include <xxh_x86dispatch.h> /* libxxhash picks SSE2, AVX2 or AVX-512 at run time */
#endif
#endif

/* Python's own buffers are released around copies and checksums this large. */
#define GIL_RELEASE_BYTES (64 * 1024)
/* Kernel read/write calls transfer at most this much in one request. */
#define MAX_REQUEST_BYTES (1u << 30)

/* ------------------------------------------------------------------ CRC32C */

#define CRC32C_POLY 0x82F63B78u /* reflected Castagnoli polynomial */

static uint32_t crc_sw_table[8][256];

static void crc_sw_init(void)
{
    for (uint32_t b = 0; b < 256; b++) {
        uint32_t c = b;
        for (int k = 0; k < 8; k++)
            c = (c & 1) ? (c >> 1) ^ CRC32C_POLY : c >> 1;
        crc_sw_table[0][b] = c;
    }
    for (uint32_t b = 0; b < 256; b++)
        for (int t = 1; t < 8; t++)
            crc_sw_table[t][b] = (crc_sw_table[t - 1][b] >> 8) ^
                                 crc_sw_table[0][crc_sw_table[t - 1][b] & 0xff];
}

/* Raw CRC register update (no pre/post inversion), slicing-by-8. */
static uint32_t crc_sw(uint32_t crc, const uint8_t *p, size_t n)
{
    while (n && ((uintptr_t)p & 7)) {
        crc = crc_sw_table[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
        n--;
    }
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        v ^= crc;
        crc = crc_sw_table[7][v & 0xff] ^ crc_sw_table[6][(v >> 8) & 0xff] ^
              crc_sw_table[5][(v >> 16) & 0xff] ^ crc_sw_table[4][(v >> 24) & 0xff] ^
              crc_sw_table[3][(v >> 32) & 0xff] ^ crc_sw_table[2][(v >> 40) & 0xff] ^
              crc_sw_table[1][(v >> 48) & 0xff] ^ crc_sw_table[0][v >> 56];
        p += 8;
        n -= 8;
    }
    while (n--)
        crc = crc_sw_table[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
    return crc;
}

static uint32_t (*crc_raw)(uint32_t, const uint8_t *, size_t) = crc_sw;
static int crc_hardware = 0;
static const char *crc_engine = "tables";
static int fold_usable = 0; /* copy_fold runs here (AVX2, VPCLMULQDQ, SSE4.2) */

#if defined(__x86_64__)
/*
 * One crc32 instruction has a latency of three cycles but a throughput of
 * one, so three independent streams over adjacent lanes run three times as
 * fast. The lanes are joined with the linearity of the raw register:
 * crc(r, A||B) = shift(crc(r, A)) ^ crc(0, B), where shift advances a
 * register over LANE zero bytes; shift is linear, hence four table lookups.
 */
#define LANE 8192

static uint32_t crc_shift_table[4][256];

__attribute__((target("sse4.2"))) static uint32_t crc_hw_1way(uint32_t crc, const uint8_t *p,
                                                               size_t n)
{
    while (n && ((uintptr_t)p & 7)) {
        crc = _mm_crc32_u8(crc, *p++);
        n--;
    }
    uint64_t c = crc;
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        c = _mm_crc32_u64(c, v);
        p += 8;
        n -= 8;
    }
    crc = (uint32_t)c;
    while (n--)
        crc = _mm_crc32_u8(crc, *p++);
    return crc;
}

static uint32_t crc_shift(uint32_t x)
{
    return crc_shift_table[0][x & 0xff] ^ crc_shift_table[1][(x >> 8) & 0xff] ^
           crc_shift_table[2][(x >> 16) & 0xff] ^ crc_shift_table[3][x >> 24];
}

__attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t crc, const uint8_t *p, size_t n)
{
    while (n && ((uintptr_t)p & 7)) {
        crc = _mm_crc32_u8(crc, *p++);
        n--;
    }
    while (n >= 3 * LANE) {
        uint64_t c0 = crc, c1 = 0, c2 = 0;
        for (size_t i = 0; i < LANE; i += 8) {
            uint64_t v0, v1, v2;
            memcpy(&v0, p + i, 8);
            memcpy(&v1, p + LANE + i, 8);
            memcpy(&v2, p + 2 * LANE + i, 8);
            c0 = _mm_crc32_u64(c0, v0);
            c1 = _mm_crc32_u64(c1, v1);
            c2 = _mm_crc32_u64(c2, v2);
        }
        crc = crc_shift(crc_shift((uint32_t)c0) ^ (uint32_t)c1) ^ (uint32_t)c2;
        p += 3 * LANE;
        n -= 3 * LANE;
    }
    return crc_hw_1way(crc, p, n);
}

static void crc_hw_init(void)
{
    static const uint8_t zeros[LANE];
    uint32_t basis[32];
    for (int i = 0; i < 32; i++)
        basis[i] = crc_hw_1way(1u << i, zeros, LANE);
    for (int k = 0; k < 4; k++)
        for (uint32_t b = 0; b < 256; b++) {
            uint32_t v = 0;
            for (int j = 0; j < 8; j++)
                if (b & (1u << j))
                    v ^= basis[8 * k + j];
            crc_shift_table[k][b] = v;
        }
    crc_raw = crc_hw;
    crc_hardware = 1;
    crc_engine = "sse4.2";
}
#endif

/*
 * Combining: crc(A||B) = crc(A) * x^(8|B|) ^ crc(B) over GF(2) modulo the polynomial, for the
 * finished (inverted) values too, as in zlib's crc32_combine. Pieces checksummed apart (other threads,
 * the GPU) are joined with it. Products are in the reflected domain, where x^0 is bit 31.
 */
/* x^(2^k) mod P for every bit of 8n, n a 64-bit length. The table cannot wrap at 32 as zlib's does:
 * for this P, x^(2^32) is x^2, not x. */
static uint32_t crc_x2n_table[67];

static uint32_t crc_multmodp(uint32_t a, uint32_t b)
{
    uint32_t p = 0;
    for (uint32_t m = 1u << 31; m; m >>= 1) {
        if (a & m)
            p ^= b;
        b = (b & 1) ? (b >> 1) ^ CRC32C_POLY : b >> 1;
    }
    return p;
}

static void crc_combine_init(void)
{
    uint32_t p = 1u << 30; /* x^1 */
    for (int k = 0; k < 67; k++) {
        crc_x2n_table[k] = p;
        p = crc_multmodp(p, p);
    }
}

/* x^(8n) mod P */
static uint32_t crc_x8n(uint64_t n)
{
    uint32_t p = 1u << 31; /* x^0 */
    for (int k = 3; n; n >>= 1, k++)
        if (n & 1)
            p = crc_multmodp(crc_x2n_table[k], p);
    return p;
}

static uint32_t crc_combine(uint32_t crc1, uint32_t crc2, uint64_t len2)
{
    return crc_multmodp(crc_x8n(len2), crc1) ^ crc2;
}

#ifdef FP_DCP_HAVE_ISAL
/* ISA-L folds 64-byte blocks with carry-less multiplies, picking the widest unit at run time. Its
 * crc32_iscsi takes and returns the raw register, as crc_raw does; its length is an int, and copy_crc_hash
 * never passes more than COPY_STEP. */
static uint32_t crc_isal(uint32_t crc, const uint8_t *p, size_t n)
{
    return crc32_iscsi((unsigned char *)p, (int)n, crc);
}
#endif

static void crc_init(void)
{
    crc_sw_init();
    crc_combine_init();
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("sse4.2"))
        crc_hw_init();
    fold_usable = __builtin_cpu_supports("sse4.2") && __builtin_cpu_supports("avx2") &&
                  __builtin_cpu_supports("vpclmulqdq");
#endif
#ifdef FP_DCP_HAVE_ISAL
    crc_raw = crc_isal;
    crc_hardware = 1;
    crc_engine = "isa-l";
#endif
}

static int parse_crc(PyObject *obj, uint32_t *out)
{
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    if (v > 0xffffffffULL) {
        PyErr_SetString(PyExc_ValueError, "crc must fit in 32 bits");
        return -1;
    }
    *out = (uint32_t)v;
    return 0;
}

/* ------------------------------------------------------------------ XXH3-128 */

#ifdef FP_DCP_HAVE_XXHASH

typedef struct {
    PyObject_HEAD XXH3_state_t *state;
    int busy; /* set (under the GIL) while an update runs without it */
} HashObject;

static PyTypeObject HashType;

static int hash_init(HashObject *h, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, ":Hash128", kwlist))
        return -1;
    if (!h->state && !(h->state = XXH3_createState())) {
        PyErr_NoMemory();
        return -1;
    }
    if (XXH3_128bits_reset(h->state) != XXH_OK) {
        PyErr_SetString(PyExc_RuntimeError, "XXH3_128bits_reset failed");
        return -1;
    }
    h->busy = 0;
    return 0;
}

static void hash_dealloc(HashObject *h)
{
    if (h->state)
        XXH3_freeState(h->state);
    Py_TYPE(h)->tp_free((PyObject *)h);
}

/* Claim h for an update that may run without the GIL; NULL (error set) if it is not a Hash128 or in use. */
static HashObject *hash_claim(PyObject *obj)
{
    if (!PyObject_TypeCheck(obj, &HashType)) {
        PyErr_Format(PyExc_TypeError, "hasher must be a Hash128, not %s", Py_TYPE(obj)->tp_name);
        return NULL;
    }
    HashObject *h = (HashObject *)obj;
    if (!h->state || h->busy) {
        PyErr_SetString(PyExc_RuntimeError, "Hash128 is uninitialized or in use by another thread");
        return NULL;
    }
    h->busy = 1;
    return h;
}

static int hash_feed(HashObject *h, const void *p, size_t n)
{
    return XXH3_128bits_update(h->state, p, n) == XXH_OK ? 0 : -1;
}

/* Give back what hash_claim took (h may be NULL: no hasher). */
static void hash_release(HashObject *h)
{
    if (h)
        h->busy = 0;
}

#else
typedef struct HashObject HashObject;
static HashObject *hash_claim(PyObject *obj)
{
    (void)obj;
    PyErr_SetString(PyExc_NotImplementedError,
                    "fp_dcp._native._cio was built without libxxhash: no content hashing");
    return NULL;
}
static int hash_feed(HashObject *h, const void *p, size_t n)
{
    (void)h, (void)p, (void)n;
    return -1;
}
static void hash_release(HashObject *h) { (void)h; }
#endif

/* Checksum (and, with dst, copy) in cache-sized steps: each step is checksummed and hashed first, which brings
 * it into the cache, then copied from there. */
#define COPY_STEP (256 * 1024)
/* Copies this large go around the cache (non-temporal stores): the copy's destination is not read again soon
 * (a load's target, a buffer the disk reads), and skipping the read-for-ownership of every destination line
 * saved a fifth of the CPU time of a copy and checksum here. */
#define STREAM_MIN (64 * 1024)

static void copy_stream(uint8_t *dst, const uint8_t *src, size_t n)
{
#if defined(__x86_64__)
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    size_t i = head;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + i, src + i, n - i);
#else
    memcpy(dst, src, n);
#endif
}

#if defined(__x86_64__)
/*
 * Copy and CRC in one pass, for copies without a content hash (every staged copy of a save or a load): each
 * 128-byte block is loaded once, stored, and folded into four 256-bit accumulators with carry-less multiplies
 * (VPCLMULQDQ), so the bytes cross from memory once. Checksumming a step first and copying it from the cache
 * after (the loop below, which a hash and older CPUs take) ran copy and CRC at 9 GB/s against memcpy's 16
 * here; the CRC was half of a staged load's CPU time. This fold runs at 25 GB/s in cache on one core. It is
 * the standard one for reflected CRCs (Gopal et al., "Fast CRC Computation for Generic Polynomials Using
 * PCLMULQDQ", Intel, 2009); its constants are x^e mod P, bit-reflected: e = 1055 and 991 fold 1024 bits
 * ahead, e = 159 and 95 fold 128 bits ahead. The 128 bits left at the end go through the crc32 instruction,
 * which reduces them modulo P.
 */
#define FOLD_TARGET __attribute__((target("avx2,vpclmulqdq,pclmul,sse4.2")))

FOLD_TARGET static inline __m128i fold128(__m128i x, __m128i next)
{
    const __m128i k = _mm_set_epi64x(0x493c7d27, 0xf20c0dfe);
    return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11)), next);
}

FOLD_TARGET static inline __m256i fold1024(__m256i x, __m256i next)
{
    const __m256i k = _mm256_set_epi64x(0x0d3b6092, 0x6992cea2, 0x0d3b6092, 0x6992cea2);
    return _mm256_xor_si256(
        _mm256_xor_si256(_mm256_clmulepi64_epi128(x, k, 0x00), _mm256_clmulepi64_epi128(x, k, 0x11)), next);
}

/* The raw register c continued over n >= 128 bytes of src, copied to dst (streamed: dst 32-byte aligned). */
FOLD_TARGET static uint32_t copy_fold(uint8_t *dst, const uint8_t *src, size_t n, uint32_t c, int stream)
{
#define LOAD(at) _mm256_loadu_si256((const __m256i *)(src + (at)))
#define STORE(at, v)                                                                                           \
    (stream ? _mm256_stream_si256((__m256i *)(dst + (at)), (v)) : _mm256_storeu_si256((__m256i *)(dst + (at)), (v)))
    __m256i x0 = LOAD(0), x1 = LOAD(32), x2 = LOAD(64), x3 = LOAD(96);
    STORE(0, x0);
    STORE(32, x1);
    STORE(64, x2);
    STORE(96, x3);
    x0 = _mm256_xor_si256(x0, _mm256_zextsi128_si256(_mm_cvtsi32_si128((int)c))); /* the register enters as
                                                                                     the first four bytes */
    size_t i = 128;
    for (; i + 128 <= n; i += 128) {
        __m256i y0 = LOAD(i), y1 = LOAD(i + 32), y2 = LOAD(i + 64), y3 = LOAD(i + 96);
        STORE(i, y0);
        STORE(i + 32, y1);
        STORE(i + 64, y2);
        STORE(i + 96, y3);
        x0 = fold1024(x0, y0);
        x1 = fold1024(x1, y1);
        x2 = fold1024(x2, y2);
        x3 = fold1024(x3, y3);
    }
#undef LOAD
#undef STORE
    __m256i lanes[4] = {x0, x1, x2, x3};
    __m128i x = _mm256_castsi256_si128(x0);
    for (int j = 0; j < 4; j++) {
        if (j)
            x = fold128(x, _mm256_castsi256_si128(lanes[j]));
        x = fold128(x, _mm256_extracti128_si256(lanes[j], 1));
    }
    for (; i + 16 <= n; i += 16) {
        __m128i y = _mm_loadu_si128((const __m128i *)(src + i));
        _mm_storeu_si128((__m128i *)(dst + i), y);
        x = fold128(x, y);
    }
    uint64_t r = _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(x));
    r = _mm_crc32_u64(r, (uint64_t)_mm_extract_epi64(x, 1));
    memcpy(dst + i, src + i, n - i);
    return crc_hw_1way((uint32_t)r, src + i, n - i);
}
#undef FOLD_TARGET
#endif

/* Copy (dst non-NULL), checksum (crc non-NULL: continued in place) and hash (h non-NULL) n bytes of src. */
static int copy_crc_hash(uint8_t *dst, const uint8_t *src, size_t n, uint32_t *crc, HashObject *h)
{
    uint32_t c = crc ? ~*crc : 0;
    int stream = dst && n >= STREAM_MIN;
    int rc = 0;
#if defined(__x86_64__)
    if (fold_usable && dst && crc && !h && n >= 128 + 31) {
        size_t head = stream ? (32 - ((uintptr_t)dst & 31)) & 31 : 0;
        memcpy(dst, src, head);
        c = copy_fold(dst + head, src + head, n - head, crc_raw(c, src, head), stream);
        if (stream)
            _mm_sfence();
        *crc = ~c;
        return 0;
    }
#endif
    for (size_t off = 0; off < n; off += COPY_STEP) {
        size_t m = n - off < COPY_STEP ? n - off : COPY_STEP;
        const uint8_t *block = src + off;
        if (crc)
            c = crc_raw(c, block, m);
        if (h && hash_feed(h, block, m) < 0) {
            rc = -1;
            break;
        }
        if (stream)
            copy_stream(dst + off, block, m);
        else if (dst)
            memcpy(dst + off, block, m);
    }
#if defined(__x86_64__)
    if (stream)
        _mm_sfence(); /* the streamed lines are visible (to the disk's DMA too) before anyone is told */
#endif
    if (crc)
        *crc = ~c;
    return rc;
}

/* copy_crc_hash on Python buffers, GIL released for large ones, the hasher claimed meanwhile; 0, or -1 with
 * an exception set. */
static int checksum_buffers(Py_buffer *dst, Py_buffer *src, uint32_t *crc, PyObject *hasher)
{
    HashObject *h = NULL;
    int rc;
    if (hasher && hasher != Py_None && !(h = hash_claim(hasher)))
        return -1;
    uint8_t *out = dst ? dst->buf : NULL;
    if (src->len >= GIL_RELEASE_BYTES) {
        Py_BEGIN_ALLOW_THREADS rc = copy_crc_hash(out, src->buf, (size_t)src->len, crc, h);
        Py_END_ALLOW_THREADS
    } else {
        rc = copy_crc_hash(out, src->buf, (size_t)src->len, crc, h);
    }
    hash_release(h);
    if (rc < 0) {
        PyErr_SetString(PyExc_RuntimeError, "XXH3_128bits_update failed");
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(crc32c_doc, "crc32c(data, crc=0, hasher=None, /) -> int\n\n"
                         "CRC-32C of a bytes-like object; pass the previous result as crc to "
                         "continue a running checksum. A Hash128 given as hasher is fed the "
                         "same bytes in the same pass.");

static PyObject *py_crc32c(PyObject *self, PyObject *args)
{
    Py_buffer data;
    PyObject *crc_obj = NULL, *hasher = NULL, *result = NULL;
    uint32_t crc = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*|OO:crc32c", &data, &crc_obj, &hasher))
        return NULL;
    if ((!crc_obj || parse_crc(crc_obj, &crc) == 0) && checksum_buffers(NULL, &data, &crc, hasher) == 0)
        result = PyLong_FromUnsignedLong(crc);
    PyBuffer_Release(&data);
    return result;
}

PyDoc_STRVAR(copy_crc32c_doc,
             "copy_crc32c(dst, src, crc=0, hasher=None, /) -> int\n\n"
             "Copy src into dst (same length) and return the CRC-32C of the copied bytes, "
             "continuing from crc; a Hash128 given as hasher is fed them too. One pass over "
             "memory instead of two or three.");

static PyObject *py_copy_crc32c(PyObject *self, PyObject *args)
{
    Py_buffer dst, src;
    PyObject *crc_obj = NULL, *hasher = NULL, *result = NULL;
    uint32_t crc = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*y*|OO:copy_crc32c", &dst, &src, &crc_obj, &hasher))
        return NULL;
    if (dst.len != src.len)
        PyErr_Format(PyExc_ValueError, "copy_crc32c: dst has %zd bytes, src has %zd", dst.len,
                     src.len);
    else if ((!crc_obj || parse_crc(crc_obj, &crc) == 0) && checksum_buffers(&dst, &src, &crc, hasher) == 0)
        result = PyLong_FromUnsignedLong(crc);
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return result;
}

PyDoc_STRVAR(read_crc32c_doc,
             "read_crc32c(fd, offset, dst, bounce, crc=0, /) -> (int, int)\n\n"
             "Read len(dst) bytes of fd from offset into dst through bounce, CRC-32C continued from crc as "
             "they are copied on; (crc, bytes read), fewer only where the file ended. GIL released.");

/* For files in memory (tmpfs): a read straight into the target is the kernel's copy from memory into memory,
 * whose destination lines are read for ownership, and the CRC then reads the target again. Read through a
 * small bounce buffer instead, the kernel's copy lands in this core's cache and copy_crc_hash streams it on
 * with the CRC folded in: 2 GB from tmpfs on two threads, 10 GB/s and 0.19 CPU-s/GB against 7 and 0.25.
 * Returns 0 or an errno; *done: the bytes read (fewer than n where the file ended). */
static int read_through(int fd, uint64_t offset, uint8_t *dst, size_t n, uint8_t *bounce, size_t bounce_len,
                        uint32_t *crc, size_t *done)
{
    *done = 0;
    while (*done < n) {
        size_t want = n - *done < bounce_len ? n - *done : bounce_len;
        ssize_t got = pread(fd, bounce, want, (off_t)(offset + *done));
        if (got < 0 && errno == EINTR)
            continue;
        if (got < 0)
            return errno;
        if (got == 0)
            return 0;
        copy_crc_hash(dst + *done, bounce, (size_t)got, crc, NULL);
        *done += (size_t)got;
    }
    return 0;
}

static PyObject *py_read_crc32c(PyObject *self, PyObject *args)
{
    int fd, err = 0;
    unsigned long long offset;
    Py_buffer dst, bounce;
    PyObject *crc_obj = NULL, *result = NULL;
    uint32_t crc = 0;
    size_t done = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "iKw*w*|O:read_crc32c", &fd, &offset, &dst, &bounce, &crc_obj))
        return NULL;
    if (bounce.len <= 0)
        PyErr_SetString(PyExc_ValueError, "read_crc32c: bounce is empty");
    else if (!crc_obj || parse_crc(crc_obj, &crc) == 0) {
        Py_BEGIN_ALLOW_THREADS err = read_through(fd, offset, dst.buf, (size_t)dst.len, bounce.buf,
                                                  (size_t)bounce.len, &crc, &done);
        Py_END_ALLOW_THREADS
        if (err) {
            errno = err;
            PyErr_SetFromErrno(PyExc_OSError);
        } else {
            result = Py_BuildValue("(kn)", (unsigned long)crc, (Py_ssize_t)done);
        }
    }
    PyBuffer_Release(&dst);
    PyBuffer_Release(&bounce);
    return result;
}

PyDoc_STRVAR(write_crc32c_doc,
             "write_crc32c(fd, offset, src, step, crc=0, hasher=None, /) -> int\n\n"
             "Write src to fd at offset, step bytes per pwrite, and return the CRC-32C of its bytes continued "
             "from crc, each step checksummed (and fed to hasher, a Hash128) right after its write. GIL released; "
             "a write that fails raises OSError, one that writes nothing EIO.");

/* For files in memory (tmpfs): the write is the kernel's copy out of src, so a step's bytes are in this core's
 * cache when it returns, and the CRC reads them there rather than from memory a second time. Returns 0 or an
 * errno. */
static int write_through(int fd, uint64_t offset, const uint8_t *src, size_t n, size_t step, uint32_t *crc,
                         HashObject *h)
{
    size_t done = 0;
    while (done < n) {
        size_t want = n - done < step ? n - done : step;
        ssize_t put = pwrite(fd, src + done, want, (off_t)(offset + done));
        if (put < 0 && errno == EINTR)
            continue;
        if (put < 0)
            return errno;
        if (put == 0)
            return EIO;
        if (copy_crc_hash(NULL, src + done, (size_t)put, crc, h) < 0)
            return -1;
        done += (size_t)put;
    }
    return 0;
}

static PyObject *py_write_crc32c(PyObject *self, PyObject *args)
{
    int fd, err = 0;
    unsigned long long offset;
    Py_ssize_t step;
    Py_buffer src;
    PyObject *crc_obj = NULL, *hasher = NULL, *result = NULL;
    HashObject *h = NULL;
    uint32_t crc = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "iKy*n|OO:write_crc32c", &fd, &offset, &src, &step, &crc_obj, &hasher))
        return NULL;
    if (step <= 0)
        PyErr_SetString(PyExc_ValueError, "write_crc32c: step must be positive");
    else if ((!crc_obj || parse_crc(crc_obj, &crc) == 0) &&
             (!hasher || hasher == Py_None || (h = hash_claim(hasher)))) {
        Py_BEGIN_ALLOW_THREADS err = write_through(fd, offset, src.buf, (size_t)src.len, (size_t)step, &crc, h);
        Py_END_ALLOW_THREADS
        hash_release(h);
        if (err < 0) {
            PyErr_SetString(PyExc_RuntimeError, "XXH3_128bits_update failed");
        } else if (err) {
            errno = err;
            PyErr_SetFromErrno(PyExc_OSError);
        } else {
            result = PyLong_FromUnsignedLong(crc);
        }
    }
    PyBuffer_Release(&src);
    return result;
}

PyDoc_STRVAR(crc32c_combine_doc,
             "crc32c_combine(crc1, crc2, length2, /) -> int\n\n"
             "The CRC-32C of A followed by B, from crc1 = crc32c(A), crc2 = crc32c(B) and length2 = len(B).");

static PyObject *py_crc32c_combine(PyObject *self, PyObject *args)
{
    PyObject *crc1_obj, *crc2_obj;
    unsigned long long length;
    uint32_t crc1, crc2;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOK:crc32c_combine", &crc1_obj, &crc2_obj, &length))
        return NULL;
    if (parse_crc(crc1_obj, &crc1) < 0 || parse_crc(crc2_obj, &crc2) < 0)
        return NULL;
    return PyLong_FromUnsignedLong(crc_combine(crc1, crc2, length));
}

#ifdef FP_DCP_HAVE_XXHASH

PyDoc_STRVAR(hash_update_doc, "update(data, /) -> None\n\nFeed bytes (the GIL is released for large ones).");

static PyObject *hash_update(HashObject *self, PyObject *arg)
{
    Py_buffer data;
    if (PyObject_GetBuffer(arg, &data, PyBUF_SIMPLE) < 0)
        return NULL;
    int rc = checksum_buffers(NULL, &data, NULL, (PyObject *)self);
    PyBuffer_Release(&data);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(hash_hexdigest_doc,
             "hexdigest() -> str\n\nThe XXH3-128 of the bytes fed so far: 32 lowercase hex digits, "
             "xxHash's canonical (big-endian) form, as `xxhsum -H2` prints it.");

static PyObject *hash_hexdigest(HashObject *self, PyObject *unused)
{
    (void)unused;
    if (!self->state || self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "Hash128 is uninitialized or in use by another thread");
        return NULL;
    }
    XXH128_canonical_t canon;
    XXH128_canonicalFromHash(&canon, XXH3_128bits_digest(self->state));
    char hex[33];
    for (int i = 0; i < 16; i++)
        snprintf(hex + 2 * i, 3, "%02x", canon.digest[i]);
    return PyUnicode_FromStringAndSize(hex, 32);
}

static PyMethodDef hash_methods[] = {
    {"update", (PyCFunction)hash_update, METH_O, hash_update_doc},
    {"hexdigest", (PyCFunction)hash_hexdigest, METH_NOARGS, hash_hexdigest_doc},
    {NULL, NULL, 0, NULL}};

static PyTypeObject HashType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "fp_dcp._native._cio.Hash128",
    .tp_doc = "Hash128()\n\nA running XXH3-128 (seed 0). Feed it with update() or as the hasher of "
              "crc32c / copy_crc32c; one thread at a time.",
    .tp_basicsize = sizeof(HashObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)hash_init,
    .tp_dealloc = (destructor)hash_dealloc,
    .tp_methods = hash_methods,
};

#endif /* FP_DCP_HAVE_XXHASH */

/* ----------------------------------------------------------- system helpers */

PyDoc_STRVAR(dio_alignment_doc,
             "dio_alignment(fd, /) -> (mem_align, offset_align)\n\n"
             "Direct-I/O alignment the kernel reports for an open file (statx "
             "STATX_DIOALIGN); (0, 0) when the file does not support direct I/O, None when "
             "the kernel or C library cannot tell.");

static PyObject *py_dio_alignment(PyObject *self, PyObject *args)
{
    int fd;
    (void)self;
    if (!PyArg_ParseTuple(args, "i:dio_alignment", &fd))
        return NULL;
#ifdef STATX_DIOALIGN
    struct statx stx;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &stx);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        if (errno == ENOSYS || errno == EINVAL)
            Py_RETURN_NONE;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (!(stx.stx_mask & STATX_DIOALIGN))
        Py_RETURN_NONE;
    return Py_BuildValue("(II)", stx.stx_dio_mem_align, stx.stx_dio_offset_align);
#else
    Py_RETURN_NONE;
#endif
}

PyDoc_STRVAR(fallocate_doc,
             "fallocate(fd, offset, length, /) -> None\n\n"
             "Reserve blocks and extend the file (Linux fallocate, mode 0). Raises OSError, "
             "EOPNOTSUPP where the filesystem cannot; unlike posix_fallocate it never "
             "emulates by writing.");

static PyObject *py_fallocate(PyObject *self, PyObject *args)
{
    int fd;
    long long offset, length;
    int rc;
    (void)self;
    if (!PyArg_ParseTuple(args, "iLL:fallocate", &fd, &offset, &length))
        return NULL;
    Py_BEGIN_ALLOW_THREADS rc = fallocate(fd, 0, (off_t)offset, (off_t)length);
    Py_END_ALLOW_THREADS
    if (rc < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

/* cachestat(2), Linux 6.5; syscall 451 on every architecture. Declared here since older kernel headers lack it. */
#ifndef __NR_cachestat
#define __NR_cachestat 451
#endif
struct fp_cachestat_range {
    uint64_t off, len;
};
struct fp_cachestat {
    uint64_t nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted;
};

PyDoc_STRVAR(cached_pages_doc,
             "cached_pages(fd, offset, length, /) -> int | None\n\n"
             "Pages of [offset, offset + length) of an open file that are in the page cache, dirty ones "
             "included (cachestat); None where the kernel cannot tell (before Linux 6.5, a seccomp "
             "filter refusing the call, a file without a page cache).");

static PyObject *py_cached_pages(PyObject *self, PyObject *args)
{
    int fd;
    unsigned long long offset, length;
    (void)self;
    if (!PyArg_ParseTuple(args, "iKK:cached_pages", &fd, &offset, &length))
        return NULL;
    if (length == 0) /* cachestat reads 0 as "to the end of the file" */
        return PyLong_FromLong(0);
    struct fp_cachestat_range range = {offset, length};
    struct fp_cachestat cs;
    long rc;
    Py_BEGIN_ALLOW_THREADS rc = syscall(__NR_cachestat, fd, &range, &cs, 0);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        if (errno == ENOSYS || errno == EPERM || errno == EOPNOTSUPP)
            Py_RETURN_NONE;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromUnsignedLongLong(cs.nr_cache);
}

PyDoc_STRVAR(address_doc, "address(buffer, /) -> int\n\nStart address of a bytes-like object.");

static PyObject *py_address(PyObject *self, PyObject *arg)
{
    Py_buffer view;
    (void)self;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *r = PyLong_FromVoidPtr(view.buf);
    PyBuffer_Release(&view);
    return r;
}

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14 */
#endif
#define HUGE_PAGE (2u << 20)

/* The pages holding a buffer: its start rounded down and its end up to the page size. */
static int page_span(Py_buffer *view, uintptr_t *start, size_t *length)
{
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t lo = (uintptr_t)view->buf & ~(page - 1);
    uintptr_t hi = ((uintptr_t)view->buf + (uintptr_t)view->len + page - 1) & ~(page - 1);
    *start = lo;
    *length = hi - lo;
    return view->len > 0;
}

PyDoc_STRVAR(populate_doc,
             "populate(buffer, /) -> int\n\n"
             "Fault in the pages of a writable buffer that hold none yet (mincore), writable, "
             "without changing a byte (madvise MADV_POPULATE_WRITE, Linux 5.14), GIL released; "
             "returns the bytes it faulted in. Pages already there are skipped: faulting them in "
             "again walks them one by one for nothing (a touched target cost 18% more CPU). "
             "Raises OSError: EINVAL where the kernel is older.");

/* MADV_POPULATE_WRITE on [start, end); 0 or -1 with errno set. */
static int populate_run(uintptr_t start, uintptr_t end)
{
    return madvise((void *)start, end - start, MADV_POPULATE_WRITE);
}

/* Populate the runs of [start, start + length) that mincore finds without pages; the bytes populated, or
 * -1 with errno set. Without the vector (no memory for it, or mincore failing), the whole span. */
static ssize_t populate_missing(uintptr_t start, size_t length)
{
    size_t page = (size_t)sysconf(_SC_PAGESIZE), pages = length / page;
    unsigned char *resident = PyMem_RawMalloc(pages);
    if (!resident || mincore((void *)start, length, resident) < 0) {
        PyMem_RawFree(resident);
        return populate_run(start, start + length) < 0 ? -1 : (ssize_t)length;
    }
    ssize_t done = 0;
    size_t i = 0;
    while (i < pages) {
        for (; i < pages && (resident[i] & 1); i++)
            ;
        size_t first = i;
        for (; i < pages && !(resident[i] & 1); i++)
            ;
        if (i > first) {
            if (populate_run(start + first * page, start + i * page) < 0) {
                PyMem_RawFree(resident);
                return -1;
            }
            done += (ssize_t)((i - first) * page);
        }
    }
    PyMem_RawFree(resident);
    return done;
}

static PyObject *py_populate(PyObject *self, PyObject *arg)
{
    Py_buffer view;
    uintptr_t start;
    size_t length;
    ssize_t done = 0;
    (void)self;
    if (PyObject_GetBuffer(arg, &view, PyBUF_WRITABLE) < 0)
        return NULL;
    if (page_span(&view, &start, &length)) {
        Py_BEGIN_ALLOW_THREADS done = populate_missing(start, length);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&view);
    if (done < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    return PyLong_FromSsize_t(done);
}

PyDoc_STRVAR(advise_huge_doc,
             "advise_huge(buffer, /) -> [(offset, length), ...]\n\n"
             "Ask for transparent huge pages (madvise MADV_HUGEPAGE) on the 2 MiB-aligned "
             "blocks of a writable buffer that hold no page yet (mincore), so that their first "
             "touch maps 2 MiB at a time; blocks already touched are left alone. Returns the "
             "runs advised, as offsets into the buffer: none where the kernel has no huge pages.");

/* Advise [start, end) and append it to runs as offsets from base; 0, or -1 with an exception set. */
static int advise_run(PyObject *runs, uintptr_t base, uintptr_t start, uintptr_t end)
{
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = madvise((void *)start, end - start, MADV_HUGEPAGE);
    Py_END_ALLOW_THREADS
    if (rc < 0)
        return 0; /* EINVAL: no transparent huge pages in this kernel; the memory is as it was */
    PyObject *run = Py_BuildValue("(nn)", (Py_ssize_t)(start - base), (Py_ssize_t)(end - start));
    if (!run)
        return -1;
    rc = PyList_Append(runs, run);
    Py_DECREF(run);
    return rc;
}

static PyObject *py_advise_huge(PyObject *self, PyObject *arg)
{
    Py_buffer view;
    (void)self;
    if (PyObject_GetBuffer(arg, &view, PyBUF_WRITABLE) < 0)
        return NULL;
    PyObject *runs = PyList_New(0);
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE), base = (uintptr_t)view.buf;
    uintptr_t lo = (base + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1);
    uintptr_t hi = (base + (uintptr_t)view.len) & ~(uintptr_t)(HUGE_PAGE - 1);
    unsigned char *resident = NULL;
    if (!runs || hi <= lo)
        goto done;
    if (!(resident = PyMem_RawMalloc((hi - lo) / page))) {
        Py_CLEAR(runs);
        PyErr_NoMemory();
        goto done;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = mincore((void *)lo, hi - lo, resident);
    Py_END_ALLOW_THREADS
    if (rc < 0) /* part of the range unmapped: cannot be, for a live buffer; then advise nothing */
        goto done;
    size_t per_block = HUGE_PAGE / page;
    uintptr_t run = 0; /* start of the current run of untouched blocks; 0: none */
    for (uintptr_t block = lo; block <= hi; block += HUGE_PAGE) {
        int untouched = block < hi;
        for (size_t i = 0; untouched && i < per_block; i++)
            untouched = !(resident[(block - lo) / page + i] & 1);
        if (untouched && !run)
            run = block;
        else if (!untouched && run) {
            if (advise_run(runs, base, run, block) < 0) {
                Py_CLEAR(runs);
                break;
            }
            run = 0;
        }
    }
done:
    PyMem_RawFree(resident);
    PyBuffer_Release(&view);
    return runs;
}

/* ------------------------------------------------------- untouched memory */

PyDoc_STRVAR(userfaultfd_doc,
             "userfaultfd() -> int\n\n"
             "A new userfaultfd (close-on-exec, non-blocking, faults in user mode only: Linux 5.11, "
             "no privilege needed), its API handshake done; the caller closes it, which also "
             "unregisters every range registered with it. Raises OSError where the kernel or a "
             "seccomp filter (Docker's default one) refuses it.");

static PyObject *py_userfaultfd(PyObject *self, PyObject *noargs)
{
    (void)self, (void)noargs;
#ifdef FP_DCP_HAVE_USERFAULTFD
    int fd = (int)syscall(__NR_userfaultfd, O_CLOEXEC | O_NONBLOCK | UFFD_USER_MODE_ONLY);
    if (fd < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    struct uffdio_api api = {.api = UFFD_API, .features = 0};
    if (ioctl(fd, UFFDIO_API, &api) < 0) {
        int e = errno;
        close(fd);
        errno = e;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromLong(fd);
#else
    errno = ENOSYS;
    return PyErr_SetFromErrno(PyExc_OSError);
#endif
}

PyDoc_STRVAR(register_untouched_doc,
             "register_untouched(fd, buffer, /) -> (start, end) | None\n\n"
             "Register with userfaultfd fd, for missing pages, the whole pages inside a writable "
             "buffer, if none of them holds a page yet (mincore); returns their address range, or "
             "None where there is no whole page or one is touched. Until fd is closed, a thread "
             "of this process that touches one of them before fill_crc32c fills it waits for "
             "serve_faults to answer, and the kernel's own accesses to them (a read(2) or direct "
             "read into them) fail with EFAULT. Raises OSError where the kernel refuses the memory "
             "(not anonymous or shmem, hugetlbfs, or registered with another userfaultfd).");

static PyObject *py_register_untouched(PyObject *self, PyObject *args)
{
    int fd;
    Py_buffer view;
    (void)self;
    if (!PyArg_ParseTuple(args, "iw*:register_untouched", &fd, &view))
        return NULL;
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE), base = (uintptr_t)view.buf;
    uintptr_t lo = (base + page - 1) & ~(page - 1), hi = (base + (uintptr_t)view.len) & ~(page - 1);
    PyBuffer_Release(&view); /* the caller holds the memory; only its addresses are kept */
    if (hi <= lo)
        Py_RETURN_NONE;
    size_t pages = (hi - lo) / page;
    unsigned char *resident = PyMem_RawMalloc(pages);
    if (!resident)
        return PyErr_NoMemory();
    int rc, touched = 0;
    Py_BEGIN_ALLOW_THREADS rc = mincore((void *)lo, hi - lo, resident);
    for (size_t i = 0; rc == 0 && i < pages && !touched; i++)
        touched = resident[i] & 1;
    Py_END_ALLOW_THREADS
    PyMem_RawFree(resident);
    if (rc < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    if (touched)
        Py_RETURN_NONE;
#ifdef FP_DCP_HAVE_USERFAULTFD
    struct uffdio_register reg = {.range = {.start = lo, .len = hi - lo}, .mode = UFFDIO_REGISTER_MODE_MISSING};
    if (ioctl(fd, UFFDIO_REGISTER, &reg) < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    /* both, or not this memory: hugetlbfs takes neither a zero page nor copies of single small pages */
    uint64_t needed = ((uint64_t)1 << _UFFDIO_COPY) | ((uint64_t)1 << _UFFDIO_ZEROPAGE);
    if ((reg.ioctls & needed) != needed) {
        if (ioctl(fd, UFFDIO_UNREGISTER, &reg.range) < 0)
            return PyErr_SetFromErrno(PyExc_OSError);
        errno = EOPNOTSUPP;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return Py_BuildValue("(KK)", (unsigned long long)lo, (unsigned long long)hi);
#else
    (void)fd;
    errno = ENOSYS;
    return PyErr_SetFromErrno(PyExc_OSError);
#endif
}

PyDoc_STRVAR(unregister_doc,
             "unregister(fd, start, end, /) -> None\n\n"
             "End the registration of [start, end) with userfaultfd fd (UFFDIO_UNREGISTER): its "
             "missing pages fault in as zeros again. Closing fd does the same for all its ranges, "
             "unless a child made by fork still holds it.");

static PyObject *py_unregister(PyObject *self, PyObject *args)
{
    int fd;
    unsigned long long lo, hi;
    (void)self;
    if (!PyArg_ParseTuple(args, "iKK:unregister", &fd, &lo, &hi))
        return NULL;
#ifdef FP_DCP_HAVE_USERFAULTFD
    struct uffdio_range range = {.start = lo, .len = hi - lo};
    if (ioctl(fd, UFFDIO_UNREGISTER, &range) < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
#else
    (void)fd, (void)lo, (void)hi;
    errno = ENOSYS;
    return PyErr_SetFromErrno(PyExc_OSError);
#endif
}

#ifdef FP_DCP_HAVE_USERFAULTFD
/* Install the n bytes at src (whole pages) as the registered pages from dst on; a page already there is
 * copied into instead. 0, or -1 with errno set. */
static int fill_pages(int fd, uintptr_t dst, const uint8_t *src, size_t n, size_t page)
{
    while (n) {
        struct uffdio_copy cp = {.dst = dst, .src = (uintptr_t)src, .len = n, .mode = 0};
        if (ioctl(fd, UFFDIO_COPY, &cp) == 0)
            return 0;
        int e = errno;
        size_t done = cp.copy > 0 ? (size_t)cp.copy : 0; /* the pages before the one that stopped it */
        dst += done, src += done, n -= done;
        if (e == EEXIST) { /* touched meanwhile: no fault can wait on it */
            memcpy((void *)dst, src, page);
            dst += page, src += page, n -= page;
        } else if (e != EAGAIN || !done) {
            errno = e;
            return -1;
        }
    }
    return 0;
}

/* Write n bytes at src into the registered page at page_addr from byte at on: the page installed with zeros
 * around them (what its first fault would have shown), or, where it is there already, copied into. */
static int fill_part(int fd, uintptr_t page_addr, size_t at, const uint8_t *src, size_t n, uint8_t *bounce,
                     size_t page)
{
    memset(bounce, 0, page);
    memcpy(bounce + at, src, n);
    struct uffdio_copy cp = {.dst = page_addr, .src = (uintptr_t)bounce, .len = page, .mode = 0};
    if (ioctl(fd, UFFDIO_COPY, &cp) == 0)
        return 0;
    if (errno != EEXIST)
        return -1;
    memcpy((void *)(page_addr + at), src, n);
    return 0;
}

/* Copy n bytes from src to dst, the pages of [lo, hi) through fd (fill_pages, fill_part), the rest plainly. */
static int fill_range(int fd, uintptr_t lo, uintptr_t hi, uintptr_t dst, const uint8_t *src, size_t n,
                      uint8_t *bounce, size_t page)
{
    uintptr_t a = dst, end = dst + n;
    if (a < lo) {
        size_t k = (end < lo ? end : lo) - a;
        memcpy((void *)a, src, k);
        a += k;
    }
    uintptr_t stop = end < hi ? end : hi;
    while (a < stop) {
        uintptr_t p = a & ~(uintptr_t)(page - 1), full = (stop - p) / page * page;
        int rc;
        if (a == p && full) /* whole pages from here */
            rc = fill_pages(fd, a, src + (a - dst), full, page), a += full;
        else {
            size_t k = (p + page < stop ? p + page : stop) - a;
            rc = fill_part(fd, p, a - p, src + (a - dst), k, bounce, page), a += k;
        }
        if (rc < 0)
            return -1;
    }
    if (a < end)
        memcpy((void *)a, src + (a - dst), end - a);
    return 0;
}
#endif

PyDoc_STRVAR(serve_faults_doc,
             "serve_faults(fd, stop_fd, /) -> None\n\n"
             "Answer the faults userfaultfd fd reports (a thread of this process touched a registered "
             "page before it was filled) with the zero page, as the kernel would have, and wake the "
             "thread; return once stop_fd is readable. GIL released while waiting.");

#ifdef FP_DCP_HAVE_USERFAULTFD
/* Map the zero page at each fault read from fd (one already filled: wake its waiter); 0, or -1 with errno. */
static int answer_faults(int fd, size_t page)
{
    struct uffd_msg msg;
    for (;;) {
        ssize_t got = read(fd, &msg, sizeof msg);
        if (got < 0)
            return errno == EAGAIN ? 0 : -1;
        if (got != (ssize_t)sizeof msg) {
            errno = EIO;
            return -1;
        }
        if (msg.event != UFFD_EVENT_PAGEFAULT)
            continue;
        struct uffdio_range range = {.start = msg.arg.pagefault.address & ~(uint64_t)(page - 1), .len = page};
        struct uffdio_zeropage zero = {.range = range, .mode = 0};
        if (ioctl(fd, UFFDIO_ZEROPAGE, &zero) < 0 && (errno != EEXIST || ioctl(fd, UFFDIO_WAKE, &range) < 0))
            return -1;
    }
}
#endif

static PyObject *py_serve_faults(PyObject *self, PyObject *args)
{
    int fd, stop_fd;
    (void)self;
    if (!PyArg_ParseTuple(args, "ii:serve_faults", &fd, &stop_fd))
        return NULL;
#ifdef FP_DCP_HAVE_USERFAULTFD
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    int rc = 0;
    Py_BEGIN_ALLOW_THREADS for (;;)
    {
        struct pollfd fds[2] = {{.fd = fd, .events = POLLIN}, {.fd = stop_fd, .events = POLLIN}};
        rc = poll(fds, 2, -1);
        if (rc < 0 && errno == EINTR)
            continue;
        if (rc < 0 || (rc = (fds[0].revents & POLLIN) ? answer_faults(fd, page) : 0) < 0)
            break;
        if (fds[1].revents)
            break;
    }
    Py_END_ALLOW_THREADS
    if (rc < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
#else
    (void)fd, (void)stop_fd;
    errno = ENOSYS;
    return PyErr_SetFromErrno(PyExc_OSError);
#endif
}

PyDoc_STRVAR(fill_crc32c_doc,
             "fill_crc32c(fd, start, end, dst, src, crc=0, /) -> int\n\n"
             "copy_crc32c(dst, src, crc) for a dst whose pages in [start, end) are registered with "
             "userfaultfd fd (register_untouched): those still missing are installed with their "
             "bytes (UFFDIO_COPY: no clearing, no fault), the others copied into. Partly covered "
             "pages are installed with zeros around the bytes, as a first fault would show them. "
             "GIL released. Raises OSError where the kernel refuses a page.");

static PyObject *py_fill_crc32c(PyObject *self, PyObject *args)
{
    int fd;
    unsigned long long lo, hi;
    Py_buffer dst, src;
    PyObject *crc_obj = NULL, *result = NULL;
    uint32_t crc = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "iKKw*y*|O:fill_crc32c", &fd, &lo, &hi, &dst, &src, &crc_obj))
        return NULL;
    if (dst.len != src.len) {
        PyErr_Format(PyExc_ValueError, "fill_crc32c: dst has %zd bytes, src has %zd", dst.len, src.len);
        goto done;
    }
    if (crc_obj && parse_crc(crc_obj, &crc) < 0)
        goto done;
#ifdef FP_DCP_HAVE_USERFAULTFD
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    uint8_t *bounce = PyMem_RawMalloc(2 * page); /* a page-aligned page inside it */
    if (!bounce) {
        PyErr_NoMemory();
        goto done;
    }
    uint8_t *aligned = (uint8_t *)(((uintptr_t)bounce + page - 1) & ~(uintptr_t)(page - 1));
    uint32_t c = ~crc;
    int rc = 0;
    uintptr_t base = (uintptr_t)dst.buf;
    size_t n = (size_t)src.len;
    Py_BEGIN_ALLOW_THREADS for (size_t off = 0; off < n && rc == 0;)
    {
        /* cache-sized steps that end on dst's page boundaries: checksummed first, then copied from the cache,
         * and no page of dst split between two steps */
        size_t m = n - off;
        if (m > COPY_STEP) {
            uintptr_t cut = (base + off + COPY_STEP) & ~(uintptr_t)(page - 1);
            m = cut > base + off ? cut - (base + off) : COPY_STEP;
        }
        c = crc_raw(c, (const uint8_t *)src.buf + off, m);
        rc = fill_range(fd, (uintptr_t)lo, (uintptr_t)hi, base + off, (const uint8_t *)src.buf + off, m, aligned,
                        page);
        off += m;
    }
    Py_END_ALLOW_THREADS
    PyMem_RawFree(bounce);
    if (rc < 0)
        PyErr_SetFromErrno(PyExc_OSError);
    else
        result = PyLong_FromUnsignedLong(~c);
#else
    (void)fd, (void)lo, (void)hi;
    errno = ENOSYS;
    PyErr_SetFromErrno(PyExc_OSError);
#endif
done:
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return result;
}

/* -------------------------------------------------------------------- Ring */

#ifdef FP_DCP_HAVE_LIBURING

typedef struct {
    Py_buffer view; /* view.obj is NULL for requests without memory (fsync) */
    PyObject *tag;
} Slot;

typedef struct {
    PyObject_HEAD struct io_uring ring;
    int open;
    unsigned depth;
    unsigned in_flight;
    Slot *slots;
    unsigned *free_slots; /* stack of unused slot indices */
    unsigned n_free;
    Py_buffer *fixed; /* registered buffers, exported while registered */
    unsigned n_fixed;
} RingObject;

static PyObject *ring_oserror(int neg_errno, const char *what)
{
    errno = -neg_errno;
    return PyErr_SetFromErrnoWithFilename(PyExc_OSError, what);
}

static void slot_release(RingObject *r, unsigned idx)
{
    Slot *s = &r->slots[idx];
    if (s->view.obj)
        PyBuffer_Release(&s->view);
    s->view.obj = NULL;
    Py_CLEAR(s->tag);
    r->free_slots[r->n_free++] = idx;
    r->in_flight--;
}

/* Move all available completions into list (or drop them when list is NULL). */
static int ring_reap(RingObject *r, PyObject *list, unsigned *reaped)
{
    struct io_uring_cqe *cqe;
    unsigned head, n = 0;
    int failed = 0;
    io_uring_for_each_cqe(&r->ring, head, cqe)
    {
        unsigned idx = (unsigned)io_uring_cqe_get_data64(cqe);
        if (list && !failed) {
            PyObject *item = Py_BuildValue("(Oi)", r->slots[idx].tag, cqe->res);
            if (!item || PyList_Append(list, item) < 0)
                failed = 1;
            Py_XDECREF(item);
        }
        slot_release(r, idx);
        n++;
    }
    io_uring_cq_advance(&r->ring, n);
    *reaped += n;
    return failed ? -1 : 0;
}

/* Submit queued requests and wait until `want` more have completed. */
static int ring_wait(RingObject *r, PyObject *list, unsigned want)
{
    unsigned got = 0;
    if (want > r->in_flight)
        want = r->in_flight;
    for (;;) {
        if (ring_reap(r, list, &got) < 0)
            return -1;
        if (got >= want && io_uring_sq_ready(&r->ring) == 0)
            return 0;
        int rc;
        unsigned wait_nr = got >= want ? 0 : want - got;
        Py_BEGIN_ALLOW_THREADS rc = io_uring_submit_and_wait(&r->ring, wait_nr);
        Py_END_ALLOW_THREADS
        if (rc == -EINTR) {
            if (PyErr_CheckSignals() < 0)
                return -1;
            continue;
        }
        if (rc < 0) {
            ring_oserror(rc, "io_uring_submit_and_wait");
            return -1;
        }
    }
}

/* Wait out every request, dropping results: memory must outlive the kernel's use. */
static void ring_drain(RingObject *r)
{
    while (r->in_flight) {
        unsigned got = 0;
        int rc;
        ring_reap(r, NULL, &got);
        if (!r->in_flight)
            break;
        Py_BEGIN_ALLOW_THREADS rc = io_uring_submit_and_wait(&r->ring, 1);
        Py_END_ALLOW_THREADS
        if (rc < 0 && rc != -EINTR)
            break; /* the ring is unusable; exiting it below reclaims the requests */
    }
}

static void ring_unregister(RingObject *r)
{
    if (!r->n_fixed)
        return;
    io_uring_unregister_buffers(&r->ring); /* only fails if none are registered */
    for (unsigned i = 0; i < r->n_fixed; i++)
        PyBuffer_Release(&r->fixed[i]);
    PyMem_Free(r->fixed);
    r->fixed = NULL;
    r->n_fixed = 0;
}

static void ring_close(RingObject *r)
{
    if (!r->open)
        return;
    ring_drain(r);
    ring_unregister(r);
    io_uring_queue_exit(&r->ring);
    r->open = 0;
    /* Anything still held could not be waited for; the ring's exit has cancelled it. */
    for (unsigned i = 0; i < r->depth; i++) {
        if (r->slots[i].view.obj)
            PyBuffer_Release(&r->slots[i].view);
        Py_CLEAR(r->slots[i].tag);
    }
    r->in_flight = 0;
}

static int ring_init(RingObject *r, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"depth", NULL};
    unsigned depth;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "I:Ring", kwlist, &depth))
        return -1;
    if (r->open) {
        PyErr_SetString(PyExc_RuntimeError, "Ring is already initialised");
        return -1;
    }
    if (depth < 1 || depth > 4096) {
        PyErr_Format(PyExc_ValueError, "Ring depth must be 1..4096, got %u", depth);
        return -1;
    }
    PyMem_Free(r->slots);
    PyMem_Free(r->free_slots);
    r->slots = PyMem_Calloc(depth, sizeof(Slot));
    r->free_slots = PyMem_Calloc(depth, sizeof(unsigned));
    if (!r->slots || !r->free_slots) {
        PyErr_NoMemory();
        return -1;
    }
    int rc = io_uring_queue_init(depth, &r->ring, 0);
    if (rc < 0) {
        ring_oserror(rc, "io_uring_queue_init");
        return -1;
    }
    r->open = 1;
    r->depth = depth;
    r->in_flight = 0;
    r->n_free = depth;
    for (unsigned i = 0; i < depth; i++)
        r->free_slots[i] = depth - 1 - i;
    return 0;
}

static void ring_dealloc(RingObject *r)
{
    ring_close(r);
    PyMem_Free(r->slots);
    PyMem_Free(r->free_slots);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

static int ring_check_open(RingObject *r)
{
    if (!r->open) {
        PyErr_SetString(PyExc_ValueError, "I/O operation on a closed Ring");
        return -1;
    }
    return 0;
}

/* Claim a slot and an SQE; the caller fills the SQE. */
static struct io_uring_sqe *ring_claim(RingObject *r, unsigned *idx)
{
    if (ring_check_open(r) < 0)
        return NULL;
    if (!r->n_free) {
        PyErr_Format(PyExc_BlockingIOError, "Ring: all %u requests are in flight; wait() first",
                     r->depth);
        return NULL;
    }
    struct io_uring_sqe *sqe = io_uring_get_sqe(&r->ring);
    if (!sqe) { /* cannot happen: queued requests never exceed depth */
        PyErr_SetString(PyExc_RuntimeError, "Ring: submission queue full");
        return NULL;
    }
    *idx = r->free_slots[--r->n_free];
    r->in_flight++;
    io_uring_sqe_set_data64(sqe, *idx);
    return sqe;
}

static int find_fixed(RingObject *r, const char *p, size_t n)
{
    for (unsigned i = 0; i < r->n_fixed; i++) {
        const char *base = r->fixed[i].buf;
        if (p >= base && p + n <= base + r->fixed[i].len)
            return (int)i;
    }
    return -1;
}

static PyObject *ring_rw(RingObject *r, PyObject *args, int is_write)
{
    int fd;
    Py_buffer view;
    long long offset;
    PyObject *tag;
    int punt = 0;
    if (!PyArg_ParseTuple(args, is_write ? "iy*LO|p:write" : "iw*LO|p:read", &fd, &view, &offset,
                          &tag, &punt))
        return NULL;
    if ((size_t)view.len > MAX_REQUEST_BYTES || offset < 0) {
        PyErr_Format(PyExc_ValueError, "Ring: request of %zd bytes at offset %lld is out of range",
                     view.len, offset);
        PyBuffer_Release(&view);
        return NULL;
    }
    unsigned idx;
    struct io_uring_sqe *sqe = ring_claim(r, &idx);
    if (!sqe) {
        PyBuffer_Release(&view);
        return NULL;
    }
    int fixed = find_fixed(r, view.buf, (size_t)view.len);
    unsigned len = (unsigned)view.len;
    if (is_write && fixed >= 0)
        io_uring_prep_write_fixed(sqe, fd, view.buf, len, (__u64)offset, fixed);
    else if (is_write)
        io_uring_prep_write(sqe, fd, view.buf, len, (__u64)offset);
    else if (fixed >= 0)
        io_uring_prep_read_fixed(sqe, fd, view.buf, len, (__u64)offset, fixed);
    else
        io_uring_prep_read(sqe, fd, view.buf, len, (__u64)offset);
    if (punt) /* to the kernel's io-wq workers: a page-cache copy then runs beside the caller, not in it */
        io_uring_sqe_set_flags(sqe, IOSQE_ASYNC);
    r->slots[idx].view = view; /* the slot now owns the export */
    Py_INCREF(tag);
    r->slots[idx].tag = tag;
    Py_RETURN_NONE;
}

static PyObject *ring_write(RingObject *r, PyObject *args) { return ring_rw(r, args, 1); }
static PyObject *ring_read(RingObject *r, PyObject *args) { return ring_rw(r, args, 0); }

static PyObject *ring_fsync(RingObject *r, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"fd", "tag", "datasync", NULL};
    int fd, datasync = 0;
    PyObject *tag;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iO|p:fsync", kwlist, &fd, &tag, &datasync))
        return NULL;
    unsigned idx;
    struct io_uring_sqe *sqe = ring_claim(r, &idx);
    if (!sqe)
        return NULL;
    io_uring_prep_fsync(sqe, fd, datasync ? IORING_FSYNC_DATASYNC : 0);
    Py_INCREF(tag);
    r->slots[idx].tag = tag;
    Py_RETURN_NONE;
}

static PyObject *ring_wait_method(RingObject *r, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"min_complete", NULL};
    unsigned want = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|I:wait", kwlist, &want))
        return NULL;
    if (ring_check_open(r) < 0)
        return NULL;
    PyObject *list = PyList_New(0);
    if (!list)
        return NULL;
    if (ring_wait(r, list, want) < 0) {
        Py_DECREF(list);
        return NULL;
    }
    return list;
}

static PyObject *ring_register_buffers(RingObject *r, PyObject *seq)
{
    if (ring_check_open(r) < 0)
        return NULL;
    if (r->in_flight) {
        PyErr_SetString(PyExc_RuntimeError, "Ring: cannot change buffers with requests in flight");
        return NULL;
    }
    PyObject *fast = PySequence_Fast(seq, "register_buffers expects a sequence of buffers");
    if (!fast)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    Py_buffer *views = PyMem_Calloc(n ? (size_t)n : 1, sizeof(Py_buffer));
    struct iovec *iov = PyMem_Calloc(n ? (size_t)n : 1, sizeof(struct iovec));
    Py_ssize_t got = 0;
    PyObject *result = NULL;
    if (!views || !iov) {
        PyErr_NoMemory();
        goto done;
    }
    for (; got < n; got++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, got), &views[got],
                               PyBUF_WRITABLE) < 0)
            goto done;
        iov[got].iov_base = views[got].buf;
        iov[got].iov_len = (size_t)views[got].len;
    }
    ring_unregister(r);
    if (n) {
        int rc = io_uring_register_buffers(&r->ring, iov, (unsigned)n);
        if (rc < 0) {
            ring_oserror(rc, "io_uring_register_buffers");
            goto done;
        }
        r->fixed = views;
        r->n_fixed = (unsigned)n;
        views = NULL; /* owned by the ring now */
    }
    result = Py_None;
    Py_INCREF(result);
done:
    if (views) {
        for (Py_ssize_t i = 0; i < got; i++)
            PyBuffer_Release(&views[i]);
        PyMem_Free(views);
    }
    PyMem_Free(iov);
    Py_DECREF(fast);
    return result;
}

static PyObject *ring_close_method(RingObject *r, PyObject *unused)
{
    (void)unused;
    ring_close(r);
    Py_RETURN_NONE;
}

static PyObject *ring_get_in_flight(RingObject *r, void *closure)
{
    (void)closure;
    return PyLong_FromUnsignedLong(r->in_flight);
}

static PyObject *ring_get_depth(RingObject *r, void *closure)
{
    (void)closure;
    return PyLong_FromUnsignedLong(r->depth);
}

static PyObject *ring_get_fixed(RingObject *r, void *closure)
{
    (void)closure;
    return PyLong_FromUnsignedLong(r->n_fixed);
}

static PyMethodDef ring_methods[] = {
    {"write", (PyCFunction)ring_write, METH_VARARGS,
     "write(fd, buffer, offset, tag, punt=False) -> None: queue a write of buffer at offset; punt hands it "
     "to the kernel's worker threads (IOSQE_ASYNC)."},
    {"read", (PyCFunction)ring_read, METH_VARARGS,
     "read(fd, buffer, offset, tag, punt=False) -> None: queue a read into buffer from offset; punt as for "
     "write."},
    {"fsync", (PyCFunction)(void (*)(void))ring_fsync, METH_VARARGS | METH_KEYWORDS,
     "fsync(fd, tag, datasync=False) -> None: queue an fsync (fdatasync if datasync)."},
    {"wait", (PyCFunction)(void (*)(void))ring_wait_method, METH_VARARGS | METH_KEYWORDS,
     "wait(min_complete=1) -> list[(tag, result)]: submit queued requests, wait until at "
     "least min_complete have completed (GIL released) and return every completion "
     "reaped; result is a byte count or -errno."},
    {"register_buffers", (PyCFunction)ring_register_buffers, METH_O,
     "register_buffers(buffers) -> None: register writable buffers as fixed buffers; "
     "requests inside them then skip per-request page pinning."},
    {"close", (PyCFunction)ring_close_method, METH_NOARGS,
     "close() -> None: wait for requests in flight, then release the ring."},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef ring_getset[] = {
    {"in_flight", (getter)ring_get_in_flight, NULL, "requests queued or in flight", NULL},
    {"depth", (getter)ring_get_depth, NULL, "most requests in flight at once", NULL},
    {"fixed_buffers", (getter)ring_get_fixed, NULL, "number of registered buffers", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyTypeObject RingType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "fp_dcp._native._cio.Ring",
    .tp_basicsize = sizeof(RingObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Ring(depth): one io_uring instance with at most depth requests in flight.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)ring_init,
    .tp_dealloc = (destructor)ring_dealloc,
    .tp_methods = ring_methods,
    .tp_getset = ring_getset,
};

#endif /* FP_DCP_HAVE_LIBURING */

/* ------------------------------------------------------------------ module */

static PyMethodDef module_methods[] = {
    {"crc32c", py_crc32c, METH_VARARGS, crc32c_doc},
    {"copy_crc32c", py_copy_crc32c, METH_VARARGS, copy_crc32c_doc},
    {"read_crc32c", py_read_crc32c, METH_VARARGS, read_crc32c_doc},
    {"write_crc32c", py_write_crc32c, METH_VARARGS, write_crc32c_doc},
    {"crc32c_combine", py_crc32c_combine, METH_VARARGS, crc32c_combine_doc},
    {"populate", py_populate, METH_O, populate_doc},
    {"userfaultfd", py_userfaultfd, METH_NOARGS, userfaultfd_doc},
    {"register_untouched", py_register_untouched, METH_VARARGS, register_untouched_doc},
    {"fill_crc32c", py_fill_crc32c, METH_VARARGS, fill_crc32c_doc},
    {"serve_faults", py_serve_faults, METH_VARARGS, serve_faults_doc},
    {"unregister", py_unregister, METH_VARARGS, unregister_doc},
    {"advise_huge", py_advise_huge, METH_O, advise_huge_doc},
    {"dio_alignment", py_dio_alignment, METH_VARARGS, dio_alignment_doc},
    {"fallocate", py_fallocate, METH_VARARGS, fallocate_doc},
    {"cached_pages", py_cached_pages, METH_VARARGS, cached_pages_doc},
    {"address", py_address, METH_O, address_doc},
    {NULL, NULL, 0, NULL}};

/* The optional libraries this build links, named as fp_dcp._native.libraries names them. */
static const char *const linked_libraries[] = {
#ifdef FP_DCP_HAVE_LIBURING
    "liburing",
#endif
#ifdef FP_DCP_HAVE_ISAL
    "isa-l",
#endif
#ifdef FP_DCP_HAVE_XXHASH
    "libxxhash",
#endif
};

static int add_linked_libraries(PyObject *m)
{
    size_t n = sizeof(linked_libraries) / sizeof(linked_libraries[0]);
    PyObject *names = PyTuple_New((Py_ssize_t)n);
    if (!names)
        return -1;
    for (size_t i = 0; i < n; i++) {
        PyObject *name = PyUnicode_FromString(linked_libraries[i]);
        if (!name) {
            Py_DECREF(names);
            return -1;
        }
        PyTuple_SET_ITEM(names, (Py_ssize_t)i, name);
    }
    int rc = PyModule_AddObjectRef(m, "LINKED_LIBRARIES", names);
    Py_DECREF(names);
    return rc;
}

static struct PyModuleDef cio_module = {
    PyModuleDef_HEAD_INIT, "fp_dcp._native._cio",
    "Native I/O and checksum primitives of fp-dcp (see cio/cio.c).", -1, module_methods,
    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__cio(void)
{
    crc_init();
    PyObject *m = PyModule_Create(&cio_module);
    if (!m)
        return NULL;
#ifdef FP_DCP_HAVE_LIBURING
    if (PyType_Ready(&RingType) < 0 || PyModule_AddObjectRef(m, "Ring", (PyObject *)&RingType) < 0)
        goto fail;
    if (PyModule_AddObjectRef(m, "HAVE_IO_URING", Py_True) < 0)
        goto fail;
#else
    if (PyModule_AddObjectRef(m, "HAVE_IO_URING", Py_False) < 0)
        goto fail;
#endif
    if (PyModule_AddObjectRef(m, "CRC32C_HARDWARE", crc_hardware ? Py_True : Py_False) < 0 ||
        PyModule_AddStringConstant(m, "CRC32C_ENGINE", crc_engine) < 0 ||
        PyModule_AddStringConstant(m, "COPY_CRC32C_ENGINE", fold_usable ? "vpclmulqdq" : crc_engine) < 0)
        goto fail;
#ifdef FP_DCP_HAVE_XXHASH
    if (PyType_Ready(&HashType) < 0 || PyModule_AddObjectRef(m, "Hash128", (PyObject *)&HashType) < 0)
        goto fail;
#endif
    if (add_linked_libraries(m) < 0)
        goto fail;
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}
