"""SiLU (swish) and SwiGLU on whole arrays of `xp` (numpy or CuPy): the formulas (derivation.md
derives them).

    silu(x)          = x * sigmoid(x)
    swiglu(gate, up) = silu(gate) * up          (Llama's feed-forward: silu(x W_gate) * (x W_up))

What the forward saves for the backward: the input(s) and s = sigmoid(x) (or sigmoid(gate)), from
which silu(x) = x s, silu'(x) = s (1 + x (1 - s)) and silu''(x) = s (1 - s) (2 + x (1 - 2 s)).
sigmoid is formed from exp(-|x|), which never overflows: no warning, finite for every finite x.
Each backward (dx = dy * silu'(x); SwiGLU's (d gate, d up)) is an op of its own, so below are
also its derivatives: the double backward and the tangent (JVP). Every array has one shape.
"""


def added_into(total, term):
    """total += term, where a None total (no contribution yet) becomes term."""
    if total is None:
        return term
    total += term
    return total


def sigmoid(xp, x):
    """1 / (1 + exp(-x)), a new array, from e = exp(-|x|) <= 1: 1 / (1 + e) for x >= 0, e / (1 + e)
    below (no overflow, no warning; NaN stays NaN)."""
    e = xp.exp(-xp.abs(x))
    return xp.where(x >= 0, 1.0, e) / (1.0 + e)


def silu_derivative(xp, x, s):
    """silu'(x) = s (1 + x (1 - s)), s = sigmoid(x), a new array."""
    # y = x s, s' = s (1 - s)  ->  y' = s + x s (1 - s)
    out = 1.0 - s
    out *= x
    out += 1.0
    out *= s
    return out


def silu_second_derivative(xp, x, s):
    """silu''(x) = s (1 - s) (2 + x (1 - 2 s)), s = sigmoid(x), a new array."""
    # y' = s + x s (1 - s), (s (1 - s))' = s (1 - s) (1 - 2 s)  ->  y'' = s (1 - s) (2 + x (1 - 2 s))
    out = 1.0 - 2.0 * s
    out *= x
    out += 2.0
    out *= s
    out *= 1.0 - s
    return out


# ---------------------------------------------------------------- SiLU

def silu_forward(xp, x):
    """x (...) -> (y, s): y = x * sigmoid(x), s = sigmoid(x) (saved for the backward)."""
    s = sigmoid(xp, x)                                           # s = sigmoid(x)
    return x * s, s                                              # y = x s


def silu_backward(xp, dy, x, s):
    """dx = dy * silu'(x) (...), from x and s = sigmoid(x); also the tangent t_y of a tangent t_x
    (a diagonal Jacobian is its own transpose)."""
    # y = x s  ->  dx = dy * s (1 + x (1 - s))
    dx = silu_derivative(xp, x, s)
    dx *= dy
    return dx


def silu_double_backward(xp, g, dy, x, s, need_dy, need_x):
    """(d dy, d x) of <g, dx> for SiLU's backward dx = dy * silu'(x) (each None unless needed)."""
    # dx = dy * silu'(x)  ->  d(dy) = g * silu'(x)
    ddy = silu_backward(xp, g, x, s) if need_dy else None
    dx_bar = None
    if need_x:
        # dx = dy * silu'(x)  ->  d(x) = g * dy * silu''(x)
        dx_bar = silu_second_derivative(xp, x, s)
        dx_bar *= dy
        dx_bar *= g
    return ddy, dx_bar


def silu_backward_jvp(xp, dy, x, s, t_dy, t_x):
    """The tangent of SiLU's backward dx = dy * silu'(x) along t_dy and t_x (either None; None
    when both are)."""
    # dx = dy * silu'(x)  ->  t_dx = t_dy * silu'(x) + dy * silu''(x) * t_x
    t_dx = None if t_dy is None else silu_backward(xp, t_dy, x, s)
    if t_x is not None:
        along_x = silu_second_derivative(xp, x, s)
        along_x *= dy
        along_x *= t_x
        t_dx = added_into(t_dx, along_x)
    return t_dx


# ---------------------------------------------------------------- SwiGLU

def swiglu_forward(xp, gate, up):
    """gate, up (...) of one shape -> (y, s): y = silu(gate) * up, s = sigmoid(gate) (saved)."""
    s = sigmoid(xp, gate)                                        # s = sigmoid(gate)
    y = gate * s                                                 # silu(gate) = gate s
    y *= up                                                      # y = silu(gate) * up
    return y, s


