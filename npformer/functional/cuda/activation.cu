// Bias + activation (ReLU, GELU exact and tanh) over a contiguous (rows, n) array, one thread per
// entry: the epilogue of `linear(..., activation=...)` and the standalone activations (bias null).
// The CUDA twin of bias_activation_forward / bias_activation_backward in
// npformer/functional/activation/math.py (the reference these kernels are tested against); the
// derivations are in docs/backprop.md.

// Grid-stride loop over the `size` entries; entry i has column i % n (the bias index).
#define FOR_EACH_ENTRY(i, size) \
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < (size); i += (long long)gridDim.x * blockDim.x)

// h = x + bias;  y = h where not (h <= 0), else 0:  relu(-inf) = 0 and relu(NaN) = NaN, as torch's.
// keep = not (h <= 0) is saved for backward (1 byte per entry).
template <typename T>
__global__ void bias_relu_forward(const T* __restrict__ x, const T* __restrict__ bias, T* __restrict__ y,
                                  bool* __restrict__ keep, long long size, int n) {
    FOR_EACH_ENTRY(i, size) {
        const T h = bias ? x[i] + bias[i % n] : x[i];
        const bool k = !(h <= T(0));
        y[i] = k ? h : T(0);
        keep[i] = k;
    }
}

// Forward: y = h [h > 0] (and NaN passes), so dh = dy where keep, else exactly 0 (a NaN dy of a
// dropped entry gives 0, as torch's threshold_backward). In place (dh == dy) is fine.
template <typename T>
__global__ void relu_backward(const T* dy, const bool* __restrict__ keep, T* dh, long long size) {
    FOR_EACH_ENTRY(i, size) dh[i] = keep[i] ? dy[i] : T(0);
}

// GELU constants in T: sqrt(2 / pi), the cubic coefficient, 1 / sqrt(2), 1 / sqrt(2 pi)
template <typename T> __device__ __forceinline__ T tanh_c() { return T(0.7978845608028654); }
template <typename T> __device__ __forceinline__ T tanh_k() { return T(0.044715); }
template <typename T> __device__ __forceinline__ T inv_sqrt_2() { return T(0.7071067811865476); }
template <typename T> __device__ __forceinline__ T inv_sqrt_2pi() { return T(0.3989422804014327); }

// h = x + bias (written to h_out when there is a bias: backward needs it; else h is x itself).
// exact:  y = h Phi(h),  Phi(h) = (1 + erf(h / sqrt 2)) / 2   (aux = Phi(h))
// tanh:   y = h (1 + t) / 2,  t = tanh(sqrt(2/pi) (h + 0.044715 h^3))   (aux = t)
template <typename T>
__global__ void bias_gelu_forward(const T* __restrict__ x, const T* __restrict__ bias, T* __restrict__ y,
                                  T* __restrict__ h_out, T* __restrict__ aux, long long size, int n, int tanh_form) {
    FOR_EACH_ENTRY(i, size) {
        const T h = bias ? x[i] + bias[i % n] : x[i];
        if (bias) h_out[i] = h;
        if (tanh_form) {
            const T t = tanh(tanh_c<T>() * (h + tanh_k<T>() * h * h * h));
            aux[i] = t;
            y[i] = T(0.5) * h * (T(1) + t);
        } else {
            const T cdf = T(0.5) * (T(1) + erf(h * inv_sqrt_2<T>()));
            aux[i] = cdf;
            y[i] = h * cdf;
        }
    }
}

// exact: y = h Phi(h), Phi' = phi(h) = exp(-h^2 / 2) / sqrt(2 pi), so dh = dy (Phi(h) + h phi(h)).
// tanh:  y = h (1 + t) / 2 with t = tanh(u), u = c (h + k h^3), du/dh = c (1 + 3 k h^2), dt/du = 1 - t^2:
//        dh = dy ((1 + t) / 2 + h (1 - t^2) du/dh / 2).
// In place (dh == dy) is fine.
template <typename T>
__global__ void gelu_backward(const T* dy, const T* __restrict__ h, const T* __restrict__ aux, T* dh,
                              long long size, int tanh_form) {
    FOR_EACH_ENTRY(i, size) {
        const T v = h[i], a = aux[i];
        T slope;
        if (tanh_form) {
            // s du/dh with s = h (1 - t^2) / 2 as c s + 3 c k (s h) h: s is 0 where tanh saturates, and
            // h^2 (inf in float32 from 1.8e19) is never formed: the slope's limit, not 0 * inf
            const T s = T(0.5) * v * (T(1) - a * a);
            slope = T(0.5) * (T(1) + a) + tanh_c<T>() * s + T(3) * tanh_c<T>() * tanh_k<T>() * (s * v) * v;
        } else {
            slope = a + v * exp(T(-0.5) * v * v) * inv_sqrt_2pi<T>();
        }
        dh[i] = dy[i] * slope;
    }
}
