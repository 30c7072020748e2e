"""RMS normalization over the trailing `normalized_shape` dimensions (Llama's, Qwen's, Mistral's
norm): the kernel tables made from the formulas of math.py, the Functions (RMSNormFunction, and its
backward as an op, RMSNormBackward) and the public op."""
from __future__ import annotations

from math import prod

from autograd import Function, Tensor, backend
from autograd.backend import Array
from autograd.checks import check_real, check_shape
from npformer.runtime.kernels import kernel_table

from .._common import check_one_dtype, check_tensor, has_twin
from . import math

__all__ = ["rms_norm"]  # its public ops, which npformer.functional exports

rms_norm_forward = kernel_table(math.rms_norm_forward)
rms_norm_backward = kernel_table(math.rms_norm_backward)
rms_norm_jvp = kernel_table(math.rms_norm_jvp)
rms_norm_double_backward = kernel_table(math.rms_norm_double_backward)
rms_norm_backward_jvp = kernel_table(math.rms_norm_backward_jvp)


def _needed_outputs(ctx, grads):
    """Of (dx (N, D), dweight (D,)) (or their tangents, each may be None), the ones RMSNormBackward
    outputs (ctx.needs), in the shapes of x and normalized_shape."""
    shapes = (ctx.shape, ctx.normalized_shape)
    return tuple(None if g is None else g.reshape(shape) for g, shape, need in zip(grads, shapes, ctx.needs) if need)


def _arriving_grads(ctx, grads):
    """The gradients arriving at RMSNormBackward's outputs as (gx (N, D), gw (D,)), arrays or
    Tensors, None for a gradient it does not output."""
    grads = iter(grads)
    gx, gw = (next(grads) if need else None for need in ctx.needs)
    return None if gx is None else gx.reshape(ctx.saved_tensors[1].shape), None if gw is None else gw.reshape(-1)


def _reshaped(grads, ctx):
    """(d dy, d x, d weight) in the shapes of dy, x and weight (None stays None)."""
    ddy, dx_bar, dw_bar = grads
    return (None if ddy is None else ddy.reshape(ctx.shape), None if dx_bar is None else dx_bar.reshape(ctx.shape),
            None if dw_bar is None else dw_bar.reshape(ctx.normalized_shape))


