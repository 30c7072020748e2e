"""F.gelu and nn.GELU (exact and tanh): the registry's cases (gradcheck, torch, composite twin on
every device), their second derivatives (gradgradcheck, torch's double backward), a third derivative,
extreme inputs against torch, erf to float64 rounding, and clear errors."""
import math

import numpy as np
import pytest

import autograd
from autograd import Tensor, backend
import npformer.functional as F
from npformer import nn

from helpers import assert_clear_error, compare_with_torch, double_backward_tests, forward_mode_tests, leaf, op_tests

test_gradcheck, test_matches_torch, test_matches_composite_twin = op_tests("gelu")
test_gradgradcheck, test_double_backward_matches_torch = double_backward_tests("gelu")
test_forward_mode_gradcheck, test_jvp_matches_torch, test_forward_mode_in_float32 = forward_mode_tests("gelu")


def test_erf_is_accurate_to_float64_rounding():
    from npformer.functional.activation import erf
    x = np.concatenate([np.linspace(-7, 7, 20001), [0.0, -0.0, 1e-300, 5.9999, 6.0, 40.0, np.inf, -np.inf]])
    expected = np.array([math.erf(v) for v in x])
    np.testing.assert_allclose(erf(np, x), expected, rtol=5e-16, atol=2e-16)
    assert np.isnan(erf(np, np.array([np.nan]))[0])
    assert erf(np, x.astype(np.float32)).dtype == np.float32


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
    """Every order works: GELUBackward's own backward is differentiable (gelu'' on Tensors, phi
    written with exp). y''' = phi'(x) (2 - x^2) - 2 x phi(x) = x phi(x) (x^2 - 4)."""
    x = leaf(np.linspace(-3.0, 3.0, 13))
    (d1,) = autograd.grad(F.gelu(x).sum(), x, create_graph=True)
    (d2,) = autograd.grad(d1.sum(), x, create_graph=True)
    (d3,) = autograd.grad(d2.sum(), x)
    a = x.numpy()
    phi = np.exp(-a * a / 2) / np.sqrt(2 * np.pi)
    np.testing.assert_allclose(d2.numpy(), phi * (2 - a * a), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(d3.numpy(), a * phi * (a * a - 4), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_backward_op_checks_in_both_modes(approximate):
    """GELUBackward (dy, x) -> dy * gelu'(x) on its own, every input moving: its backward (the
    double backward) and its jvp against finite differences, and the transpose identity between them."""
    from npformer.functional.activation import GELUBackward, bias_activation_forward
    kind = "gelu_tanh" if approximate == "tanh" else "gelu"
    rng = np.random.default_rng(3)
    dy, x = leaf(rng.standard_normal((4, 5))), leaf(3 * rng.standard_normal((4, 5)))

    def gelu_backward(dy, x):
        return GELUBackward.apply(dy, x, saved=bias_activation_forward(np, x.numpy(), None, kind)[1], kind=kind)

    assert autograd.gradcheck(gelu_backward, [dy, x], check_forward_ad=True)


def test_forward_over_reverse_hvp_through_gelu_matches_reverse_over_reverse():
    from autograd.functional import hvp, vhp
    rng = np.random.default_rng(4)
    x, v = rng.standard_normal((3, 6)), rng.standard_normal((3, 6))
    for approximate in ("none", "tanh"):
        def loss(a):
            return (F.linear(a, Tensor(w), activation="gelu" if approximate == "none" else "gelu_tanh")
                    * F.gelu(a, approximate=approximate)).sum()
        w = rng.standard_normal((6, 6))
        forward = hvp(loss, Tensor(x), Tensor(v))[1].numpy()
        reverse = vhp(loss, Tensor(x), Tensor(v))[1].numpy()
        np.testing.assert_allclose(forward, reverse, rtol=1e-12, atol=1e-12 * np.abs(reverse).max())


@pytest.mark.parametrize("fused", [True, False])
def test_forward_over_reverse_forms_the_density_once(fused, monkeypatch):
    """An HVP forward over reverse through the exact GELU (linear's epilogue, or F.gelu) forms
    phi(h) = exp(-h^2 / 2) / sqrt(2 pi) once, in the forward's jvp: the GELU backward of the
    differentiable backward and that backward's tangent take the same array (no kernel forms it
    again), and the products are reverse over reverse's."""
    from autograd.functional import hvp, vhp
    from npformer.functional import activation
    formed, given = [], []
    for name in ("gelu_backward_density", "gelu_backward_jvp", "bias_activation_backward"):
        def spy(*args, table=getattr(activation, name), name=name):
            density = args[-1] if name != "bias_activation_backward" and len(args) in (5, 8) else None
            (given if density is not None else formed).append((name, density))
            return table(*args)
        monkeypatch.setattr(activation, name, spy)
    rng = np.random.default_rng(5)
    x, w, v = rng.standard_normal((3, 4)), rng.standard_normal((6, 4)), rng.standard_normal((3, 4))

    def loss(a):
        y = F.linear(a, Tensor(w), activation="gelu") if fused else F.gelu(F.linear(a, Tensor(w)))
        return (y * y).sum()

    forward = hvp(loss, Tensor(x), Tensor(v))[1].numpy()
    assert [name for name, _ in formed] == ["gelu_backward_density"]   # the forward's jvp: t_y = gelu'(h) t_h
    assert [name for name, _ in given] == ["gelu_backward_density", "gelu_backward_jvp"]
    density = activation.normal_density(x @ w.T)
    for _, array in given:
        np.testing.assert_array_equal(array, density)
    reverse = vhp(loss, Tensor(x), Tensor(v))[1].numpy()
    np.testing.assert_allclose(forward, reverse, rtol=1e-12, atol=1e-12 * np.abs(reverse).max())


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
def test_third_derivative_through_fused_linear_matches_torch(activation, torch):
    """F.linear's fused GELU, differentiated three times (GELUBackward's differentiable backward),
    against torch, float64: d/dx <d/dx <d/dx <f(x), g>, u>, w>."""
    rng = np.random.default_rng(8)
    x, weight, g, u, w = (rng.standard_normal(s) for s in [(3, 4), (5, 4), (3, 5), (3, 4), (3, 4)])
    approximate = "tanh" if activation == "gelu_tanh" else "none"

    def third(library):
        if library is None:
            xs = leaf(x)
            y = F.linear(xs, Tensor(weight), activation=activation)
            wrap, grad = Tensor, autograd.grad
        else:
            xs = library.tensor(x, requires_grad=True)
            y = library.nn.functional.gelu(xs @ library.tensor(weight).T, approximate=approximate)
            wrap, grad = library.tensor, library.autograd.grad
        (d1,) = grad(y, xs, wrap(g), create_graph=True)
        (d2,) = grad(d1, xs, wrap(u), create_graph=True)
        (d3,) = grad(d2, xs, wrap(w))
        return np.asarray(d3.detach().numpy() if library is not None else d3.numpy())

    theirs = third(torch)
    np.testing.assert_allclose(third(None), theirs, rtol=0, atol=1e-12 * max(1.0, np.abs(theirs).max()))


# float32's largest and smallest magnitudes (subnormal 1e-40 too), and float64's beside them
EXTREMES = {"float32": [3.4e38, 1.75e38, 1e20, 1e13, 1e10, 50.0, 6.0, 1.0, 1e-8, 1e-30, 1e-40, 0.0],
            "float64": [1.7e308, 1e200, 3.4e38, 1e20, 1e13, 50.0, 6.0, 1.0, 1e-8, 1e-200, 1e-310, 0.0]}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("bias", [False, True], ids=["gelu", "linear's epilogue"])
def test_tanh_gelu_stays_finite_at_the_largest_inputs_as_torchs(dtype, bias, device, torch):
    """Issue 46, item 4: y = 0.5 x (1 + tanh(u)) was 0.5 * (x (1 + t)), inf for float32 x >= 1.75e38.
    The value matches torch's everywhere; the derivatives are finite where torch's are NaN (its
    du/dx = c (1 + 3 k x^2) overflows beside 1 - t^2 = 0) and there take their limits: gelu' is 1
    (x > 0) or 0, gelu'' is 0. Its backward, double backward, jvp and the jvp of the backward
    (forward over reverse) alike, on every device (the reference, the CPU's and CUDA's kernels);
    no overflow warning (RuntimeWarnings are errors here)."""
    magnitudes = np.array(EXTREMES[dtype])
    x0 = np.concatenate([-magnitudes, magnitudes]).astype(dtype)
    tx = torch.tensor(x0, requires_grad=True)
    ty = torch.nn.functional.gelu(tx, approximate="tanh")
    (tg,) = torch.autograd.grad(ty.sum(), tx, create_graph=True)
    (tgg,) = torch.autograd.grad(tg.sum(), tx)
    ty, tg, tgg = (t.detach().numpy() for t in (ty, tg, tgg))

    def gelu(a):
        if not bias:
            return F.gelu(a, approximate="tanh")
        return F.linear(a.reshape(-1, 1), Tensor(np.ones((1, 1), dtype), device=device),
                        Tensor(np.zeros(1, dtype), device=device),
                        activation="gelu_tanh").reshape(-1)

    x = Tensor(x0.copy(), requires_grad=True, device=device)
    y = gelu(x)
    ones = Tensor(np.ones_like(x0), device=device)  # (a sum of y would overflow)
    (g,) = autograd.grad(y, x, ones, create_graph=True)
    (gg,) = autograd.grad(g, x, ones)
    with autograd.forward_ad.dual_level():  # forward mode: t_y = gelu'(x) u, and forward over reverse
        dual = autograd.forward_ad.make_dual(Tensor(x0.copy(), requires_grad=True, device=device), ones.data)
        ty_dual = gelu(dual)
        (g_dual,) = autograd.grad(ty_dual, dual, ones)
        jvp = autograd.forward_ad.unpack_dual(ty_dual).tangent.numpy()
        jvp_of_gradient = autograd.forward_ad.unpack_dual(g_dual).tangent.numpy()
    limit_g, limit_gg = np.where(x0 > 0, 1.0, 0.0), np.zeros_like(x0)
    rtol = 1e-6 if dtype == "float32" else 1e-14
    for name, ours, theirs, limit in [("y", y.numpy(), ty, None), ("gelu'", g.numpy(), tg, limit_g),
                                      ("gelu''", gg.numpy(), tgg, limit_gg), ("jvp", jvp, tg, limit_g),
                                      ("jvp of the gradient", jvp_of_gradient, tgg, limit_gg)]:
        assert ours.dtype == dtype and np.isfinite(ours).all(), (name, x0[~np.isfinite(ours)])
        expected = np.where(np.isfinite(theirs), theirs, limit if limit is not None else theirs)
        np.testing.assert_allclose(ours, expected, rtol=rtol, atol=1e-30 if name == "y" else rtol,  # derivatives: at most about 1
                                   err_msg=name)