def swiglu_backward(xp, dy, gate, up, s, need_gate, need_up):
    """(d gate, d up) of y = silu(gate) * up, from gate, up and s = sigmoid(gate); each None unless
    needed."""
    dgate = dup = None
    if need_gate:
        # y = silu(gate) * up  ->  d gate = dy * up * silu'(gate)
        dgate = silu_derivative(xp, gate, s)
        dgate *= up
        dgate *= dy
    if need_up:
        # y = silu(gate) * up  ->  d up = dy * silu(gate)
        dup = gate * s
        dup *= dy
    return dgate, dup


def swiglu_jvp(xp, gate, up, s, t_gate, t_up):
    """The tangent of y = silu(gate) * up along t_gate and t_up (either None; zeros when both are)."""
    # y = silu(gate) * up  ->  t_y = silu'(gate) t_gate up + silu(gate) t_up
    t_y = xp.zeros_like(gate) if t_gate is None else swiglu_backward(xp, t_gate, gate, up, s, True, False)[0]
    if t_up is not None:
        t_y += swiglu_backward(xp, t_up, gate, up, s, False, True)[1]
    return t_y


def swiglu_double_backward(xp, dy, gate, up, s, g_gate, g_up, need_dy, need_gate, need_up):
    """(d dy, d gate, d up) of L = <g_gate, d gate> + <g_up, d up>, where (d gate, d up) is
    swiglu_backward of (dy, gate, up): its backward. g_gate, g_up: the gradients arriving at
    d gate and d up, each None when that gradient was not formed. Each result None unless needed.

    d dy   = g_gate up silu'(gate) + g_up silu(gate),    d up = g_gate dy silu'(gate),
    d gate = g_gate dy up silu''(gate) + g_up dy silu'(gate)."""
    ddy = dgate_bar = dup_bar = None
    uses_slope = (g_gate is not None and (need_dy or need_up)) or (g_up is not None and need_gate)
    slope = silu_derivative(xp, gate, s) if uses_slope else None          # silu'(gate)
    if g_gate is not None:
        # d gate = dy * up * silu'(gate)  ->  d dy = g_gate up silu'(gate), d up = g_gate dy silu'(gate),
        #                                     d gate = g_gate dy up silu''(gate)
        if need_dy:
            ddy = g_gate * up
            ddy *= slope
        if need_up:
            dup_bar = g_gate * dy
            dup_bar *= slope
        if need_gate:
            dgate_bar = silu_second_derivative(xp, gate, s)
            dgate_bar *= g_gate
            dgate_bar *= dy
            dgate_bar *= up
    if g_up is not None:
        # d up = dy * silu(gate)  ->  d dy += g_up silu(gate), d gate += g_up dy silu'(gate)
        if need_dy:
            ddy = added_into(ddy, g_up * (gate * s))
        if need_gate:
            dgate_bar = added_into(dgate_bar, g_up * dy * slope)
    return ddy, dgate_bar, dup_bar


def swiglu_backward_jvp(xp, dy, gate, up, s, t_dy, t_gate, t_up, need_gate, need_up):
    """The tangents of (d gate, d up) = swiglu_backward(dy, gate, up) along (t_dy, t_gate, t_up),
    each None (a zero tangent). Each result None when not needed or zero.

    t_d gate = (t_dy up + dy t_up) silu'(gate) + dy up silu''(gate) t_gate,
    t_d up   = t_dy silu(gate) + dy silu'(gate) t_gate."""
    slope = silu_derivative(xp, gate, s)                                 # silu'(gate)
    t_dgate = t_dup = None
    if need_gate:
        # d gate = dy * up * silu'(gate)  ->  (t_dy up + dy t_up) silu'(gate) + dy up silu''(gate) t_gate
        if t_dy is not None:
            t_dgate = t_dy * up
        if t_up is not None:
            t_dgate = added_into(t_dgate, dy * t_up)
        if t_dgate is not None:
            t_dgate *= slope
        if t_gate is not None:
            curvature = silu_second_derivative(xp, gate, s)
            curvature *= dy
            curvature *= up
            curvature *= t_gate
            t_dgate = added_into(t_dgate, curvature)
    if need_up:
        # d up = dy * silu(gate)  ->  t_dy silu(gate) + dy silu'(gate) t_gate
        if t_dy is not None:
            t_dup = t_dy * (gate * s)
        if t_gate is not None:
            t_dup = added_into(t_dup, dy * slope * t_gate)
    return t_dgate, t_dup
