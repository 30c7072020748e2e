"""Launcher of npformer/functional/cuda/embedding.cu: the embedding backward (a scatter-add of rows with atomics)."""
from ..cuda import contiguous_floats, function, row_grid, row_threads, short_rows
from . import scatter_add_rows


@scatter_add_rows.register("cuda", supports=lambda xp, ids, rows, num_rows:
                           short_rows(rows.shape[1]) and contiguous_floats(rows))
def scatter_add_rows_cuda(xp, ids, rows, num_rows):
    out = xp.zeros((num_rows, rows.shape[1]), dtype=rows.dtype)
    if rows.size:
        function("embedding", "embedding_backward", rows.dtype)(
            (row_grid(rows.shape[0]),), (row_threads(rows.shape[1]),),
            (xp.ascontiguousarray(ids, dtype="int64"), rows, out, xp.int64(rows.shape[0]), xp.int32(rows.shape[1]),
             xp.int64(num_rows)))
    return out
