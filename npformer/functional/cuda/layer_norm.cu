// Layer normalization over the rows of a contiguous (rows, n) array: one thread block per row
// (forward, dx), then the parameter gradients by a second reduction over the rows. The CUDA twin
// of layer_norm_forward / layer_norm_backward in npformer/functional/layer_norm/math.py (the
// reference these kernels are tested against); the derivation is in docs/backprop.md.
#include "reduce.cuh"

// xhat = (x - mean) rstd,  rstd = 1 / sqrt(mean((x - mean)^2) + eps),  y = xhat * weight + bias
// (weight, bias may be null: 1 and 0). Like the reference, the centring is refined once: the mean
// of the residuals x - mean is subtracted again, which removes the rounding error of `mean` when
// |mean| >> std (e.g. mean 1e4, std 1e-2 in float32). The variance is the two-pass sum of squared
// residuals, never E[x^2] - E[x]^2. The row is read three times (from L1/L2: a row is a few KB)
// and written once per output.
template <typename T>
__global__ void layer_norm_forward(const T* __restrict__ x, const T* __restrict__ weight,
                                   const T* __restrict__ bias, T* __restrict__ y, T* __restrict__ xhat,
                                   T* __restrict__ rstd, double eps, long long rows, int n) {
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* xr = x + row * n;
        T total = T(0);                                          // mean = sum_j x_j / n
        for (int i = threadIdx.x; i < n; i += blockDim.x) total += xr[i];
        const T mean = block_sum(total) / T(n);
        T residual = T(0);                                       // refinement: mean of x_j - mean
        for (int i = threadIdx.x; i < n; i += blockDim.x) residual += xr[i] - mean;
        const T correction = block_sum(residual) / T(n);
        T squares = T(0);                                        // var = sum_j (x_j - mean - c)^2 / n
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const T d = (xr[i] - mean) - correction;
            squares += d * d;
        }
        const T r = T(1) / sqrt(block_sum(squares) / T(n) + T(eps));
        if (threadIdx.x == 0) rstd[row] = r;
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const T h = ((xr[i] - mean) - correction) * r;       // xhat
            xhat[row * n + i] = h;
            y[row * n + i] = (weight ? h * weight[i] : h) + (bias ? bias[i] : T(0));
        }
    }
}

// Forward: y = xhat * w + b with xhat = (x - mean) rstd. With g = dy * w (the gradient reaching
// xhat), and d mean / d x = 1/n, d rstd / d x_k = -rstd xhat_k / n:
//   dx = rstd (g - mean(g) - xhat mean(g xhat))        (two row sums, then one elementwise pass)
// In place (dx == dy) is fine: a thread writes only entries it has read, after both sums.
template <typename T>
__global__ void layer_norm_backward_input(const T* dy, const T* __restrict__ xhat, const T* __restrict__ weight,
                                          const T* __restrict__ rstd, T* dx, long long rows, int n) {
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* dyr = dy + row * n;
        const T* hr = xhat + row * n;
        T sum_g = T(0), sum_gh = T(0);                           // sum_j g_j,  sum_j g_j xhat_j
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const T g = weight ? dyr[i] * weight[i] : dyr[i];
            sum_g += g;
            sum_gh += g * hr[i];
        }
        const T mean_g = block_sum(sum_g) / T(n);
        const T mean_gh = block_sum(sum_gh) / T(n);
        const T r = rstd[row];
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const T g = weight ? dyr[i] * weight[i] : dyr[i];
            dx[row * n + i] = (g - hr[i] * mean_gh - mean_g) * r;
        }
    }
}

// Forward: y_rj = xhat_rj w_j + b_j for every row r, so
//   dweight_j = sum_r dy_rj xhat_rj,   dbias_j = sum_r dy_rj.
// First reduction: a block of 32 x 32 threads takes 32 columns (threadIdx.x: one column each, so a
// warp reads 32 consecutive entries of a row) and the rows blockIdx.y, blockIdx.y + gridDim.y, ...
// split among its 32 threadIdx.y; the 32 partial sums of each column meet in shared memory and
// one partial per (column, blockIdx.y) is written to partial_w / partial_b (gridDim.y, n).
// Either output may be null (that gradient is not needed).
template <typename T>
__global__ void layer_norm_backward_params(const T* __restrict__ dy, const T* __restrict__ xhat,
                                           T* __restrict__ partial_w, T* __restrict__ partial_b,
                                           long long rows, int n) {
    __shared__ T sums_w[32][33];                                 // 33: no shared-memory bank conflicts
    __shared__ T sums_b[32][33];
    const int column = blockIdx.x * 32 + threadIdx.x;
    T w = T(0), b = T(0);
    if (column < n)
        for (long long row = blockIdx.y * 32LL + threadIdx.y; row < rows; row += 32LL * gridDim.y) {
            const T g = dy[row * n + column];
            w += g * xhat[row * n + column];
            b += g;
        }
    sums_w[threadIdx.y][threadIdx.x] = w;
    sums_b[threadIdx.y][threadIdx.x] = b;
    __syncthreads();
    if (threadIdx.y == 0 && column < n) {
        for (int k = 1; k < 32; ++k) {
            w += sums_w[k][threadIdx.x];
            b += sums_b[k][threadIdx.x];
        }
        if (partial_w) partial_w[(long long)blockIdx.y * n + column] = w;
        if (partial_b) partial_b[(long long)blockIdx.y * n + column] = b;
    }
}

// Second reduction: out_j = sum_p partial_pj over the `parts` rows of partial (parts, n), one
// thread per column (consecutive threads read consecutive entries).
template <typename T>
__global__ void column_sum(const T* __restrict__ partial, T* __restrict__ out, int parts, int n) {
    for (long long column = blockIdx.x * (long long)blockDim.x + threadIdx.x; column < n;
         column += (long long)gridDim.x * blockDim.x) {
        T total = T(0);
        for (int p = 0; p < parts; ++p) total += partial[(long long)p * n + column];
        out[column] = total;
    }
}
