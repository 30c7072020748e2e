"""Numerically stable softmax and log-softmax along one axis: the kernel tables made from the
formulas of math.py, the Functions and the public ops."""
from __future__ import annotations

from autograd import Function, Tensor, backend
from autograd.backend import Array
from npformer.runtime.kernels import kernel_table

from .._common import check_tensor, has_twin, normalize_dim, tensor_of
from . import math
from .rows import row_dot, row_max, row_sum, stable_row_max  # noqa: F401  (other ops' row reductions)

__all__ = ["log_softmax", "softmax"]  # its public ops, which npformer.functional exports

softmax_forward = kernel_table(math.softmax_forward)
softmax_backward = kernel_table(math.softmax_backward)
log_softmax_forward = kernel_table(math.log_softmax_forward)
log_softmax_backward = kernel_table(math.log_softmax_backward)
log_softmax_jvp = kernel_table(math.log_softmax_jvp)


class SoftmaxFunction(Function):
    """y = softmax(x) along `dim`, any shape.  dx = y * (dy - sum(dy * y, dim))."""
    backward_formula = staticmethod(math.softmax_backward)

    @staticmethod
    def forward(ctx, x, dim):
        y = softmax_forward(backend.get_array_module(x), x, dim)
        ctx.save_for_backward(y)
        ctx.dim = dim
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        # y_i = exp(x_i) / sum_j exp(x_j)  ->  dx_i = y_i (dy_i - sum_j dy_j y_j)
        return softmax_backward(backend.get_array_module(dy), y, dy, ctx.dim)

    @staticmethod
    def differentiable_backward(ctx, dy):
        # dx = y * (dy - s), s = sum(dy * y), y this node's output (in the graph: back to x through it)
        #   d/d(dy) <dx, u> = y * (u - sum(u * y))                    (softmax's Jacobian again: symmetric)
        #   d/dy <dx, u> = r = u * (dy - s) - dy * sum(u * y), then to x as softmax's backward: y * (r - sum(r * y))
        y = ctx.as_output(ctx.saved_tensors[0])
        return y * (dy - (dy * y).sum(axis=ctx.dim, keepdims=True))

    @staticmethod
    def jvp(ctx, t):
        (y,) = ctx.saved_tensors
        # y_i = exp(x_i) / sum_j exp(x_j)  ->  t_y_i = y_i (t_i - sum_j y_j t_j): the Jacobian
        # diag(y) - y y^T is symmetric, so the backward's kernel applies as is
        return softmax_backward(backend.get_array_module(t), y, t, ctx.dim)


class LogSoftmaxFunction(Function):
    """logp = log_softmax(x) along `dim`, any shape.  dx = dy - exp(logp) * sum(dy, dim)."""
    backward_formula = staticmethod(math.log_softmax_backward)

    @staticmethod
    def forward(ctx, x, dim):
        logp = log_softmax_forward(backend.get_array_module(x), x, dim)
        ctx.save_for_backward(logp)
        ctx.dim = dim
        return logp

    @staticmethod
    def backward(ctx, dy):
        (logp,) = ctx.saved_tensors
        return log_softmax_backward(backend.get_array_module(dy), logp, dy, ctx.dim)

    @staticmethod
    def differentiable_backward(ctx, dy):
        # dx = dy - p * sum(dy), p = exp(logp), logp this node's output
        #   d/d(dy) <dx, u> = u - sum(u * p)                          (broadcast along the row)
        #   d/dlogp <dx, u> = r = -p * u * sum(dy), then to x as log_softmax's backward: r - p * sum(r)
        p = ctx.as_output(ctx.saved_tensors[0]).exp()
        return dy - p * dy.sum(axis=ctx.dim, keepdims=True)

    @staticmethod
    def jvp(ctx, t):
        (logp,) = ctx.saved_tensors
        return log_softmax_jvp(backend.get_array_module(t), logp, t, ctx.dim)


def _along(function, op, input, dim):
    """function.apply(input) along `dim`; a 0-d input runs as one row of one entry (torch's
    softmax of a scalar is 1, its log_softmax 0)."""
    x = check_tensor("input", input, op)
    dim = normalize_dim(dim, x.ndim, op)
    if x.ndim == 0:
        row = tensor_of(input).reshape(1)
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


from . import cpu, cuda  # noqa: E402,F401  (register the fast variants)