class RMSNormBackward(Function):
    """(dy, x, weight) -> the needed ones of (dx, dweight), in that order: RMS norm's backward as
    an op (its forward runs the kernel table rms_norm_backward), so that a gradient of RMS norm is
    one node whose own derivatives are hand-derived: backward `rms_norm_double_backward`, jvp
    `rms_norm_backward_jvp`. xhat and rstd, the forward's saved values, come as constants (the
    formulas differentiate through them by hand); x is an input only for the gradients to reach it
    (None: a constant). weight: a Tensor, an array or None."""
    backward_formula = staticmethod(math.rms_norm_double_backward)

    @staticmethod
    def forward(ctx, dy, x, weight, xhat, rstd, normalized_shape, eps, needs):
        w = weight.reshape(-1) if weight is not None else None                     # (D,)
        dy2d = dy.reshape(xhat.shape)                                              # (N, D)
        xp = backend.get_array_module(xhat)
        grads = rms_norm_backward(xp, dy2d, xhat, rstd, w, *needs)                 # (dx, dweight)
        ctx.save_for_backward(dy2d, xhat, rstd, w, grads[0])
        ctx.shape, ctx.normalized_shape = dy.shape, normalized_shape
        ctx.eps, ctx.needs = eps, needs  # needs: which of (dx, dweight) are outputs
        return _needed_outputs(ctx, grads)

    @staticmethod
    def backward(ctx, *grads):
        dy, xhat, rstd, w, dx = ctx.saved_tensors
        gx, gw = _arriving_grads(ctx, grads)
        xp = backend.get_array_module(xhat)
        return _reshaped(rms_norm_double_backward(xp, dy, xhat, rstd, w, dx, gx, gw, *ctx.needs_input_grad), ctx)

    @staticmethod
    def jvp(ctx, t_dy, t_x, t_weight):
        dy, xhat, rstd, w, dx = ctx.saved_tensors
        rows = xhat.shape
        tangents = rms_norm_backward_jvp(
            backend.get_array_module(xhat), dy, xhat, rstd, w, dx, None if t_dy is None else t_dy.reshape(rows),
            None if t_x is None else t_x.reshape(rows), None if t_weight is None else t_weight.reshape(-1), *ctx.needs)
        return _needed_outputs(ctx, tangents)

    @staticmethod
    def differentiable_backward(ctx, *grads):
        """rms_norm_double_backward's formulas on Tensors, xhat, rstd and dx formed again from x in
        the graph (constants where x is): a third derivative, and every order above."""
        dy_saved, xhat_saved, rstd_saved, w_saved, _ = ctx.saved_tensors
        dy, x, weight = ctx.inputs
        dy = Tensor(dy_saved) if dy is None else dy.reshape(xhat_saved.shape)      # (N, D)
        if x is None:  # x is a constant: so are xhat and rstd
            xhat, rstd = Tensor(xhat_saved), Tensor(rstd_saved)
        else:  # formed again in the graph, so that the derivatives reach x through them
            x2d = x.reshape(xhat_saved.shape)                                       # (N, D)
            rstd = 1.0 / ((x2d * x2d).mean(axis=1, keepdims=True) + ctx.eps).sqrt()  # (N, 1)
            xhat = x2d * rstd
        w = None if w_saved is None else (weight.reshape(-1) if weight is not None else Tensor(w_saved))

        def normalize_backward(u):  # J u = rstd (u - xhat mean(xhat u)), J the Jacobian of xhat
            return rstd * (u - xhat * (u * xhat).mean(axis=1, keepdims=True))

        gx, gw = _arriving_grads(ctx, grads)
        need_dy, need_x, need_w = ctx.needs_input_grad
        ddy = dx_bar = dw_bar = None
        if gx is not None:
            h = normalize_backward(gx)                                              # h = J gx  (N, D)
            if need_dy:
                ddy = h * w if w is not None else h                                 # d dy = h w
            if need_x:
                # d x = -rstd (mean(gx dx) xhat + m h + mean(gx xhat) dx), m = mean(g xhat), dx = J g
                g = dy * w if w is not None else dy
                dx = normalize_backward(g)
                m = (g * xhat).mean(axis=1, keepdims=True)                          # (N, 1)
                dx_bar = -rstd * ((gx * dx).mean(axis=1, keepdims=True) * xhat + m * h
                                  + (gx * xhat).mean(axis=1, keepdims=True) * dx)
            if need_w:
                dw_bar = (h * dy).sum(axis=0)                                       # d weight = sum of h dy
        if gw is not None:
            if need_dy:
                ddy = gw * xhat if ddy is None else ddy + gw * xhat                 # d dy += gw xhat
            if need_x:
                through_xhat = normalize_backward(gw * dy)                          # d x += J (gw dy)
                dx_bar = through_xhat if dx_bar is None else dx_bar + through_xhat
        return _reshaped((ddy, dx_bar, dw_bar), ctx)


