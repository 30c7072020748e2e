// Inverted dropout with the mask regenerated from the Philox stream, never stored: the CUDA twin
// of dropout_forward / dropout_backward in npformer/functional/activation/ (math.py), and of
// dropout_add_forward in npformer/functional/dropout_add/ (y = residual + dropout(x), the residual
// connection of a Transformer sublayer in one pass).
//
// DROPOUT CONTRACT (every dropout site, CPU and CUDA): entry i (flat, C order) is kept iff its 16
// random bits, value offset + i of the stream of `seed`, are >= threshold (autograd.random,
// philox.cuh), threshold = min(round(p 2^16), 2^16 - 1) (2^16 for p = 1: nothing is kept); kept
// entries are scaled by 1 / (1 - p). The forward y = x * keep * scale and the backward
// dx = dy * keep * scale are the same computation with the same (seed, offset): one kernel serves both.
// Under CUDA-graph capture `state` points at the device array (seed, base) that the host rewrites
// before each replay: the seed is state[0] and the values start at state[1] + offset; else null.
#include "philox.cuh"

// One thread per Philox counter: counter c gives the values 8c, ..., 8c + 7 of the stream, i.e. the
// entries i = 8c + m - offset (m = 0..7) that lie in [0, n). `offset` need not be a multiple of 8
// (the streams of autograd.random keep it one, but a Philox may be built at any offset).
// apply(i, keep) is called for each of them.
template <typename Apply>
__device__ __forceinline__ void for_each_entry(long long n, const unsigned long long* state, unsigned long long seed,
                                               unsigned long long offset, unsigned int threshold, Apply apply) {
    if (state) { seed = state[0]; offset += state[1]; }
    if (n <= 0) return;
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
            const unsigned int bits = m % 2 ? r.w[m / 2] >> 16 : r.w[m / 2] & 0xFFFFu;
            apply((long long)(value - offset), bits >= threshold);
        }
    }
}

// y = x * keep * scale (x * 0 for a dropped entry, as the reference: inf gives NaN there).
// Backward: the same with dy for x (dx = dy * keep * scale). In place (y == x) is fine.
template <typename T>
__global__ void dropout_apply(const T* x, T* y, long long n, const unsigned long long* __restrict__ state,
                              unsigned long long seed, unsigned long long offset, unsigned int threshold, T scale) {
    for_each_entry(n, state, seed, offset, threshold, [&](long long i, bool keep) {
        y[i] = x[i] * (keep ? scale : T(0));
    });
}

// Forward: y = residual + x * keep * scale (the backward is dropout_apply for dx, and dy itself
// for the residual).
template <typename T>
__global__ void dropout_add_forward(const T* __restrict__ x, const T* __restrict__ residual, T* __restrict__ y,
                                    long long n, const unsigned long long* __restrict__ state,
                                    unsigned long long seed, unsigned long long offset, unsigned int threshold,
                                    T scale) {
    for_each_entry(n, state, seed, offset, threshold, [&](long long i, bool keep) {
        y[i] = residual[i] + x[i] * (keep ? scale : T(0));
    });
}
