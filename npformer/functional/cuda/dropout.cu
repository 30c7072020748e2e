// Dropout fused with the residual add, y = residual + dropout(x), over contiguous arrays: one
// thread per 8 consecutive entries, which is one Philox call (philox.cuh: 8 values of 16 bits).
// The mask is never stored: the backward kernel draws it again from the same (seed, offset).
// The CUDA twin of dropout_add_forward / dropout_backward in npformer/functional/residual.py (the
// reference these kernels are tested against); the derivation is in docs/backprop.md.
//
// DROPOUT CONTRACT (every dropout site, CPU and CUDA): entry i (C-order flat index) is kept iff
// value (offset + i) of the Philox stream of `seed` is >= threshold, threshold = min(round(p 2^16),
// 2^16 - 1); a kept entry is scaled by 1 / (1 - p). offset is a multiple of 8 (every draw starts
// on a fresh counter), so entries 8g ... 8g + 7 use counter offset / 8 + g.
// Under graph capture `state` points at the device array (seed, base) written before each replay:
// then seed = state[0] and the draw starts at state[1] + offset; else state is null.
#include "philox.cuh"

// The 8 keep bits of group g (entries 8g ... 8g + 7), bit k for entry 8g + k.
__device__ __forceinline__ unsigned int keep_bits(unsigned long long seed, unsigned long long offset,
                                                  long long g, unsigned int threshold) {
    const unsigned long long counter = offset / 8 + (unsigned long long)g;
    const PhiloxWords r = philox4x32_10((unsigned int)counter, (unsigned int)(counter >> 32), 0u, 0u,
                                        (unsigned int)seed, (unsigned int)(seed >> 32));
    unsigned int bits = 0;
    #pragma unroll
    for (int k = 0; k < 8; ++k) {
        const unsigned int value = (k % 2) ? r.w[k / 2] >> 16 : r.w[k / 2] & 0xFFFFu;
        bits |= (value >= threshold ? 1u : 0u) << k;
    }
    return bits;
}

#define FOR_EACH_GROUP(g, size) \
    for (long long g = blockIdx.x * (long long)blockDim.x + threadIdx.x; g < ((size) + 7) / 8; \
         g += (long long)gridDim.x * blockDim.x)

// y = residual + x * m with m = keep / (1 - p) (so x * 0 where dropped: inf and NaN give NaN,
// as the reference's x * mask does).
template <typename T>
__global__ void dropout_add_forward(const T* __restrict__ x, const T* __restrict__ residual, T* __restrict__ y,
                                    const unsigned long long* __restrict__ state, unsigned long long seed,
                                    unsigned long long offset, unsigned int threshold, double scale, long long size) {
    if (state) { seed = state[0]; offset += state[1]; }
    FOR_EACH_GROUP(g, size) {
        const unsigned int bits = keep_bits(seed, offset, g, threshold);
        for (int k = 0; k < 8 && g * 8 + k < size; ++k) {
            const long long i = g * 8 + k;
            y[i] = residual[i] + x[i] * ((bits >> k) & 1u ? T(scale) : T(0));
        }
    }
}

// Forward: y = residual + x m, so dx = dy m (the same m, drawn again) and dresidual = dy (no kernel).
// In place (dx == dy) is fine.
template <typename T>
__global__ void dropout_backward(const T* dy, T* dx, const unsigned long long* __restrict__ state,
                                 unsigned long long seed, unsigned long long offset, unsigned int threshold,
                                 double scale, long long size) {
    if (state) { seed = state[0]; offset += state[1]; }
    FOR_EACH_GROUP(g, size) {
        const unsigned int bits = keep_bits(seed, offset, g, threshold);
        for (int k = 0; k < 8 && g * 8 + k < size; ++k) {
            const long long i = g * 8 + k;
            dx[i] = dy[i] * ((bits >> k) & 1u ? T(scale) : T(0));
        }
    }
}
