"""F.rms_norm and nn.RMSNorm: the registry's cases (normalized shapes of one and two axes, with and
without a weight, eps given and torch's default: gradcheck, torch, composite twin on every device;
second derivatives: gradgradcheck, torch's double backward; forward mode), nn.RMSNorm against
torch.nn.RMSNorm, clear errors; the backward as an op (RMSNormBackward: its double backward and jvp
on their own, a third derivative against torch, forward over reverse against reverse over reverse,
float32)."""
import math

import numpy as np
import pytest

import autograd
from autograd import Tensor
import npformer.functional as F
from npformer import nn

from helpers import assert_clear_error, double_backward_tests, forward_mode_tests, leaf, op_tests
from npformer.functional.rms_norm import RMSNormBackward, rms_norm_forward
from npformer.opcases import TOLERANCE, compare

test_gradcheck, test_matches_torch, test_matches_composite_twin = op_tests("rms_norm")
test_gradgradcheck, test_double_backward_matches_torch = double_backward_tests("rms_norm")
test_forward_mode_gradcheck, test_jvp_matches_torch, test_forward_mode_in_float32 = forward_mode_tests("rms_norm")


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_default_eps_is_the_machine_epsilon_of_the_dtype_as_torch(dtype, torch):
    """eps=None: torch.finfo(dtype).eps. Rows of tiny entries show it (mean(x^2) ~ eps)."""
    x = (np.random.default_rng(0).standard_normal((3, 4)) * np.sqrt(np.finfo(dtype).eps)).astype(dtype)
    ours = F.rms_norm(Tensor(x), 4).numpy()
    theirs = torch.nn.functional.rms_norm(torch.tensor(x), (4,)).numpy()
    assert ours.dtype == dtype
    np.testing.assert_allclose(ours, theirs, rtol=1e-5 if dtype == np.float32 else 1e-12)
    np.testing.assert_allclose(ours, F.rms_norm(Tensor(x), 4, eps=float(np.finfo(dtype).eps)).numpy(), rtol=0)


