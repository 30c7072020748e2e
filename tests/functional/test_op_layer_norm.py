"""F.layer_norm and nn.LayerNorm: the registry's cases (normalized shapes of one and two axes,
optional affine, eps, module options: gradcheck, torch, composite twin on every device; second
derivatives: gradgradcheck, torch's double backward),
accuracy at mean 1e4 and std 1e-2 (against torch and 80-bit arithmetic), property-based tests,
clear errors; the backward as an op (LayerNormBackward: its double backward and jvp on their own,
a third derivative against torch, forward over reverse against reverse over reverse, float32)."""
import math

import numpy as np
import pytest
from hypothesis import given, strategies as st

import autograd
from autograd import Tensor
import npformer.functional as F
from npformer import nn

from helpers import (
    DTYPES, HYPOTHESIS, assert_clear_error, compare_with_torch, double_backward_tests, forward_mode_tests, leaf, op_tests,
    tolerance)
from npformer.functional.layer_norm import LayerNormBackward, layer_norm_forward
from npformer.opcases import TOLERANCE, compare
from tolerances import rounding_tolerance

test_gradcheck, test_matches_torch, test_matches_composite_twin = op_tests("layer_norm")
test_gradgradcheck, test_double_backward_matches_torch = double_backward_tests("layer_norm")
test_forward_mode_gradcheck, test_jvp_matches_torch, test_forward_mode_in_float32 = forward_mode_tests("layer_norm")


def test_layer_norm_mean_1e4_std_1e2_matches_torch(torch, device):
    """Two-pass variance (E[x^2] - E[x]^2 would lose every digit here) plus a refined mean.
    With rstd ~ 100 the gradients are ~ 500 and float64 rounding of x alone allows ~1e-10
    relative error; torch itself is ~2e-8 off in dx (checked against 80-bit arithmetic below).
    The rounding of x is amplified by rstd = 1 / std = 100, on top of the inputs' magnitudes."""
    rng = np.random.default_rng(3)
    x = 1e4 + 1e-2 * rng.standard_normal((4, 16))
    weight, bias = 1 + rng.standard_normal(16), rng.standard_normal(16)
    compare_with_torch(torch, lambda a, w, b: F.layer_norm(a, 16, w, b),
                       lambda a, w, b: torch.nn.functional.layer_norm(a, (16,), w, b),
                       [x, weight, bias], np.random.default_rng(0), atol=rounding_tolerance(np.float64, 1e2, terms=16),
                       rtol=1e-9, device=device)
    # float32 (where torch's own kernel is ~0.1 off here): against torch in float64 on the same data
    x32, g32 = x.astype(np.float32), rng.standard_normal((4, 16)).astype(np.float32)
    xt, tx = leaf(x32, device, np.float32), torch.tensor(x32.astype(np.float64), requires_grad=True)
    y, ty = F.layer_norm(xt, 16), torch.nn.functional.layer_norm(tx, (16,))
    y.backward(autograd.backend.to_device(g32, device))
    ty.backward(torch.tensor(g32.astype(np.float64)))
    np.testing.assert_allclose(y.numpy(), ty.detach().numpy(), atol=rounding_tolerance(np.float32, terms=16))
    np.testing.assert_allclose(xt.grad.numpy(), tx.grad.numpy(), atol=1e-4 * np.abs(tx.grad.numpy()).max())


@pytest.mark.skipif(np.finfo(np.longdouble).eps > 1e-17, reason="needs 80-bit long double as the reference")
def test_layer_norm_mean_1e4_std_1e2_is_accurate_to_float64_rounding(device):
    rng = np.random.default_rng(3)
    x, weight, g = 1e4 + 1e-2 * rng.standard_normal((4, 16)), 1 + rng.standard_normal(16), rng.standard_normal((4, 16))
    xl, wl, gl = (a.astype(np.longdouble) for a in (x, weight, g))
    centered = xl - xl.mean(axis=1, keepdims=True)
    rstd = 1 / np.sqrt((centered * centered).mean(axis=1, keepdims=True) + np.longdouble(1e-5))
    xhat, gh = centered * rstd, gl * wl
    dx = rstd * (gh - gh.mean(axis=1, keepdims=True) - xhat * (gh * xhat).mean(axis=1, keepdims=True))
    xt = leaf(x, device)
    y = F.layer_norm(xt, 16, Tensor(weight, device=device))
    y.backward(autograd.backend.to_device(g, device))
    np.testing.assert_allclose(y.numpy(), (xhat * wl).astype(np.float64), atol=1e-14)
    np.testing.assert_allclose(xt.grad.numpy(), dx.astype(np.float64), atol=1e-8, rtol=1e-11)


