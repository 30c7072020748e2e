"""Affine map y = x W^T + b as one 2-D GEMM, optionally followed by an activation (a fused epilogue)."""
from __future__ import annotations

import weakref
from math import prod

from autograd import Function, Tensor, backend
from autograd.backend import Array
from npformer.runtime.kernels import kernel_table

from .._common import check_one_dtype, check_tensor, has_twin
from ..activation import (ACTIVATIONS, activation_tangent, bias_activation_backward, bias_activation_forward,
                          bias_activation_grad)
from . import math

__all__ = ["linear"]  # its public ops, which npformer.functional exports


# the kernel tables: math.py's formulas as the reference, the CPU's threaded GEMMs (cpu.py) beside them
linear_forward = kernel_table(math.linear_forward)
linear_backward = kernel_table(math.linear_backward)
linear_tangent = kernel_table(math.linear_tangent)


class LinearFunction(Function):
    """x (..., in), weight (out, in), bias (out,) or None -> y (..., out) = act(x W^T + b).

    h = x W^T + b,  y = act(h):  dh = dy act'(h),  dx = dh W,  dW = dh^T x,  db = sum of dh over all
    rows (with x, dy flattened to 2-D; the formulas: math.py). With an activation, bias and
    activation run as one kernel after the GEMM (bias_activation_forward). The kernel tables
    linear_forward / linear_backward / linear_tangent run the GEMMs (cpu: split across the threads of
    `npformer.runtime.threads`, see cpu.py).

    A differentiable backward through a smooth activation forms h again in the graph, as a node of
    this op made from the values the forward kept (`values=`: no GEMM). Forward over reverse then asks
    that node for t_h, which the first node's jvp has just computed; the two nodes hand it over
    through their ctx:
      - the node of h holds `ctx.tangent_from`, a weak reference to the first node's ctx;
      - the first node's jvp leaves `ctx.pre_activation_tangent = (tangents, t_h)` there;
      - the node of h's jvp takes t_h from it once (`_take_pre_activation_tangent`) when its
        tangents are the same objects, else computes t_h itself.
    """
    backward_formula = staticmethod(math.linear_backward)

    @staticmethod
    def forward(ctx, x, weight, bias, activation, values=None, tangent_from=None):
        x2d = x.reshape(prod(x.shape[:-1]), x.shape[-1])    # (N, in), a view when x is contiguous (not -1: in may be 0)
        xp = backend.get_array_module(x2d)
        if values is not None:
            # h = x W^T + b formed again by tangent_from's differentiable backward: its values, no GEMM
            y2d = values
            ctx.tangent_from = None if tangent_from is None else weakref.ref(tangent_from)  # not kept alive
        elif activation is None:
            y2d = linear_forward(xp, x2d, weight, bias)          # (N, out)  y = x W^T + b
        else:  # y = act(x W^T + b): the bias and the activation in one pass after the GEMM
            y2d, ctx.activation_saved = bias_activation_forward(xp, linear_forward(xp, x2d, weight, None), bias, activation)
        ctx.save_for_backward(x2d, weight)
        ctx.x_shape, ctx.activation = x.shape, activation
        return y2d.reshape(x.shape[:-1] + (weight.shape[0],))

    @staticmethod
    def backward(ctx, dy):
        x2d, weight = ctx.saved_tensors
        dy2d = dy.reshape(x2d.shape[0], weight.shape[0])         # (N, out)
        xp = backend.get_array_module(dy2d)
        if ctx.activation is not None:
            # y = act(h)  ->  dh = dy act'(h); below, dy stands for dh
            dy2d = bias_activation_backward(xp, dy2d, ctx.activation_saved, ctx.activation)
        dx2d, dweight, dbias = linear_backward(xp, dy2d, x2d, weight, *ctx.needs_input_grad)
        return (dx2d.reshape(ctx.x_shape) if dx2d is not None else None), dweight, dbias

    @staticmethod
    def differentiable_backward(ctx, dy):
        x2d_saved, weight_saved = ctx.saved_tensors
        x, weight, bias = (t if t is not None else None if raw is None else Tensor(raw)
                           for t, raw in zip(ctx.inputs, (x2d_saved, weight_saved, ctx.input_arrays[2])))
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
        y_shape = ctx.x_shape[:-1] + (weight.shape[0],)
        tangents = (t_x, t_weight, t_bias)
        t_h = _take_pre_activation_tangent(ctx, tangents)
        if t_h is not None:
            return t_h.reshape(y_shape)
        # h = x W^T + b  ->  t_h = t_x W^T + x t_W^T + t_b (its table: on the CPU split across the threads)
        xp = backend.get_array_module(x2d)
        t_h = linear_tangent(xp, x2d, weight, None if t_x is None else t_x.reshape(x2d.shape), t_weight, t_bias)
        if ctx.activation is None:
            return t_h.reshape(y_shape)
        if ctx.activation != "relu" and ctx.inputs is not None:
            # a node of the graph: its differentiable backward forms h again, whose jvp takes this t_h (class docstring)
            ctx.pre_activation_tangent = tangents, t_h
        # y = act(h)  ->  t_y = act'(h) * t_h (the exact GELU keeps phi(h) for the differentiable backward)
        t_y = activation_tangent(ctx, t_h, ctx.activation)
        return t_y.reshape(y_shape)


def _take_pre_activation_tangent(ctx, tangents):
    """t_h left by the node whose differentiable backward formed this node's h again (LinearFunction's
    docstring), when it moved the same x, W, b along the same tangents; taken once. Else None."""
    source = getattr(ctx, "tangent_from", None)                 # set only on a node made with values=
    source = None if source is None else source()               # the weak reference: None once freed
    left = getattr(source, "pre_activation_tangent", None)
    if left is None:
        return None
    left_tangents, t_h = left
    if not all(a is b for a, b in zip(left_tangents, tangents)):
        return None
    del source.pre_activation_tangent
    return t_h


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


from . import cpu  # noqa: E402,F401  (register the fast variants)
