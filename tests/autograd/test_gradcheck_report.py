"""gradcheck and check_formula report like a teacher: every input judged (exact, close or
wrong, the largest difference, the worst index), named, "yours" beside the "reference", the
absolute error where the reference is 0; and `autograd.gradcheck` is both the module and the
function."""
import importlib
import re

import numpy as np
import pytest

import autograd
import npformer.functional as F
from autograd import Function, GradcheckError, Tensor


def _attention_inputs():
    rng = np.random.default_rng(0)
    q, k, v, dO = (rng.standard_normal((1, 2, 3, 2)) for _ in range(4))
    return q, k, v, dO


def _attention_formula(q, k, v, dO, rowsum=True):
    """dq, dk, dv of softmax(q k^T / sqrt(hd)) v, on paper; rowsum=False forgets the
    softmax's row-sum term, which q and k receive and v does not."""
    scale = 1 / np.sqrt(q.shape[-1])
    S = q @ k.swapaxes(-1, -2) * scale
    P = np.exp(S - S.max(-1, keepdims=True))
    P /= P.sum(-1, keepdims=True)
    dP = dO @ v.swapaxes(-1, -2)
    dS = P * (dP - (P * dP).sum(-1, keepdims=True) if rowsum else dP)
    return [dS @ k * scale, dS.swapaxes(-1, -2) @ q * scale, P.swapaxes(-1, -2) @ dO]


def test_check_formula_judges_every_input_by_name_with_yours_and_the_reference():
    q, k, v, dO = _attention_inputs()
    assert autograd.gradcheck.check_formula(F.scaled_dot_product_attention, [q, k, v], dO,
                                            _attention_formula(q, k, v, dO), names=["q", "k", "v"])
    with pytest.raises(GradcheckError) as info:
        autograd.gradcheck.check_formula(F.scaled_dot_product_attention, [q, k, v], dO,
                                         _attention_formula(q, k, v, dO, rowsum=False), names=["q", "k", "v"])
    lines = str(info.value).splitlines()
    assert "your formula (yours)" in lines[0]
    verdicts = dict(re.match(r"\s*(.*?\)): (\w+)", line).groups() for line in lines[1:])
    assert verdicts == {"q (reference: the op's backward)": "wrong", "q (reference: finite differences)": "wrong",
                        "k (reference: the op's backward)": "wrong", "k (reference: finite differences)": "wrong",
                        "v (reference: the op's backward)": "close", "v (reference: finite differences)": "close"}
    wrong_q = next(line for line in lines if line.strip().startswith("q (reference: the op's backward)"))
    assert "worst at index (" in wrong_q and "yours " in wrong_q and "reference " in wrong_q
    assert "analytic" not in str(info.value) and "numeric" not in str(info.value)


def test_check_formula_names_a_formula_of_the_wrong_shape():
    q, k, v, dO = _attention_inputs()
    dq, dk, dv = _attention_formula(q, k, v, dO)
    with pytest.raises(GradcheckError, match=r"v: wrong: your formula has shape \(1, 2, 3\)"):
        autograd.gradcheck.check_formula(F.scaled_dot_product_attention, [q, k, v], dO, [dq, dk, dv[..., 0]],
                                         names=["q", "k", "v"])


class TwoWrong(Function):
    """y = a * b + c with the gradients of a and b swapped: a and b wrong, c right."""

    @staticmethod
    def forward(ctx, a, b, c):
        ctx.save_for_backward(a, b)
        return a * b + c

    @staticmethod
    def backward(ctx, dy):
        a, b = ctx.saved_tensors
        return dy * a, dy * b, dy


def test_gradcheck_judges_every_input_not_only_the_first_wrong_one():
    rng = np.random.default_rng(1)
    inputs = [Tensor(rng.standard_normal((2, 3)), requires_grad=True) for _ in range(3)]
    with pytest.raises(GradcheckError) as info:
        autograd.gradcheck(TwoWrong.apply, inputs, names=["a", "b", "c"])
    message = str(info.value)
    assert "your backward (yours) against central finite differences (reference)" in message
    assert "a: wrong" in message and "b: wrong" in message and "c: close" in message
    assert "random direction over all inputs: wrong" in message
    with pytest.raises(ValueError, match=r"names: one name per input expected \(3\), got 2"):
        autograd.gradcheck(TwoWrong.apply, inputs, names=["a", "b"])


