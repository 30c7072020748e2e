"""Elementwise activations (ReLU, GELU; with a bias: the epilogue of `linear`) and inverted dropout."""
from __future__ import annotations

import math

from autograd import Function, Tensor, backend, where
from autograd.backend import Array
from autograd.checks import check_bool, check_real
from npformer.runtime import random
from npformer.runtime.kernels import kernel_table

from ._common import added_into, check_tensor, has_twin
from ._erf import INV_SQRT_2PI, SQRT_2, erf


TANH_C = math.sqrt(2.0 / math.pi)  # GELU tanh form: u = TANH_C * (x + 0.044715 x^3)
TANH_K = 0.044715


ACTIVATIONS = ("relu", "gelu", "gelu_tanh")  # bias_activation kinds (gelu: the exact form)


@kernel_table
def bias_activation_forward(x, bias, kind):
    """y = act(x + bias) for x (..., N), bias (N,) or None, kind in ACTIVATIONS -> (y, saved):
    relu saves (keep,) with keep = not (h <= 0) (bool); gelu saves (h, aux) with h = x + bias (x
    itself without a bias) and aux = Phi(h) (exact) or tanh(u) (tanh form)."""
    xp = backend.get_array_module(x)
    h = x + bias if bias is not None else x
    if kind == "relu":
        keep = ~(h <= 0)                                    # NaN is kept: relu(NaN) = NaN, as torch's
        return xp.where(keep, h, 0), (keep,)                # relu(-inf) = 0
    if kind == "gelu_tanh":
        t = xp.tanh(TANH_C * (h + TANH_K * h * h * h))      # t = tanh(u)
        return 0.5 * h * (1.0 + t), (h, t)
    cdf = erf(h / SQRT_2)                                   # Phi(h) = (1 + erf(h / sqrt 2)) / 2
    cdf += 1.0
    cdf *= 0.5
    return h * cdf, (h, cdf)


@kernel_table
def bias_activation_backward(dy, saved, kind):
    """dh = dy * act'(h), from what bias_activation_forward saved; the bias gradient is the sum of
    dh over the leading dimensions."""
    xp = backend.get_array_module(dy)
    if kind == "relu":
        (keep,) = saved
        # y = h where keep, else 0  ->  dh = dy where keep, else 0 (also for a NaN dy, as torch)
        return xp.where(keep, dy, 0)
    h, aux = saved
    if kind == "gelu_tanh":
        # u = TANH_C (h + k h^3)  ->  du/dh = TANH_C (1 + 3 k h^2)
        du = TANH_C * (1.0 + 3.0 * TANH_K * h * h)
        # y = 0.5 h (1 + tanh(u))  ->  dy/dh = 0.5 (1 + t) + 0.5 h (1 - t^2) du/dh
        return dy * (0.5 * (1.0 + aux) + 0.5 * h * (1.0 - aux * aux) * du)
    density = normal_density(h)
    # y = h Phi(h)  ->  dy/dh = Phi(h) + h phi(h)
    density *= h
    density += aux
    density *= dy
    return density


def normal_density(h):
    """phi(h) = exp(-h^2 / 2) / sqrt(2 pi) of a raw array, a new array: the standard normal density,
    the derivative of the exact GELU's Phi(h)."""
    return _density_and_square(h)[0]


@kernel_table
def gelu_backward_density(dy, h, cdf, density=None):
    """The exact GELU's dh = dy * gelu'(h) and the density it takes: (dh, phi(h)), from h and
    cdf = Phi(h) as bias_activation_forward saved them; phi(h) formed here when `density` is None,
    else the given one (formed for the same h by an earlier call)."""
    if density is None:
        density = normal_density(h)
    # y = h Phi(h)  ->  dy/dh = Phi(h) + h phi(h)
    dh = density * h
    dh += cdf
    dh *= dy
    return dh, density


