"""The planted-bug matrix (issue 45's targets): one op per mistake a researcher makes in a
hand-written Function, each checked as a user's case (`gradcheck.run_case`, torch installed).
Every bug fails in the column that judges what it breaks, and only there, with a message that
names the input, the entry and, where it applies, the kind of mistake; the right version of
each op passes every column."""
import numpy as np
import pytest

import autograd
from autograd import Function, Tensor, backend
from npformer import gradcheck, opcases

COLUMNS = set(gradcheck.COLUMNS)


def _square_jvp(ctx, t):
    return 2.0 * t * ctx.saved_tensors[0]


class Square(Function):
    """y = x^2, right in every mode: the base of the bugs below."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, dy):
        return 2.0 * dy * ctx.saved_tensors[0]

    @staticmethod
    def differentiable_backward(ctx, dy):
        return 2.0 * dy * ctx.inputs[0]

    jvp = staticmethod(_square_jvp)


class AddBias(Function):
    """y = x + b, b (4,) broadcast over the rows of x (4, 4); the bias gradient summed over the
    wrong axis (the columns): a bug that keeps b's shape."""

    @staticmethod
    def forward(ctx, x, b):
        return x + b

    @staticmethod
    def backward(ctx, dy):
        return dy, dy.sum(axis=1)


class OnesOnly(Function):
    """y = x^2 whose backward forgets dy: right only for an all-ones upstream gradient."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, dy):
        return 2.0 * ctx.saved_tensors[0]


class NaiveSoftplus(Function):
    """log(1 + exp(x)) and sigmoid = exp(x) / (1 + exp(x)) as written on paper: exact in float64
    at x = 100, inf and NaN in float32."""

    @staticmethod
    def forward(ctx, x):
        xp = backend.get_array_module(x)
        e = xp.exp(x)
        ctx.save_for_backward(e)
        return xp.log(1.0 + e)

    @staticmethod
    def backward(ctx, dy):
        e, = ctx.saved_tensors
        return dy * e / (1.0 + e)


class InPlaceSquare(Square):
    """x^2 whose backward multiplies into its upstream gradient."""

    @staticmethod
    def backward(ctx, dy):
        dy *= 2.0 * ctx.saved_tensors[0]
        return dy


class TwiceLinear(Function):
    """2x, with a backward that says 3: stands inside WrongDoubleSquare's differentiable_backward."""

    @staticmethod
    def forward(ctx, x):
        return 2.0 * x

    @staticmethod
    def backward(ctx, dy):
        return 3.0 * dy


class WrongDoubleSquare(Square):
    """x^2 whose differentiable_backward has the right value and a wrong derivative."""

    @staticmethod
    def differentiable_backward(ctx, dy):
        return dy * TwiceLinear.apply(ctx.inputs[0])


class DoubledCreateGraphSquare(Square):
    """x^2 whose differentiable_backward (the gradient taken with create_graph) is twice the backward's."""

    @staticmethod
    def differentiable_backward(ctx, dy):
        return 4.0 * dy * ctx.inputs[0]


class WrongJvpSquare(Square):
    """x^2 whose jvp forgets the 2."""

    @staticmethod
    def jvp(ctx, t):
        return t * ctx.saved_tensors[0]


class Float32Gradient(Function):
    """y = 3x whose backward returns float32 for a float64 input."""

    @staticmethod
    def forward(ctx, x):
        return 3.0 * x

    @staticmethod
    def backward(ctx, dy):
        return (3.0 * dy).astype("float32")


class WrongShapeGradient(Function):
    """y = 3x whose backward returns one row of the gradient."""

    @staticmethod
    def forward(ctx, x):
        return 3.0 * x

    @staticmethod
    def backward(ctx, dy):
        return 3.0 * dy[:1]


