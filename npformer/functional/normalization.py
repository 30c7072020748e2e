"""Layer normalization over the trailing `normalized_shape` dimensions."""
import math

from autograd import Function, backend
from autograd.checks import check_real, check_shape
from autograd.threads import for_rows

from ._common import check_tensor, has_twin
from .softmax import row_sum


class LayerNormFunction(Function):
    """x (..., *S) -> y = (x - mean) * rstd * weight + bias over the trailing dims S
    (biased variance, eps inside the sqrt); weight, bias (*S,) or None.

    With xhat = (x - mean) rstd, g = weight * dy (per row of D = prod(S) entries):
    dx = rstd (g - mean(g) - xhat mean(g xhat)),  dweight = sum(dy xhat),  dbias = sum(dy).
    Rows run in blocks on the threads of `autograd.threads`; xhat is saved for backward. Off the CPU
    the elementwise steps run as fused kernels (backend.elementwise_kernel).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, normalized_shape, eps):
        xp = backend.get_array_module(x)
        d = math.prod(normalized_shape)
        x2d = x.reshape(-1, d)                                    # (N, D)
        xhat = xp.empty(x2d.shape, dtype=x.dtype)                 # (N, D)
        rstd = xp.empty((x2d.shape[0], 1), dtype=x.dtype)         # (N, 1)
        y = xp.empty_like(xhat) if weight is not None or bias is not None else None
        w = weight.reshape(-1) if weight is not None else None
        b = bias.reshape(-1) if bias is not None else None
        if backend.device_of(x) != "cpu":  # the same steps, the elementwise ones fused: 7 kernels, not 13
            kernel = backend.elementwise_kernel
            # mean = sum(x) / d;  xhat = x - mean
            kernel(xp, "T x, T s, T d", "T xh", "xh = x - s / d;", "npformer_center")(
                x2d, row_sum(x2d, 1), d, xhat)
            # the refinement step below, on residuals: xhat -= mean(xhat)
            kernel(xp, "T s, T d", "T xh", "xh = xh - s / d;", "npformer_recenter")(row_sum(xhat, 1), d, xhat)
            # rstd = 1 / sqrt(sum(xhat^2) / d + eps)
            kernel(xp, "T ss, T d, T eps", "T rstd", "rstd = 1 / sqrt(ss / d + eps);", "npformer_rstd")(
                xp.einsum("nd,nd->n", xhat, xhat)[:, None], d, eps, rstd)
            # xhat *= rstd;  y = xhat * weight + bias
            y = xp.empty_like(xhat)
            kernel(xp, "T rstd, T w, T b", "T xh, T y", "xh = xh * rstd; y = xh * w + b;", "npformer_scale_shift")(
                rstd, w if w is not None else 1.0, b if b is not None else 0.0, xhat, y)
            ctx.save_for_backward(xhat, weight, rstd)
            ctx.shape, ctx.normalized_shape = x.shape, normalized_shape
            return y.reshape(x.shape)

        def rows(start, stop):
            xb, xh = x2d[start:stop], xhat[start:stop]
            mean = row_sum(xb, 1) / d                             # (n, 1)
            xp.subtract(xb, mean, out=xh)                         # x - mean
            # one refinement step: the rounding error of mean, times rstd, would dominate when
            # |mean| >> std (e.g. mean 1e4, std 1e-2); the mean of the residuals removes it
            # (kept apart from mean: in float32, mean + residual would round back at 1e4's ulp)
            xh -= row_sum(xh, 1) / d
            var = xp.einsum("nd,nd->n", xh, xh)[:, None]          # (n, 1)  two-pass sum (x - mean)^2
            var /= d
            var += eps
            xp.sqrt(var, out=var)
            xp.divide(1.0, var, out=rstd[start:stop])             # rstd = 1 / sqrt(var + eps)
            xh *= rstd[start:stop]                                # (n, D)  xhat
            if y is None:
                return
            yb = y[start:stop]                                    # y = xhat * weight + bias
            if w is not None:
                xp.multiply(xh, w, out=yb)
            else:
                yb[...] = xh
            if b is not None:
                yb += b

        for_rows(rows, x2d.shape[0], x2d.size, x)
        ctx.save_for_backward(xhat, weight, rstd)
        ctx.shape, ctx.normalized_shape = x.shape, normalized_shape
        return (y if y is not None else xhat.copy()).reshape(x.shape)

    @staticmethod
    def backward(ctx, dy):
        xhat, weight, rstd = ctx.saved_tensors
        xp = backend.get_array_module(dy)
        d = xhat.shape[1]
        dy2d = dy.reshape(-1, d)                                  # (N, D)
        need_x, need_w, need_b = ctx.needs_input_grad
        dx = xp.empty_like(xhat) if need_x else None              # (N, D)
        w = weight.reshape(-1) if weight is not None else None
        if backend.device_of(dy) != "cpu":  # the same steps as rows() below, the last ones fused
            dweight = xp.einsum("nd,nd->d", dy2d, xhat).reshape(ctx.normalized_shape) if need_w else None
            dbias = dy2d.sum(axis=0).reshape(ctx.normalized_shape) if need_b else None
            if need_x:
                g = dy2d * w if w is not None else dy2d
                backend.elementwise_kernel(
                    xp, "T g, T xh, T sg, T sgx, T rstd, T d", "T dx", "dx = (g - xh * (sgx / d) - sg / d) * rstd;",
                    "npformer_layer_norm_dx")(g, xhat, row_sum(g, 1), xp.einsum("nd,nd->n", g, xhat)[:, None],
                                              rstd, d, dx)
            return (dx.reshape(ctx.shape) if need_x else None), dweight, dbias

        def rows(start, stop):
            dyb, xh = dy2d[start:stop], xhat[start:stop]
            # y = xhat * weight + bias  ->  dweight = sum over rows of dy * xhat, dbias = sum of dy
            dweight = xp.einsum("nd,nd->d", dyb, xh) if need_w else None
            dbias = dyb.sum(axis=0) if need_b else None
            if need_x:
                # y = xhat * weight  ->  g = dy * weight (the gradient arriving at xhat)
                g = dyb * w if w is not None else dyb                               # (n, D)
                # xhat = (x - mean) * rstd  ->  dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
                mean_g = row_sum(g, 1) / d                                          # (n, 1)
                mean_gx = xp.einsum("nd,nd->n", g, xh)[:, None]                     # (n, 1)
                mean_gx /= d
                dxb = xp.multiply(xh, mean_gx, out=dx[start:stop])                  # (n, D)
                xp.subtract(g, dxb, out=dxb)
                dxb -= mean_g
                dxb *= rstd[start:stop]
            return dweight, dbias

        partial = for_rows(rows, dy2d.shape[0], dy2d.size, dy)    # per block: column sums
        dweight = sum(p[0] for p in partial).reshape(ctx.normalized_shape) if need_w else None
        dbias = sum(p[1] for p in partial).reshape(ctx.normalized_shape) if need_b else None
        return (dx.reshape(ctx.shape) if need_x else None), dweight, dbias


@has_twin
def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    """Like torch.nn.functional.layer_norm: normalize over the trailing `normalized_shape` dims,
    then scale by `weight` and shift by `bias` (each of shape normalized_shape, or None)."""
    x = check_tensor("input", input, "layer_norm")
    shape = check_shape(normalized_shape, "normalized_shape", "layer_norm")
    if tuple(x.shape[x.ndim - len(shape):]) != shape or len(shape) > x.ndim:
        raise ValueError(f"layer_norm: normalized_shape {shape} must match the trailing dimensions "
                         f"of input, got input shape {tuple(x.shape)}")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and tuple(check_tensor(name, p, "layer_norm").shape) != shape:
            raise ValueError(f"layer_norm: {name} must have shape {shape}, got {tuple(p.shape)}")
    eps = check_real(eps, "eps", "layer_norm", above=0)
    return LayerNormFunction.apply(input, weight, bias, normalized_shape=shape, eps=eps)
