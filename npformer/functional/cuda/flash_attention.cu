// Flash attention forward and backward (the FlashAttention-2 scheme: Dao, 2023): the CUDA twin of
// attention_blockwise_forward / attention_blockwise_backward in npformer/functional/attention/blockwise.py,
// the reference these kernels are tested against; the derivation is in npformer/functional/attention/derivation.md.
//
// Layout: q (BH, Tq, D), k and v (BH, Tk, D), out and dout (BH, Tq, D), lse and delta (BH, Tq),
// all contiguous; BH is the flattened leading (batch, head) shape. D is a template argument
// (32, 64 or 128), so that each thread keeps its share of a row in registers.
//
// Work split: a block owns ROWS rows (query rows in the forward and the dQ kernel, key rows in
// the dK/dV kernel) of one (batch, head). Each row belongs to a group of G = D / DIMS consecutive
// lanes of one warp; lane g of the group holds DIMS dimensions of the row (`dim_of`). A dot
// product over D is DIMS products per lane and a sum over the group (warp shuffles). The other
// operand streams through shared memory in tiles of KEYS rows (keys, or queries for dK/dV), read
// by every group of the block.
//
// Masks (any combination, as in the reference): causal (key j > query i hidden, top-left
// aligned like torch), a bool mask (true = hidden) or a float mask (added to the scores),
// broadcastable to (..., Tq, Tk): the kernels read entry (i, j) of (batch, head) b at
// mask[base[b] + i stride_q + j stride_k] (stride 0 on a broadcast axis). Dropout: entry (b, i, j)
// of the (..., Tq, Tk) probabilities is kept iff philox_keep(seed, offset + (b Tq + i) Tk + j,
// threshold) (the dropout contract, autograd/random.py), regenerated wherever needed, never stored.
#include "philox.cuh"
#include "reduce.cuh"

// Rows per block, dimensions per lane, and the rows of a shared-memory tile: float keeps 32
// dimensions per lane, double 16 (the same registers); every instance runs at most 256 threads
// and 32 KB of shared memory.
template <typename T> struct FlashTile;
template <> struct FlashTile<float>  { static constexpr int ROWS = 64, DIMS = 32, KEYS = 32; };
template <> struct FlashTile<double> { static constexpr int ROWS = 32, DIMS = 16, KEYS = 16; };

// The rows of one thread: block b owns rows [first, first + ROWS) (of Tq, or of Tk for dK/dV) of
// (batch, head) bh, and this thread is lane g of the group of row `index`. A row past the last
// (`count` rows in all) computes on the last row, `row`, and stores nothing: every thread runs
// every loop and barrier.
template <typename T, int D>
struct Rows {
    static constexpr int ROWS = FlashTile<T>::ROWS, G = D / FlashTile<T>::DIMS;
    long long bh;
    int first, index, row, g;
    __device__ explicit Rows(int count) {
        const int tiles = (count + ROWS - 1) / ROWS;
        bh = blockIdx.x / tiles;
        first = (int)(blockIdx.x % tiles) * ROWS;
        g = threadIdx.x % G;
        index = first + threadIdx.x / G;
        row = index < count ? index : count - 1;
    }
};

// Dimension d (0 <= d < DIMS) of lane g: the lanes hold a row in chunks of VEC = 16 bytes / sizeof(T)
// consecutive dimensions, chunk c G + g for c = 0, 1, ... So the G lanes of a group read G
// consecutive 16-byte chunks of a shared-memory row (one vector load each, no bank conflicts),
// and each load feeds VEC multiply-adds.
template <typename T, int G>
__device__ __forceinline__ int dim_of(int d, int g) {
    constexpr int VEC = 16 / sizeof(T);
    return ((d / VEC) * G + g) * VEC + d % VEC;
}

enum MaskKind { NO_MASK = 0, BOOL_MASK = 1, FLOAT_MASK = 2 };

// The attention mask of one (batch, head), as it applies to a score S_ij.
template <typename T>
struct Mask {
    int kind;                    // MaskKind
    const bool* hidden;          // BOOL_MASK: true = the key may not be attended to
    const T* added;              // FLOAT_MASK: added to the score
    long long stride_q, stride_k;
    int tk, causal;

