"""ReLU, GELU (exact and tanh form) and dropout on whole arrays of `xp` (numpy or CuPy).

The activation takes h = x + bias (the epilogue of `linear`; no bias for F.relu / F.gelu) and a
kind in ACTIVATIONS. What the forward saves for the backward ("saved"):
    relu:      (keep,)   keep = not (h <= 0), bool (NaN is kept, as torch's relu(NaN) = NaN)
    gelu:      (h, Phi(h))          Phi the standard normal CDF: y = h Phi(h)
    gelu_tanh: (h, tanh(u))         u = TANH_C (h + TANH_K h^3):  y = 0.5 h (1 + tanh(u))
GELU's backward dh = dy * gelu'(h) is an op of its own (GELUBackward), so below are also its
derivatives: the double backward (d dy, d h) and the tangent (JVP).

Dropout: y = x * keep / (1 - p) with `keep` the mask of the dropout contract (drawn by the caller
from a Philox stream: see derivation.md); its backward and its tangent are the same product.
"""
import math

from .erf import INV_SQRT_2PI, SQRT_2, erf

TANH_C = math.sqrt(2.0 / math.pi)  # GELU tanh form: u = TANH_C * (x + 0.044715 x^3)
TANH_K = 0.044715
TANH_SATURATED = 1e4  # |h| beyond which tanh(u) is +-1 exactly in float32 and float64 (tanh_of_cubic)

ACTIVATIONS = ("relu", "gelu", "gelu_tanh")  # bias_activation kinds (gelu: the exact form)


# ---------------------------------------------------------------- ReLU and GELU

def bias_activation_forward(xp, x, bias, kind):
    """y = act(x + bias) for x (..., N), bias (N,) or None, kind in ACTIVATIONS -> (y, saved):
    relu saves (keep,) with keep = not (h <= 0) (bool); gelu saves (h, aux) with h = x + bias (x
    itself without a bias) and aux = Phi(h) (exact) or tanh(u) (tanh form)."""
    h = x + bias if bias is not None else x                 # (..., N)
    if kind == "relu":
        keep = ~(h <= 0)                                    # NaN is kept: relu(NaN) = NaN, as torch's
        return xp.where(keep, h, 0), (keep,)                # relu(-inf) = 0
    if kind == "gelu_tanh":
        t = tanh_of_cubic(xp, h)                            # t = tanh(u)
        return 0.5 * h * (1.0 + t), (h, t)                  # 0.5 h first: h (1 + t) overflows for h > max / 2
    cdf = erf(xp, h / SQRT_2)                               # Phi(h) = (1 + erf(h / sqrt 2)) / 2
    cdf += 1.0
    cdf *= 0.5
    return h * cdf, (h, cdf)


def tanh_of_cubic(xp, h, out=None):
    """t = tanh(u), u = TANH_C (h + TANH_K h^3), of the tanh-form GELU, h^3 formed from h clipped to
    +-TANH_SATURATED: h^3 would overflow for |h| > 7e12 in float32, and past the clip tanh(u) is
    +-1 exactly either way (u > 4e10), as torch's (whose h^3 overflows to an infinity)."""
    hc = xp.clip(h, -TANH_SATURATED, TANH_SATURATED)
    return xp.tanh(TANH_C * (hc + TANH_K * hc * hc * hc), out=out)


def tanh_gelu_slope(xp, h, t):
    """gelu'(h) = 0.5 (1 + t) + s du/dh of the tanh form, s = 0.5 h (1 - t^2), du/dh = c (1 + 3 k h^2),
    formed as c s + 3 c k (s h) h: s is 0 where tanh saturates, and h^2 is never formed, so at large
    |h| (float32 h^2 overflows from 1.8e19) the slope is its limit, 1 or 0, not 0 * inf = NaN."""
    s = t * t
    xp.subtract(1.0, s, out=s)
    s *= h
    s *= 0.5                                                # s = 0.5 h (1 - t^2)
    slope = s * h
    slope *= h
    slope *= 3.0 * TANH_C * TANH_K                          # 3 c k (s h) h
    s *= TANH_C
    slope += s                                              # + c s
    s = xp.add(t, 1.0)
    s *= 0.5
    slope += s                                              # + 0.5 (1 + t)
    return slope


