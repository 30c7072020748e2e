"""SiLU (x * sigmoid(x)) and SwiGLU (silu(gate) * up, one fused op): the kernel tables made from the
formulas of math.py, the Functions (SiLUFunction, SwiGLUFunction, and their backwards as ops,
SiLUBackward and SwiGLUBackward) and the public ops."""
from __future__ import annotations

from autograd import Function, Tensor, backend
from autograd.backend import Array
from npformer.runtime.kernels import kernel_table

from .._common import check_one_dtype, check_tensor, has_twin
from . import math

__all__ = ["silu", "swiglu"]  # its public ops, which npformer.functional exports

silu_forward = kernel_table(math.silu_forward)
silu_backward = kernel_table(math.silu_backward)
silu_double_backward = kernel_table(math.silu_double_backward)
silu_backward_jvp = kernel_table(math.silu_backward_jvp)
swiglu_forward = kernel_table(math.swiglu_forward)
swiglu_backward = kernel_table(math.swiglu_backward)
swiglu_jvp = kernel_table(math.swiglu_jvp)
swiglu_double_backward = kernel_table(math.swiglu_double_backward)
swiglu_backward_jvp = kernel_table(math.swiglu_backward_jvp)


def sigmoid_graph(x):
    """sigmoid(x) of a Tensor, differentiable: (1 + tanh(x / 2)) / 2 (tanh never overflows)."""
    return 0.5 + 0.5 * (0.5 * x).tanh()


def silu_derivatives_graph(x):
    """(silu(x), silu'(x), silu''(x)) of a Tensor, built from differentiable ops (the third
    derivative and above): s = sigmoid(x), silu = x s, silu' = s (1 + x (1 - s)),
    silu'' = s (1 - s) (2 + x (1 - 2 s))."""
    s = sigmoid_graph(x)
    return x * s, s * (1.0 + x * (1.0 - s)), s * (1.0 - s) * (2.0 + x * (1.0 - 2.0 * s))


class SiLUBackward(Function):
    """(dy, x) -> dx = dy * silu'(x): SiLU's backward as an op of its own (its forward is the
    kernel silu_backward), so a SiLU gradient is one node of the graph, and its derivatives are two
    lines (as GELUBackward's):

        dx = dy * silu'(x)  ->  d(dy) = g * silu'(x),  d(x) = g * dy * silu''(x)

    and the tangent t_dx = t_dy * silu'(x) + dy * silu''(x) * t_x. x_saved and s = sigmoid(x): the
    forward's arrays (constants; the rules differentiate through them by hand)."""
    backward_formula = staticmethod(math.silu_double_backward)

    @staticmethod
    def forward(ctx, dy, x, x_saved, s):
        ctx.save_for_backward(dy, x_saved, s)
        return silu_backward(backend.get_array_module(dy), dy, x_saved, s)

    @staticmethod
    def backward(ctx, g):
        dy, x, s = ctx.saved_tensors
        return silu_double_backward(backend.get_array_module(g), g, dy, x, s, *ctx.needs_input_grad)

    @staticmethod
    def differentiable_backward(ctx, g):
        dy_saved, x_saved, s = ctx.saved_tensors
        dy, x = (Tensor(saved) if t is None else t for t, saved in zip(ctx.inputs, (dy_saved, x_saved)))
        need_dy, need_x = ctx.needs_input_grad
        # dx = dy * silu'(x)  ->  d(dy) = g * silu'(x): SiLU's backward of g, the same op again
        ddy = SiLUBackward.apply(g, x, x_saved=x_saved, s=s) if need_dy else None
        # dx = dy * silu'(x)  ->  d(x) = g * dy * silu''(x), silu'' formed from x in the graph
        dx = g * dy * silu_derivatives_graph(x)[2] if need_x else None
        return ddy, dx

    @staticmethod
    def jvp(ctx, t_dy, t_x):
        dy, x, s = ctx.saved_tensors
        return silu_backward_jvp(backend.get_array_module(x), dy, x, s, t_dy, t_x)