@HYPOTHESIS
@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=3), trailing=st.integers(1, 2),
       affine=st.sampled_from(["none", "weight", "both"]), offset=st.sampled_from([0.0, 10.0, -1e3]),
       spread=st.sampled_from([1e-2, 1.0, 30.0]), dtype=DTYPES, seed=st.integers(0, 2**31))
def test_layer_norm_properties(shape, trailing, affine, offset, spread, dtype, seed, torch):
    rng = np.random.default_rng(seed)
    trailing = min(trailing, len(shape))
    norm_shape = tuple(shape[-trailing:])
    x = offset + spread * rng.standard_normal(shape)
    params = [1 + rng.standard_normal(norm_shape), rng.standard_normal(norm_shape)][:{"none": 0, "weight": 1, "both": 2}[affine]]
    fn = lambda a, *p: F.layer_norm(a, norm_shape, *p)   # noqa: E731
    # |mean| >> std: the rounding of x itself is amplified by rstd (up to 1e5 here), and torch's
    # float32 kernel loses more than ours: float32 is compared with torch in float64
    tol = tolerance(dtype) if dtype == np.float64 else {"atol": 1e-4, "rtol": 1e-3}
    if offset and spread < 1:
        tol = {"atol": 1e-7, "rtol": 1e-8} if dtype == np.float64 else {"atol": 2e-2, "rtol": 1e-2}
    compare_with_torch(torch, fn, lambda a, *p: torch.nn.functional.layer_norm(a, norm_shape, *p),
                       [x] + params, rng, dtype=dtype, torch_dtype=np.float64, **tol)
    if dtype == np.float64 and spread >= 1:
        assert autograd.gradcheck(fn, [leaf(a) for a in [x] + params], check_forward_ad=True)


def test_layer_norm_module_errors():
    with pytest.raises(ValueError, match=r"trailing dimensions must be \(4,\)"):
        nn.LayerNorm(4)(Tensor(np.zeros((2, 5))))
    with pytest.raises(ValueError, match="eps"):
        nn.LayerNorm(4, eps=0)


@pytest.mark.parametrize("call, error, words", [
    (lambda: F.layer_norm(Tensor(np.zeros((2, 3))), (4,)), ValueError, ["normalized_shape", "(4,)", "(2, 3)"]),
    (lambda: F.layer_norm(Tensor(np.zeros((2, 3))), 3, Tensor(np.zeros(4))), ValueError, ["weight", "(3,)", "(4,)"]),
])
def test_bad_input_raises_a_clear_error(call, error, words):
    assert_clear_error(call, error, words)


# x's shape, normalized_shape, with a weight, with a bias
VARIANTS = {
    "affine": ((3, 5), (5,), True, True),
    "two normalized dims, weight only": ((2, 3, 4), (3, 4), True, False),
    "no affine": ((3, 5), (5,), False, False),
    "bias only": ((3, 5), (5,), False, True),
}


def variant_arrays(rng, variant):
    """x (mean 1.5, std 2: rstd is not 1) and the variant's weight and bias (None where absent)."""
    shape, normalized, with_weight, with_bias = VARIANTS[variant]
    return (1.5 + 2 * rng.standard_normal(shape), 1 + rng.standard_normal(normalized) if with_weight else None,
            rng.standard_normal(normalized) if with_bias else None)


# which of (dx, dweight, dbias) the op forms: a variant's, or one where x is a constant
BACKWARD_OP_CASES = {variant: (variant, (True, VARIANTS[variant][2], VARIANTS[variant][3])) for variant in VARIANTS}
BACKWARD_OP_CASES["x constant"] = ("affine", (False, True, True))


