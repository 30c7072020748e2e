"""Affine map y = x W^T + b as one 2-D GEMM, optionally followed by an activation (a fused epilogue)."""
from __future__ import annotations

import math
import weakref

from autograd import Function, Tensor, backend
from autograd.backend import Array
from npformer.runtime.kernels import kernel_table

from ._common import added_into, check_one_dtype, check_tensor, has_twin
from .activation import (ACTIVATIONS, activation_tangent, bias_activation_backward, bias_activation_forward,
                         bias_activation_grad)


@kernel_table
def linear_forward(x, weight, bias):
    """x (N, in), weight (out, in), bias (out,) or None -> y (N, out) = x W^T + b."""
    y = x @ weight.T                                             # (N, out)
    if bias is not None:
        y += bias
    return y


@kernel_table
def linear_backward(dy, x, weight, need_x, need_w, need_b):
    """dy (N, out), x (N, in), weight (out, in) -> (dx (N, in), dweight (out, in), dbias (out,)),
    each None when not needed."""
    xp = backend.get_array_module(dy)
    # y = x W^T  ->  dx = dy W
    dx = dy @ weight if need_x else None                         # (N, in)
    # y = x W^T  ->  dW = dy^T x
    dweight = dy.T @ x if need_w else None                       # (out, in)
    # y = x W^T + b  ->  db = sum over rows of dy, as 1^T dy (a BLAS product, ~3x faster than
    # numpy's column sums)
    dbias = xp.ones(dy.shape[0], dtype=dy.dtype) @ dy if need_b else None   # (out,)
    return dx, dweight, dbias


@kernel_table
def linear_tangent(x, weight, t_x, t_weight, t_bias):
    """x (N, in), weight (out, in) and their tangents t_x (N, in), t_weight (out, in), t_bias (out,),
    each None (at least one given) -> t_h (N, out), the tangent of h = x W^T + b."""
    xp = backend.get_array_module(x)
    t_h = None
    # h = x W^T + b  ->  t_h = t_x W^T + x t_W^T + t_b
    if t_x is not None:
        t_h = t_x @ weight.T
    if t_weight is not None:
        t_h = added_into(t_h, x @ t_weight.T)
    if t_bias is not None:
        t_h = xp.broadcast_to(t_bias, (x.shape[0], weight.shape[0])).copy() if t_h is None else added_into(t_h, t_bias)
    return t_h


