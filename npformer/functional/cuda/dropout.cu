// Inverted dropout with the mask regenerated from the Philox stream, never stored: the CUDA
// twin of dropout_forward / dropout_backward in npformer/functional/activation.py.
//
// Entry i (flat, C order) is kept iff its 16 random bits, value offset + i of the stream of
// `seed`, are >= threshold (autograd.random, philox.cuh); kept entries are scaled by
// 1 / (1 - p). The forward y = x * keep * scale and the backward dx = dy * keep * scale are the
// same computation with the same (seed, offset): one kernel serves both.
#include "philox.cuh"

// One thread per Philox counter: counter c gives the values 8c, ..., 8c + 7 of the stream, i.e.
// the entries i = 8c + m - offset (m = 0..7) that lie in [0, n). `offset` need not be a multiple
// of 8 (the streams of autograd.random keep it one, but a Philox may be built at any offset).
template <typename T>
__global__ void dropout_apply(const T* __restrict__ x, T* __restrict__ y, long long n,
                              unsigned long long seed, unsigned long long offset,
                              unsigned int threshold, T scale) {
    const unsigned long long first = offset / 8, last = (offset + (unsigned long long)n - 1) / 8;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long c = first + (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; c <= last;
         c += stride) {
        const PhiloxWords r = philox4x32_10((unsigned int)c, (unsigned int)(c >> 32), 0u, 0u,
                                            (unsigned int)seed, (unsigned int)(seed >> 32));
        #pragma unroll
        for (int m = 0; m < 8; ++m) {
            const unsigned long long value = 8 * c + m;             // index in the stream
            if (value < offset || value - offset >= (unsigned long long)n) continue;
            const long long i = (long long)(value - offset);
            const unsigned int bits = m % 2 ? r.w[m / 2] >> 16 : r.w[m / 2] & 0xFFFFu;
            // y = x * keep * scale (x * 0 for a dropped entry, as the reference: inf stays NaN there)
            y[i] = x[i] * (bits >= threshold ? scale : T(0));
        }
    }
}
