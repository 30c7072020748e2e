"""F.cross_entropy: the registry's cases (smoothing, class weights, ignore_index, reductions,
spatial and unbatched targets, logits of 1e4, class-probability targets: gradcheck, torch,
composite twin on every device; second derivatives: gradgradcheck, torch's double backward),
every target ignored, float32, logits of +/-1e4 with smoothing, weights and padding against
torch, property-based tests, and clear errors."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

import autograd
from autograd import Tensor
from autograd import forward_ad as fwAD
import npformer.functional as F

from helpers import (
    DTYPES, HYPOTHESIS, assert_clear_error, compare_with_torch, double_backward_tests, forward_mode_tests, leaf, op_tests,
    tolerance)
from tolerances import rounding_tolerance

test_gradcheck, test_matches_torch, test_matches_composite_twin = op_tests("cross_entropy")
test_gradgradcheck, test_double_backward_matches_torch = double_backward_tests("cross_entropy")
test_forward_mode_gradcheck, test_jvp_matches_torch, test_forward_mode_in_float32 = forward_mode_tests("cross_entropy")


def test_cross_entropy_every_target_ignored():
    logits = leaf(np.zeros((3, 4)))
    with pytest.raises(ValueError, match="every target equals ignore_index=-100"):
        F.cross_entropy(logits, np.full(3, -100))
    total = F.cross_entropy(logits, np.full(3, -100), reduction="sum")
    total.backward()
    assert total.item() == 0 and not logits.grad.numpy().any()
    assert not F.cross_entropy(logits, np.full(3, -100), reduction="none").numpy().any()


def test_cross_entropy_float32_stays_float32(torch):
    rng = np.random.default_rng(6)
    target = np.array([1, 2, -100, 0])
    compare_with_torch(torch, lambda x: F.cross_entropy(x, target, label_smoothing=0.1),
                       lambda x: torch.nn.functional.cross_entropy(x, torch.tensor(target), label_smoothing=0.1),
                       [rng.standard_normal((4, 3))], rng, atol=1e-6, rtol=1e-5, dtype=np.float32)


def logits_1e4(rng, shape):
    """Entries 1e4, -1e4 or 0 plus N(0, 1): the softmax is one-hot up to exp(-1e4) = 0."""
    return 1e4 * rng.choice([-1.0, 0.0, 1.0], size=shape) + rng.standard_normal(shape)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("options", ["smoothing", "weights_smoothing_padding"])
def test_cross_entropy_logits_1e4_with_smoothing_weights_and_padding_match_torch(reduction, options, torch):
    rng = np.random.default_rng(0)
    logits = logits_1e4(rng, (8, 6))
    target = np.array([1, 0, 3, 5, 0, 2, 4, 1])          # class 0 is PAD when it is ignored
    kwargs = {"label_smoothing": 0.1, "reduction": reduction}
    if options == "weights_smoothing_padding":
        kwargs.update(ignore_index=0, weight=np.array([1.0, 0.5, 2.0, 1.0, 0.1, 3.0]))
    t_kwargs = {k: torch.tensor(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
    # logp = x - max - log(sum exp(x - max)) rounds by ~eps |x|; the loss sums C of them (weights <= 3):
    # at unit scale C * 3 terms, scaled by |logits| ~ 8e3 inside compare_with_torch
    compare_with_torch(torch, lambda x: F.cross_entropy(x, target, **kwargs),
                       lambda x: torch.nn.functional.cross_entropy(x, torch.tensor(target), **t_kwargs),
                       [logits], rng, atol=rounding_tolerance(np.float64, terms=3 * 6), rtol=0)


def test_cross_entropy_logits_1e4_float32_is_finite_and_matches_torch_float64(torch):
    """float32 ulp at 1e4 is ~1e-3: the loss (~1e3..1e4) is exact to that, and the gradient
    (probabilities, O(1)) moves by as much (logits off by 1e-3 shift probabilities by 1e-3):
    float32 rounding at unit scale, scaled by |logits| inside compare_with_torch."""
    rng = np.random.default_rng(1)
    logits = logits_1e4(rng, (2, 7, 5)).astype(np.float32)        # (N, C, d1): spatial targets
    target = rng.integers(0, 7, (2, 5))
    target[0, :2] = -100
    compare_with_torch(torch, lambda x: F.cross_entropy(x, target, label_smoothing=0.2),
                       lambda x: torch.nn.functional.cross_entropy(x, torch.tensor(target), label_smoothing=0.2),
                       [logits], rng, atol=rounding_tolerance(np.float32, terms=5), rtol=0, dtype=np.float32,
                       torch_dtype=np.float64)


@HYPOTHESIS
@given(n=st.integers(1, 4), c=st.integers(2, 5), spatial=st.lists(st.integers(1, 3), max_size=2),
       reduction=st.sampled_from(["mean", "sum", "none"]), smoothing=st.sampled_from([0.0, 0.1, 0.3]),
       weighted=st.booleans(), scale=st.sampled_from([1.0, 30.0]), dtype=DTYPES, seed=st.integers(0, 2**31))
def test_cross_entropy_properties(n, c, spatial, reduction, smoothing, weighted, scale, dtype, seed, torch):
    rng = np.random.default_rng(seed)
    logits = scale * rng.standard_normal((n, c, *spatial))
    target = rng.integers(0, c, (n, *spatial))
    target[rng.random(target.shape) < 0.3] = -100
    target.reshape(-1)[0] = rng.integers(0, c)                    # at least one valid target
    kwargs = {"reduction": reduction, "label_smoothing": smoothing}
    if weighted:
        kwargs["weight"] = (rng.random(c) + 0.1).astype(dtype)
    t_kwargs = {k: torch.tensor(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
    fn = lambda a: F.cross_entropy(a, target, **kwargs)   # noqa: E731
    compare_with_torch(torch, fn, lambda a: torch.nn.functional.cross_entropy(a, torch.tensor(target), **t_kwargs),
                       [logits], rng, dtype=dtype, **tolerance(dtype))
    if dtype == np.float64:
        assert autograd.gradcheck(fn, [leaf(logits)], check_forward_ad=True)


X = Tensor(np.zeros((3, 4)))


@pytest.mark.parametrize("call, error, words", [
    (lambda: F.cross_entropy(X, np.array([0, 4, 1])), IndexError, ["[0, 3]", "max 4"]),
    (lambda: F.cross_entropy(X, np.array([0.0, 1.0, 1.0])), ValueError, ["probabilities", "(3, 4)", "(3,)", "integer"]),
    (lambda: F.cross_entropy(X, np.array([0, 1])), ValueError, ["target shape", "(3,)", "(2,)"]),
    (lambda: F.cross_entropy(X, np.full((3, 5), 0.2)), ValueError, ["probabilities", "(3, 4)", "(3, 5)"]),
    (lambda: F.cross_entropy(X, np.full((3, 4), 0.25, dtype=np.float32)), TypeError, ["float32", "float64"]),
    (lambda: F.cross_entropy(X, np.array([0, 1, 1]), reduction="avg"), ValueError, ["reduction", "'avg'"]),
    (lambda: F.cross_entropy(X, np.array([0, 1, 1]), weight=Tensor(np.ones(3))), ValueError,
     ["weight", "(4,)", "(3,)"]),
])
def test_bad_input_raises_a_clear_error(call, error, words):
    assert_clear_error(call, error, words)


def test_class_weights_that_carry_a_tangent_are_refused():
    """The class weights are constants in forward mode too: a dual weight is an error naming it,
    never a tangent silently dropped; with plain weights the logits' tangent goes through."""
    rng = np.random.default_rng(6)
    logits, target, w = rng.standard_normal((3, 4)), np.array([0, 3, 1]), rng.random(4) + 0.5
    with fwAD.dual_level():
        dual_weight = fwAD.make_dual(Tensor(w), np.ones(4))
        assert_clear_error(lambda: F.cross_entropy(Tensor(logits), target, weight=dual_weight), RuntimeError,
                           ["weight carries a tangent", "class weights are constants"])
        x = fwAD.make_dual(Tensor(logits), np.ones((3, 4)))
        tangent = fwAD.unpack_dual(F.cross_entropy(x, target, weight=Tensor(w))).tangent
        assert abs(float(tangent)) < 1e-14                             # logits + c (each row): no change