    // S_ij = (s q_i) . k_j + mask_ij, or -inf where the key is hidden (or past the last key)
    __device__ __forceinline__ T apply(T score, int i, int j) const {
        if (j >= tk || (causal && j > i)) return -infinity<T>();
        const long long at = i * stride_q + j * stride_k;
        if (kind == FLOAT_MASK) return score + added[at];
        if (kind == BOOL_MASK && hidden[at]) return -infinity<T>();
        return score;
    }
};

template <typename T>
__device__ __forceinline__ Mask<T> mask_of(long long bh, int kind, const bool* hidden, const T* added,
                                           const long long* base, long long stride_q, long long stride_k,
                                           int tk, int causal) {
    Mask<T> mask = {kind, hidden, added, stride_q, stride_k, tk, causal};
    if (kind == BOOL_MASK) mask.hidden += base[bh];
    if (kind == FLOAT_MASK) mask.added += base[bh];
    return mask;
}

// Dropout's keep test of probability (b, i, j): value offset + (b Tq + i) Tk + j of the stream.
// Under CUDA-graph capture `state` points at the device (seed, base) rewritten before each replay:
// the seed is state[0] and the values start at state[1] + offset; else it is null.
struct Dropout {
    unsigned long long seed, offset;
    unsigned int threshold;      // 0: no dropout
    __device__ static Dropout of(const unsigned long long* state, unsigned long long seed, unsigned long long offset,
                                 unsigned int threshold) {
        if (state) { seed = state[0]; offset += state[1]; }
        return Dropout{seed, offset, threshold};
    }
    __device__ __forceinline__ bool keep(long long bh, int tq, int tk, int i, int j) const {
        if (threshold == 0u) return true;
        const unsigned long long index = ((unsigned long long)bh * tq + i) * tk + j;
        return philox_keep(seed, offset + index, threshold);
    }
};

// The sum over the G lanes of a row group (consecutive lanes, G a power of two dividing 32):
// after the xor steps G/2, ..., 1 every lane of the group holds the group's sum. Every lane of
// the warp must call it.
template <int G, typename T>
__device__ __forceinline__ T group_sum(T value) {
    #pragma unroll
    for (int step = G / 2; step > 0; step /= 2) value += __shfl_xor_sync(0xffffffffu, value, step);
    return value;
}

// Copy rows [first, first + rows) of a (n, D) matrix into a shared tile (rows x D), scaled by
// `scale`, zeros past row n. Every thread of the block takes part.
template <typename T, int D>
__device__ __forceinline__ void load_tile(T* tile, const T* matrix, int first, int rows, int n, T scale) {
    for (int e = threadIdx.x; e < rows * D; e += blockDim.x) {
        const int r = first + e / D;
        tile[e] = r < n ? matrix[(long long)r * D + e % D] * scale : T(0);
    }
}

