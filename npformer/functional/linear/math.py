"""Linear: y = act(x W^T + b), its gradients and its tangent, on whole arrays of `xp` (numpy or CuPy).

x is flattened to rows (N, in) by the caller. The activation act (None, relu, gelu, gelu_tanh) is
the activation op's (npformer/functional/activation): the pre-activation h = x W^T + b is computed
here, and the activation's backward turns dy into dh before linear_backward (dh plays dy's part).
The double backward is linear again (see derivation.md): dx = dh W and dW = dh^T x are themselves
products that this op computes, so no formula of its own is needed.
"""


def linear_forward(xp, x, weight, bias):
    """x (N, in), weight (out, in), bias (out,) or None -> y (N, out) = x W^T + b."""
    y = x @ weight.T                                             # (N, out)
    if bias is not None:
        y += bias
    return y


def linear_backward(xp, dy, x, weight, need_x, need_w, need_b):
    """dy (N, out), x (N, in), weight (out, in) -> (dx (N, in), dweight (out, in), dbias (out,)),
    each None when not needed."""
    # y = x W^T  ->  dx = dy W
    dx = dy @ weight if need_x else None                         # (N, in)
    # y = x W^T  ->  dW = dy^T x
    dweight = dy.T @ x if need_w else None                       # (out, in)
    # y = x W^T + b  ->  db = sum over rows of dy, as 1^T dy (a BLAS product, faster than the
    # column sums)
    dbias = xp.ones(dy.shape[0], dtype=dy.dtype) @ dy if need_b else None   # (out,)
    return dx, dweight, dbias


def linear_tangent(xp, x, weight, t_x, t_weight, t_bias):
    """x (N, in), weight (out, in) and their tangents t_x (N, in), t_weight (out, in), t_bias (out,),
    each None (at least one given) -> t_h (N, out), the tangent of h = x W^T + b."""
    # h = x W^T + b  ->  t_h = t_x W^T + x t_W^T + t_b, the terms whose tangent is given, summed in place
    t_h = t_x @ weight.T if t_x is not None else None            # (N, out)
    if t_weight is not None:
        along_w = x @ t_weight.T                                 # (N, out)
        if t_h is None:
            t_h = along_w
        else:
            t_h += along_w
    if t_bias is not None:
        if t_h is None:
            t_h = xp.broadcast_to(t_bias, (x.shape[0], weight.shape[0])).copy()
        else:
            t_h += t_bias
    return t_h
