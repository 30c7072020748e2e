"""Affine map y = x W^T + b as one 2-D GEMM, optionally followed by an activation (a fused epilogue)."""
from __future__ import annotations

import math

from autograd import Function, Tensor, backend
from autograd.backend import Array
from autograd.threads import for_rows, row_blocks, run_tasks, split_blocks

from ._common import check_one_dtype, check_tensor, has_twin
from .activation import ACTIVATIONS, bias_activation_backward, bias_activation_forward


class LinearFunction(Function):
    """x (..., in), weight (out, in), bias (out,) or None -> y (..., out) = act(x W^T + b).

    h = x W^T + b,  y = act(h):  dh = dy act'(h),  dx = dh W,  dW = dh^T x,  db = sum of dh over all
    rows (with x, dy flattened to 2-D). With an activation, bias and activation run as one kernel
    after the GEMM (bias_activation_forward). With set_num_threads(n > 1) the GEMMs are split
    across the threads of `autograd.threads`: y and dx by rows, dW and db by output features,
    dx and dW side by side.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, activation):
        xp = backend.get_array_module(x)
        x2d = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])   # (N, in), a view when x is contiguous (not -1: in may be 0)
        y2d = xp.empty((x2d.shape[0], weight.shape[0]), dtype=x.dtype)   # (N, out)
        add_bias = bias is not None and activation is None

        def rows(start, stop):
            # y = x W^T + b
            xp.matmul(x2d[start:stop], weight.T, out=y2d[start:stop])
            if add_bias:
                y2d[start:stop] += bias

        for_rows(rows, x2d.shape[0], y2d.size, x)
        if activation is not None:  # y = act(x W^T + b): the bias and the activation in one pass
            y2d, ctx.activation_saved = bias_activation_forward(y2d, bias, activation)
        ctx.save_for_backward(x2d, weight)
        ctx.x_shape, ctx.activation = x.shape, activation
        return y2d.reshape(x.shape[:-1] + (weight.shape[0],))

    @staticmethod
    def backward(ctx, dy):
        x2d, weight = ctx.saved_tensors
        xp = backend.get_array_module(dy)
        dy2d = dy.reshape(x2d.shape[0], weight.shape[0])  # (N, out)
        if ctx.activation is not None:
            # y = act(h)  ->  dh = dy act'(h); below, dy stands for dh
            dy2d = bias_activation_backward(dy2d, ctx.activation_saved, ctx.activation)
        need_x, need_w, need_b = ctx.needs_input_grad
        dx2d = xp.empty_like(x2d) if need_x else None                    # (N, in)
        dweight = xp.empty_like(weight) if need_w else None              # (out, in)
        dbias = xp.empty(weight.shape[0], dtype=dy.dtype) if need_b else None   # (out,)
        ones = xp.ones(dy2d.shape[0], dtype=dy.dtype) if need_b else None       # (N,)

        def rows(start, stop):
            # y = x W^T  ->  dx = dy W
            xp.matmul(dy2d[start:stop], weight, out=dx2d[start:stop])

        def features(start, stop):
            # y = x W^T  ->  dW = dy^T x
            if need_w:
                xp.matmul(dy2d[:, start:stop].T, x2d, out=dweight[start:stop])
            # y = x W^T + b  ->  db = sum over rows of dy (as 1^T dy: a BLAS product, ~3x faster
            # than numpy's column sums)
            if need_b:
                xp.matmul(ones, dy2d[:, start:stop], out=dbias[start:stop])

        blocks = row_blocks(dy2d.shape[0], dy2d.size + x2d.size, dy)
        if len(blocks) > 1 and need_x and (need_w or need_b):
            # dx and dW cost the same FLOPs and need not wait for each other: half of the threads
            # each (on 2 threads two whole GEMMs, where blocks of each, one product after the
            # other, would join twice and run four smaller GEMMs)
            x_blocks, w_blocks = split_blocks(len(blocks), (dy2d.shape[0], weight.shape[0]))
            run_tasks([(rows, *block) for block in x_blocks] + [(features, *block) for block in w_blocks])
        else:
            if need_x:
                for_rows(rows, dy2d.shape[0], dx2d.size, dy)
            if need_w or need_b:
                for_rows(features, weight.shape[0], dy2d.size, dy)
        return (dx2d.reshape(ctx.x_shape) if need_x else None), dweight, dbias

    @staticmethod
    def jvp(ctx, t_x, t_weight, t_bias):
        x2d, weight = ctx.saved_tensors
        xp = backend.get_array_module(x2d)
        t_x2d = t_x.reshape(x2d.shape) if t_x is not None else None      # (N, in)
        t_h = xp.empty((x2d.shape[0], weight.shape[0]), dtype=x2d.dtype)  # (N, out)

        def rows(start, stop):
            # h = x W^T + b  ->  t_h = t_x W^T + x t_W^T + t_b
            out = t_h[start:stop]
            if t_x2d is not None:
                xp.matmul(t_x2d[start:stop], weight.T, out=out)
            else:
                out[...] = 0
            if t_weight is not None:
                out += x2d[start:stop] @ t_weight.T
            if t_bias is not None:
                out += t_bias

        for_rows(rows, x2d.shape[0], t_h.size, x2d)
        if ctx.activation is not None:
            # y = act(h)  ->  t_y = act'(h) * t_h: elementwise, so the backward's kernel applies
            t_h = bias_activation_backward(t_h, ctx.activation_saved, ctx.activation)
        return t_h.reshape(ctx.x_shape[:-1] + (weight.shape[0],))


@has_twin
def linear(input: Tensor | Array, weight: Tensor | Array, bias: Tensor | Array | None = None,
           activation: str | None = None) -> Tensor:
    """y = input @ weight^T + bias, like torch.nn.functional.linear.

    input (..., in_features), weight (out_features, in_features), bias (out_features,) or None.
    activation: None, or "relu", "gelu" (exact) or "gelu_tanh" applied to the result in the same
    op (the bias and the activation fused: one pass instead of two, and one kernel on a GPU).
    Raises ValueError when the shapes do not fit or for an unknown activation, TypeError for
    inputs of different floating dtypes.
    """
    x = check_tensor("input", input, "linear")
    w = check_tensor("weight", weight, "linear")
    if w.ndim != 2:
        raise ValueError(f"linear: weight must be 2-D (out_features, in_features), got shape {tuple(w.shape)}")
    if x.ndim == 0 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"linear: input's last dimension must equal weight.shape[1]={w.shape[1]}, "
                         f"got input shape {tuple(x.shape)}")
    b = None
    if bias is not None:
        b = check_tensor("bias", bias, "linear")
        if tuple(b.shape) != (w.shape[0],):
            raise ValueError(f"linear: bias must have shape ({w.shape[0]},), got {tuple(b.shape)}")
    check_one_dtype("linear", x, w, b)
    if activation is not None and activation not in ACTIVATIONS:
        raise ValueError(f"linear: activation must be None or one of {ACTIVATIONS}, got {activation!r}")
    return LinearFunction.apply(input, weight, bias, activation=activation)