class ZeroWrong(Function):
    """y = x^2 whose backward returns dy (instead of 2 x dy): at x = 0 the reference is 0."""

    @staticmethod
    def forward(ctx, x):
        return x * x

    @staticmethod
    def backward(ctx, dy):
        return dy


def test_a_zero_reference_gives_the_absolute_error_not_1e300():
    with pytest.raises(GradcheckError) as info:
        autograd.gradcheck(ZeroWrong.apply, [Tensor(np.zeros((2, 2)), requires_grad=True)], names=["x"])
    message = str(info.value)
    assert "x: wrong, max diff" in message and "reference 0 (the reference is 0 there)" in message
    assert "e+300" not in message and "inf" not in message


def test_autograd_gradcheck_is_the_module_and_calls_the_function():
    module = importlib.import_module("autograd.gradcheck")
    assert autograd.gradcheck is module and module.check_formula and module.gradcheck
    x = Tensor(np.random.default_rng(2).standard_normal(3), requires_grad=True)
    assert autograd.gradcheck(lambda a: a * a, [x]) is True
    assert module.gradcheck(lambda a: a * a, [x]) is True


def test_a_zero_tolerance_judges_without_dividing_by_zero():
    """check_formula(rtol=0) asks for the backward exactly: 0 / 0 would be a RuntimeWarning
    (an error in this suite) and a NaN verdict."""
    x, dy = np.random.default_rng(3).standard_normal((2, 3)), np.ones((2, 3))
    assert autograd.gradcheck.check_formula(lambda a: a * 2.0, [x], dy, [2 * dy], rtol=0.0)
    with pytest.raises(GradcheckError, match=r"input 0 \(reference: the op's backward\): wrong, .* beyond atol 0\n"):
        autograd.gradcheck.check_formula(lambda a: a * 2.0, [x], dy, [2 * dy + 1e-9], rtol=0.0)


