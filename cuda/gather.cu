// Gather many small device buffers into one, so that a staging buffer's worth
// of small GPU tensors costs one device-to-host copy instead of one copy each.
//
// Compiled at run time by fp_dcp.staging through cupy's RawModule (NVRTC);
// CI compiles it with nvcc for sm_90 (tests/test_cuda_sources.py), and runs
// fp_dcp_copy_segment on the CPU through a host harness. No #include: NVRTC
// has no standard headers, and nothing here needs one.

// One segment: the bytes [src, src + nbytes) go to out + dst_offset. The
// Python side fills a table of these as three uint64 per segment.
struct fp_dcp_segment {
    unsigned long long src;
    unsigned long long dst_offset;
    unsigned long long nbytes;
};

// Copy n bytes with `lanes` cooperating threads, `lane` being this one. Every
// byte is written by exactly one lane, so the lanes may run in any order (on
// the CPU, one after the other). 16-byte vectors are used when source and
// destination agree modulo 16, which they do for tensors from PyTorch's
// allocator placed at fp-dcp's 64-byte offsets.
__host__ __device__ inline void fp_dcp_copy_segment(const unsigned char* src, unsigned char* dst,
                                                    unsigned long long n, unsigned int lane,
                                                    unsigned int lanes)
{
    unsigned long long done = 0;
    if ((((unsigned long long)src ^ (unsigned long long)dst) & 15ULL) == 0) {
        unsigned long long head = (16ULL - ((unsigned long long)src & 15ULL)) & 15ULL;
        if (head > n)
            head = n;
        for (unsigned long long i = lane; i < head; i += lanes)
            dst[i] = src[i];
        const uint4* s = (const uint4*)(src + head);
        uint4* d = (uint4*)(dst + head);
        unsigned long long vectors = (n - head) / 16ULL;
        for (unsigned long long i = lane; i < vectors; i += lanes)
            d[i] = s[i];
        done = head + vectors * 16ULL;
    }
    for (unsigned long long i = done + lane; i < n; i += lanes)
        dst[i] = src[i];
}

// One block per segment (grid-stride over segments): small tensors are
// numerous and short, so a block per segment keeps every launch busy without
// any prefix sums over the sizes.
extern "C" __global__ void fp_dcp_gather(const fp_dcp_segment* __restrict__ table, unsigned int count,
                                         unsigned char* __restrict__ out)
{
    for (unsigned int s = blockIdx.x; s < count; s += gridDim.x) {
        const fp_dcp_segment seg = table[s];
        fp_dcp_copy_segment((const unsigned char*)seg.src, out + seg.dst_offset, seg.nbytes, threadIdx.x,
                            blockDim.x);
    }
}