// Forward, per query row i (the reference's attention_blockwise_forward with one row per group):
//   S_ij = (s q_i) . k_j + mask_ij
//   m' = max(m, max_j S_ij);  l = l exp(m - m') + sum_j exp(S_ij - m');
//   acc = acc exp(m - m') + sum_j exp(S_ij - m') keep_ij v_j;  m = m'
// over the key tiles, then O_i = acc / l / (1 - p) and L_i = m + log(l) (the logsumexp of the
// row: exp(S_ij - L_i) = P_ij). l sums the probabilities before dropout, the normalisation of
// the full softmax. A row whose keys are all hidden keeps m = -inf and l = 0: O_i = 0, L_i = -inf.
template <typename T, int D>
__global__ void __launch_bounds__(256)
flash_attention_forward(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                        T* __restrict__ out, T* __restrict__ lse,
                        int mask_kind, const bool* __restrict__ hidden, const T* __restrict__ added,
                        const long long* __restrict__ mask_base, long long mask_stride_q, long long mask_stride_k,
                        int tq, int tk, int causal, T scale,
                        const unsigned long long* __restrict__ state, unsigned long long seed, unsigned long long offset,
                        unsigned int threshold, T dropout_scale) {
    constexpr int ROWS = FlashTile<T>::ROWS, DIMS = FlashTile<T>::DIMS, KEYS = FlashTile<T>::KEYS, G = D / DIMS;
    static_assert(D % DIMS == 0 && 32 % G == 0, "a row group is a power-of-two share of one warp");
    __shared__ __align__(16) T k_tile[KEYS * D];
    __shared__ __align__(16) T v_tile[KEYS * D];
    const Rows<T, D> rows(tq);
    const long long bh = rows.bh;
    const int first_row = rows.first, i = rows.index, row = rows.row, g = rows.g;
    const Mask<T> mask = mask_of(bh, mask_kind, hidden, added, mask_base, mask_stride_q, mask_stride_k, tk, causal);
    const Dropout dropout = Dropout::of(state, seed, offset, threshold);

    T q_row[DIMS], acc[DIMS];
    #pragma unroll
    for (int d = 0; d < DIMS; ++d) {
        q_row[d] = q[((long long)bh * tq + row) * D + dim_of<T, G>(d, g)] * scale;   // s q_i, as the reference
        acc[d] = T(0);
    }
    T m = -infinity<T>(), l = T(0);
    // causal: keys past the block's last row are hidden from all of its rows
    const int key_stop = causal ? min(tk, first_row + ROWS) : tk;
    for (int k0 = 0; k0 < key_stop; k0 += KEYS) {
        __syncthreads();                                          // the previous tile is used up
        load_tile<T, D>(k_tile, k + (long long)bh * tk * D, k0, KEYS, tk, T(1));
        load_tile<T, D>(v_tile, v + (long long)bh * tk * D, k0, KEYS, tk, T(1));
        __syncthreads();
        T s[KEYS];                                                // S_ij of the tile
        T tile_max = -infinity<T>();
        #pragma unroll
        for (int jj = 0; jj < KEYS; ++jj) {
            T dot = T(0);
            #pragma unroll
            for (int d = 0; d < DIMS; ++d) dot += q_row[d] * k_tile[jj * D + dim_of<T, G>(d, g)];
            s[jj] = mask.apply(group_sum<G>(dot), row, k0 + jj);
            tile_max = s[jj] > tile_max ? s[jj] : tile_max;
        }
        const T new_max = tile_max > m ? tile_max : m;            // m', may still be -inf
        const T shift = isfinite(new_max) ? new_max : T(0);      // never -inf - (-inf)
        const T correction = exp(m - shift);                      // exp(m - m'): 0 while m = -inf
        l *= correction;
        #pragma unroll
        for (int d = 0; d < DIMS; ++d) acc[d] *= correction;
        #pragma unroll
        for (int jj = 0; jj < KEYS; ++jj) {
            T p = exp(s[jj] - shift);                             // exp(S_ij - m'), 0 where hidden
            l += p;                                               // before dropout
            if (p != T(0) && !dropout.keep(bh, tq, tk, row, k0 + jj)) p = T(0);   // P keep
            #pragma unroll
            for (int d = 0; d < DIMS; ++d) acc[d] += p * v_tile[jj * D + dim_of<T, G>(d, g)];
        }
        m = new_max;
    }
    if (i < tq) {
        // O = acc / l / (1 - p); 0 if all hidden (l = 0, not a NaN l: a NaN score keeps O and L NaN)
        const T factor = l == T(0) ? T(0) : dropout_scale / l;
        #pragma unroll
        for (int d = 0; d < DIMS; ++d) out[((long long)bh * tq + i) * D + dim_of<T, G>(d, g)] = acc[d] * factor;
        if (g == 0) lse[(long long)bh * tq + i] = l == T(0) ? -infinity<T>() : m + log(l);
    }
}