class RMSNormFunction(Function):
    """x (..., *S) -> y = x * rstd * weight over the trailing dims S, rstd = 1 / sqrt(mean(x^2) + eps)
    (no mean subtracted, no bias); weight (*S,) or None.

    With xhat = x rstd and g = weight * dy (per row of D = prod(S) entries):
    dx = rstd (g - xhat mean(g xhat)),  dweight = sum(dy xhat).
    The kernel table rms_norm_forward / rms_norm_backward runs it; xhat and rstd are saved for backward.
    """
    backward_formula = staticmethod(math.rms_norm_backward)

    @staticmethod
    def forward(ctx, x, weight, normalized_shape, eps):
        d = prod(normalized_shape)
        w = weight.reshape(-1) if weight is not None else None
        xp = backend.get_array_module(x)
        y, xhat, rstd = rms_norm_forward(xp, x.reshape(-1, d), w, eps)        # (N, D), (N, D), (N, 1)
        ctx.save_for_backward(xhat, w, rstd)
        ctx.shape, ctx.normalized_shape = x.shape, normalized_shape
        ctx.eps = eps  # for the differentiable backward, which forms xhat and rstd again in the graph
        return y.reshape(x.shape)

    @staticmethod
    def backward(ctx, dy):
        xhat, w, rstd = ctx.saved_tensors
        xp = backend.get_array_module(xhat)
        dx, dweight = rms_norm_backward(xp, dy.reshape(xhat.shape), xhat, rstd, w, *ctx.needs_input_grad)
        return (dx.reshape(ctx.shape) if dx is not None else None,
                dweight.reshape(ctx.normalized_shape) if dweight is not None else None)

    @staticmethod
    def differentiable_backward(ctx, dy):
        """The backward as the op `RMSNormBackward`: one node, whose own backward and jvp are the
        hand-derived double backward and tangent of the gradients."""
        xhat, w, rstd = ctx.saved_tensors
        x, weight = ctx.inputs
        grads = iter(RMSNormBackward.apply(dy, x, w if weight is None else weight, xhat=xhat, rstd=rstd,
                                           normalized_shape=ctx.normalized_shape, eps=ctx.eps,
                                           needs=ctx.needs_input_grad))
        return tuple(next(grads) if need else None for need in ctx.needs_input_grad)

    @staticmethod
    def jvp(ctx, t_x, t_weight):
        xhat, w, rstd = ctx.saved_tensors
        xp = backend.get_array_module(xhat)
        # xhat = x rstd  ->  t_xhat = rstd (t_x - xhat mean(xhat t_x)): the Jacobian
        # rstd (I - xhat xhat^T / D) is symmetric, so the backward's J applies as is
        t_xhat = None if t_x is None else math.normalize_backward(xp, t_x.reshape(xhat.shape), xhat, rstd)
        t_y = rms_norm_jvp(xp, xhat, t_xhat, w, None if t_weight is None else t_weight.reshape(-1))
        return t_y.reshape(ctx.shape)


@has_twin
def rms_norm(input: Tensor | Array, normalized_shape: int | tuple[int, ...], weight: Tensor | Array | None = None,
             eps: float | None = None) -> Tensor:
    """Like torch.nn.functional.rms_norm: y = x / sqrt(mean(x^2) + eps) * weight over the trailing
    `normalized_shape` dims (weight of shape normalized_shape, or None), e.g. (B, T, E) with
    normalized_shape E. No mean is subtracted and there is no bias. eps=None takes the machine
    epsilon of input's dtype (torch.finfo(dtype).eps), as torch does. Raises ValueError when the
    shapes do not match and for eps <= 0, TypeError for a non-floating input or inputs of
    different floating dtypes."""
    _, shape, _, eps = rms_norm_arguments(input, normalized_shape, weight, eps)
    return RMSNormFunction.apply(input, weight, normalized_shape=shape, eps=eps)


def rms_norm_arguments(input, normalized_shape, weight, eps):
    """rms_norm's arguments checked: (input's array, normalized_shape as a tuple, weight's array or
    None, eps as a float, machine epsilon of input's dtype for None)."""
    x = check_tensor("input", input, "rms_norm")
    shape = check_shape(normalized_shape, "normalized_shape", "rms_norm")
    if len(shape) > x.ndim or tuple(x.shape[x.ndim - len(shape):]) != shape:
        raise ValueError(f"rms_norm: normalized_shape {shape} must match the trailing dimensions "
                         f"of input, got input shape {tuple(x.shape)}")
    w = None if weight is None else check_tensor("weight", weight, "rms_norm")
    if w is not None and tuple(w.shape) != shape:
        raise ValueError(f"rms_norm: weight must have shape normalized_shape = {shape}, got {tuple(w.shape)}")
    check_one_dtype("rms_norm", x, w)
    if eps is None:  # torch's default: the machine epsilon of the input's dtype
        eps = float(backend.get_array_module(x).finfo(x.dtype).eps)
    eps = check_real(eps, "eps", "rms_norm", above=0)
    return x, shape, w, eps
