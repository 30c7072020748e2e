"""F.gelu and nn.GELU (exact and tanh): the registry's cases (gradcheck, torch, composite twin on
every device), their second derivatives (gradgradcheck, torch's double backward), a third derivative,
extreme inputs against torch, erf to float64 rounding, and clear errors."""
import math

import numpy as np
import pytest

import autograd
from autograd import Tensor
import npformer.functional as F
from npformer import nn

from helpers import assert_clear_error, compare_with_torch, double_backward_tests, forward_mode_tests, leaf, op_tests

test_gradcheck, test_matches_torch, test_matches_composite_twin = op_tests("gelu")
test_gradgradcheck, test_double_backward_matches_torch = double_backward_tests("gelu")
test_forward_mode_gradcheck, test_jvp_matches_torch, test_forward_mode_in_float32 = forward_mode_tests("gelu")


def test_erf_is_accurate_to_float64_rounding():
    from npformer.functional._erf import erf
    x = np.concatenate([np.linspace(-7, 7, 20001), [0.0, -0.0, 1e-300, 5.9999, 6.0, 40.0, np.inf, -np.inf]])
    expected = np.array([math.erf(v) for v in x])
    np.testing.assert_allclose(erf(x), expected, rtol=5e-16, atol=2e-16)
    assert np.isnan(erf(np.array([np.nan]))[0])
    assert erf(x.astype(np.float32)).dtype == np.float32


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_extreme_inputs_match_torch(approximate, torch):
    x = np.array([-40.0, -10.0, -6.0, -3.0, -1.0, -1e-8, 0.0, 0.7, 1.0, 2.5, 3.5, 6.0, 10.0, 40.0])
    compare_with_torch(torch, lambda a: F.gelu(a, approximate=approximate),
                       lambda a: torch.nn.functional.gelu(a, approximate=approximate), [x], np.random.default_rng(13))


def test_unknown_approximation_raises_a_clear_error():
    assert_clear_error(lambda: F.gelu(Tensor(np.zeros(3)), approximate="fast"), ValueError, ["approximate", "'fast'"])
    with pytest.raises(ValueError, match="approximate"):
        nn.GELU("erf")


def test_third_derivative_of_exact_gelu():
    """Every order works: the double backward is built from differentiable ops (NormalCDF's own
    backward is phi, written with exp). y''' = phi'(x) (2 - x^2) - 2 x phi(x) = x phi(x) (x^2 - 4)."""
    x = leaf(np.linspace(-3.0, 3.0, 13))
    (d1,) = autograd.grad(F.gelu(x).sum(), x, create_graph=True)
    (d2,) = autograd.grad(d1.sum(), x, create_graph=True)
    (d3,) = autograd.grad(d2.sum(), x)
    a = x.numpy()
    phi = np.exp(-a * a / 2) / np.sqrt(2 * np.pi)
    np.testing.assert_allclose(d2.numpy(), phi * (2 - a * a), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(d3.numpy(), a * phi * (a * a - 4), rtol=1e-12, atol=1e-15)


def test_normal_cdf_node_has_the_density_as_its_derivative_in_both_modes():
    """NormalCDF (Phi with the forward's values, for GELU's double backward): backward and jvp are phi(x)."""
    from autograd import forward_ad
    from npformer.functional.activation import NormalCDF
    a = np.linspace(-3.0, 3.0, 7)
    values = np.array([0.5 * (1 + math.erf(v / math.sqrt(2))) for v in a])
    phi = np.exp(-a * a / 2) / np.sqrt(2 * np.pi)
    x = leaf(a)
    NormalCDF.apply(x, values=values).backward(np.ones(7))
    np.testing.assert_allclose(x.grad.numpy(), phi, rtol=1e-15)
    with forward_ad.dual_level():
        y = NormalCDF.apply(forward_ad.make_dual(Tensor(a), Tensor(np.ones(7))), values=values)
        np.testing.assert_allclose(np.asarray(forward_ad.unpack_dual(y).tangent), phi, rtol=1e-15)
