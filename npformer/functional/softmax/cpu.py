"""Row reductions on the CPU (the "cpu" implementations of this family's kernel tables): faster
numpy calls than the references' for the short rows of attention (einsum sums, argmax maxima),
and math.py's softmax steps along the last axis on them."""
from autograd import backend

from . import log_softmax_forward, softmax_backward, softmax_forward
from .rows import row_dot, row_max, row_sum, stable_row_max


# below this many entries max's single call beats argmax's two (a decoding step's few query rows)
ROW_MAX_MIN_ENTRIES = 1 << 14


def _last_axis(x, axis):
    return axis in (-1, x.ndim - 1)


@row_max.register("cpu", supports=lambda x, axis: _last_axis(x, axis) and x.size >= ROW_MAX_MIN_ENTRIES)
def row_max_cpu(x, axis):
    """Along the last axis as the entry at argmax: numpy's argmax is vectorised along short rows,
    its max is not. The same value: argmax picks a maximum, or the first NaN, which max propagates."""
    xp = backend.get_array_module(x)
    rows = x.reshape(-1, x.shape[-1])                                    # (R, n)
    first = xp.arange(rows.shape[0]) * rows.shape[1]                     # (R,) flat index of each row's start
    return rows.reshape(-1).take(first + rows.argmax(axis=1)).reshape(x.shape[:-1] + (1,))


@row_sum.register("cpu", supports=lambda x, axis: _last_axis(x, axis))
def row_sum_cpu(x, axis):
    """Along the last axis with einsum: faster than numpy's reduction over short rows
    (e.g. 64 attention keys)."""
    return backend.get_array_module(x).einsum("...i->...", x)[..., None]


@row_dot.register("cpu")
def row_dot_cpu(a, b):
    """With einsum: no (..., n) temporary, and faster than numpy's reduction over short rows."""
    return backend.get_array_module(a).einsum("...i,...i->...", a, b)[..., None]


@softmax_forward.register("cpu", supports=lambda xp, x, axis, out=None: _last_axis(x, axis))
def softmax_forward_cpu(xp, x, axis, out=None):
    """math.softmax_forward with the row maximum and the row sums of rows.py (argmax, einsum)."""
    y = xp.subtract(x, stable_row_max(x, axis), out=out)
    xp.exp(y, out=y)
    total = row_sum(y, axis)
    xp.copyto(total, 1.0, where=total == 0)
    y /= total
    return y


@softmax_backward.register("cpu", supports=lambda xp, y, dy, axis, out=None: _last_axis(y, axis))
def softmax_backward_cpu(xp, y, dy, axis, out=None):
    """math.softmax_backward with the row sum of dy * y as an einsum (no (..., n) temporary)."""
    dx = xp.subtract(dy, row_dot(dy, y), out=out)
    dx *= y
    return dx


@log_softmax_forward.register("cpu", supports=lambda xp, x, axis: _last_axis(x, axis)
                              and x.size >= ROW_MAX_MIN_ENTRIES)
def log_softmax_forward_cpu(xp, x, axis):
    """math.log_softmax_forward with the row maximum of rows.py (argmax)."""
    shifted = x - stable_row_max(x, axis)
    total = xp.exp(shifted).sum(axis=axis, keepdims=True)
    xp.copyto(total, 1.0, where=total == 0)
    shifted -= xp.log(total)
    return shifted
