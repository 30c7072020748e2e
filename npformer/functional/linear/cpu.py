"""linear's GEMMs split across the threads of `npformer.runtime.threads` (the "cpu" implementation of
the kernel tables linear_forward / linear_backward / linear_tangent): y, dx and the tangent t_h by
blocks of rows, dW and db by blocks of output features, dx and dW side by side; products too small
to split and big enough for numpy's BLAS threads (threads.MIN_BLAS_THREADS_MACS) whole on them."""
from npformer.runtime import threads
from npformer.runtime.threads import for_rows, side_by_side

from . import linear_backward, linear_forward, linear_tangent

# t_h = t_x W^T + x t_W^T is split by blocks of rows when it has at least this many rows per unit
# of the products' depth (in), else its two products run side by side (BENCHMARKS.md)
TANGENT_ROW_BLOCKS_MIN_ROWS_PER_DEPTH = 1


@linear_forward.register("cpu", splits_reference=True, supports=lambda xp, x, weight, bias:
                         x.size * weight.shape[0] >= threads.MIN_BLAS_THREADS_MACS)
def linear_forward_cpu(xp, x, weight, bias):
    """The reference on blocks of rows of x and y; a product too small to split, whole on BLAS's threads."""
    if x.size * weight.shape[0] < threads.MIN_PARALLEL_MACS:
        return threads.run_on_blas_threads(linear_forward.reference, xp, x, weight, bias)
    y = xp.empty((x.shape[0], weight.shape[0]), dtype=x.dtype)   # (N, out)

    def rows(start, stop):
        # y = x W^T + b
        xp.matmul(x[start:stop], weight.T, out=y[start:stop])
        if bias is not None:
            y[start:stop] += bias

    for_rows(rows, x.shape[0], x.size + y.size, x)
    return y


@linear_backward.register("cpu", splits_reference=True,
                          supports=lambda xp, dy, x, weight, need_x, need_w, need_b:
                          dy.size + x.size >= threads.MIN_PARALLEL_ENTRIES
                          or dy.size * x.shape[1] >= threads.MIN_BLAS_THREADS_MACS)
def linear_backward_cpu(xp, dy, x, weight, need_x, need_w, need_b):
    """The reference's dx on blocks of rows, dW and db on blocks of output features; products too
    small to split, whole on BLAS's threads."""
    if dy.size + x.size < threads.MIN_PARALLEL_ENTRIES:
        return threads.run_on_blas_threads(linear_backward.reference, xp, dy, x, weight, need_x, need_w, need_b)
    dx = xp.empty_like(x) if need_x else None                                # (N, in)
    dweight = xp.empty_like(weight) if need_w else None                      # (out, in)
    dbias = xp.empty(weight.shape[0], dtype=dy.dtype) if need_b else None    # (out,)
    ones = xp.ones(dy.shape[0], dtype=dy.dtype) if need_b else None          # (N,)

    def rows(start, stop):
        # y = x W^T  ->  dx = dy W
        xp.matmul(dy[start:stop], weight, out=dx[start:stop])

    def features(start, stop):
        # y = x W^T  ->  dW = dy^T x
        if need_w:
            xp.matmul(dy[:, start:stop].T, x, out=dweight[start:stop])
        # y = x W^T + b  ->  db = 1^T dy
        if need_b:
            xp.matmul(ones, dy[:, start:stop], out=dbias[start:stop])

    if need_x and (need_w or need_b):
        # dx and dW cost the same FLOPs and need not wait for each other: side by side
        side_by_side([(rows, dy.shape[0], dx.size), (features, weight.shape[0], dy.size)], dy.size + x.size, dy)
    else:
        if need_x:
            for_rows(rows, dy.shape[0], dx.size, dy)
        if need_w or need_b:
            for_rows(features, weight.shape[0], dy.size, dy)
    return dx, dweight, dbias


@linear_tangent.register("cpu", splits_reference=True, supports=lambda xp, x, weight, t_x, t_weight, t_bias:
                         t_x is not None and t_weight is not None
                         and x.size * weight.shape[0] >= threads.MIN_PARALLEL_MACS)
def linear_tangent_cpu(xp, x, weight, t_x, t_weight, t_bias):
    """The reference's two products t_x W^T and x t_W^T and their sum (and t_b), split two ways by
    the shape: a tall output (the forward's and dx's tangents) by blocks of rows, each block's two
    products and their sum in its thread; a short one (dW's tangent, (out, N) @ (N, in)) with the
    two products side by side, each whole on its own thread, then the small sum."""
    t_h = xp.empty((x.shape[0], weight.shape[0]), dtype=x.dtype)           # (N, out)
    entries = x.size + t_h.size
    if x.shape[0] >= TANGENT_ROW_BLOCKS_MIN_ROWS_PER_DEPTH * x.shape[1]:
        def rows(start, stop):
            block = t_h[start:stop]
            # h = x W^T + b  ->  t_h = t_x W^T + x t_W^T + t_b
            xp.matmul(t_x[start:stop], weight.T, out=block)
            block += x[start:stop] @ t_weight.T
            if t_bias is not None:
                block += t_bias

        for_rows(rows, x.shape[0], entries, x)
        return t_h
    along_w = xp.empty_like(t_h)                                            # x t_W^T

    def with_x(start, stop):
        xp.matmul(t_x[start:stop], weight.T, out=t_h[start:stop])

    def with_w(start, stop):
        xp.matmul(x[start:stop], t_weight.T, out=along_w[start:stop])

    side_by_side([(with_x, x.shape[0], entries), (with_w, x.shape[0], entries)], entries, x)
    t_h += along_w
    if t_bias is not None:
        t_h += t_bias
    return t_h
