// Block-wide reductions shared by the row kernels: every thread of the block passes its partial
// value and every thread gets the reduction of the whole block back.
//
// Two steps: the 32 lanes of each warp combine their values through register shuffles
// (__shfl_xor_sync: after the steps 16, 8, 4, 2, 1 every lane holds the warp's result), then
// warp 0 combines the per-warp results left in shared memory. Needs blockDim.x a multiple of 32
// (at most 1024), and every thread of the block must call it (it synchronises the block).
#pragma once

// +infinity of T (NVRTC has no math.h, hence no INFINITY macro)
template <typename T> __device__ __forceinline__ T infinity();
template <> __device__ __forceinline__ float infinity<float>() { return __int_as_float(0x7f800000); }
template <> __device__ __forceinline__ double infinity<double>() { return __longlong_as_double(0x7ff0000000000000LL); }

template <typename T>
struct SumOp {
    __device__ static T identity() { return T(0); }
    __device__ static T apply(T a, T b) { return a + b; }
};

template <typename T>
struct MaxOp {
    __device__ static T identity() { return -infinity<T>(); }
    __device__ static T apply(T a, T b) { return a > b ? a : b; }
};

template <typename Op, typename T>
__device__ T warp_reduce(T value) {
    for (int step = 16; step > 0; step /= 2)
        value = Op::apply(value, __shfl_xor_sync(0xffffffffu, value, step));
    return value;
}

template <typename Op, typename T>
__device__ T block_reduce(T value) {
    __shared__ T partial[32];                       // one slot per warp (blockDim.x <= 1024)
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    value = warp_reduce<Op>(value);
    __syncthreads();                                // partial may still be read by a previous call
    if (lane == 0) partial[warp] = value;
    __syncthreads();
    value = lane < warps ? partial[lane] : Op::identity();
    return warp_reduce<Op>(value);                  // every warp reduces the per-warp results
}

template <typename T>
__device__ T block_sum(T value) { return block_reduce<SumOp<T>>(value); }

template <typename T>
__device__ T block_max(T value) { return block_reduce<MaxOp<T>>(value); }