class LayoutSquare(Function):
    """x^2 whose backward reads dy in memory order (ravel(order="K")) and x in logical order: right
    for contiguous arrays, scrambled for a non-contiguous upstream gradient."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, dy):
        x, = ctx.saved_tensors
        return (2.0 * x.ravel() * dy.ravel(order="K")).reshape(x.shape)


def _x(rng):
    return {"x": rng.standard_normal((3, 4))}


def _softplus_inputs(rng):
    x = rng.standard_normal((2, 3))
    x[1, 2] = 100.0   # exp overflows float32
    return {"x": x}


BOTH = ("second-order", "forward-mode")
# name: (case, the columns that must fail, what the failing messages must contain)
MATRIX = {
    "right square": (opcases.OpCase("right square", _x, Square.apply, lambda t, x: x * x, require=BOTH), set(), []),
    "bias summed over the wrong axis": (
        opcases.OpCase("bias summed over the wrong axis", lambda rng: {"x": rng.standard_normal((4, 4)),
                                                                     "b": rng.standard_normal(4)},
                       AddBias.apply, lambda t, x, b: x + b),
        {"fd", "torch", "torch32"}, ["b: wrong", "worst at index (", "gradient of b: max abs difference"]),
    "right only for an all-ones upstream": (
        opcases.OpCase("right only for an all-ones upstream", _x, OnesOnly.apply, lambda t, x: x * x),
        {"fd", "torch", "torch32"}, ["x: wrong", "worst at index (", "right for an all-ones upstream gradient"]),
    "unstable in float32": (
        opcases.OpCase("unstable in float32", _softplus_inputs, NaiveSoftplus.apply,
                       lambda t, x: t.nn.functional.softplus(x)),
        {"torch32"}, ["output 0: max abs difference inf", "worst at index (1, 2): yours inf",
                      "gradient of x: max abs difference nan", "yours has NaN at 1 entries (the first at index (1, 2))"]),
    "in-place write into the upstream": (
        opcases.OpCase("in-place write into the upstream", _x, InPlaceSquare.apply, lambda t, x: x * x),
        {"fd"}, ["in-place write: the backward of test_planted_bugs.InPlaceSquare wrote into its upstream gradient"]),
    "wrong double backward": (
        opcases.OpCase("wrong double backward", _x, WrongDoubleSquare.apply, lambda t, x: x * x, require=BOTH),
        {"second"}, ["x: wrong", "worst at index ("]),
    "create_graph gradient differs from the backward": (
        opcases.OpCase("create_graph gradient differs from the backward", _x, DoubledCreateGraphSquare.apply,
                       lambda t, x: x * x, require=BOTH),
        {"create_graph"}, ["op test_planted_bugs.DoubledCreateGraphSquare, its input 0: wrong",
                           "x: create_graph's gradient: wrong", "worst at index ("]),
    "wrong jvp": (
        opcases.OpCase("wrong jvp", _x, WrongJvpSquare.apply, lambda t, x: x * x, require=BOTH),
        {"forward"}, ["forward mode, output 0 along x: J u: wrong", "worst at index (",
                      "tangent of output 0: max abs difference"]),
    "non-contiguous arrays": (
        opcases.OpCase("non-contiguous arrays", _x, LayoutSquare.apply, lambda t, x: x * x),
        {"fd"}, ["layout: the gradient of x with non-contiguous inputs and upstream gradients: wrong",
                 "worst at index (", "the op depends on memory layout"]),
    "float32 gradient for a float64 input": (
        opcases.OpCase("float32 gradient for a float64 input", _x, Float32Gradient.apply, lambda t, x: 3.0 * x,
                       float32=False),
        {"fd"}, ["test_planted_bugs.Float32Gradient returned an invalid gradient at index 0",
                 "expected dtype float64 but got float32"]),
    "gradient of the wrong shape": (
        opcases.OpCase("gradient of the wrong shape", _x, WrongShapeGradient.apply, lambda t, x: 3.0 * x),
        {"fd"}, ["test_planted_bugs.WrongShapeGradient returned an invalid gradient at index 0",
                 "got shape (1, 4) but expected shape compatible with (3, 4)"]),
}


def _failing(row):
    return {c for c in COLUMNS if row[c] in ("ERROR", "TIME LIMIT") or isinstance(row[c], tuple) and not row[c][2]}


@pytest.mark.parametrize("name", MATRIX)
def test_each_planted_bug_fails_its_own_column_only_and_says_what_and_where(name, torch):
    case, columns, fragments = MATRIX[name]
    row = gradcheck.run_case(case, torch)
    assert _failing(row) == columns, (row, row["messages"])
    assert row["passed"] is (not columns)
    text = "\n".join(row["messages"])
    for fragment in fragments:
        assert fragment in text, (fragment, text)
    if columns:
        line = gradcheck.summary(row)
        assert line.startswith(f"{name}: ") and "\n" not in line
        assert any(k in line for k in ("index (", "in-place write", "invalid gradient")), line
