"""gradcheck's and gradgradcheck's torch arguments (issue 45, item 7), each against
torch.autograd.gradcheck / gradgradcheck on the same small float64 functions: a bare Tensor as
inputs, raise_exception, fast_mode, check_undefined_grad, check_batched_grad, nondet_tol;
gradgradcheck's check_fwd_over_rev, check_rev_over_rev, gen_non_contig_grad_outputs,
raise_exception, fast_mode. Bad arguments get clear errors."""
import numpy as np
import pytest

import autograd
from autograd import Function, GradcheckError, Tensor, gradgradcheck

from helpers import assert_clear_error

X = np.array([[0.3, -1.2, 0.8], [1.5, 0.1, -0.4]])


def inputs(torch):
    return Tensor(X.copy(), requires_grad=True), torch.tensor(X.copy(), requires_grad=True)


def cube_sum(x):
    return (x * x * x).sum(-1)


def test_a_bare_tensor_is_one_input_as_torch(torch):
    x, tx = inputs(torch)
    assert autograd.gradcheck(cube_sum, x) is True and torch.autograd.gradcheck(cube_sum, tx) is True
    assert autograd.gradgradcheck(cube_sum, x) is True and torch.autograd.gradgradcheck(cube_sum, tx) is True
    assert autograd.gradcheck(cube_sum, (x,)) is True


def wrong_square(torch=None):
    """x ** 2 with the gradient 3 x (wrong): ours, or torch's twin (the same class on torch's base)."""
    base = Function if torch is None else torch.autograd.Function

    class WrongSquare(base):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            return grad * 3 * x
    return WrongSquare.apply


@pytest.mark.parametrize("fast_mode", [False, True])
def test_raise_exception_false_returns_false_and_fast_mode_is_accepted_as_torch(fast_mode, torch):
    x, tx = inputs(torch)
    assert autograd.gradcheck(wrong_square(), x, raise_exception=False, fast_mode=fast_mode) is False
    assert torch.autograd.gradcheck(wrong_square(torch), tx, raise_exception=False, fast_mode=fast_mode) is False
    with pytest.raises(GradcheckError, match="input 0: wrong"):
        autograd.gradcheck(wrong_square(), x, fast_mode=fast_mode)
    with pytest.raises(RuntimeError):   # (torch's GradcheckError)
        torch.autograd.gradcheck(wrong_square(torch), tx, fast_mode=fast_mode)
    assert autograd.gradcheck(cube_sum, x, fast_mode=fast_mode) is True
    assert torch.autograd.gradcheck(cube_sum, tx, fast_mode=fast_mode) is True


def test_raise_exception_false_leaves_other_errors_raised():
    assert_clear_error(lambda: autograd.gradcheck(cube_sum, Tensor(X.astype(np.float32), requires_grad=True),
                                                  raise_exception=False), TypeError, ["float64"])


