"""Layer normalization over rows of D entries: the formulas (derivation.md derives them).

Every function takes the array module `xp` (numpy or CuPy) first; x is (N, D), one row per
normalized group of D entries, weight and bias (D,) or None.
"""


def added_into(total, term):
    """total += term, where a None total (no contribution yet) becomes term."""
    if total is None:
        return term
    total += term
    return total


def layer_norm_forward(xp, x, weight, bias, eps):
    """x (N, D) -> (y, xhat, rstd): xhat = (x - mean) rstd (N, D), rstd = 1 / sqrt(var + eps) (N, 1),
    y = xhat * weight + bias (N, D), a new array even without weight and bias (each (D,) or None)."""
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


def layer_norm_backward(xp, dy, xhat, rstd, weight, need_x, need_w, need_b):
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


def normalize_backward(xp, u, xhat, rstd):
    """u (N, D) -> J u, J = rstd (I - 1/D - xhat xhat^T / D) per row: the Jacobian of xhat in x,
    symmetric, so this is also xhat's tangent along u (layer_norm_backward without a weight)."""
    return layer_norm_backward(xp, u, xhat, rstd, None, True, False, False)[0]


def layer_norm_jvp(xp, xhat, t_xhat, weight, t_w, t_b):
    """The tangent of y = xhat * weight + bias (N, D), given xhat's t_xhat = J t_x (normalize_backward,
    None for a constant x) and the tangents t_w, t_b (D,) of weight and bias (each may be None)."""
    # y = xhat * weight  ->  t_y = t_xhat * weight
    if t_xhat is None:
        t_y = xp.zeros_like(xhat)                                  # (N, D)
    elif weight is not None:
        t_y = t_xhat * weight
    else:
        t_y = t_xhat.copy()
    if t_w is not None:
        t_y += xhat * t_w                                          # y = xhat * weight  ->  + xhat * t_w
    if t_b is not None:
        t_y += t_b                                                 # y = ... + bias  ->  + t_b
    return t_y


def layer_norm_double_backward(xp, dy, xhat, rstd, weight, dx, gx, gw, gb, need_dy, need_x, need_w):
    """(d dy, d x, d weight) of L = <gx, dx> + <gw, dweight> + <gb, dbias>, where (dx, dweight,
    dbias) is layer_norm_backward of (dy, x, weight): its backward (torch's layer_norm_double_backward).
    dy, xhat (N, D), rstd (N, 1), weight (D,) or None; dx (N, D), the first-order one (None without gx);
    gx (N, D), gw, gb (D,), each None when that gradient was not formed. Each result None unless needed.

    With g = dy w, m = mean(g xhat) per row, J the Jacobian of xhat (normalize_backward) and
    h = J gx:  d dy = h w + gw xhat + gb,  d weight = sum over rows of h dy,
    d x = J (gw dy) - rstd (mean(gx dx) xhat + m h + mean(gx xhat) dx)."""
    d = xhat.shape[1]
    ddy = dx_bar = dw_bar = None
    if gx is not None:
        # dx = J g with J symmetric  ->  <gx, J t_g> = <h, t_g>, h = J gx, t_g = t_dy w + dy t_w
        h = normalize_backward(xp, gx, xhat, rstd)                        # (N, D)
        if need_x:
            g = dy * weight if weight is not None else dy
            m = (g * xhat).sum(axis=1, keepdims=True) / d                # (N, 1)
            # dx = rstd (g - mean(g) - xhat m), m = mean(g xhat): t_rstd = -rstd^2 mean(xhat t_x) scales
            # dx / rstd; t_xhat = J t_x enters xhat m and m  (layer_norm_backward_jvp's t_x part, transposed)
            dx_bar = xhat * ((gx * dx).sum(axis=1, keepdims=True) / d)
            dx_bar += m * h
            dx_bar += dx * ((gx * xhat).sum(axis=1, keepdims=True) / d)
            dx_bar *= -rstd
        if need_w:
            dw_bar = (h * dy).sum(axis=0)                                 # (D,)
        if need_dy:
            ddy = h * weight if weight is not None else h
    if gw is not None:
        # dweight = sum over rows of dy xhat  ->  d dy += gw xhat, d x += J (gw dy)
        if need_dy:
            ddy = added_into(ddy, gw * xhat)
        if need_x:
            dx_bar = added_into(dx_bar, normalize_backward(xp, gw * dy, xhat, rstd))
    if gb is not None and need_dy:
        # dbias = sum over rows of dy  ->  d dy += gb on every row
        ddy = xp.broadcast_to(gb, xhat.shape).copy() if ddy is None else added_into(ddy, gb)
    return ddy, dx_bar, dw_bar


def layer_norm_backward_jvp(xp, dy, xhat, rstd, weight, dx, t_dy, t_x, t_w, need_x, need_w, need_b):
    """The tangents of (dx, dweight, dbias) = layer_norm_backward(dy, x, weight) along (t_dy, t_x,
    t_w), each None (a zero tangent); arrays as in layer_norm_double_backward, t_dy, t_x (N, D),
    t_w (D,). Each result None when not needed or zero.

    With t_xhat = J t_x, g = dy w, m = mean(g xhat) and t_g = t_dy w + dy t_w:
    t_dx = J t_g - rstd (mean(xhat t_x) dx + m t_xhat + xhat mean(dx t_x)),
    t_dweight = sum over rows of (t_dy xhat + dy t_xhat),  t_dbias = sum over rows of t_dy."""
    d = xhat.shape[1]
    t_xhat = None if t_x is None else normalize_backward(xp, t_x, xhat, rstd)       # (N, D)
    t_dx = t_dweight = t_dbias = None
    if need_x:
        # g = dy w  ->  t_g = t_dy w + dy t_w;  dx = J g is linear in g: + J t_g
        t_g = None if t_dy is None else (t_dy * weight if weight is not None else t_dy)
        if t_w is not None:
            t_g = dy * t_w if t_g is None else t_g + dy * t_w
        t_dx = None if t_g is None else normalize_backward(xp, t_g, xhat, rstd)
        if t_x is not None:
            g = dy * weight if weight is not None else dy
            m = (g * xhat).sum(axis=1, keepdims=True) / d                          # (N, 1)
            # dx = rstd (g - mean(g) - xhat m), m = mean(g xhat): t_rstd = -rstd^2 mean(xhat t_x)
            # scales dx / rstd; t_xhat enters xhat m and m, mean(g t_xhat) = mean(dx t_x) (J symmetric)
            through_x = dx * ((xhat * t_x).sum(axis=1, keepdims=True) / d)
            through_x += m * t_xhat
            through_x += xhat * ((dx * t_x).sum(axis=1, keepdims=True) / d)
            through_x *= -rstd
            t_dx = added_into(t_dx, through_x)
    if need_w:
        # dweight = sum over rows of dy xhat  ->  t_dy xhat + dy t_xhat
        if t_dy is not None:
            t_dweight = (t_dy * xhat).sum(axis=0)                                   # (D,)
        if t_x is not None:
            t_dweight = added_into(t_dweight, (dy * t_xhat).sum(axis=0))
    if need_b and t_dy is not None:
        t_dbias = t_dy.sum(axis=0)                                                  # dbias = sum of dy
    return t_dx, t_dweight, t_dbias
