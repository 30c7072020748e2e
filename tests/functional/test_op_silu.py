"""F.silu and nn.SiLU: the registry's cases (gradcheck, torch, composite twin on every device; second
derivatives: gradgradcheck, torch's double backward; forward mode), extreme inputs in float32 and
float64 (no overflow, no warning, torch's values), the backward as an op (SiLUBackward: its double
backward and jvp), a third derivative, and clear errors."""
import warnings

import numpy as np
import pytest

import autograd
from autograd import Tensor
import npformer.functional as F
from npformer import nn

from helpers import assert_clear_error, double_backward_tests, forward_mode_tests, leaf, op_tests

test_gradcheck, test_matches_torch, test_matches_composite_twin = op_tests("silu")
test_gradgradcheck, test_double_backward_matches_torch = double_backward_tests("silu")
test_forward_mode_gradcheck, test_jvp_matches_torch, test_forward_mode_in_float32 = forward_mode_tests("silu")

EXTREMES = [-3e38, -1e30, -1e4, -800.0, -100.0, -89.0, -40.0, -1.0, -1e-8, 0.0, 1e-8, 0.7, 40.0, 89.0, 100.0,
            800.0, 1e4, 1e30, 3e38]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_extreme_inputs_are_finite_without_warnings_and_match_torch(dtype, torch):
    """exp(-|x|) never overflows: silu and its gradient are finite for every finite x, with no
    numpy warning, and equal torch's (values relative to their magnitude, gradients 1 or 0 in the
    tails). (The composite twin, a test reference from primitives, makes no such promise.)"""
    x = np.array(EXTREMES, dtype=dtype)
    g = np.linspace(0.5, 1.5, len(x)).astype(dtype)
    xt = leaf(x, dtype=dtype)
    with warnings.catch_warnings(), np.errstate(over="raise", invalid="raise", divide="raise"):
        warnings.simplefilter("error")
        y = F.silu(xt)
        y.backward(g)
    tx = torch.tensor(x, requires_grad=True)
    ty = torch.nn.functional.silu(tx)
    ty.backward(torch.tensor(g))
    assert np.isfinite(y.numpy()).all() and np.isfinite(xt.grad.numpy()).all()
    assert y.dtype == xt.grad.dtype == dtype
    rtol = 1e-6 if dtype == np.float32 else 1e-14
    np.testing.assert_allclose(y.numpy(), ty.detach().numpy(), rtol=rtol, atol=1e-30)
    np.testing.assert_allclose(xt.grad.numpy(), tx.grad.numpy(), rtol=rtol, atol=1e-6 if dtype == np.float32 else 1e-14)


def test_nan_and_infinities_follow_torch(torch):
    x = np.array([np.nan, np.inf, -np.inf, 1.0])
    with np.errstate(invalid="ignore"):
        ours = F.silu(Tensor(x)).numpy()
    np.testing.assert_array_equal(ours, torch.nn.functional.silu(torch.tensor(x)).numpy())


def test_module_is_silu():
    x = np.random.default_rng(0).standard_normal((2, 3))
    np.testing.assert_array_equal(nn.SiLU()(Tensor(x)).numpy(), F.silu(Tensor(x)).numpy())


def test_third_derivative():
    """Every order works: SiLUBackward's own backward is differentiable. With s = sigmoid(x),
    silu''' = s (1 - s) (3 (1 - 2 s) + x (1 - 6 s + 6 s^2))."""
    x = leaf(np.linspace(-6.0, 6.0, 13))
    (d1,) = autograd.grad(F.silu(x).sum(), x, create_graph=True)
    (d2,) = autograd.grad(d1.sum(), x, create_graph=True)
    (d3,) = autograd.grad(d2.sum(), x)
    a = x.numpy()
    s = 1 / (1 + np.exp(-a))
    np.testing.assert_allclose(d1.numpy(), s * (1 + a * (1 - s)), rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(d2.numpy(), s * (1 - s) * (2 + a * (1 - 2 * s)), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(d3.numpy(), s * (1 - s) * (3 * (1 - 2 * s) + a * (1 - 6 * s + 6 * s * s)),
                               rtol=1e-11, atol=1e-14)


def test_backward_op_checks_in_both_modes(device):
    """SiLUBackward (dy, x) -> dy * silu'(x) on its own, every input moving: its backward (the
    double backward) and its jvp against finite differences, and gradgradcheck (its differentiable
    backward)."""
    from npformer.functional.silu import SiLUBackward, silu_forward
    rng = np.random.default_rng(3)
    dy, x = leaf(rng.standard_normal((4, 5)), device), leaf(3 * rng.standard_normal((4, 5)), device)

    def silu_backward(dy, x):
        xp = autograd.backend.get_array_module(x.data)
        return SiLUBackward.apply(dy, x, x_saved=x.data, s=silu_forward(xp, x.data)[1])

    assert autograd.gradcheck(silu_backward, [dy, x], check_forward_ad=True)
    assert autograd.gradgradcheck(silu_backward, [dy, x])


def test_a_create_graph_gradient_is_one_backward_node():
    from npformer.functional.silu import SiLUBackward
    x = leaf(np.random.default_rng(4).standard_normal((2, 3)))
    (dx,) = autograd.grad(F.silu(x), x, Tensor(np.ones((2, 3))), create_graph=True)
    assert type(dx.creator) is SiLUBackward


def test_forward_over_reverse_hvp_matches_reverse_over_reverse():
    from autograd.functional import hvp, vhp
    rng = np.random.default_rng(5)
    x, v, c = rng.standard_normal((3, 6)), rng.standard_normal((3, 6)), rng.standard_normal((3, 6))

    def loss(a):
        return (F.silu(a).tanh() * Tensor(c)).sum()

    forward = hvp(loss, Tensor(x), Tensor(v))[1].numpy()
    reverse = vhp(loss, Tensor(x), Tensor(v))[1].numpy()
    np.testing.assert_allclose(forward, reverse, rtol=1e-12, atol=1e-12 * np.abs(reverse).max())


def test_integer_input_raises_a_clear_error():
    assert_clear_error(lambda: F.silu(Tensor(np.zeros(3, dtype=np.int64))), TypeError, ["silu", "floating", "int64"])
    assert_clear_error(lambda: F.silu([1.0, 2.0]), TypeError, ["silu", "input", "list"])
