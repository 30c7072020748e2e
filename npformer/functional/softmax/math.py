"""Softmax and log-softmax along one axis: the formulas (derivation.md derives them).

Every function takes the array module `xp` (numpy or CuPy) first; a row is the entries along `axis`.
"""


def stable_max(xp, x, axis):
    """Row maximum with rows that are entirely -inf mapped to 0, so x - max never makes -inf - (-inf).
    A row holding +inf or NaN keeps its maximum: x - max is NaN there, the whole row NaN, as torch's."""
    if x.shape[axis] == 0:  # empty rows: nothing to shift
        return xp.zeros(x.shape[:axis % x.ndim] + (1,) + x.shape[axis % x.ndim + 1:], dtype=x.dtype)
    m = x.max(axis=axis, keepdims=True)                 # (..., 1, ...)
    xp.copyto(m, 0.0, where=m == -xp.inf)  # not m[mask] = 0: on a GPU that waits for the count
    return m


def softmax_forward(xp, x, axis, out=None):
    """exp(x - max) / sum(exp(x - max)) along axis; a row that is entirely -inf gives zeros.
    `out=x` computes it in place."""
    y = xp.subtract(x, stable_max(xp, x, axis), out=out)   # (...) shifted scores, <= 0
    xp.exp(y, out=y)
    total = y.sum(axis=axis, keepdims=True)                 # (..., 1, ...)
    xp.copyto(total, 1.0, where=total == 0)                 # fully -inf row: 0 / 1 = 0
    y /= total
    return y


def softmax_backward(xp, y, dy, axis, out=None):
    """dx = y * (dy - sum(dy * y)) along axis; `out=dy` computes it in place. Also softmax's tangent
    with t for dy: t_y = y * (t - sum(y * t)), the Jacobian diag(y) - y y^T being symmetric."""
    # y_i = exp(x_i) / sum_j exp(x_j)  ->  dx_i = y_i (dy_i - sum_j dy_j y_j)
    inner = (dy * y).sum(axis=axis, keepdims=True)          # (..., 1, ...)  sum_j dy_j y_j
    dx = xp.subtract(dy, inner, out=out)
    dx *= y
    return dx


def log_softmax_forward(xp, x, axis):
    """x - max - log(sum(exp(x - max))) along axis; a row that is entirely -inf stays -inf."""
    shifted = x - stable_max(xp, x, axis)                  # (...)
    total = xp.exp(shifted).sum(axis=axis, keepdims=True)  # (..., 1, ...)
    xp.copyto(total, 1.0, where=total == 0)                # fully -inf row: log 1 = 0, output -inf
    shifted -= xp.log(total)
    return shifted


def log_softmax_backward(xp, logp, dy, axis):
    """dx = dy - exp(logp) * sum(dy) along axis."""
    # logp_i = x_i - log sum_j exp(x_j)  ->  dx_i = dy_i - softmax_i * sum_j dy_j
    dx = xp.exp(logp)
    dx *= -dy.sum(axis=axis, keepdims=True)
    dx += dy
    return dx


def log_softmax_jvp(xp, logp, t, axis):
    """t_logp = t - sum(exp(logp) * t) along axis."""
    # logp_i = x_i - log sum_j exp(x_j)  ->  t_logp_i = t_i - sum_j softmax_j t_j
    inner = xp.exp(logp)
    inner *= t
    return t - inner.sum(axis=axis, keepdims=True)