class LinearFunction(Function):
    """x (..., in), weight (out, in), bias (out,) or None -> y (..., out) = act(x W^T + b).

    h = x W^T + b,  y = act(h):  dh = dy act'(h),  dx = dh W,  dW = dh^T x,  db = sum of dh over all
    rows (with x, dy flattened to 2-D). With an activation, bias and activation run as one kernel
    after the GEMM (bias_activation_forward). The kernel tables linear_forward / linear_backward
    run the GEMMs (cpu: split across the threads of `npformer.runtime.threads`, see
    npformer/functional/cpu/linear.py).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, activation, values=None, tangent_from=None):
        x2d = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])   # (N, in), a view when x is contiguous (not -1: in may be 0)
        if values is not None:  # h = x W^T + b already computed (by the forward whose differentiable backward
            y2d = values        # forms h again in the graph): its node without the GEMM, and its tangent
            # that forward's ctx (a weak reference: this node does not keep it alive), where its jvp left t_h
            ctx.tangent_from = None if tangent_from is None else weakref.ref(tangent_from)
        elif activation is None:
            y2d = linear_forward(x2d, weight, bias)              # (N, out)  y = x W^T + b
        else:  # y = act(x W^T + b): the bias and the activation in one pass after the GEMM
            xp = backend.get_array_module(x2d)
            y2d, ctx.activation_saved = bias_activation_forward(xp, linear_forward(x2d, weight, None), bias, activation)
        ctx.save_for_backward(x2d, weight)
        ctx.x_shape, ctx.activation = x.shape, activation
        ctx.bias = bias  # for the differentiable backward, which forms h again in the graph
        return y2d.reshape(x.shape[:-1] + (weight.shape[0],))

    @staticmethod
    def backward(ctx, dy):
        x2d, weight = ctx.saved_tensors
        dy2d = dy.reshape(x2d.shape[0], weight.shape[0])         # (N, out)
        if ctx.activation is not None:
            # y = act(h)  ->  dh = dy act'(h); below, dy stands for dh
            dy2d = bias_activation_backward(backend.get_array_module(dy2d), dy2d, ctx.activation_saved, ctx.activation)
        dx2d, dweight, dbias = linear_backward(dy2d, x2d, weight, *ctx.needs_input_grad)
        return (dx2d.reshape(ctx.x_shape) if dx2d is not None else None), dweight, dbias

    @staticmethod
    def differentiable_backward(ctx, dy):
        x2d_saved, weight_saved = ctx.saved_tensors
        x, weight, bias = (t if t is not None else None if raw is None else Tensor(raw)
                           for t, raw in zip(ctx.inputs, (x2d_saved, weight_saved, ctx.bias)))
        x2d = x.reshape(x2d_saved.shape)                                  # (N, in)
        dh = dy.reshape(x2d_saved.shape[0], weight_saved.shape[0])        # (N, out)
        if ctx.activation is not None:
            # y = act(h)  ->  dh = dy act'(h), with h = x W^T + b a node of the graph again, from the values
            # the forward saved (ReLU's mask needs no h): its second derivative dy act''(h) reaches x, W
            # and b through h
            h = None if ctx.activation == "relu" else LinearFunction.apply(
                x, weight, bias, activation=None, values=ctx.activation_saved[0], tangent_from=ctx).reshape(dh.shape)
            dh = bias_activation_grad(dh, h, ctx.activation_saved, ctx.activation,
                                      getattr(ctx, "activation_density", None))
        need_x, need_w, need_b = ctx.needs_input_grad
        # dx = dh W, dW = dh^T x, db = sum of dh over rows: bilinear in (dh, W) and (dh, x), so
        #   d/d(dh) <(dx, dW, db), (u, U, c)> = u W^T + x U^T + c,  d/dW <dx, u> = dh^T u,  d/dx <dW, U> = dh U.
        # Both products are linear's own op, dh (W^T)^T and dh^T (x^T)^T: its kernels (threads on the
        # CPU) run them and their derivatives of every order
        dx = LinearFunction.apply(dh, weight.T, None, activation=None).reshape(ctx.x_shape) if need_x else None
        dweight = None
        if need_w:
            # forward over reverse reading W's gradient for its tangent alone (ctx.tangent_only_grads): its
            # values, one GEMM, left as zeros; the node's jvp gives the tangent t_dh^T x + dh^T t_x all the same
            xp = backend.get_array_module(weight_saved)
            unread = xp.zeros_like(weight_saved) if 1 in ctx.tangent_only_grads else None
            dweight = LinearFunction.apply(dh.T, x2d.T, None, activation=None, values=unread)
        dbias = dh.sum(axis=0) if need_b else None
        return dx, dweight, dbias

    @staticmethod
    def jvp(ctx, t_x, t_weight, t_bias):
        x2d, weight = ctx.saved_tensors                                   # (N, in), (out, in)
        tangents = (t_x, t_weight, t_bias)
        source = getattr(ctx, "tangent_from", None)  # h formed again by a differentiable backward
        source = None if source is None else source()
        reused = getattr(source, "pre_activation_tangent", None)
        if reused is not None and all(a is b for a, b in zip(reused[0], tangents)):
            # the same x, W, b moving along the same tangents: the forward's jvp computed this t_h; taken once
            del source.pre_activation_tangent
            return reused[1].reshape(ctx.x_shape[:-1] + (weight.shape[0],))
        # h = x W^T + b  ->  t_h = t_x W^T + x t_W^T + t_b (its table: on the CPU split across the threads)
        t_h = linear_tangent(x2d, weight, None if t_x is None else t_x.reshape(x2d.shape), t_weight, t_bias)
        if ctx.activation is None:
            return t_h.reshape(ctx.x_shape[:-1] + (weight.shape[0],))
        if ctx.activation != "relu" and ctx.inputs is not None:  # recorded: its differentiable backward forms h
            ctx.pre_activation_tangent = tangents, t_h                # again and takes t_h from here (above)
        # y = act(h)  ->  t_y = act'(h) * t_h (the exact GELU keeps phi(h) for the differentiable backward)
        t_y = activation_tangent(ctx, t_h, ctx.activation)
        return t_y.reshape(ctx.x_shape[:-1] + (weight.shape[0],))


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
