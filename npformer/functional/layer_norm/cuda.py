"""Launchers of layer_norm.cu (npformer/functional/cuda/): layer norm forward and backward over
contiguous (N, D) rows."""
from ..cuda import contiguous_floats, function, null, row_grid, row_shape, row_threads, short_rows
from . import layer_norm_backward, layer_norm_forward

PARAM_BLOCK = (32, 32)   # layer_norm_backward_params: 32 columns x 32 row-threads per block
MAX_ROW_PARTS = 64       # blocks along the rows in the first reduction of dweight / dbias


@layer_norm_forward.register("cuda", supports=lambda xp, x, weight, bias, eps:
                            short_rows(x.shape[1]) and contiguous_floats(x, weight, bias))
def layer_norm_forward_cuda(xp, x, weight, bias, eps):
    rows, n = x.shape
    y, xhat = xp.empty_like(x), xp.empty_like(x)
    rstd = xp.empty((rows, 1), dtype=x.dtype)
    if x.size:
        function("layer_norm", "layer_norm_forward", x.dtype)(
            (row_grid(rows),), (row_threads(n),),
            (x, null(weight), null(bias), y, xhat, rstd, float(eps), *row_shape(xp, rows, n)))
    return y, xhat, rstd


@layer_norm_backward.register("cuda", supports=lambda xp, dy, xhat, rstd, weight, need_x, need_w, need_b:
                              short_rows(xhat.shape[1]) and contiguous_floats(dy, xhat, rstd, weight))
def layer_norm_backward_cuda(xp, dy, xhat, rstd, weight, need_x, need_w, need_b):
    rows, n = xhat.shape
    dx = xp.empty_like(xhat) if need_x else None
    dweight = xp.zeros(n, dtype=xhat.dtype) if need_w else None
    dbias = xp.zeros(n, dtype=xhat.dtype) if need_b else None
    if need_x and dy.size:
        function("layer_norm", "layer_norm_backward_input", xhat.dtype)(
            (row_grid(rows),), (row_threads(n),), (dy, xhat, null(weight), rstd, dx, *row_shape(xp, rows, n)))
    if (need_w or need_b) and dy.size:
        parts = max(1, min(MAX_ROW_PARTS, -(-rows // PARAM_BLOCK[1])))          # blocks along the rows
        partial_w = xp.empty((parts, n), dtype=xhat.dtype) if need_w else None  # (parts, D)
        partial_b = xp.empty((parts, n), dtype=xhat.dtype) if need_b else None
        function("layer_norm", "layer_norm_backward_params", xhat.dtype)(
            (-(-n // PARAM_BLOCK[0]), parts), PARAM_BLOCK,
            (dy, xhat, null(partial_w), null(partial_b), *row_shape(xp, rows, n)))
        for partial, out in ((partial_w, dweight), (partial_b, dbias)):
            if partial is not None:
                function("layer_norm", "column_sum", xhat.dtype)(
                    (-(-n // 256),), (256,), (partial, out, xp.int32(parts), xp.int32(n)))
    return dx, dweight, dbias