// Backward, first kernel: dQ (and D), per query row i, over the key tiles. With P_ij = exp(S_ij - L_i)
// recomputed from the saved logsumexp (a fully hidden row has L = -inf: +inf is used, so P = 0):
//   O_i = sum_j Pd_ij v_j, Pd = P keep / (1 - p)   ->  dPd_ij = dO_i . v_j,  dP_ij = dPd_ij keep_ij / (1 - p)
//   P_i = softmax(S_i)                             ->  dS_ij = P_ij (dP_ij - sum_k dP_ik P_ik)
// and sum_k dP_ik P_ik = sum_k dPd_ik Pd_ik = dO_i . O_i = D_i, known before any key is seen.
//   S_ij = (s q_i) . k_j                           ->  dQ_i = s sum_j dS_ij k_j
// D_i is written to `delta` for the second kernel.
template <typename T, int D>
__global__ void __launch_bounds__(256)
flash_attention_backward_dq(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                            const T* __restrict__ out, const T* __restrict__ dout, const T* __restrict__ lse,
                            T* __restrict__ delta, T* __restrict__ dq,
                            int mask_kind, const bool* __restrict__ hidden, const T* __restrict__ added,
                            const long long* __restrict__ mask_base, long long mask_stride_q,
                            long long mask_stride_k, int tq, int tk, int causal, T scale,
                            const unsigned long long* __restrict__ state, unsigned long long seed, unsigned long long offset,
                        unsigned int threshold,
                            T dropout_scale) {
    constexpr int ROWS = FlashTile<T>::ROWS, DIMS = FlashTile<T>::DIMS, KEYS = FlashTile<T>::KEYS, G = D / DIMS;
    static_assert(D % DIMS == 0 && 32 % G == 0, "a row group is a power-of-two share of one warp");
    __shared__ __align__(16) T k_tile[KEYS * D];
    __shared__ __align__(16) T v_tile[KEYS * D];
    const Rows<T, D> rows(tq);
    const long long bh = rows.bh;
    const int first_row = rows.first, i = rows.index, row = rows.row, g = rows.g;
    const long long at = (long long)bh * tq + row;                // this row in (BH, Tq)
    const Mask<T> mask = mask_of(bh, mask_kind, hidden, added, mask_base, mask_stride_q, mask_stride_k, tk, causal);
    const Dropout dropout = Dropout::of(state, seed, offset, threshold);

    T q_row[DIMS], do_row[DIMS], dq_row[DIMS];
    T row_delta = T(0);                                           // D_i = dO_i . O_i
    #pragma unroll
    for (int d = 0; d < DIMS; ++d) {
        q_row[d] = q[at * D + dim_of<T, G>(d, g)] * scale;
        do_row[d] = dout[at * D + dim_of<T, G>(d, g)];
        row_delta += do_row[d] * out[at * D + dim_of<T, G>(d, g)];
        dq_row[d] = T(0);
    }
    row_delta = group_sum<G>(row_delta);
    if (i < tq && g == 0) delta[at] = row_delta;
    const T row_lse = isfinite(lse[at]) ? lse[at] : infinity<T>();
    const int key_stop = causal ? min(tk, first_row + ROWS) : tk;
    for (int k0 = 0; k0 < key_stop; k0 += KEYS) {
        __syncthreads();
        load_tile<T, D>(k_tile, k + (long long)bh * tk * D, k0, KEYS, tk, T(1));
        load_tile<T, D>(v_tile, v + (long long)bh * tk * D, k0, KEYS, tk, T(1));
        __syncthreads();
        #pragma unroll 4
        for (int jj = 0; jj < KEYS; ++jj) {
            T dot = T(0), dpd = T(0);
            #pragma unroll
            for (int d = 0; d < DIMS; ++d) {
                dot += q_row[d] * k_tile[jj * D + dim_of<T, G>(d, g)];
                dpd += do_row[d] * v_tile[jj * D + dim_of<T, G>(d, g)];
            }
            const T p = exp(mask.apply(group_sum<G>(dot), row, k0 + jj) - row_lse);   // P_ij
            dpd = group_sum<G>(dpd);                                                  // dPd_ij
            const bool keep = p == T(0) || dropout.keep(bh, tq, tk, row, k0 + jj);
            const T ds = p * ((keep ? dpd * dropout_scale : T(0)) - row_delta);      // dS_ij = P (dP - D)
            #pragma unroll
            for (int d = 0; d < DIMS; ++d) dq_row[d] += ds * k_tile[jj * D + dim_of<T, G>(d, g)];
        }
    }
    if (i < tq) {
        #pragma unroll
        for (int d = 0; d < DIMS; ++d) dq[at * D + dim_of<T, G>(d, g)] = dq_row[d] * scale;   // dQ = s dS K
    }
}