def activation_tangent(ctx, t_h, kind):
    """t_y = act'(h) * t_h, the tangent of y = act(h) (jvp of linear's epilogue and of gelu), from
    what bias_activation_forward saved (ctx.activation_saved). The exact GELU of a recorded node
    also keeps phi(h) on ctx (ctx.activation_density, h's size): forward over reverse runs the
    node's differentiable backward next, whose GELU backward and its tangent need phi(h) again
    (bias_activation_grad's `density`), so one step takes exp(-h^2 / 2) once, not three times."""
    if kind != "gelu" or ctx.inputs is None:
        # y = act(h)  ->  t_y = act'(h) * t_h: elementwise, so the backward's kernel applies
        return bias_activation_backward(t_h, ctx.activation_saved, kind)
    h, cdf = ctx.activation_saved
    t_y, ctx.activation_density = gelu_backward_density(t_h, h, cdf)
    return t_y


def normal_pdf(x):
    """phi(x) = exp(-x^2 / 2) / sqrt(2 pi) of a Tensor (differentiable): the derivative of Phi."""
    return (x * x * -0.5).exp() * INV_SQRT_2PI


def bias_activation_grad(dy, h, saved, kind, density=None):
    """dh = dy * act'(h) on Tensors, differentiable (for the double backward): h the pre-activation
    Tensor in the graph (unused by relu), saved what bias_activation_forward saved, density the
    exact GELU's phi(h) when activation_tangent kept it (else None)."""
    if kind == "relu":
        # dh = dy where keep, else 0: the mask is a constant (the step's derivative is 0), so
        #   d/d(dy) <dh, u> = u where keep, and no second derivative through h
        return where(saved[0], dy, 0)
    return GELUBackward.apply(dy, h, saved=saved, kind=kind, density=density)


def gelu_second_derivative(h, aux, kind):
    """gelu''(h) on raw arrays, from what bias_activation_forward saved: h and aux = Phi(h)
    (exact) or t = tanh(u) (tanh form)."""
    xp = backend.get_array_module(h)
    if kind == "gelu_tanh":
        # u = c (h + k h^3), du = c (1 + 3 k h^2), t' = (1 - t^2) du;
        # y' = 0.5 (1 + t) + 0.5 h (1 - t^2) du  ->  y'' = (1 - t^2) (du (1 - h t du) + 3 c k h^2)
        du = TANH_C * (1.0 + 3.0 * TANH_K * h * h)
        return (1.0 - aux * aux) * (du * (1.0 - h * aux * du) + 3.0 * TANH_C * TANH_K * h * h)
    # y' = Phi(h) + h phi(h), phi' = -h phi  ->  y'' = phi + phi + h phi' = phi(h) (2 - h^2)
    phi, hh = _density_and_square(h)
    xp.subtract(2.0, hh, out=hh)
    phi *= hh
    return phi


def _density_and_square(h):
    """(phi(h), h^2) of a raw array, each a new array: phi(h) = exp(-h^2 / 2) / sqrt(2 pi), the
    standard normal density (the exact GELU's second-order rules need both)."""
    xp = backend.get_array_module(h)
    hh = h * h
    phi = hh * -0.5
    xp.exp(phi, out=phi)
    phi *= INV_SQRT_2PI
    return phi, hh


def _gelu_second_derivative_graph(h, kind):
    """gelu''(h) of the Tensor h, built from differentiable ops (the third derivative and above)."""
    if kind == "gelu_tanh":
        t = (TANH_C * (h + TANH_K * h * h * h)).tanh()
        du = TANH_C * (1.0 + 3.0 * TANH_K * h * h)
        return (1.0 - t * t) * (du * (1.0 - h * t * du) + 3.0 * TANH_C * TANH_K * h * h)
    return normal_pdf(h) * (2.0 - h * h)


