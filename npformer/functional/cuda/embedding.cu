// The backward of an embedding lookup, a scatter-add of rows: dweight[ids[r]] += dout[r] for every
// row r, with atomic adds (rows with the same id meet in dweight). The CUDA twin of
// scatter_add_rows in npformer/functional/embedding/math.py (the reference it is tested against).
//
// Forward: out[r] = weight[ids[r]], so d out[r] / d weight[v] = [ids[r] == v] and
//   dweight[v] = sum over r with ids[r] == v of dout[r].
// One block per row r (the blocks loop over the rows), its threads along the dim entries: a warp
// reads 32 consecutive entries of dout and adds them to 32 consecutive entries of dweight.
// dweight must be zero on entry. Ids out of [0, num_rows) are skipped (the id check reports them).
template <typename T>
__global__ void embedding_backward(const long long* __restrict__ ids, const T* __restrict__ dout,
                                   T* __restrict__ dweight, long long rows, int dim, long long num_rows) {
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const long long v = ids[row];
        if (v < 0 || v >= num_rows) continue;
        for (int j = threadIdx.x; j < dim; j += blockDim.x) atomicAdd(&dweight[v * dim + j], dout[row * dim + j]);
    }
}
