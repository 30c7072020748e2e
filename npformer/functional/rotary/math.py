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


def inverse_frequencies(xp, head_dim, base, scaling=None):
    """The angle per position of each pair i (hd/2,), float64: base^(-2i/head_dim), then scaled.
    scaling: None, or a checked dict (functional.rotary.check_rope_scaling):
    "linear": every frequency / factor (positions divided by factor: a position interpolation);
    "llama3" (Llama 3.1, as transformers' _compute_llama3_parameters): with wavelengths 2 pi / f,
    frequencies of wavelength above L / low_freq_factor (L = original_max_position_embeddings)
    / factor, below L / high_freq_factor kept, and in between
    (1 - s) f / factor + s f with s = (L / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)."""
    inv_freq = base ** (-xp.arange(0, head_dim, 2, dtype="float64") / head_dim)   # (hd/2,)
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelength = 2 * xp.pi / inv_freq                                              # (hd/2,)
    smooth = (context / wavelength - low) / (high - low)                           # 0 at L/low, 1 at L/high
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = xp.where(wavelength > context / low, inv_freq / factor, inv_freq)    # long waves / factor
    middle = (wavelength >= context / high) & (wavelength <= context / low)
    return xp.where(middle, blended, scaled)


def cos_sin_at(xp, positions, head_dim, base, dtype, scaling=None):
    """The tables at integer `positions` (any shape P): cos and sin (*P, head_dim // 2) of the angle
    p * inverse_frequencies(head_dim, base, scaling)_i for position p and pair i (base^(-2i/head_dim)
    unscaled), computed in float64 and cast to `dtype`."""
    inv_freq = inverse_frequencies(xp, head_dim, base, scaling)                    # (hd/2,)
    angles = positions.astype("float64")[..., None] * inv_freq                    # (*P, hd/2)
    return xp.cos(angles).astype(dtype), xp.sin(angles).astype(dtype)
