"""Numerically stable softmax and log-softmax along one axis."""
from __future__ import annotations

from autograd import Function, Tensor, backend
from autograd.backend import Array
from npformer.runtime.kernels import kernel_table

from ._common import check_tensor, has_twin, normalize_dim


def stable_row_max(x, axis):
    """Row maximum with rows that are entirely -inf mapped to 0, so x - max never makes -inf - (-inf).
    A row holding +inf or NaN keeps its maximum: x - max is NaN there, the whole row NaN, as torch's."""
    xp = backend.get_array_module(x)
    if x.shape[axis] == 0:  # empty rows: nothing to shift
        return xp.zeros(x.shape[:axis % x.ndim] + (1,) + x.shape[axis % x.ndim + 1:], dtype=x.dtype)
    m = row_max(x, axis)
    xp.copyto(m, 0.0, where=m == -xp.inf)  # not m[mask] = 0: on a GPU that waits for the count
    return m


@kernel_table
def row_max(x, axis):
    """x.max(axis, keepdims=True) of a non-empty axis (NaN if the row holds one)."""
    return x.max(axis=axis, keepdims=True)


@kernel_table
def softmax_forward(x, axis, out=None):
    """exp(x - max) / sum(exp(x - max)) along axis; a row that is entirely -inf gives zeros.
    `out=x` computes it in place."""
    xp = backend.get_array_module(x)
    y = xp.subtract(x, stable_row_max(x, axis), out=out)   # (...) shifted scores, <= 0
    xp.exp(y, out=y)
    total = row_sum(y, axis)                        # (..., 1, ...)
    xp.copyto(total, 1.0, where=total == 0)         # fully -inf row: 0 / 1 = 0
    y /= total
    return y


@kernel_table
def row_sum(x, axis):
    """x.sum(axis, keepdims=True)."""
    return x.sum(axis=axis, keepdims=True)


@kernel_table
def row_dot(a, b):
    """sum(a * b) along the last axis, keepdims: (..., n), (..., n) -> (..., 1)."""
    return (a * b).sum(axis=-1, keepdims=True)


@kernel_table
def softmax_backward(y, dy, axis, out=None):
    """dx = y * (dy - sum(dy * y)) along axis; `out=dy` computes it in place."""
    xp = backend.get_array_module(dy)
    if axis in (-1, y.ndim - 1):                    # (..., 1)  sum_j dy_j y_j
        inner = row_dot(dy, y)
    else:
        inner = (dy * y).sum(axis=axis, keepdims=True)
    dx = xp.subtract(dy, inner, out=out)
    dx *= y
    return dx


class SoftmaxFunction(Function):
    """y = softmax(x) along `dim`, any shape.  dx = y * (dy - sum(dy * y, dim))."""

    @staticmethod
    def forward(ctx, x, dim):
        y = softmax_forward(x, dim)
        ctx.save_for_backward(y)
        ctx.dim = dim
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        # y_i = exp(x_i) / sum_j exp(x_j)  ->  dx_i = y_i (dy_i - sum_j dy_j y_j)
        return softmax_backward(y, dy, ctx.dim)


@kernel_table
def log_softmax_forward(x, axis):
    """x - max - log(sum(exp(x - max))) along axis; a row that is entirely -inf stays -inf."""
    xp = backend.get_array_module(x)
    shifted = x - stable_row_max(x, axis)           # (...)
    total = xp.exp(shifted).sum(axis=axis, keepdims=True)
    xp.copyto(total, 1.0, where=total == 0)         # fully -inf row: log 1 = 0, output -inf
    shifted -= xp.log(total)
    return shifted


@kernel_table
def log_softmax_backward(logp, dy, axis):
    """dx = dy - exp(logp) * sum(dy) along axis."""
    xp = backend.get_array_module(dy)
    # logp_i = x_i - log sum_j exp(x_j)  ->  dx_i = dy_i - softmax_i * sum_j dy_j
    dx = xp.exp(logp)
    dx *= -dy.sum(axis=axis, keepdims=True)
    dx += dy
    return dx


class LogSoftmaxFunction(Function):
    """logp = log_softmax(x) along `dim`, any shape.  dx = dy - exp(logp) * sum(dy, dim)."""

    @staticmethod
    def forward(ctx, x, dim):
        logp = log_softmax_forward(x, dim)
        ctx.save_for_backward(logp)
        ctx.dim = dim
        return logp

    @staticmethod
    def backward(ctx, dy):
        (logp,) = ctx.saved_tensors
        return log_softmax_backward(logp, dy, ctx.dim)


def _along(function, op, input, dim):
    """function.apply(input) along `dim`; a 0-d input runs as one row of one entry (torch's
    softmax of a scalar is 1, its log_softmax 0)."""
    x = check_tensor("input", input, op)
    dim = normalize_dim(dim, x.ndim, op)
    if x.ndim == 0:
        row = (input if isinstance(input, Tensor) else Tensor(input)).reshape(1)
        return function.apply(row, dim=0).reshape(())
    return function.apply(input, dim=dim)


@has_twin
def softmax(input: Tensor | Array, dim: int = -1) -> Tensor:
    """softmax along `dim` (like torch.nn.functional.softmax); rows of all -inf give 0, not NaN.
    Raises IndexError for a dim out of range."""
    return _along(SoftmaxFunction, "softmax", input, dim)


@has_twin
def log_softmax(input: Tensor | Array, dim: int = -1) -> Tensor:
    """log_softmax along `dim` (like torch.nn.functional.log_softmax), never log(softmax(x)).
    A row of all -inf gives -inf (and gradient dy for that row) instead of NaN."""
    return _along(LogSoftmaxFunction, "log_softmax", input, dim)
