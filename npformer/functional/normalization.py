"""Layer normalization over the trailing `normalized_shape` dimensions."""
from __future__ import annotations

import math

from autograd import Function, Tensor, backend
from autograd.backend import Array
from autograd.checks import check_real, check_shape
from npformer.runtime.kernels import kernel_table

from ._common import check_one_dtype, check_tensor, has_twin


@kernel_table
def layer_norm_forward(x, weight, bias, eps):
    """x (N, D) -> (y, xhat, rstd): xhat = (x - mean) rstd (N, D), rstd = 1 / sqrt(var + eps) (N, 1),
    y = xhat * weight + bias (N, D), a new array even without weight and bias (each (D,) or None)."""
    xp = backend.get_array_module(x)
    d = x.shape[1]
    xhat = x - x.sum(axis=1, keepdims=True) / d                   # (N, D)  x - mean
    # one refinement step: the rounding error of mean, times rstd, would dominate when
    # |mean| >> std (e.g. mean 1e4, std 1e-2); the mean of the residuals removes it
    # (kept apart from mean: in float32, mean + residual would round back at 1e4's ulp)
    xhat -= xhat.sum(axis=1, keepdims=True) / d
    rstd = 1.0 / xp.sqrt((xhat * xhat).sum(axis=1, keepdims=True) / d + eps)   # (N, 1)  two-pass variance
    xhat *= rstd
    y = xhat * weight if weight is not None else xhat.copy()      # y = xhat * weight + bias
    if bias is not None:
        y += bias
    return y, xhat, rstd


@kernel_table
def layer_norm_backward(dy, xhat, rstd, weight, need_x, need_w, need_b):
    """dy, xhat (N, D), rstd (N, 1), weight (D,) or None -> (dx (N, D), dweight (D,), dbias (D,)),
    each None when not needed."""
    d = xhat.shape[1]
    # y = xhat * weight + bias  ->  dweight = sum over rows of dy * xhat, dbias = sum of dy
    dweight = (dy * xhat).sum(axis=0) if need_w else None
    dbias = dy.sum(axis=0) if need_b else None
    dx = None
    if need_x:
        # y = xhat * weight  ->  g = dy * weight (the gradient arriving at xhat)
        g = dy * weight if weight is not None else dy
        # xhat = (x - mean) * rstd  ->  dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
        dx = (g - g.sum(axis=1, keepdims=True) / d - xhat * ((g * xhat).sum(axis=1, keepdims=True) / d)) * rstd
    return dx, dweight, dbias


class LayerNormFunction(Function):
    """x (..., *S) -> y = (x - mean) * rstd * weight + bias over the trailing dims S
    (biased variance, eps inside the sqrt); weight, bias (*S,) or None.

    With xhat = (x - mean) rstd, g = weight * dy (per row of D = prod(S) entries):
    dx = rstd (g - mean(g) - xhat mean(g xhat)),  dweight = sum(dy xhat),  dbias = sum(dy).
    The kernel table layer_norm_forward / layer_norm_backward runs it (cpu: row blocks on
    threads, npformer/functional/cpu/normalization.py; cuda: hand-written kernels); xhat and rstd are saved for backward.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, normalized_shape, eps):
        d = math.prod(normalized_shape)
        w = weight.reshape(-1) if weight is not None else None
        b = bias.reshape(-1) if bias is not None else None
        y, xhat, rstd = layer_norm_forward(x.reshape(-1, d), w, b, eps)   # (N, D), (N, D), (N, 1)
        ctx.save_for_backward(xhat, w, rstd)
        ctx.shape, ctx.normalized_shape = x.shape, normalized_shape
        return y.reshape(x.shape)

    @staticmethod
    def backward(ctx, dy):
        xhat, w, rstd = ctx.saved_tensors
        dx, dweight, dbias = layer_norm_backward(dy.reshape(xhat.shape), xhat, rstd, w, *ctx.needs_input_grad)
        return (dx.reshape(ctx.shape) if dx is not None else None,
                dweight.reshape(ctx.normalized_shape) if dweight is not None else None,
                dbias.reshape(ctx.normalized_shape) if dbias is not None else None)


@has_twin
def layer_norm(input: Tensor | Array, normalized_shape: int | tuple[int, ...], weight: Tensor | Array | None = None,
               bias: Tensor | Array | None = None, eps: float = 1e-5) -> Tensor:
    """Like torch.nn.functional.layer_norm: normalize over the trailing `normalized_shape` dims,
    then scale by `weight` and shift by `bias` (each of shape normalized_shape, or None), e.g.
    (B, T, E) with normalized_shape E. The variance is the biased one; eps is added to it.
    Raises ValueError when the shapes do not match and for eps <= 0, TypeError for inputs of
    different floating dtypes."""
    x = check_tensor("input", input, "layer_norm")
    shape = check_shape(normalized_shape, "normalized_shape", "layer_norm")
    if tuple(x.shape[x.ndim - len(shape):]) != shape or len(shape) > x.ndim:
        raise ValueError(f"layer_norm: normalized_shape {shape} must match the trailing dimensions "
                         f"of input, got input shape {tuple(x.shape)}")
    affine = []
    for name, p in (("weight", weight), ("bias", bias)):
        affine.append(None if p is None else check_tensor(name, p, "layer_norm"))
        if p is not None and tuple(affine[-1].shape) != shape:
            raise ValueError(f"layer_norm: {name} must have shape {shape}, got {tuple(p.shape)}")
    check_one_dtype("layer_norm", x, *affine)
    eps = check_real(eps, "eps", "layer_norm", above=0)
    return LayerNormFunction.apply(input, weight, bias, normalized_shape=shape, eps=eps)
