// Softmax along the rows of a contiguous (rows, n) array: one thread block per row, any n.
// The CUDA twin of softmax_forward / softmax_backward in npformer/functional/softmax/math.py (the
// reference these kernels are tested against); the derivation is in docs/backprop.md.
#include "reduce.cuh"

// y_i = exp(x_i - m) / sum_j exp(x_j - m) with m = max_j x_j. A row that is entirely -inf has
// m = -inf: like the reference, shift it by 0 instead (no -inf - (-inf) = NaN), so exp gives 0
// everywhere, the sum is 0, and dividing by 1 instead leaves a row of zeros.
// In place (y == x) is fine: a thread writes only entries it has read, after the row max.
template <typename T>
__global__ void softmax_forward(const T* __restrict__ x, T* y, long long rows, int n) {
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* xr = x + row * n;
        T* yr = y + row * n;
        T m = -infinity<T>();                                        // m = max_j x_j
        for (int i = threadIdx.x; i < n; i += blockDim.x) m = max(m, xr[i]);
        m = block_max(m);
        if (m == -infinity<T>()) m = T(0);                      // all -inf: shift by 0 (+inf: a NaN row)
        T total = T(0);                                         // total = sum_j exp(x_j - m)
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            T e = exp(xr[i] - m);
            yr[i] = e;
            total += e;
        }
        total = block_sum(total);
        if (total == T(0)) total = T(1);                        // all -inf: 0 / 1 = 0
        for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] /= total;
    }
}

// Forward: y_i = exp(x_i) / sum_j exp(x_j), so dy_i/dx_k = y_i ([i == k] - y_k) and
//   dx_k = sum_i dy_i y_i ([i == k] - y_k) = y_k (dy_k - sum_i dy_i y_i).
// In place (dx == dy) is fine: the row's inner product is complete before any write.
template <typename T>
__global__ void softmax_backward(const T* __restrict__ y, const T* dy, T* dx, long long rows, int n) {
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* yr = y + row * n;
        const T* dyr = dy + row * n;
        T* dxr = dx + row * n;
        T inner = T(0);                                         // inner = sum_i dy_i y_i
        for (int i = threadIdx.x; i < n; i += blockDim.x) inner += dyr[i] * yr[i];
        inner = block_sum(inner);
        for (int i = threadIdx.x; i < n; i += blockDim.x) dxr[i] = yr[i] * (dyr[i] - inner);
    }
}
