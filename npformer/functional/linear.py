"""Affine map y = x W^T + b as one 2-D GEMM."""
from autograd import Function

from ._common import check_tensor


class Linear(Function):
    """x (..., in), weight (out, in), bias (out,) or None -> y (..., out).

    dx = dy W,  dW = dy^T x,  db = sum of dy over all rows (with x, dy flattened to 2-D).
    """

    @staticmethod
    def forward(ctx, x, weight, bias):
        x2d = x.reshape(-1, x.shape[-1])                  # (N, in), a view when x is contiguous
        y2d = x2d @ weight.T                              # (N, out)
        if bias is not None:
            y2d += bias                                   # (N, out)
        ctx.save_for_backward(x2d, weight)
        ctx.x_shape = x.shape
        return y2d.reshape(x.shape[:-1] + (weight.shape[0],))

    @staticmethod
    def backward(ctx, dy):
        x2d, weight = ctx.saved_tensors
        dy2d = dy.reshape(-1, weight.shape[0])            # (N, out)
        need_x, need_w, need_b = ctx.needs_input_grad
        # y2d = x2d @ W^T  ->  dx2d = dy2d @ W
        dx = (dy2d @ weight).reshape(ctx.x_shape) if need_x else None
        # y2d = x2d @ W^T  ->  dW = dy2d^T @ x2d
        dweight = dy2d.T @ x2d if need_w else None
        # y2d += b  ->  db = sum over rows of dy2d
        dbias = dy2d.sum(axis=0) if need_b else None
        return dx, dweight, dbias


def linear(input, weight, bias=None):
    """y = input @ weight^T + bias, like torch.nn.functional.linear.

    input (..., in_features), weight (out_features, in_features), bias (out_features,) or None.
    """
    x = check_tensor("input", input, "linear")
    w = check_tensor("weight", weight, "linear")
    if w.ndim != 2:
        raise ValueError(f"linear: weight must be 2-D (out_features, in_features), got shape {tuple(w.shape)}")
    if x.ndim == 0 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"linear: input's last dimension must equal weight.shape[1]={w.shape[1]}, "
                         f"got input shape {tuple(x.shape)}")
    if bias is not None:
        b = check_tensor("bias", bias, "linear")
        if tuple(b.shape) != (w.shape[0],):
            raise ValueError(f"linear: bias must have shape ({w.shape[0]},), got {tuple(b.shape)}")
    return Linear.apply(input, weight, bias)