class GELUBackward(Function):
    """(dy, h) -> dh = dy * gelu'(h): GELU's backward as an op of its own (its forward is the
    kernel bias_activation_backward), so a GELU gradient is one node of the graph, and its
    derivatives are two fused lines (torch's gelu_backward has its own derivative the same way):

        dh = dy * gelu'(h)  ->  d(dy) = g * gelu'(h),  d(h) = g * dy * gelu''(h)

    and the tangent t_dh = t_dy * gelu'(h) + dy * gelu''(h) * t_h. saved: what
    bias_activation_forward saved, (h, Phi(h)) or (h, tanh(u)); kind "gelu" or "gelu_tanh";
    density: the exact form's phi(h) when already formed (activation_tangent), else None."""

    @staticmethod
    def forward(ctx, dy, h, saved, kind, density=None):
        ctx.save_for_backward(dy)
        ctx.activation_saved, ctx.kind, ctx.density = saved, kind, density
        if density is None:
            return bias_activation_backward(dy, saved, kind)
        return gelu_backward_density(dy, *saved, density)[0]

    @staticmethod
    def backward(ctx, g):
        (dy,) = ctx.saved_tensors
        h, aux = ctx.activation_saved
        return gelu_double_backward(g, dy, h, aux, ctx.kind, *ctx.needs_input_grad)

    @staticmethod
    def differentiable_backward(ctx, g):
        dy, h = ctx.inputs
        need_dy, need_h = ctx.needs_input_grad
        ddy = None
        if need_dy:
            ddy = GELUBackward.apply(g, h, saved=ctx.activation_saved, kind=ctx.kind, density=ctx.density)
        dh = g * dy * _gelu_second_derivative_graph(h, ctx.kind) if need_h else None
        return ddy, dh

    @staticmethod
    def jvp(ctx, t_dy, t_h):
        (dy,) = ctx.saved_tensors
        h, aux = ctx.activation_saved
        return gelu_backward_jvp(dy, h, aux, t_dy, t_h, ctx.kind, ctx.density)


@kernel_table
def gelu_double_backward(g, dy, h, aux, kind, need_dy, need_h):
    """(d dy, d h) of <g, dh> for GELU's backward dh = dy * gelu'(h) (each None unless needed);
    aux as bias_activation_forward saved it."""
    # dh = dy * gelu'(h)  ->  d(dy) = g * gelu'(h)
    ddy = bias_activation_backward(g, (h, aux), kind) if need_dy else None
    # dh = dy * gelu'(h)  ->  d(h) = g * dy * gelu''(h)
    dh = None
    if need_h:
        dh = gelu_second_derivative(h, aux, kind)
        dh *= dy
        dh *= g
    return ddy, dh


@kernel_table
def gelu_backward_jvp(dy, h, aux, t_dy, t_h, kind, density=None):
    """The tangent of GELU's backward dh = dy * gelu'(h) along t_dy and t_h (either None); density
    the exact form's phi(h) when already formed (along both tangents it is not formed again)."""
    # dh = dy * gelu'(h)  ->  t_dh = t_dy * gelu'(h) + dy * gelu''(h) * t_h
    if kind == "gelu" and t_dy is not None and t_h is not None:
        return _exact_gelu_backward_jvp(dy, h, aux, t_dy, t_h, density)
    t_dh = None if t_dy is None else bias_activation_backward(t_dy, (h, aux), kind)
    if t_h is not None:
        along_h = gelu_second_derivative(h, aux, kind)
        along_h *= dy
        along_h *= t_h
        t_dh = added_into(t_dh, along_h)
    return t_dh


def _exact_gelu_backward_jvp(dy, h, cdf, t_dy, t_h, density=None):
    """gelu_backward_jvp of the exact form along both tangents, phi(h) formed once for gelu'(h) and
    gelu''(h) (12 array passes where the two separate rules take 16, two of them exp), or not at
    all when `density` gives it (9 passes, no exp)."""
    xp = backend.get_array_module(h)
    if density is None:
        phi, hh = _density_and_square(h)
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


class ReLUFunction(Function):
    """y = max(x, 0), any shape (relu(NaN) = NaN).  dx = dy where not (x <= 0), else 0."""

    @staticmethod
    def forward(ctx, x):
        y, ctx.activation_saved = bias_activation_forward(x, None, "relu")
        return y

    @staticmethod
    def backward(ctx, dy):
        return bias_activation_backward(dy, ctx.activation_saved, "relu")

    @staticmethod
    def differentiable_backward(ctx, dy):
        return bias_activation_grad(dy, None, ctx.activation_saved, "relu")

    @staticmethod
    def jvp(ctx, t):
        # y = max(x, 0)  ->  t_y = t_x * [not x <= 0]: elementwise, so the backward's kernel applies
        return bias_activation_backward(t, ctx.activation_saved, "relu")