class SquareWrongBackward(Function):
    """y = x^2 with a backward that forgets the 2 and a right jvp."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, dy):
        return dy * ctx.saved_tensors[0]

    @staticmethod
    def jvp(ctx, t):
        return 2.0 * t * ctx.saved_tensors[0]


class SquareWrongJvp(SquareWrongBackward):
    """y = x^2 with a right backward and a jvp that forgets the 2."""

    @staticmethod
    def backward(ctx, dy):
        return 2.0 * dy * ctx.saved_tensors[0]

    @staticmethod
    def jvp(ctx, t):
        return t * ctx.saved_tensors[0]


def _x(seed=4, shape=(2, 3)):
    return Tensor(np.random.default_rng(seed).standard_normal(shape), requires_grad=True)


def test_forward_mode_is_judged_on_its_own_when_the_backward_is_wrong():
    """A right jvp beside a wrong backward: the forward-mode section passes (the transpose identity
    is not judged against a backward that finite differences reject); forward mode alone
    (check_backward_ad=False, torch's name) passes; a wrong jvp fails its own section only."""
    with pytest.raises(GradcheckError) as info:
        autograd.gradcheck(SquareWrongBackward.apply, [_x()], names=["x"], check_forward_ad=True)
    message = str(info.value)
    assert "your backward (yours)" in message and "x: wrong" in message
    assert "your jvp rules" not in message          # was: the forward-mode verdict repeated the backward's failure
    assert autograd.gradcheck(SquareWrongBackward.apply, [_x()], check_forward_ad=True, check_backward_ad=False)
    with pytest.raises(GradcheckError) as info:
        autograd.gradcheck(SquareWrongJvp.apply, [_x()], names=["x"], check_forward_ad=True)
    message = str(info.value)
    assert "your backward (yours)" not in message
    assert "forward mode, output 0 along x: J u: wrong" in message and "worst at index (" in message
    assert "the transpose identity <g, J u> = <J^T g, u>: wrong" in message   # judged: the backward is right
    with pytest.raises(ValueError, match="leave nothing to check"):
        autograd.gradcheck(SquareWrongJvp.apply, [_x()], check_backward_ad=False)


class NaNBackward(SquareWrongJvp):
    """y = x^2 whose backward gives NaN at entry (1, 2) (an unstable formula)."""

    @staticmethod
    def backward(ctx, dy):
        result = 2.0 * dy * ctx.saved_tensors[0]
        result[1, 2] = np.nan
        return result


def test_a_nan_is_named_with_its_entry():
    report = []
    with pytest.raises(GradcheckError) as info:
        autograd.gradcheck(NaNBackward.apply, [_x()], names=["x"], report=report)
    line = next(line for line in str(info.value).splitlines() if line.strip().startswith("x:"))
    assert "x: wrong, max diff nan, yours has NaN at 1 entries (the first at index (1, 2))" in line
    assert "worst at index (1, 2): yours nan" in line and "(not finite)" in line
    assert np.isnan(report[0][1])      # the largest difference is NaN, not the largest finite one


def test_a_failure_at_a_kink_says_the_one_sided_slopes_differ():
    import npformer.functional as F

    x = Tensor(np.array([[0.0, 1.0, -0.5]]), requires_grad=True)
    with pytest.raises(GradcheckError) as info:
        autograd.gradcheck(F.relu, [x], names=["x"])
    line = next(line for line in str(info.value).splitlines() if line.strip().startswith("x:"))
    assert "worst at index (0, 0): yours 0, reference" in line
    assert re.search(r"a kink there: the one-sided slopes differ \(left 0, right -?\d", line)
    assert "the reference is their average" in line
    with pytest.raises(GradcheckError) as info:   # a smooth op's wrong backward has no such note
        autograd.gradcheck(SquareWrongBackward.apply, [_x()], names=["x"])
    assert "kink" not in str(info.value)


class WritesIntoUpstream(Function):
    """y = x^2 whose backward is right but multiplies into dy in place."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, dy):
        dy *= 2.0 * ctx.saved_tensors[0]
        return dy


def test_a_backward_that_writes_into_its_upstream_gradient_is_named_an_in_place_write():
    with pytest.raises(GradcheckError) as info:
        autograd.gradcheck(WritesIntoUpstream.apply, [_x()], names=["x"])
    message = str(info.value)
    assert "x: close" in message and "x: wrong" not in message   # was: wrong inputs, nothing said "in place"
    assert "in-place write: the backward of test_gradcheck_report.WritesIntoUpstream wrote into its upstream " \
           "gradient" in message
    # torch's columns and the create_graph check get the upstream gradient as drawn
    outs, upstream, grads = autograd.gradcheck.vjp(WritesIntoUpstream.apply, [_x()], written=(written := []))
    assert written == [0] and np.allclose(grads[0], 2.0 * _x().data * upstream[0])


class MemoryOrderSquare(Function):
    """y = x^2 whose backward reads dy in memory order: right for contiguous arrays only."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, dy):
        x, = ctx.saved_tensors
        return (2.0 * x.ravel() * dy.ravel(order="K")).reshape(x.shape)


def test_an_op_that_depends_on_memory_layout_fails_naming_the_input_and_entry():
    assert not autograd.gradcheck_diagnosis.strided(np.ones((2, 3))).flags["C_CONTIGUOUS"]
    with pytest.raises(GradcheckError) as info:
        autograd.gradcheck(MemoryOrderSquare.apply, [_x()], names=["x"])
    message = str(info.value)
    assert "x: close" in message     # contiguous arrays: right
    assert re.search(r"layout: the gradient of x with non-contiguous inputs and upstream gradients: wrong, max diff "
                     r"\S+, worst at index \(\d, \d\)", message)
    assert "the op depends on memory layout" in message
    assert autograd.gradcheck(SquareWrongJvp.apply, [_x()])      # a right backward passes the layout check


def test_a_forward_mode_failure_at_a_kink_says_so_too():
    import npformer.functional as F

    x = Tensor(np.array([[0.0, 1.0, -0.5]]), requires_grad=True)
    with pytest.raises(GradcheckError) as info:
        autograd.gradcheck(F.relu, [x], names=["x"], check_forward_ad=True, check_backward_ad=False)
    line = next(line for line in str(info.value).splitlines() if "J u: wrong" in line)
    assert "worst at index (0, 0)" in line and "a kink there: the one-sided slopes differ" in line