@pytest.mark.parametrize("elementwise_affine", [True, False])
@pytest.mark.parametrize("eps", [None, 1e-6])
def test_module_matches_torch_rms_norm(elementwise_affine, eps, torch):
    """nn.RMSNorm against torch.nn.RMSNorm (same weight), output and every gradient, float64; the
    state_dict holds `weight` (ones) as torch's does."""
    ours = nn.RMSNorm((3, 4), eps=eps, elementwise_affine=elementwise_affine, dtype="float64")
    theirs = torch.nn.RMSNorm((3, 4), eps=eps, elementwise_affine=elementwise_affine, dtype=torch.float64)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    rng = np.random.default_rng(1)
    if elementwise_affine:
        np.testing.assert_array_equal(ours.weight.numpy(), np.ones((3, 4)))
        w = 1 + rng.standard_normal((3, 4))
        ours.weight.data[...] = w
        with torch.no_grad():
            theirs.weight.copy_(torch.tensor(w))
    x, g = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 3, 4))
    xt, tx = leaf(x), torch.tensor(x, requires_grad=True)
    y, ty = ours(xt), theirs(tx)
    y.backward(g)
    ty.backward(torch.tensor(g))
    np.testing.assert_allclose(y.numpy(), ty.detach().numpy(), rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(xt.grad.numpy(), tx.grad.numpy(), rtol=1e-11, atol=1e-12)
    if elementwise_affine:
        np.testing.assert_allclose(ours.weight.grad.numpy(), theirs.weight.grad.numpy(), rtol=1e-11, atol=1e-12)
    assert repr(ours).startswith("RMSNorm((3, 4), eps=")


def test_module_keeps_float32():
    norm = nn.RMSNorm(4)
    assert norm.weight.dtype == np.float32 and norm.eps is None
    y = norm(Tensor(np.ones((2, 4), np.float32)))
    assert y.dtype == np.float32


def test_large_and_tiny_rows_are_finite_and_scale_invariant():
    """RMS norm is invariant to the scale of a row (up to eps, tiny here): rows at 1e-3 and 1e15
    give the unit row's output, in float32 and float64."""
    base = np.random.default_rng(2).standard_normal((1, 8))
    for dtype in (np.float64, np.float32):
        rows = np.concatenate([base, 1e-3 * base, 1e15 * base]).astype(dtype)
        y = F.rms_norm(Tensor(rows), 8, eps=1e-30).numpy()
        assert np.isfinite(y).all()
        np.testing.assert_allclose(y[1:], np.broadcast_to(y[:1], (2, 8)), rtol=1e-5 if dtype == np.float32 else 1e-13)


def test_module_errors():
    with pytest.raises(ValueError, match=r"trailing dimensions must be \(4,\)"):
        nn.RMSNorm(4)(Tensor(np.zeros((2, 5))))
    with pytest.raises(ValueError, match="eps"):
        nn.RMSNorm(4, eps=0)
    with pytest.raises(TypeError, match="autograd.Tensor"):
        nn.RMSNorm(4)(np.zeros((2, 4)))


@pytest.mark.parametrize("call, error, words", [
    (lambda: F.rms_norm(Tensor(np.zeros((2, 3))), (4,)), ValueError, ["normalized_shape", "(4,)", "(2, 3)"]),
    (lambda: F.rms_norm(Tensor(np.zeros((2, 3))), (2, 2, 3)), ValueError, ["normalized_shape", "(2, 2, 3)", "(2, 3)"]),
    (lambda: F.rms_norm(Tensor(np.zeros((2, 3))), 3, Tensor(np.zeros(4))), ValueError, ["weight", "(3,)", "(4,)"]),
    (lambda: F.rms_norm(Tensor(np.zeros((2, 3))), 3, eps=0.0), ValueError, ["eps"]),
    (lambda: F.rms_norm(Tensor(np.zeros((2, 3))), 3, eps=-1e-5), ValueError, ["eps"]),
    (lambda: F.rms_norm(Tensor(np.zeros((2, 3), np.int64)), 3), TypeError, ["input", "floating", "int64"]),
    (lambda: F.rms_norm(Tensor(np.zeros((2, 3))), 3, np.ones(3, np.float32)), TypeError, ["float32", "float64"]),
    (lambda: F.rms_norm([[1.0, 2.0]], 2), TypeError, ["input", "list"]),
    (lambda: F.rms_norm(Tensor(np.zeros((2, 3))), 0), ValueError, ["normalized_shape"]),
])
def test_bad_input_raises_a_clear_error(call, error, words):
    assert_clear_error(call, error, words)


# x's shape, normalized_shape, with a weight
VARIANTS = {
    "weight": ((3, 5), (5,), True),
    "two normalized dims, weight": ((2, 3, 4), (3, 4), True),
    "no weight": ((3, 5), (5,), False),
}


def variant_arrays(rng, variant):
    """x (mean 1.5, std 2: rstd is not 1, and the mean is far from 0) and the variant's weight (or None)."""
    shape, normalized, with_weight = VARIANTS[variant]
    return 1.5 + 2 * rng.standard_normal(shape), 1 + rng.standard_normal(normalized) if with_weight else None


# which of (dx, dweight) the op forms: a variant's, or one where x is a constant
BACKWARD_OP_CASES = {variant: (variant, (True, VARIANTS[variant][2])) for variant in VARIANTS}
BACKWARD_OP_CASES["x constant"] = ("weight", (False, True))


@pytest.mark.parametrize("name", list(BACKWARD_OP_CASES))
def test_backward_op_gradcheck_checks_its_double_backward_and_jvp(name, device):
    """RMSNormBackward on its own, (dy, x, weight) -> the formed ones of (dx, dweight), in float64
    with every input moving: its backward (the double backward) and its jvp against central
    differences, and the two against each other; its differentiable_backward (the way to the third
    derivative): the same values as its backward, and gradgradcheck. xhat and rstd, constants of the
    op, are formed from x at each evaluation, as the forward does."""
    variant, needs = BACKWARD_OP_CASES[name]
    x, weight = variant_arrays(np.random.default_rng(31), variant)
    normalized, x_moves, eps = VARIANTS[variant][1], needs[0], 1e-3
    dy = leaf(np.random.default_rng(32).standard_normal(x.shape), device)
    inputs = [dy] + ([leaf(x, device)] if x_moves else []) + ([leaf(weight, device)] if weight is not None else [])
    constant_x = autograd.backend.to_device(x, device)

    def backward_op(dy, *rest):   # (dy, x, weight), x and weight where they move
        x_tensor = rest[0] if x_moves else None
        x_array = x_tensor.data if x_moves else constant_x
        xp = autograd.backend.get_array_module(x_array)
        _, xhat, rstd = rms_norm_forward(xp, x_array.reshape(-1, math.prod(normalized)), None, eps)
        return RMSNormBackward.apply(dy, x_tensor, rest[-1] if weight is not None else None, xhat=xhat, rstd=rstd,
                                     normalized_shape=normalized, eps=eps, needs=needs)

    assert autograd.gradcheck(backward_op, inputs, check_forward_ad=True)
    upstream = [Tensor(np.random.default_rng(35).standard_normal(o.shape), device=device) for o in backward_op(*inputs)]
    raw, composed = ([None if g is None else g.numpy() for g in autograd.grad(
        backward_op(*inputs), inputs, upstream, create_graph=graph, allow_unused=True)] for graph in (False, True))
    assert [g is None for g in composed] == [g is None for g in raw]
    comparison = compare([g for g in composed if g is not None], [g for g in raw if g is not None],
                         [f"gradient of input {i}" for i, g in enumerate(raw) if g is not None], 1e-12)
    assert comparison.passed, comparison
    assert autograd.gradgradcheck(backward_op, inputs)


def test_a_create_graph_gradient_is_one_backward_node():
    x, weight = (leaf(a) for a in variant_arrays(np.random.default_rng(33), "weight"))
    grads = autograd.grad(F.rms_norm(x, 5, weight), [x, weight], Tensor(np.ones(x.shape)), create_graph=True)
    assert {type(g.creator) for g in grads} == {RMSNormBackward}
    assert len({id(g.creator) for g in grads}) == 1


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_third_derivative_matches_torch(variant, torch):
    """Every order works: the double backward's differentiable_backward is built from
    differentiable ops. Against torch's rms_norm, each derivative contracted with random directions."""
    rng = np.random.default_rng(14)
    arrays = [a for a in variant_arrays(rng, variant) if a is not None]
    normalized = VARIANTS[variant][1]
    g = rng.standard_normal(arrays[0].shape)
    u, v = ([rng.standard_normal(a.shape) for a in arrays] for _ in range(2))

    def third(fn, make, grad):   # d/dx <d/dx <d/dx <fn, g>, u>, v>
        xs = [make(a) for a in arrays]
        first = grad([fn(*xs)], xs, [make(g, False)], create_graph=True)
        second = grad([sum((d * make(w, False)).sum() for d, w in zip(first, u))], xs, create_graph=True)
        third = grad([sum((d * make(w, False)).sum() for d, w in zip(second, v))], xs)
        return [d.detach().numpy() for d in third]

    ours = third(lambda *xs: F.rms_norm(xs[0], normalized, *xs[1:], eps=1e-5),
                 lambda a, grad=True: Tensor(a, requires_grad=grad), autograd.grad)
    theirs = third(lambda *xs: torch.nn.functional.rms_norm(xs[0], normalized, *xs[1:], eps=1e-5),
                   lambda a, grad=True: torch.tensor(a, requires_grad=grad), torch.autograd.grad)
    comparison = compare(ours, theirs, [f"d/d input {i}" for i in range(len(arrays))], 1e-11)
    assert comparison.passed, comparison


def rms_norm_hvps(variant, moving, dtype, device="cpu"):
    """H v of f = sum(tanh(rms_norm(x, w)) * c) over the `moving` inputs of the variant (the others
    constants), forward over reverse (autograd.functional.hvp) and reverse over reverse (vhp)."""
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
        return (F.rms_norm(args[0], normalized, args[1], eps=1e-5).tanh() * c).sum()

    inputs = tuple(tensors[i] for i in moved)
    return [[p.numpy() for p in product(f, inputs, directions)[1]]
            for product in (autograd.functional.hvp, autograd.functional.vhp)]


HVP_CASES = [(variant, (0, 1)) for variant in VARIANTS] + [("weight", (1,))]


@pytest.mark.parametrize("variant, moving", HVP_CASES,
                         ids=[f"{v}-{'all' if m[0] == 0 else 'x constant'}" for v, m in HVP_CASES])
def test_hvp_forward_over_reverse_matches_reverse_over_reverse(variant, moving, device):
    forward, reverse = rms_norm_hvps(variant, moving, np.float64, device)
    comparison = compare(forward, reverse, [f"H v, input {i}" for i in range(len(forward))],
                         TOLERANCE["twin", "float64"])
    assert comparison.passed, comparison


def test_hvp_in_float32_keeps_the_dtype_and_rounds_like_it(device):
    exact = rms_norm_hvps("two normalized dims, weight", (0, 1), np.float64, device)
    rounded = rms_norm_hvps("two normalized dims, weight", (0, 1), np.float32, device)
    for ours, reference in zip(rounded, exact):
        assert all(a.dtype == np.float32 for a in ours)
        comparison = compare(ours, reference, [f"H v, input {i}" for i in range(len(ours))],
                             TOLERANCE["torch", "float32"])
        assert comparison.passed, comparison