@pytest.mark.parametrize("name", list(BACKWARD_OP_CASES))
def test_backward_op_gradcheck_checks_its_double_backward_and_jvp(name, device):
    """LayerNormBackward on its own, (dy, x, weight) -> the formed ones of (dx, dweight, dbias), in
    float64 with every input moving: its backward (the double backward) and its jvp against central
    differences, and the two against each other (<g, J u> = <J^T g, u>); its differentiable_backward
    (the way to layer norm's third derivative): the same values as its backward, and gradgradcheck.
    xhat and rstd, constants of the op, are formed from x at each evaluation, as layer norm's
    forward does."""
    variant, needs = BACKWARD_OP_CASES[name]
    x, weight, _ = variant_arrays(np.random.default_rng(31), variant)
    normalized, x_moves, eps = VARIANTS[variant][1], needs[0], 1e-3
    dy = leaf(np.random.default_rng(32).standard_normal(x.shape), device)
    inputs = [dy] + ([leaf(x, device)] if x_moves else []) + ([leaf(weight, device)] if weight is not None else [])
    constant_x = autograd.backend.to_device(x, device)

    def backward_op(dy, *rest):   # (dy, x, weight), x and weight where they move
        x_tensor = rest[0] if x_moves else None
        x_array = x_tensor.data if x_moves else constant_x
        xp = autograd.backend.get_array_module(x_array)
        _, xhat, rstd = layer_norm_forward(xp, x_array.reshape(-1, math.prod(normalized)), None, None, eps)
        return LayerNormBackward.apply(dy, x_tensor, rest[-1] if weight is not None else None, xhat=xhat, rstd=rstd,
                                       normalized_shape=normalized, eps=eps, needs=needs)

    assert autograd.gradcheck(backward_op, inputs, check_forward_ad=True)
    upstream = [Tensor(np.random.default_rng(35).standard_normal(o.shape), device=device) for o in backward_op(*inputs)]
    raw, composed = ([None if g is None else g.numpy() for g in autograd.grad(
        backward_op(*inputs), inputs, upstream, create_graph=graph, allow_unused=True)] for graph in (False, True))
    assert [g is None for g in composed] == [g is None for g in raw]   # x constant: no weight gradient
    comparison = compare([g for g in composed if g is not None], [g for g in raw if g is not None],
                         [f"gradient of input {i}" for i, g in enumerate(raw) if g is not None], 1e-12)
    assert comparison.passed, comparison
    assert autograd.gradgradcheck(backward_op, inputs)


def test_a_create_graph_gradient_is_one_backward_node():
    x, weight, bias = (leaf(a) for a in variant_arrays(np.random.default_rng(33), "affine"))
    grads = autograd.grad(F.layer_norm(x, 5, weight, bias), [x, weight, bias], Tensor(np.ones(x.shape)),
                          create_graph=True)
    assert {type(g.creator) for g in grads} == {LayerNormBackward}
    assert len({id(g.creator) for g in grads}) == 1


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_third_derivative_matches_torch_written_with_primitives(variant, torch):
    """Every order works: the double backward's differentiable_backward is built from
    differentiable ops. The reference is layer norm written with torch's primitives: the third
    derivative of torch's own layer_norm differs in x (by ~1 here, torch 2.13), while that of its
    primitives agrees with ours. Each derivative is contracted with random directions."""
    rng = np.random.default_rng(14)
    arrays = [a for a in variant_arrays(rng, variant) if a is not None]
    normalized, with_weight, with_bias = VARIANTS[variant][1:]
    g = rng.standard_normal(arrays[0].shape)
    u, v = ([rng.standard_normal(a.shape) for a in arrays] for _ in range(2))

    def split(xs):   # (x, weight or None, bias or None)
        return xs[0], xs[1] if with_weight else None, xs[-1] if with_bias else None

    def third(fn, make, grad):   # d/dx <d/dx <d/dx <fn, g>, u>, v>; the bias enters linearly: None is 0
        xs = [make(a) for a in arrays]
        first = grad([fn(*split(xs))], xs, [make(g, False)], create_graph=True)
        second = grad([sum((d * make(w, False)).sum() for d, w in zip(first, u))], xs, create_graph=True,
                      allow_unused=True)
        third = grad([sum((d * make(w, False)).sum() for d, w in zip(second, v) if d is not None)], xs,
                     allow_unused=True)
        return [np.zeros(a.shape) if d is None else d.detach().numpy() for d, a in zip(third, arrays)]

    def torch_layer_norm(x, w, b):
        axes = tuple(range(-len(normalized), 0))
        centered = x - x.mean(axes, keepdim=True)
        y = centered / ((centered * centered).mean(axes, keepdim=True) + 1e-5).sqrt()
        return (y if w is None else y * w) + (0 if b is None else b)

    ours = third(lambda x, w, b: F.layer_norm(x, normalized, w, b), lambda a, grad=True: Tensor(a, requires_grad=grad),
                 autograd.grad)
    theirs = third(torch_layer_norm, lambda a, grad=True: torch.tensor(a, requires_grad=grad), torch.autograd.grad)
    comparison = compare(ours, theirs, [f"d/d input {i}" for i in range(len(arrays))], 1e-12)
    assert comparison.passed, comparison