@has_twin
def relu(input: Tensor | Array) -> Tensor:
    """max(input, 0) elementwise, any shape, like torch.nn.functional.relu (a NaN stays NaN).
    Raises TypeError unless `input` is a floating Tensor or array."""
    check_tensor("input", input, "relu")
    return ReLUFunction.apply(input)


class GELUFunction(Function):
    """y = x * Phi(x) (exact, Phi the normal CDF) or its tanh approximation; any shape.

    exact: dx = dy * (Phi(x) + x phi(x));  tanh: dx = dy * (0.5 (1 + t) + 0.5 x (1 - t^2) du/dx).
    """

    @staticmethod
    def forward(ctx, x, approximate):
        ctx.kind = "gelu_tanh" if approximate == "tanh" else "gelu"
        y, ctx.activation_saved = bias_activation_forward(x, None, ctx.kind)
        return y

    @staticmethod
    def backward(ctx, dy):
        return bias_activation_backward(dy, ctx.activation_saved, ctx.kind)

    @staticmethod
    def differentiable_backward(ctx, dy):
        return bias_activation_grad(dy, ctx.inputs[0], ctx.activation_saved, ctx.kind,
                                    getattr(ctx, "activation_density", None))

    @staticmethod
    def jvp(ctx, t):
        # y = gelu(x)  ->  t_y = gelu'(x) * t_x
        return activation_tangent(ctx, t, ctx.kind)


@has_twin
def gelu(input: Tensor | Array, approximate: str = "none") -> Tensor:
    """x * Phi(x) elementwise (Phi: the standard normal CDF), like torch.nn.functional.gelu;
    approximate="tanh" uses the tanh form (GPT-2's). Raises ValueError for another `approximate`."""
    check_tensor("input", input, "gelu")
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return GELUFunction.apply(input, approximate=approximate)


class DropoutFunction(Function):
    """y = x * keep / (1 - p), any shape, keep_i = bits16(seed, offset + i) >= threshold over the
    flat (C-order) index i of x.  dx = dy * keep / (1 - p).

    What backward needs comes from the kernel table: on the CPU the mask (1 byte per entry,
    cheaper than drawing it again), on a GPU nothing (the kernel regenerates it)."""

    @staticmethod
    def forward(ctx, x, seed, offset, p, state=None):
        y, keep = dropout_forward(x, seed, offset, p, state)    # (...), (...) bool or None
        ctx.save_for_backward(keep)
        ctx.stream = (seed, offset, p, state)
        return y

    @staticmethod
    def backward(ctx, dy):
        (keep,) = ctx.saved_tensors
        # y = x * keep / (1 - p)  ->  dx = dy * keep / (1 - p)
        return dropout_backward(dy, keep, *ctx.stream)

    @staticmethod
    def differentiable_backward(ctx, dy):
        # dx = dy * keep / (1 - p): linear in dy with the forward's mask, i.e. the dropout of dy by the
        # same draw of the stream (its own backward the same again):  d/d(dy) <dx, u> = u * keep / (1 - p)
        seed, offset, p, state = ctx.stream
        return DropoutFunction.apply(dy, seed=seed, offset=offset, p=p, state=state)

    @staticmethod
    def jvp(ctx, t):
        (keep,) = ctx.saved_tensors
        # y = x * keep / (1 - p)  ->  t_y = t_x * keep / (1 - p), the forward's mask (kept, or drawn again)
        return dropout_backward(t, keep, *ctx.stream)


@kernel_table
def dropout_forward(x, seed, offset, p, state=None):
    """(y, keep): y = x * keep / (1 - p) with the mask of `keep_mask`, which is returned for
    the backward (implementations that regenerate it return None instead). state: None, or under
    graph capture the device (seed, base) of the draw (npformer.runtime.random.PhiloxDraw)."""
    keep = keep_mask(x.shape, p, seed, offset, backend.device_of(x), state)
    return elementwise_product(x, keep, dropout_scale(p)), keep


