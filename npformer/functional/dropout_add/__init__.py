"""Dropout fused with the residual add: y = residual + dropout(x), the residual connection of a
Transformer sublayer in one op. The mask is F.dropout's (the dropout contract, drawn from a Philox
stream); its backward is F.dropout's backward for x, and dy itself for the residual. The formulas
are in math.py; here are the kernel table, the Function and the public op."""
from __future__ import annotations

from autograd import Function, Tensor, backend
from autograd.backend import Array
from autograd.checks import check_bool, check_real
from npformer.runtime.kernels import kernel_table
from npformer.runtime.random import Philox

from .._common import check_one_dtype, check_tensor, has_twin, tensor_of
from . import math
from ..activation import DropoutFunction, dropout_forward, dropout_stream

__all__ = ["dropout_add"]  # its public ops, which npformer.functional exports


@kernel_table
def dropout_add_forward(xp, x, residual, seed, offset, p, state=None):
    """(residual + x * keep / (1 - p), keep or None) for arrays of one shape, with the mask of
    dropout_forward(xp, x, seed, offset, p, state) (None where the backward draws it again)."""
    y, keep = dropout_forward(xp, x, seed, offset, p, state)
    y += residual
    return y, keep


class DropoutAddFunction(Function):
    """y = residual + x * m, m = keep / (1 - p) by the dropout contract.  dx = dy * m,  dresidual = dy."""
    backward_formula = staticmethod(math.dropout_add_backward)

    @staticmethod
    def forward(ctx, x, residual, seed, offset, p, state=None):
        y, keep = dropout_add_forward(backend.get_array_module(x), x, residual, seed, offset, p, state)  # keep None:
        #                                                                          drawn again
        ctx.save_for_backward(keep)
        ctx.stream = (seed, offset, p, state)
        return y

    @staticmethod
    def backward(ctx, dy):
        # y = residual + x * m  ->  dx = dy * m (F.dropout's backward),  dresidual = dy
        return DropoutFunction.backward(ctx, dy), dy

    @staticmethod
    def differentiable_backward(ctx, dy):
        # linear in dy:  d/d(dy) <(dx, dresidual), (u, v)> = u * keep / (1 - p) + v
        return DropoutFunction.differentiable_backward(ctx, dy), dy

    @staticmethod
    def jvp(ctx, t_x, t_residual):
        # y = residual + x * m  ->  t_y = t_residual + t_x * m (F.dropout's jvp: the forward's mask)
        if t_x is None:
            return t_residual
        t_y = DropoutFunction.jvp(ctx, t_x)
        if t_residual is not None:
            t_y += t_residual
        return t_y


def check_dropout_add(input, residual, p, training, op):
    """(input's array, p, training) checked: one shape for input and residual, 0 <= p <= 1, a bool training."""
    x = check_tensor("input", input, op)
    r = check_tensor("residual", residual, op)
    if tuple(x.shape) != tuple(r.shape):
        raise ValueError(f"{op}: input and residual must have one shape, got {tuple(x.shape)} and {tuple(r.shape)}")
    check_one_dtype(op, x, r)
    return x, check_real(p, "p", op, at_least=0, at_most=1), check_bool(training, "training", op)


@has_twin
def dropout_add(input: Tensor | Array, residual: Tensor | Array, p: float = 0.5, training: bool = True,
                generator: Philox | None = None) -> Tensor:
    """residual + dropout(input, p): the residual connection of a Transformer sublayer in one op,
    with F.dropout's mask (from `generator`, an npformer.runtime.random.Philox, or the global dropout
    stream), so on a GPU one kernel draws the mask and adds, and the backward draws it again
    instead of storing it. p=0 or training=False: residual + input. input and residual have one
    shape, e.g. (B, T, E). Raises ValueError unless 0 <= p <= 1 or when the shapes differ, TypeError
    for a `training` that is not a bool."""
    x, p, training = check_dropout_add(input, residual, p, training, "dropout_add")
    if not training or p == 0.0:
        return tensor_of(residual) + input
    draw = dropout_stream(generator, "dropout_add").draw(x.size, backend.device_of(x))
    return DropoutAddFunction.apply(input, residual, seed=draw.seed, offset=draw.offset, p=p, state=draw.state)


from . import cuda  # noqa: E402,F401  (registers the CUDA kernels)