// Backward, second kernel: dK and dV, per key row j, over the query tiles (after the first kernel,
// which wrote D). With P_ij, Pd_ij, dP_ij and dS_ij as above:
//   O_i = sum_j Pd_ij v_j    ->  dV_j = sum_i Pd_ij dO_i
//   S_ij = (s q_i) . k_j     ->  dK_j = sum_i dS_ij (s q_i)
// The query tile holds s q_i, so dK needs no final scaling.
template <typename T, int D>
__global__ void __launch_bounds__(256)
flash_attention_backward_dkdv(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                              const T* __restrict__ dout, const T* __restrict__ lse, const T* __restrict__ delta,
                              T* __restrict__ dk, T* __restrict__ dv,
                              int mask_kind, const bool* __restrict__ hidden, const T* __restrict__ added,
                              const long long* __restrict__ mask_base, long long mask_stride_q,
                              long long mask_stride_k, int tq, int tk, int causal, T scale,
                              const unsigned long long* __restrict__ state, unsigned long long seed, unsigned long long offset,
                        unsigned int threshold,
                              T dropout_scale) {
    constexpr int DIMS = FlashTile<T>::DIMS, QUERIES = FlashTile<T>::KEYS, G = D / DIMS;
    static_assert(D % DIMS == 0 && 32 % G == 0, "a row group is a power-of-two share of one warp");
    __shared__ __align__(16) T q_tile[QUERIES * D];
    __shared__ __align__(16) T do_tile[QUERIES * D];
    __shared__ T lse_tile[QUERIES];
    __shared__ T delta_tile[QUERIES];
    const Rows<T, D> rows(tk);                                    // key rows
    const long long bh = rows.bh;
    const int first_key = rows.first, j = rows.index, key = rows.row, g = rows.g;
    const long long at = (long long)bh * tk + key;                // this key in (BH, Tk)
    const Mask<T> mask = mask_of(bh, mask_kind, hidden, added, mask_base, mask_stride_q, mask_stride_k, tk, causal);
    const Dropout dropout = Dropout::of(state, seed, offset, threshold);

    T k_row[DIMS], v_row[DIMS], dk_row[DIMS], dv_row[DIMS];
    #pragma unroll
    for (int d = 0; d < DIMS; ++d) {
        k_row[d] = k[at * D + dim_of<T, G>(d, g)];
        v_row[d] = v[at * D + dim_of<T, G>(d, g)];
        dk_row[d] = dv_row[d] = T(0);
    }
    // causal: queries before the block's first key see none of its keys
    for (int q0 = causal ? first_key : 0; q0 < tq; q0 += QUERIES) {
        __syncthreads();
        load_tile<T, D>(q_tile, q + (long long)bh * tq * D, q0, QUERIES, tq, scale);   // s q_i
        load_tile<T, D>(do_tile, dout + (long long)bh * tq * D, q0, QUERIES, tq, T(1));
        for (int e = threadIdx.x; e < QUERIES; e += blockDim.x) {
            const int i = q0 + e;
            const T row_lse = i < tq ? lse[(long long)bh * tq + i] : -infinity<T>();
            lse_tile[e] = isfinite(row_lse) ? row_lse : infinity<T>();    // hidden rows (and past Tq): P = 0
            delta_tile[e] = i < tq ? delta[(long long)bh * tq + i] : T(0);
        }
        __syncthreads();
        #pragma unroll 4
        for (int ii = 0; ii < QUERIES; ++ii) {
            const int i = q0 + ii;
            T dot = T(0), dpd = T(0);
            #pragma unroll
            for (int d = 0; d < DIMS; ++d) {
                dot += q_tile[ii * D + dim_of<T, G>(d, g)] * k_row[d];
                dpd += do_tile[ii * D + dim_of<T, G>(d, g)] * v_row[d];
            }
            dot = group_sum<G>(dot);
            const T score = i < tq ? mask.apply(dot, i, key) : -infinity<T>();     // no row past Tq
            const T p = exp(score - lse_tile[ii]);                                  // P_ij
            dpd = group_sum<G>(dpd);                                                // dPd_ij = dO_i . v_j
            const bool keep = p == T(0) || dropout.keep(bh, tq, tk, i, key);
            const T pd = keep ? p * dropout_scale : T(0);                           // Pd_ij
            const T ds = p * ((keep ? dpd * dropout_scale : T(0)) - delta_tile[ii]);  // dS_ij = P (dP - D)
            #pragma unroll
            for (int d = 0; d < DIMS; ++d) {
                dv_row[d] += pd * do_tile[ii * D + dim_of<T, G>(d, g)];                      // dV_j += Pd_ij dO_i
                dk_row[d] += ds * q_tile[ii * D + dim_of<T, G>(d, g)];                       // dK_j += dS_ij s q_i
            }
        }
    }
    if (j < tk) {
        #pragma unroll
        for (int d = 0; d < DIMS; ++d) {
            dk[at * D + dim_of<T, G>(d, g)] = dk_row[d];
            dv[at * D + dim_of<T, G>(d, g)] = dv_row[d];
        }
    }
}