@kernel_table
def dropout_backward(dy, keep, seed, offset, p, state=None):
    """dx = dy * keep / (1 - p) with the forward's mask `keep` (regenerated when None)."""
    if keep is None:
        keep = keep_mask(dy.shape, p, seed, offset, backend.device_of(dy), state)
    return elementwise_product(dy, keep, dropout_scale(p))


@kernel_table
def elementwise_product(a, b, scale=None):
    """a * b (* scale) into a new array, a and b of one shape."""
    out = a * b
    if scale is not None:
        out *= scale
    return out


def dropout_threshold(p):
    """Dropout's keep test: an entry is kept iff its 16 random bits are >= this threshold,
    min(round(p 2^16), 2^16 - 1), so the drop probability is p rounded to a multiple of 2^-16
    (within 7.7e-6); p = 1 gives 2^16, which keeps nothing."""
    return 2**16 if p == 1.0 else min(round(p * 2**16), 2**16 - 1)


def dropout_scale(p):
    """1 / (1 - p), the scale of the kept entries (0 for p = 1: everything is dropped)."""
    return 1.0 / (1.0 - p) if p < 1.0 else 0.0


def dropout_stream(generator, op):
    """The random.Philox stream a dropout draws from: `generator`, or the global
    random.dropout_stream() when None."""
    if generator is None:
        return random.dropout_stream()
    if not isinstance(generator, random.Philox):
        raise TypeError(f"{op}: generator must be an npformer.runtime.random.Philox (a dropout stream, like a "
                        f"torch.Generator) or None for the global one, got {type(generator).__name__}")
    return generator


def keep_mask(shape, p, seed, offset, device, state=None):
    """The boolean mask of a dropout over an array of `shape` whose values start at `offset` of
    the stream of `seed` (or, with `state`, of the device (seed, base): graph capture): entry i
    (C order) is kept iff bits16(seed, offset + i) >= threshold."""
    size = math.prod(shape)
    if p == 1.0:                                            # nothing passes a threshold of 2^16
        return backend.module_for(device).zeros(shape, dtype=bool)
    return random.bits16_at_least(seed, offset, size, dropout_threshold(p), device, state).reshape(shape)


def dropout_mask(shape, p, device, generator=None, op="dropout"):
    """Boolean mask of `shape`, True (keep) with probability 1 - p, on `device`: takes
    prod(shape) values from `generator` (an npformer.runtime.random.Philox; None: the global dropout
    stream), so every dropout site, on every device, draws the same mask for the same stream
    state. Kept entries are those whose 16 random bits are >= dropout_threshold(p)."""
    draw = dropout_stream(generator, op).draw(math.prod(shape), device)
    return keep_mask(shape, p, draw.seed, draw.offset, device, draw.state)


@has_twin
def dropout(input: Tensor | Array, p: float = 0.5, training: bool = True,
            generator: random.Philox | None = None) -> Tensor | Array:
    """Inverted dropout like torch.nn.functional.dropout: zero each entry with probability p and
    scale the rest by 1/(1-p). p=0 or training=False returns `input` itself; p=1 returns zeros.

    The mask comes from `generator`, an npformer.runtime.random.Philox (like a torch.Generator), or the
    global stream `npformer.runtime.random.dropout_stream()` (seeded by npformer.manual_seed): a dropout
    over n entries takes the next n values of the stream, and the mask is the same on every
    device and for any number of threads. Raises ValueError unless 0 <= p <= 1, TypeError for a
    `training` that is not a bool.
    """
    x = check_tensor("input", input, "dropout")
    p = check_real(p, "p", "dropout", at_least=0, at_most=1)
    if not check_bool(training, "training", "dropout") or p == 0.0:
        return input
    draw = dropout_stream(generator, "dropout").draw(x.size, backend.device_of(x))
    return DropoutFunction.apply(input, seed=draw.seed, offset=draw.offset, p=p, state=draw.state)
