// Log-softmax and cross-entropy over the rows of a contiguous (rows, C) array of logits: one thread
// block per row for the forwards, one thread per entry for the cross-entropy backward. The CUDA
// twin of log_softmax_forward / log_softmax_backward (npformer/functional/softmax/math.py) and
// cross_entropy_forward / cross_entropy_backward (npformer/functional/cross_entropy/math.py), the references
// these kernels are tested against; the derivations are in docs/backprop.md.
#include "reduce.cuh"

// The shift of a row: its maximum, or 0 when that is -inf (a row of all -inf: no -inf - (-inf) =
// NaN), as stable_max in softmax/math.py; a +inf maximum stays, making the row NaN as in torch.
template <typename T>
__device__ T row_shift(const T* xr, int n) {
    T m = -infinity<T>();
    for (int i = threadIdx.x; i < n; i += blockDim.x) m = max(m, xr[i]);
    m = block_max(m);
    return m == -infinity<T>() ? T(0) : m;
}

// logp_i = x_i - m - log(sum_j exp(x_j - m)); a row of all -inf has sum 0, taken as 1: logp = -inf.
// In place (y == x) is fine: each thread writes only entries it has read, after both row sums.
template <typename T>
__global__ void log_softmax_forward(const T* x, T* y, long long rows, int n) {
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* xr = x + row * n;
        const T m = row_shift(xr, n);
        T total = T(0);
        for (int i = threadIdx.x; i < n; i += blockDim.x) total += exp(xr[i] - m);
        total = block_sum(total);
        const T log_total = log(total == T(0) ? T(1) : total);
        for (int i = threadIdx.x; i < n; i += blockDim.x) y[row * n + i] = xr[i] - m - log_total;
    }
}

// Forward: logp_i = x_i - log sum_j exp(x_j), so d logp_i / d x_k = [i == k] - softmax_k and
//   dx_k = sum_i dy_i ([i == k] - softmax_k) = dy_k - exp(logp_k) sum_i dy_i.
// In place (dx == dy) is fine: the row sum is complete before any write.
template <typename T>
__global__ void log_softmax_backward(const T* __restrict__ logp, const T* dy, T* dx, long long rows, int n) {
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* dyr = dy + row * n;
        T total = T(0);                                          // sum_i dy_i
        for (int i = threadIdx.x; i < n; i += blockDim.x) total += dyr[i];
        total = block_sum(total);
        for (int i = threadIdx.x; i < n; i += blockDim.x)
            dx[row * n + i] = dyr[i] - exp(logp[row * n + i]) * total;
    }
}

// Cross-entropy of each row with label smoothing e and class weights w (null: all 1):
//   q = (1 - e) onehot(t) + e / C,  loss = -sum_c q_c w_c logp_c
//        = -(1 - e) w_t logp_t - (e / C) sum_c w_c logp_c,
// and with logp_c = z_c - log(total), z = x - m, total = sum_c exp(z_c):
//   sum_c w_c logp_c = sum_c w_c z_c - log(total) sum_c w_c      (one pass: no logp row stored).
// Writes the loss of each row (0 where valid is false: ignore_index; `target` holds 0 there) and
// probs = softmax(x), which the backward needs. target: class ids as long long.
template <typename T>
__global__ void cross_entropy_forward(const T* __restrict__ logits, const long long* __restrict__ target,
                                      const bool* __restrict__ valid, const T* __restrict__ weight,
                                      T* __restrict__ probs, T* __restrict__ loss, double smoothing,
                                      long long rows, int n) {
    const T e = T(smoothing);
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* xr = logits + row * n;
        const T m = row_shift(xr, n);
        T total = T(0), weighted = T(0), weights = T(0);         // sum exp(z), sum w z, sum w
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const T z = xr[i] - m;
            const T w = weight ? weight[i] : T(1);
            total += exp(z);
            weighted += w * z;
            weights += w;
        }
        total = block_sum(total);
        weighted = block_sum(weighted);
        weights = block_sum(weights);
        if (total == T(0)) total = T(1);                         // all -inf: logp = -inf, probs 0
        for (int i = threadIdx.x; i < n; i += blockDim.x) probs[row * n + i] = exp(xr[i] - m) / total;
        if (threadIdx.x == 0) {
            long long t = target[row];
            if (t < 0 || t >= n) t = 0;                          // out of range: reported by the id check
            const T log_total = log(total);
            T value = -(T(1) - e) * (weight ? weight[t] : T(1)) * (xr[t] - m - log_total);
            if (smoothing != 0.0) value -= e / T(n) * (weighted - log_total * weights);
            loss[row] = valid[row] ? value : T(0);
        }
    }
}

// Forward: loss_r = -sum_c a_rc logp_rc with a_rc = (1 - e) w_t [c == t] + (e / C) w_c, and
// d logp_rc / d x_rk = [c == k] - p_rk (p = softmax), so with the row's upstream gradient g_r:
//   dx_rk = g_r (p_rk sum_c a_rc - a_rk),  sum_c a_rc = (1 - e) w_t + (e / C) sum_c w_c.
// One thread per entry; dloss (rows,) is already 0 on ignored rows and divided by the mean's
// divisor; weight_sum points at sum_c w_c (both null without class weights: w = 1, sum C).
template <typename T>
__global__ void cross_entropy_backward(const T* __restrict__ probs, const long long* __restrict__ target,
                                       const T* __restrict__ dloss, const T* __restrict__ weight,
                                       const T* __restrict__ weight_sum, T* __restrict__ dlogits,
                                       double smoothing, long long rows, int n) {
    const T e = T(smoothing);
    const long long size = rows * n;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < size;
         i += (long long)gridDim.x * blockDim.x) {
        const long long row = i / n;
        const int c = int(i - row * n);
        long long t = target[row];
        if (t < 0 || t >= n) t = 0;                              // out of range: reported by the id check
        const T g = dloss[row];
        const T w_t = weight ? weight[t] : T(1);
        const T a_sum = (T(1) - e) * w_t + e / T(n) * (weight ? *weight_sum : T(n));
        const T a = (c == t ? (T(1) - e) * w_t : T(0)) + e / T(n) * (weight ? weight[c] : T(1));
        dlogits[i] = g * (probs[i] * a_sum - a);
    }
}
