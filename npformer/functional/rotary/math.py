"""Rotary position embedding (RoPE), half-split layout, on whole arrays of `xp` (numpy or CuPy):
each pair (x1_i, x2_i) = (x[..., i], x[..., i + hd/2]) rotated by the angle of its position and pair."""


def rotary_forward(xp, x, cos, sin):
    """x (..., T, hd) with halves x1, x2; cos, sin (T, hd/2) (broadcastable) ->
    y = [x1 cos - x2 sin, x2 cos + x1 sin] (a rotation of each pair (x1_i, x2_i))."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]                  # (..., T, hd/2) each
    y = xp.empty_like(x)                                   # (..., T, hd)
    y[..., :half] = x1 * cos - x2 * sin                    # y1 = x1 cos - x2 sin
    y[..., half:] = x2 * cos + x1 * sin                    # y2 = x2 cos + x1 sin
    return y


def rotary_backward(xp, dy, cos, sin):
    """dy (..., T, hd) -> dx (..., T, hd), the inverse rotation of dy."""
    half = dy.shape[-1] // 2
    dy1, dy2 = dy[..., :half], dy[..., half:]              # (..., T, hd/2) each
    dx = xp.empty_like(dy)                                 # (..., T, hd)
    # y1 = x1 cos - x2 sin, y2 = x2 cos + x1 sin  ->  dx1 = dy1 cos + dy2 sin
    dx[..., :half] = dy1 * cos + dy2 * sin
    # ... and dx2 = dy2 cos - dy1 sin (the transpose of the rotation)
    dx[..., half:] = dy2 * cos - dy1 * sin
    return dx


def rotary_tangent(xp, t_x, cos, sin):
    """t_x (..., T, hd) the tangent of x -> t_y (..., T, hd)."""
    # y = R x, a rotation linear in x  ->  t_y = R t_x: the forward on the tangent
    return rotary_forward(xp, t_x, cos, sin)


def cos_sin_at(xp, positions, head_dim, base, dtype):
    """The tables at integer `positions` (any shape P): cos and sin (*P, head_dim // 2) of the angle
    p * base^(-2i/head_dim) for position p and pair i, computed in float64 and cast to `dtype`."""
    inv_freq = base ** (-xp.arange(0, head_dim, 2, dtype="float64") / head_dim)   # (hd/2,)
    angles = positions.astype("float64")[..., None] * inv_freq                    # (*P, hd/2)
    return xp.cos(angles).astype(dtype), xp.sin(angles).astype(dtype)
