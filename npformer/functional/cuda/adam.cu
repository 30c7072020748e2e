// One Adam / AdamW step of one parameter, one thread per entry (the optimizer's whole update in one
// kernel instead of ~13). The CUDA twin of adam_update in npformer/functional/adam.py, operation
// for operation (a GPU may contract a * b + c into one FMA, as torch's CUDA Adam does).
//
//   AdamW (variant 2): p = p * (1 - lr * weight_decay)               (decay, before the step)
//   Adam + L2 (1):     g = grad + weight_decay * p
//   m = m + (1 - beta1) (g - m);   v = beta2 v + (1 - beta2) g g
//   p = p - step_size * m / (sqrt(v) / bias_correction2_sqrt + eps)
// with step_size = lr / (1 - beta1^t) and bias_correction2_sqrt = sqrt(1 - beta2^t).
//
// The step-dependent scalars (step_size, bias_correction2_sqrt, decay) come by value, or, under
// graph capture, from the device array `replayed` (3 doubles), which the host rewrites before each
// replay: the learning-rate schedule and the step count go on without a new capture.
#define ADAM_PLAIN 0
#define ADAM_L2 1
#define ADAM_DECOUPLED 2

template <typename T>
__global__ void adam_step(T* __restrict__ param, const T* __restrict__ grad, T* __restrict__ exp_avg,
                          T* __restrict__ exp_avg_sq, const double* __restrict__ replayed, double step_size,
                          double bias_correction2_sqrt, double decay, double one_minus_beta1, double beta2,
                          double one_minus_beta2, double eps, double weight_decay, int variant, long long size) {
    if (replayed) { step_size = replayed[0]; bias_correction2_sqrt = replayed[1]; decay = replayed[2]; }
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < size;
         i += (long long)gridDim.x * blockDim.x) {
        T p = param[i], g = grad[i];
        if (variant == ADAM_DECOUPLED) p = p * T(decay);
        if (variant == ADAM_L2) g = g + T(weight_decay) * p;
        const T m = exp_avg[i] + T(one_minus_beta1) * (g - exp_avg[i]);
        const T v = T(beta2) * exp_avg_sq[i] + T(one_minus_beta2) * g * g;
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
        param[i] = p - T(step_size) * (m / (sqrt(v) / T(bias_correction2_sqrt) + T(eps)));
    }
}
