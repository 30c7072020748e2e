"""Layer normalization over the trailing `normalized_shape` dimensions."""
import math

from autograd import Function, backend

from ._common import check_tensor


class LayerNorm(Function):
    """x (..., *S) -> y = (x - mean) * rstd * weight + bias over the trailing dims S
    (biased variance, eps inside the sqrt); weight, bias (*S,) or None.

    With xhat = (x - mean) rstd, g = weight * dy (per row of D = prod(S) entries):
    dx = rstd (g - mean(g) - xhat mean(g xhat)),  dweight = sum(dy xhat),  dbias = sum(dy).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, normalized_shape, eps):
        xp = backend.get_array_module(x)
        normalized_size = math.prod(normalized_shape)
        x2d = x.reshape(-1, normalized_size)                  # (N, D)
        mean = x2d.mean(axis=1, keepdims=True)                # (N, 1)
        xhat = x2d - mean                                     # (N, D)  x - mean
        # one refinement step: the rounding error of mean, times rstd, would dominate when
        # |mean| >> std (e.g. mean 1e4, std 1e-2); the mean of the residuals removes it
        # (kept apart from mean: in float32, mean + residual would round back at 1e4's ulp)
        residual = xhat.mean(axis=1, keepdims=True)           # (N, 1)
        xhat -= residual
        var = xp.einsum("nd,nd->n", xhat, xhat)[:, None]      # (N, 1)  two-pass sum (x - mean)^2
        var /= normalized_size
        rstd = 1.0 / xp.sqrt(var + eps)                       # (N, 1)
        xhat *= rstd                                          # (N, D)  normalized
        ctx.save_for_backward(x2d, weight, mean, residual, rstd)
        ctx.shape, ctx.normalized_shape = x.shape, normalized_shape
        if weight is not None:
            xhat *= weight.reshape(-1)
        if bias is not None:
            xhat += bias.reshape(-1)
        return xhat.reshape(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2d, weight, mean, residual, rstd = ctx.saved_tensors
        xp = backend.get_array_module(dy)
        d = x2d.shape[1]
        dy2d = dy.reshape(-1, d)                              # (N, D)
        need_x, need_w, need_b = ctx.needs_input_grad
        xhat = x2d - mean                                     # recomputed: xhat = (x - mean) * rstd
        xhat -= residual
        xhat *= rstd
        dweight = dbias = dx = None
        # y = xhat * weight + bias  ->  dweight = sum over rows of dy * xhat
        if need_w:
            dweight = xp.einsum("nd,nd->d", dy2d, xhat).reshape(ctx.normalized_shape)
        # y = xhat * weight + bias  ->  dbias = sum over rows of dy
        if need_b:
            dbias = dy2d.sum(axis=0).reshape(ctx.normalized_shape)
        if need_x:
            # y = xhat * weight  ->  g = dy * weight (the gradient arriving at xhat)
            g = dy2d * weight.reshape(-1) if weight is not None else dy2d
            # xhat = (x - mean) * rstd  ->  dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
            mean_g = g.mean(axis=1, keepdims=True)                          # (N, 1)
            mean_gx = xp.einsum("nd,nd->n", g, xhat)[:, None] / d           # (N, 1)
            dx = xhat * mean_gx                                             # (N, D)
            dx -= g
            dx += mean_g
            dx *= -rstd
            dx = dx.reshape(ctx.shape)
        return dx, dweight, dbias


def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    """Like torch.nn.functional.layer_norm: normalize over the trailing `normalized_shape` dims,
    then scale by `weight` and shift by `bias` (each of shape normalized_shape, or None)."""
    x = check_tensor("input", input, "layer_norm")
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if not shape or tuple(x.shape[x.ndim - len(shape):]) != shape or len(shape) > x.ndim:
        raise ValueError(f"layer_norm: normalized_shape {shape} must match the trailing dimensions "
                         f"of input, got input shape {tuple(x.shape)}")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and tuple(check_tensor(name, p, "layer_norm").shape) != shape:
            raise ValueError(f"layer_norm: {name} must have shape {shape}, got {tuple(p.shape)}")
    if not eps > 0:
        raise ValueError(f"layer_norm: eps must be positive, got {eps!r}")
    return LayerNorm.apply(input, weight, bias, normalized_shape=shape, eps=float(eps))