class SiLUFunction(Function):
    """y = x * sigmoid(x), any shape.  dx = dy * s (1 + x (1 - s)), s = sigmoid(x) (saved)."""
    backward_formula = staticmethod(math.silu_backward)

    @staticmethod
    def forward(ctx, x):
        y, s = silu_forward(backend.get_array_module(x), x)
        ctx.save_for_backward(x, s)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, s = ctx.saved_tensors
        return silu_backward(backend.get_array_module(dy), dy, x, s)

    @staticmethod
    def differentiable_backward(ctx, dy):
        """The backward as the op `SiLUBackward`: one node, whose own backward and jvp are the
        hand-derived double backward and tangent of the gradient."""
        x, s = ctx.saved_tensors
        return SiLUBackward.apply(dy, ctx.inputs[0], x_saved=x, s=s)

    @staticmethod
    def jvp(ctx, t):
        x, s = ctx.saved_tensors
        # y = silu(x)  ->  t_y = silu'(x) * t_x: elementwise, so the backward's kernel applies
        return silu_backward(backend.get_array_module(t), t, x, s)


@has_twin
def silu(input: Tensor | Array) -> Tensor:
    """x * sigmoid(x) elementwise (SiLU, swish), any shape, like torch.nn.functional.silu; finite
    for every finite x in float32 and float64 (no overflow). Raises TypeError unless `input` is a
    floating Tensor or array."""
    check_tensor("input", input, "silu")
    return SiLUFunction.apply(input)


def _needed_outputs(needs, grads):
    """Of (d gate, d up) (or their tangents), the ones SwiGLUBackward outputs (needs)."""
    return tuple(g for g, need in zip(grads, needs) if need)


def _arriving_grads(needs, grads):
    """The gradients arriving at SwiGLUBackward's outputs as (g_gate, g_up), None for one it does
    not output."""
    grads = iter(grads)
    return tuple(next(grads) if need else None for need in needs)


class SwiGLUBackward(Function):
    """(dy, gate, up) -> the needed ones of (d gate, d up), in that order: SwiGLU's backward as an
    op (its forward runs the kernel table swiglu_backward), so that a gradient of SwiGLU is one node
    whose own derivatives are hand-derived: backward `swiglu_double_backward`, jvp
    `swiglu_backward_jvp`. gate_saved, up_saved, s = sigmoid(gate): the forward's arrays, constants;
    gate and up are inputs for the gradients to reach them (arrays: constants)."""
    backward_formula = staticmethod(math.swiglu_double_backward)

    @staticmethod
    def forward(ctx, dy, gate, up, gate_saved, up_saved, s, needs):
        ctx.save_for_backward(dy, gate_saved, up_saved, s)
        ctx.needs = needs  # which of (d gate, d up) are outputs
        grads = swiglu_backward(backend.get_array_module(dy), dy, gate_saved, up_saved, s, *needs)
        return _needed_outputs(needs, grads)

    @staticmethod
    def backward(ctx, *grads):
        dy, gate, up, s = ctx.saved_tensors
        g_gate, g_up = _arriving_grads(ctx.needs, grads)
        return swiglu_double_backward(backend.get_array_module(dy), dy, gate, up, s, g_gate, g_up,
                                      *ctx.needs_input_grad)

    @staticmethod
    def jvp(ctx, t_dy, t_gate, t_up):
        dy, gate, up, s = ctx.saved_tensors
        tangents = swiglu_backward_jvp(backend.get_array_module(dy), dy, gate, up, s, t_dy, t_gate, t_up, *ctx.needs)
        return _needed_outputs(ctx.needs, tangents)

    @staticmethod
    def differentiable_backward(ctx, *grads):
        """swiglu_double_backward's formulas on Tensors, silu(gate), silu'(gate) and silu''(gate)
        formed again from gate in the graph (constants where gate is one): every order."""
        dy_saved, gate_saved, up_saved, s_saved = ctx.saved_tensors
        dy, gate, up = (Tensor(saved) if t is None else t
                        for t, saved in zip(ctx.inputs, (dy_saved, gate_saved, up_saved)))
        g_gate, g_up = _arriving_grads(ctx.needs, grads)
        need_dy, need_gate, need_up = ctx.needs_input_grad
        act, slope, curvature = silu_derivatives_graph(gate)                  # silu, silu', silu'' of gate
        ddy = dgate_bar = dup_bar = None
        if g_gate is not None:
            # d gate = dy up silu'(gate)  ->  d dy = g_gate up silu', d up = g_gate dy silu', d gate = g_gate dy up silu''
            ddy = g_gate * up * slope if need_dy else None
            dup_bar = g_gate * dy * slope if need_up else None
            dgate_bar = g_gate * dy * up * curvature if need_gate else None
        if g_up is not None:
            # d up = dy silu(gate)  ->  d dy += g_up silu(gate), d gate += g_up dy silu'(gate)
            if need_dy:
                ddy = g_up * act if ddy is None else ddy + g_up * act
            if need_gate:
                dgate_bar = g_up * dy * slope if dgate_bar is None else dgate_bar + g_up * dy * slope
        return ddy, dgate_bar, dup_bar