def bias_activation_backward(xp, dy, saved, kind):
    """dh = dy * act'(h), from what bias_activation_forward saved; the bias gradient is the sum of
    dh over the leading dimensions (linear's)."""
    if kind == "relu":
        (keep,) = saved
        # y = h where keep, else 0  ->  dh = dy where keep, else 0 (also for a NaN dy, as torch)
        return xp.where(keep, dy, 0)
    h, aux = saved
    if kind == "gelu_tanh":
        # u = TANH_C (h + k h^3)  ->  du/dh = TANH_C (1 + 3 k h^2)
        # y = 0.5 h (1 + tanh(u))  ->  dy/dh = 0.5 (1 + t) + 0.5 h (1 - t^2) du/dh
        return dy * tanh_gelu_slope(xp, h, aux)
    density = normal_density(xp, h)
    # y = h Phi(h)  ->  dy/dh = Phi(h) + h phi(h)
    density *= h
    density += aux
    density *= dy
    return density


def density_and_square(xp, h):
    """(phi(h), h^2), each a new array: phi(h) = exp(-h^2 / 2) / sqrt(2 pi), the standard normal
    density (the exact GELU's second-order rules need both)."""
    hh = h * h
    phi = hh * -0.5
    xp.exp(phi, out=phi)
    phi *= INV_SQRT_2PI
    return phi, hh


def normal_density(xp, h):
    """phi(h) = exp(-h^2 / 2) / sqrt(2 pi), a new array: the derivative of the exact GELU's Phi(h)."""
    return density_and_square(xp, h)[0]


def gelu_backward_density(xp, dy, h, cdf, density=None):
    """The exact GELU's dh = dy * gelu'(h) and the density it takes: (dh, phi(h)), from h and
    cdf = Phi(h) as bias_activation_forward saved them; phi(h) formed here when `density` is None,
    else the given one (formed for the same h by an earlier call)."""
    if density is None:
        density = normal_density(xp, h)
    # y = h Phi(h)  ->  dy/dh = Phi(h) + h phi(h)
    dh = density * h
    dh += cdf
    dh *= dy
    return dh, density


def gelu_second_derivative(xp, h, aux, kind):
    """gelu''(h), from what bias_activation_forward saved: h and aux = Phi(h) (exact) or
    t = tanh(u) (tanh form)."""
    if kind == "gelu_tanh":
        # u = c (h + k h^3), du = c (1 + 3 k h^2), t' = (1 - t^2) du;
        # y' = 0.5 (1 + t) + 0.5 h (1 - t^2) du  ->  y'' = (1 - t^2) (du (1 - h t du) + 3 c k h^2)
        #   = r du - h t (r du^2) + 3 c k (r h) h  with r = 1 - t^2, r du and r du^2 formed from r (as
        # tanh_gelu_slope): 0 where tanh saturates, never 0 * inf at large |h|
        r = 1.0 - aux * aux
        ck3 = 3.0 * TANH_C * TANH_K
        rh = r * h
        r_du = TANH_C * r + ck3 * rh * h
        r_du2 = TANH_C * r_du + ck3 * (r_du * h) * h
        return r_du - h * aux * r_du2 + ck3 * rh * h
    # y' = Phi(h) + h phi(h), phi' = -h phi  ->  y'' = phi + phi + h phi' = phi(h) (2 - h^2)
    phi, hh = density_and_square(xp, h)
    xp.subtract(2.0, hh, out=hh)
    phi *= hh
    return phi


