// The umbp gather kernel: one launch copies many fragments. One source for both runtimes:
// NVRTC compiles it for NVIDIA GPUs, hiprtc for AMD GPUs (HIP kernels are CUDA syntax).
//
// Launch geometry (shared with the simulated device, see src/descriptor.rs):
//   - one block per slice of UMBP_SLICE_BYTES of a descriptor, UMBP_BLOCK_THREADS threads per block;
//   - starts[i] is the first block of descriptor i; block b copies the slice
//     (b - starts[i]) * UMBP_SLICE_BYTES of the last descriptor i with starts[i] <= b.
// Each block picks one path for its slice: 16-byte vectors when source and destination are
// both 16-byte aligned, 4-byte words when both are 4-byte aligned, bytes otherwise; vector and
// word bodies finish their tail bytewise, so no byte at an unaligned edge is ever wrong.

#define UMBP_SLICE_BYTES 32768ull

struct umbp_desc {
    unsigned long long src;
    unsigned long long dst;
    unsigned long long len;
};

struct __attribute__((aligned(16))) umbp_v16 {
    unsigned int x, y, z, w;
};

extern "C" __global__ void umbp_gather(const umbp_desc* descs,
                                       const unsigned int* starts,
                                       unsigned int count) {
    const unsigned int block = blockIdx.x;
    unsigned int lo = 0, hi = count;
    while (hi - lo > 1) {
        const unsigned int mid = lo + (hi - lo) / 2;
        if (starts[mid] <= block) lo = mid; else hi = mid;
    }
    const umbp_desc d = descs[lo];
    const unsigned long long offset = (unsigned long long)(block - starts[lo]) * UMBP_SLICE_BYTES;
    if (offset >= d.len) return;
    unsigned long long n = d.len - offset;
    if (n > UMBP_SLICE_BYTES) n = UMBP_SLICE_BYTES;
    const unsigned char* s = (const unsigned char*)(d.src + offset);
    unsigned char* t = (unsigned char*)(d.dst + offset);
    const unsigned long long a = (unsigned long long)s | (unsigned long long)t;
    const unsigned long long step = blockDim.x;
    unsigned long long body = 0;
    if ((a & 15ull) == 0) {
        body = n & ~15ull;
        for (unsigned long long i = threadIdx.x * 16ull; i < body; i += step * 16ull)
            *(umbp_v16*)(t + i) = *(const umbp_v16*)(s + i);
    } else if ((a & 3ull) == 0) {
        body = n & ~3ull;
        for (unsigned long long i = threadIdx.x * 4ull; i < body; i += step * 4ull)
            *(unsigned int*)(t + i) = *(const unsigned int*)(s + i);
    }
    for (unsigned long long i = body + threadIdx.x; i < n; i += step)
        t[i] = s[i];
}
