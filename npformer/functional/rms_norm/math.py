"""RMS normalization over rows of D entries: the formulas (derivation.md derives them).

Every function takes the array module `xp` (numpy or CuPy) first; x is (N, D), one row per
normalized group of D entries, weight (D,) or None. Unlike layer norm there is no mean to
subtract and no bias: xhat = x * rstd with rstd = 1 / sqrt(mean(x^2) + eps), y = xhat * weight.
The Jacobian of xhat in x, per row, is J = rstd (I - xhat xhat^T / D) (layer norm's without its
-1/D), symmetric, so `normalize_backward` is both xhat's backward and its tangent.
"""


def added_into(total, term):
    """total += term, where a None total (no contribution yet) becomes term."""
    if total is None:
        return term
    total += term
    return total


def row_mean(a):
    """The mean of each row of a (N, D) as (N, 1)."""
    return a.sum(axis=1, keepdims=True) / a.shape[1]


def rms_norm_forward(xp, x, weight, eps):
    """x (N, D) -> (y, xhat, rstd): rstd = 1 / sqrt(mean(x^2) + eps) (N, 1), xhat = x rstd (N, D),
    y = xhat * weight (N, D), a new array even without weight ((D,) or None)."""
    rstd = 1.0 / xp.sqrt(row_mean(x * x) + eps)                      # (N, 1)  rstd = (mean(x^2) + eps)^(-1/2)
    xhat = x * rstd                                                 # (N, D)  xhat = x rstd
    y = xhat * weight if weight is not None else xhat.copy()        # (N, D)  y = xhat * weight
    return y, xhat, rstd


def normalize_backward(xp, u, xhat, rstd):
    """u (N, D) -> J u = rstd (u - xhat mean(xhat u)) per row: the gradient reaching x from a
    gradient u at xhat, and (J symmetric) xhat's tangent along a tangent u of x."""
    # xhat = x rstd, rstd = (mean(x^2) + eps)^(-1/2)  ->  d xhat_j / d x_i = rstd ([i = j] - xhat_i xhat_j / D)
    return (u - xhat * row_mean(u * xhat)) * rstd


def rms_norm_backward(xp, dy, xhat, rstd, weight, need_x, need_w):
    """dy, xhat (N, D), rstd (N, 1), weight (D,) or None -> (dx (N, D), dweight (D,)), each None
    when not needed."""
    # y = xhat * weight  ->  dweight = sum over rows of dy * xhat
    dweight = (dy * xhat).sum(axis=0) if need_w else None
    dx = None
    if need_x:
        # y = xhat * weight  ->  g = dy * weight (the gradient arriving at xhat)
        g = dy * weight if weight is not None else dy
        # xhat = x * rstd  ->  dx = rstd * (g - xhat * mean(g * xhat))
        dx = normalize_backward(xp, g, xhat, rstd)
    return dx, dweight


def rms_norm_jvp(xp, xhat, t_xhat, weight, t_w):
    """The tangent of y = xhat * weight (N, D), given xhat's t_xhat = J t_x (normalize_backward,
    None for a constant x) and the tangent t_w (D,) of weight (None: a constant)."""
    # y = xhat * weight  ->  t_y = t_xhat * weight
    if t_xhat is None:
        t_y = xp.zeros_like(xhat)                                   # (N, D)
    elif weight is not None:
        t_y = t_xhat * weight
    else:
        t_y = t_xhat.copy()
    if t_w is not None:
        t_y += xhat * t_w                                           # y = xhat * weight  ->  + xhat * t_w
    return t_y


def rms_norm_double_backward(xp, dy, xhat, rstd, weight, dx, gx, gw, need_dy, need_x, need_w):
    """(d dy, d x, d weight) of L = <gx, dx> + <gw, dweight>, where (dx, dweight) is
    rms_norm_backward of (dy, x, weight): its backward. dy, xhat (N, D), rstd (N, 1), weight (D,)
    or None; dx (N, D), the first-order one (None without gx); gx (N, D), gw (D,), each None when
    that gradient was not formed. Each result None unless needed.

    With g = dy w, m = mean(g xhat) per row, J the Jacobian of xhat (normalize_backward) and
    h = J gx:  d dy = h w + gw xhat,  d weight = sum over rows of h dy,
    d x = J (gw dy) - rstd (mean(gx dx) xhat + m h + mean(gx xhat) dx)."""
    ddy = dx_bar = dw_bar = None
    if gx is not None:
        # dx = J g with J symmetric  ->  <gx, J t_g> = <h, t_g>, h = J gx, t_g = t_dy w + dy t_w
        h = normalize_backward(xp, gx, xhat, rstd)                        # (N, D)
        if need_x:
            g = dy * weight if weight is not None else dy
            m = row_mean(g * xhat)                                        # (N, 1)
            # dx = rstd (g - xhat m), m = mean(g xhat): t_rstd = -rstd^2 mean(xhat t_x) scales dx / rstd;
            # t_xhat = J t_x enters xhat m and m  (rms_norm_backward_jvp's t_x part, transposed)
            dx_bar = xhat * row_mean(gx * dx)
            dx_bar += m * h
            dx_bar += dx * row_mean(gx * xhat)
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
    return ddy, dx_bar, dw_bar


def rms_norm_backward_jvp(xp, dy, xhat, rstd, weight, dx, t_dy, t_x, t_w, need_x, need_w):
    """The tangents of (dx, dweight) = rms_norm_backward(dy, x, weight) along (t_dy, t_x, t_w),
    each None (a zero tangent); arrays as in rms_norm_double_backward, t_dy, t_x (N, D), t_w (D,).
    Each result None when not needed or zero.

    With t_xhat = J t_x, g = dy w, m = mean(g xhat) and t_g = t_dy w + dy t_w:
    t_dx = J t_g - rstd (mean(xhat t_x) dx + m t_xhat + xhat mean(dx t_x)),
    t_dweight = sum over rows of (t_dy xhat + dy t_xhat)."""
    t_xhat = None if t_x is None else normalize_backward(xp, t_x, xhat, rstd)    # (N, D)
    t_dx = t_dweight = None
    if need_x:
        # g = dy w  ->  t_g = t_dy w + dy t_w;  dx = J g is linear in g: + J t_g
        t_g = None if t_dy is None else (t_dy * weight if weight is not None else t_dy)
        if t_w is not None:
            t_g = dy * t_w if t_g is None else t_g + dy * t_w
        t_dx = None if t_g is None else normalize_backward(xp, t_g, xhat, rstd)
        if t_x is not None:
            g = dy * weight if weight is not None else dy
            m = row_mean(g * xhat)                                                 # (N, 1)
            # dx = rstd (g - xhat m), m = mean(g xhat): t_rstd = -rstd^2 mean(xhat t_x) scales dx / rstd;
            # t_xhat enters xhat m and m, mean(g t_xhat) = mean(dx t_x) (J symmetric)
            through_x = dx * row_mean(xhat * t_x)
            through_x += m * t_xhat
            through_x += xhat * row_mean(dx * t_x)
            through_x *= -rstd
            t_dx = added_into(t_dx, through_x)
    if need_w:
        # dweight = sum over rows of dy xhat  ->  t_dy xhat + dy t_xhat
        if t_dy is not None:
            t_dweight = (t_dy * xhat).sum(axis=0)                                  # (D,)
        if t_x is not None:
            t_dweight = added_into(t_dweight, (dy * t_xhat).sum(axis=0))
    return t_dx, t_dweight