class SwiGLUFunction(Function):
    """y = silu(gate) * up = gate * sigmoid(gate) * up, gate and up of one shape (the gated
    feed-forward's nonlinearity, fused).  With s = sigmoid(gate) (saved):
    d gate = dy * up * s (1 + gate (1 - s)),  d up = dy * gate * s."""
    backward_formula = staticmethod(math.swiglu_backward)

    @staticmethod
    def forward(ctx, gate, up):
        y, s = swiglu_forward(backend.get_array_module(gate), gate, up)
        ctx.save_for_backward(gate, up, s)
        return y

    @staticmethod
    def backward(ctx, dy):
        gate, up, s = ctx.saved_tensors
        return swiglu_backward(backend.get_array_module(dy), dy, gate, up, s, *ctx.needs_input_grad)

    @staticmethod
    def differentiable_backward(ctx, dy):
        """The backward as the op `SwiGLUBackward`: one node, whose own backward and jvp are the
        hand-derived double backward and tangent of the gradients."""
        gate, up, s = ctx.saved_tensors
        gate_t, up_t = ctx.inputs
        needs = ctx.needs_input_grad
        grads = iter(SwiGLUBackward.apply(dy, gate if gate_t is None else gate_t, up if up_t is None else up_t,
                                          gate_saved=gate, up_saved=up, s=s, needs=needs))
        return tuple(next(grads) if need else None for need in needs)

    @staticmethod
    def jvp(ctx, t_gate, t_up):
        gate, up, s = ctx.saved_tensors
        return swiglu_jvp(backend.get_array_module(gate), gate, up, s, t_gate, t_up)


@has_twin
def swiglu(gate: Tensor | Array, up: Tensor | Array) -> Tensor:
    """silu(gate) * up elementwise, one fused op with its own backward (SwiGLU's nonlinearity:
    Llama's feed-forward is linear2(swiglu(linear1(x), linear3(x)))). gate and up must have the
    same shape (no broadcasting) and one floating dtype. torch has no such op: it is
    torch.nn.functional.silu(gate) * up. Raises ValueError for shapes that differ, TypeError for
    non-floating inputs or two dtypes."""
    check_swiglu_arguments(gate, up)
    return SwiGLUFunction.apply(gate, up)


def check_swiglu_arguments(gate, up):
    """ValueError unless gate and up have one shape, TypeError unless both are floating of one dtype."""
    g, u = check_tensor("gate", gate, "swiglu"), check_tensor("up", up, "swiglu")
    if tuple(g.shape) != tuple(u.shape):
        raise ValueError(f"swiglu: gate and up must have the same shape (no broadcasting), got gate "
                         f"{tuple(g.shape)} and up {tuple(u.shape)}")
    check_one_dtype("swiglu", g, u)