def layer_norm_hvps(variant, moving, dtype, device="cpu"):
    """H v of f = sum(tanh(layer_norm(x, w, b)) * c) over the `moving` inputs of the variant (the
    others constants), forward over reverse (autograd.functional.hvp) and reverse over reverse (vhp):
    tanh gives the backward an upstream gradient that moves with x, so every tangent is used."""
    rng = np.random.default_rng(34)
    arrays = variant_arrays(rng, variant)
    normalized = VARIANTS[variant][1]
    c = Tensor(rng.standard_normal(arrays[0].shape).astype(dtype), device=device)
    moved = [i for i in moving if arrays[i] is not None]
    tensors = [None if a is None else Tensor(a.astype(dtype), device=device) for a in arrays]
    directions = tuple(Tensor(rng.standard_normal(arrays[i].shape).astype(dtype), device=device) for i in moved)

    def f(*xs):
        args = list(tensors)
        for i, t in zip(moved, xs):
            args[i] = t
        return (F.layer_norm(args[0], normalized, *args[1:]).tanh() * c).sum()

    inputs = tuple(tensors[i] for i in moved)
    return [[p.numpy() for p in product(f, inputs, directions)[1]]
            for product in (autograd.functional.hvp, autograd.functional.vhp)]


# (variant, the moving inputs: 0 x, 1 weight, 2 bias), x constant where the variant has a parameter
HVP_CASES = [(variant, (0, 1, 2)) for variant in VARIANTS] + [
    (variant, (1, 2)) for variant, (_, _, with_weight, with_bias) in VARIANTS.items() if with_weight or with_bias]


@pytest.mark.parametrize("variant, moving", HVP_CASES,
                         ids=[f"{v}-{'all' if m[0] == 0 else 'x constant'}" for v, m in HVP_CASES])
def test_hvp_forward_over_reverse_matches_reverse_over_reverse(variant, moving, device):
    """The jvp of LayerNormBackward (the tangent of the gradients, forward over reverse) against its
    backward (reverse over reverse): two derivations of one Hessian."""
    forward, reverse = layer_norm_hvps(variant, moving, np.float64, device)
    labels = [f"H v, input {i}" for i in range(len(forward))]
    comparison = compare(forward, reverse, labels, TOLERANCE["twin", "float64"])
    assert comparison.passed, comparison


@pytest.mark.parametrize("variant", ["affine", "two normalized dims, weight only"])
def test_hvp_in_float32_keeps_the_dtype_and_rounds_like_it(variant, device):
    """Both modes' H v in float32 against float64 on the same data (the rules keep the dtype)."""
    exact = layer_norm_hvps(variant, (0, 1, 2), np.float64, device)
    rounded = layer_norm_hvps(variant, (0, 1, 2), np.float32, device)
    for (ours, reference) in zip(rounded, exact):
        assert all(a.dtype == np.float32 for a in ours)
        comparison = compare(ours, reference, [f"H v, input {i}" for i in range(len(ours))],
                             TOLERANCE["torch", "float32"])
        assert comparison.passed, comparison
