"""Elementwise activations (ReLU, GELU; with a bias: the epilogue of `linear`) and inverted dropout.

The formulas are in math.py (erf in erf.py); here are their kernel tables, the Functions, the
public ops, and dropout's masks drawn from the Philox streams of npformer.runtime.random."""
from __future__ import annotations

import math as _math

from autograd import Function, Tensor, backend, where
from autograd.backend import Array
from autograd.checks import check_bool, check_real
from npformer.runtime import random
from npformer.runtime.kernels import kernel_table

from .._common import check_tensor, has_twin
from . import erf as _erf_math
from . import math
from .erf import INV_SQRT_2PI
from .math import ACTIVATIONS, TANH_C, TANH_K, dropout_scale, dropout_threshold  # noqa: F401  (re-exported)

__all__ = ["dropout", "gelu", "relu"]  # its public ops, which npformer.functional exports

# the kernel tables: the math functions as references (xp first), the fast variants in cpu.py / cuda.py
erf = kernel_table(_erf_math.erf)  # (after `from . import erf`: the name is the table from here on)
bias_activation_forward = kernel_table(math.bias_activation_forward)
bias_activation_backward = kernel_table(math.bias_activation_backward)
gelu_backward_density = kernel_table(math.gelu_backward_density)
gelu_double_backward = kernel_table(math.gelu_double_backward)
gelu_backward_jvp = kernel_table(math.gelu_backward_jvp)
elementwise_product = kernel_table(math.elementwise_product)


def normal_density(h):
    """phi(h) = exp(-h^2 / 2) / sqrt(2 pi) of a raw array, a new array: the standard normal density,
    the derivative of the exact GELU's Phi(h)."""
    return math.normal_density(backend.get_array_module(h), h)


def activation_tangent(ctx, t_h, kind):
    """t_y = act'(h) * t_h, the tangent of y = act(h) (jvp of linear's epilogue and of gelu), from
    what bias_activation_forward saved (ctx.activation_saved). The exact GELU of a node in the graph
    also keeps phi(h) on ctx (ctx.activation_density, h's size): forward over reverse runs the
    node's differentiable backward next, whose GELU backward and its tangent need phi(h) again
    (bias_activation_grad's `density`), so one step takes exp(-h^2 / 2) once, not three times."""
    xp = backend.get_array_module(t_h)
    if kind != "gelu" or ctx.inputs is None:
        # y = act(h)  ->  t_y = act'(h) * t_h: elementwise, so the backward's kernel applies
        return bias_activation_backward(xp, t_h, ctx.activation_saved, kind)
    h, cdf = ctx.activation_saved
    t_y, ctx.activation_density = gelu_backward_density(xp, t_h, h, cdf)
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
    backward_formula = staticmethod(math.gelu_double_backward)

    @staticmethod
    def forward(ctx, dy, h, saved, kind, density=None):
        ctx.save_for_backward(dy)
        ctx.activation_saved, ctx.kind, ctx.density = saved, kind, density
        xp = backend.get_array_module(dy)
        if density is None:
            return bias_activation_backward(xp, dy, saved, kind)
        return gelu_backward_density(xp, dy, *saved, density)[0]

    @staticmethod
    def backward(ctx, g):
        (dy,) = ctx.saved_tensors
        h, aux = ctx.activation_saved
        return gelu_double_backward(backend.get_array_module(g), g, dy, h, aux, ctx.kind, *ctx.needs_input_grad)

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
        return gelu_backward_jvp(backend.get_array_module(h), dy, h, aux, t_dy, t_h, ctx.kind, ctx.density)


class ReLUFunction(Function):
    """y = max(x, 0), any shape (relu(NaN) = NaN).  dx = dy where not (x <= 0), else 0."""
    backward_formula = staticmethod(math.bias_activation_backward)

    @staticmethod
    def forward(ctx, x):
        y, ctx.activation_saved = bias_activation_forward(backend.get_array_module(x), x, None, "relu")
        return y

    @staticmethod
    def backward(ctx, dy):
        return bias_activation_backward(backend.get_array_module(dy), dy, ctx.activation_saved, "relu")

    @staticmethod
    def differentiable_backward(ctx, dy):
        return bias_activation_grad(dy, None, ctx.activation_saved, "relu")

    @staticmethod
    def jvp(ctx, t):
        # y = max(x, 0)  ->  t_y = t_x * [not x <= 0]: elementwise, so the backward's kernel applies
        return bias_activation_backward(backend.get_array_module(t), t, ctx.activation_saved, "relu")


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
    backward_formula = staticmethod(math.bias_activation_backward)

    @staticmethod
    def forward(ctx, x, approximate):
        ctx.kind = "gelu_tanh" if approximate == "tanh" else "gelu"
        y, ctx.activation_saved = bias_activation_forward(backend.get_array_module(x), x, None, ctx.kind)
        return y

    @staticmethod
    def backward(ctx, dy):
        return bias_activation_backward(backend.get_array_module(dy), dy, ctx.activation_saved, ctx.kind)

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
    backward_formula = staticmethod(math.dropout_backward)

    @staticmethod
    def forward(ctx, x, seed, offset, p, state=None):
        y, keep = dropout_forward(backend.get_array_module(x), x, seed, offset, p, state)  # (...), (...) bool or None
        ctx.save_for_backward(keep)
        ctx.stream = (seed, offset, p, state)
        return y

    @staticmethod
    def backward(ctx, dy):
        (keep,) = ctx.saved_tensors
        # y = x * keep / (1 - p)  ->  dx = dy * keep / (1 - p)
        return dropout_backward(backend.get_array_module(dy), dy, keep, *ctx.stream)

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
        return dropout_backward(backend.get_array_module(t), t, keep, *ctx.stream)


@kernel_table
def dropout_forward(xp, x, seed, offset, p, state=None):
    """(y, keep): y = x * keep / (1 - p) with the mask of `keep_mask`, which is returned for
    the backward (implementations that regenerate it return None instead). state: None, or under
    graph capture the device (seed, base) of the draw (npformer.runtime.random.PhiloxDraw)."""
    keep = keep_mask(x.shape, p, seed, offset, backend.device_of(x), state)
    return math.dropout_forward(xp, x, keep, p), keep


@kernel_table
def dropout_backward(xp, dy, keep, seed, offset, p, state=None):
    """dx = dy * keep / (1 - p) with the forward's mask `keep` (regenerated when None)."""
    if keep is None:
        keep = keep_mask(dy.shape, p, seed, offset, backend.device_of(dy), state)
    return math.dropout_backward(xp, dy, keep, p)


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
    size = _math.prod(shape)
    if p == 1.0:                                            # nothing passes a threshold of 2^16
        return backend.module_for(device).zeros(shape, dtype=bool)
    return random.bits16_at_least(seed, offset, size, dropout_threshold(p), device, state).reshape(shape)


def dropout_mask(shape, p, device, generator=None, op="dropout"):
    """Boolean mask of `shape`, True (keep) with probability 1 - p, on `device`: takes
    prod(shape) values from `generator` (an npformer.runtime.random.Philox; None: the global dropout
    stream), so every dropout site, on every device, draws the same mask for the same stream
    state. Kept entries are those whose 16 random bits are >= dropout_threshold(p)."""
    draw = dropout_stream(generator, op).draw(_math.prod(shape), device)
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


from . import cpu, cuda  # noqa: E402,F401  (register the fast variants)