def gelu_double_backward(xp, g, dy, h, aux, kind, need_dy, need_h):
    """(d dy, d h) of <g, dh> for GELU's backward dh = dy * gelu'(h) (each None unless needed);
    aux as bias_activation_forward saved it."""
    # dh = dy * gelu'(h)  ->  d(dy) = g * gelu'(h)
    ddy = bias_activation_backward(xp, g, (h, aux), kind) if need_dy else None
    # dh = dy * gelu'(h)  ->  d(h) = g * dy * gelu''(h)
    dh = None
    if need_h:
        dh = gelu_second_derivative(xp, h, aux, kind)
        dh *= dy
        dh *= g
    return ddy, dh


def gelu_backward_jvp(xp, dy, h, aux, t_dy, t_h, kind, density=None):
    """The tangent of GELU's backward dh = dy * gelu'(h) along t_dy and t_h (either None); density
    the exact form's phi(h) when already formed (along both tangents it is not formed again)."""
    # dh = dy * gelu'(h)  ->  t_dh = t_dy * gelu'(h) + dy * gelu''(h) * t_h
    if kind == "gelu" and t_dy is not None and t_h is not None:
        return exact_gelu_backward_jvp(xp, dy, h, aux, t_dy, t_h, density)
    t_dh = None if t_dy is None else bias_activation_backward(xp, t_dy, (h, aux), kind)
    if t_h is not None:
        along_h = gelu_second_derivative(xp, h, aux, kind)
        along_h *= dy
        along_h *= t_h
        if t_dh is None:
            t_dh = along_h
        else:
            t_dh += along_h
    return t_dh


def exact_gelu_backward_jvp(xp, dy, h, cdf, t_dy, t_h, density=None):
    """gelu_backward_jvp of the exact form along both tangents, phi(h) formed once for gelu'(h) and
    gelu''(h) (12 array passes where the two separate rules take 16, two of them exp), or not at
    all when `density` gives it (9 passes, no exp)."""
    if density is None:
        phi, hh = density_and_square(xp, h)
        slope = phi                      # gelu'(h) formed in phi's array once gelu''(h) has used it
    else:
        phi, hh, slope = density, h * h, None
    # gelu''(h) = phi(h) (2 - h^2)  ->  dy * gelu''(h) * t_h
    t_dh = xp.subtract(2.0, hh, out=hh)
    t_dh *= phi
    t_dh *= dy
    t_dh *= t_h
    # gelu'(h) = Phi(h) + h phi(h)  ->  + t_dy * gelu'(h)
    slope = xp.multiply(phi, h, out=slope)
    slope += cdf
    slope *= t_dy
    t_dh += slope
    return t_dh


# ---------------------------------------------------------------- dropout

def dropout_threshold(p):
    """Dropout's keep test: an entry is kept iff its 16 random bits are >= this threshold,
    min(round(p 2^16), 2^16 - 1), so the drop probability is p rounded to a multiple of 2^-16
    (within 7.7e-6); p = 1 gives 2^16, which keeps nothing."""
    return 2**16 if p == 1.0 else min(round(p * 2**16), 2**16 - 1)


def dropout_scale(p):
    """1 / (1 - p), the scale of the kept entries (0 for p = 1: everything is dropped)."""
    return 1.0 / (1.0 - p) if p < 1.0 else 0.0


def elementwise_product(xp, a, b, scale=None):
    """a * b (* scale) into a new array, a and b of one shape."""
    out = a * b
    if scale is not None:
        out *= scale
    return out


def dropout_forward(xp, x, keep, p):
    """y = x * keep / (1 - p) for x and its mask keep (bool) of one shape (...)."""
    return elementwise_product(xp, x, keep, dropout_scale(p))


def dropout_backward(xp, dy, keep, p):
    """dx = dy * keep / (1 - p) with the forward's mask; also the tangent t_y of t_x, and the
    double backward (linear in dy: the same product again)."""
    # y = x * keep / (1 - p)  ->  dx = dy * keep / (1 - p)
    return elementwise_product(xp, dy, keep, dropout_scale(p))