def refuses_zero_gradients():
    """2 x, whose backward raises on an all-zero upstream gradient (as one dividing by it would).
    (torch's gradcheck runs every backward on zeros too, whatever check_undefined_grad says.)"""
    class RefusesZeroGradients(Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            if not bool((grad != 0).any()):
                raise RuntimeError("cannot handle a zero gradient")
            return grad * 2
    return RefusesZeroGradients.apply


def test_check_undefined_grad_runs_the_backward_on_zero_gradients():
    x = Tensor(X.copy(), requires_grad=True)
    assert autograd.gradcheck(refuses_zero_gradients(), x, raise_exception=False) is False   # default True, as torch
    assert autograd.gradcheck(refuses_zero_gradients(), x, check_undefined_grad=False) is True
    with pytest.raises(GradcheckError, match="undefined output gradients.*cannot handle a zero gradient"):
        autograd.gradcheck(refuses_zero_gradients(), x)


def test_check_undefined_grad_names_a_nonzero_gradient_from_zero_upstream():
    class Offset(Function):  # right for every nonzero upstream gradient, wrong for zeros
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * 2 + (0.5 if not bool((grad != 0).any()) else 0.0)

    x = Tensor(X.copy(), requires_grad=True)
    with pytest.raises(GradcheckError, match="input 0: undefined output gradients.*nonzero gradient"):
        autograd.gradcheck(Offset.apply, x)


def test_check_batched_grad_as_torch(torch):
    x, tx = inputs(torch)
    assert autograd.gradcheck(cube_sum, x, check_batched_grad=True) is True
    assert torch.autograd.gradcheck(cube_sum, tx, check_batched_grad=True) is True

    class DriftsWhenRunAgain(Function):  # right the first time its node runs backward, then wrong
        @staticmethod
        def forward(ctx, x):
            ctx.calls = 0
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            ctx.calls += 1
            return grad * 2 * ctx.calls

    assert autograd.gradcheck(DriftsWhenRunAgain.apply, x) is True   # off by default, as torch's
    with pytest.raises(GradcheckError, match=r"batched gradient 1 \(check_batched_grad\)"):
        autograd.gradcheck(DriftsWhenRunAgain.apply, x, check_batched_grad=True)


def noisy_double(torch=None):
    """2 x, whose backward adds noise of 1e-12 (a nondeterministic reduction order, say)."""
    rng = np.random.default_rng(5)

    def backward(ctx, grad):
        noise = 1 + rng.standard_normal(tuple(grad.shape)) * 1e-12
        return grad * 2 * (noise if torch is None else torch.tensor(noise))
    base = Function if torch is None else torch.autograd.Function
    return type("NoisyDouble", (base,), {"forward": staticmethod(lambda ctx, x: x * 2),
                                         "backward": staticmethod(backward)}).apply


def test_nondet_tol_as_torch(torch):
    x, tx = inputs(torch)
    assert autograd.gradcheck(noisy_double(), x, raise_exception=False) is False
    assert torch.autograd.gradcheck(noisy_double(torch), tx, raise_exception=False) is False
    assert autograd.gradcheck(noisy_double(), x, nondet_tol=1e-9) is True
    assert torch.autograd.gradcheck(noisy_double(torch), tx, nondet_tol=1e-9) is True
    with pytest.raises(GradcheckError, match="not reentrant"):
        autograd.gradcheck(noisy_double(), x)


def test_bad_torch_options_are_clear_errors():
    x = Tensor(X.copy(), requires_grad=True)
    assert_clear_error(lambda: autograd.gradcheck(cube_sum, x, check_sparse_nnz=True), TypeError,
                       ["gradcheck()", "'check_sparse_nnz'", "fast_mode", "nondet_tol"])
    assert_clear_error(lambda: autograd.gradcheck(cube_sum, x, fast_mode="yes"), TypeError, ["fast_mode", "bool", "str"])
    assert_clear_error(lambda: autograd.gradcheck(cube_sum, x, nondet_tol=-1.0), ValueError, ["nondet_tol", ">= 0"])
    assert_clear_error(lambda: gradgradcheck(cube_sum, x, check_fwd_over_rev=1), TypeError,
                       ["gradgradcheck", "check_fwd_over_rev", "bool"])
    assert_clear_error(lambda: gradgradcheck(cube_sum, x, check_rev_over_rev=False), ValueError,
                       ["gradgradcheck", "leave nothing to check"])
    assert_clear_error(lambda: gradgradcheck(cube_sum, x, masked=True), TypeError, ["gradgradcheck()", "'masked'"])


# -- gradgradcheck ------------------------------------------------------------------------------------------
def tanh_mix(x):
    return (x.tanh() * x).sum(0)


@pytest.mark.parametrize("kwargs", [{"check_fwd_over_rev": True},
                                    {"check_fwd_over_rev": True, "check_rev_over_rev": False, "check_undefined_grad": False},
                                    {"gen_non_contig_grad_outputs": True}, {"fast_mode": True}])
def test_gradgradcheck_arguments_as_torch(kwargs, torch):
    x, tx = inputs(torch)
    assert gradgradcheck(tanh_mix, x, **kwargs) is True
    assert torch.autograd.gradgradcheck(tanh_mix, tx, **kwargs) is True


def test_gradgradcheck_raise_exception_false_on_a_wrong_double_backward_as_torch(torch):
    class SquareWrongTwice(Function):   # x ** 2: right backward, its derivative built on a detached x (wrong)
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            return 2 * x * grad

        @staticmethod
        def differentiable_backward(ctx, grad):
            return grad * Tensor(2 * ctx.inputs[0].data)

    class TorchSquareWrongTwice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            return grad * 2 * x.detach()

    x, tx = inputs(torch)
    assert gradgradcheck(SquareWrongTwice.apply, x, raise_exception=False) is False
    assert torch.autograd.gradgradcheck(TorchSquareWrongTwice.apply, tx, raise_exception=False) is False
    assert autograd.gradcheck(SquareWrongTwice.apply, x) is True
    with pytest.raises(GradcheckError, match="input 0: wrong"):
        gradgradcheck(SquareWrongTwice.apply, x)
