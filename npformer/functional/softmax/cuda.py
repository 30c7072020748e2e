"""Launchers of softmax.cu (npformer/functional/cuda/): softmax forward and backward along the last
axis of contiguous rows."""
from ..cuda import contiguous_floats, function, row_grid, row_shape, row_threads, short_rows
from . import softmax_backward, softmax_forward


def _last_axis_rows(*arrays, axis):
    """The kernels take contiguous (rows, n) data with the softmax along n (out: None or such an array)."""
    return (axis in (-1, arrays[0].ndim - 1) and arrays[0].size > 0 and short_rows(arrays[0].shape[-1])
            and contiguous_floats(*arrays))


@softmax_forward.register("cuda", supports=lambda xp, x, axis, out=None: _last_axis_rows(x, out, axis=axis))
def softmax_forward_cuda(xp, x, axis, out=None):
    y = xp.empty_like(x) if out is None else out
    n = x.shape[-1]
    rows = x.size // n
    function("softmax", "softmax_forward", x.dtype)((row_grid(rows),), (row_threads(n),), (x, y, *row_shape(xp, rows, n)))
    return y


@softmax_backward.register("cuda", supports=lambda xp, y, dy, axis, out=None: _last_axis_rows(y, dy, out, axis=axis))
def softmax_backward_cuda(xp, y, dy, axis, out=None):
    dx = xp.empty_like(dy) if out is None else out
    n = y.shape[-1]
    rows = y.size // n
    function("softmax", "softmax_backward", y.dtype)((row_grid(rows),), (row_threads(n),),
                                                      (y, dy, dx, *row_shape(xp, rows, n)))
    return dx
