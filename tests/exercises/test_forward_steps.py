"""ForwardSteps: every intermediate's gradient from the engine and by finite differences, and
the one-line verdict on a hand-derived one (the notebooks' cmp())."""
import io

import numpy as np
import pytest

import npformer.functional as F
from autograd import Tensor
from npformer.exercises import ForwardSteps


def attention_steps(rng):
    q, k, v = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 5, 4)), rng.standard_normal((2, 5, 4))
    return ForwardSteps({"q": q, "k": k, "v": v}, {
        "S": lambda a: 0.5 * a["q"] @ a["k"].swapaxes(-1, -2),      # (2, 3, 5)
        "P": lambda a: F.softmax(a["S"], dim=-1),
        "O": lambda a: a["P"] @ a["v"]})                             # (2, 3, 4)


def test_intermediate_gradients_match_the_formulas_and_finite_differences():
    steps = attention_steps(np.random.default_rng(0))
    P, dO, v = steps.values["P"], steps.upstream, steps.values["v"]
    assert dO.shape == (2, 3, 4) and np.abs(dO).min() > 0                 # a random upstream, not ones
    dP = dO @ v.swapaxes(-1, -2)
    dS = P * (dP - (dP * P).sum(-1, keepdims=True))
    np.testing.assert_allclose(steps.grads["P"], dP, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(steps.grads["S"], dS, rtol=1e-12, atol=1e-14)
    # central differences in float64: error ~ eps^2 f''' + rounding / eps, about 1e-9 at these magnitudes
    np.testing.assert_allclose(steps.numeric("S"), dS, atol=1e-8)
    np.testing.assert_allclose(steps.numeric("q"), 0.5 * dS @ steps.values["k"], atol=1e-8)


def test_compare_says_exact_for_the_right_gradient_and_wrong_with_the_worst_entry():
    steps = attention_steps(np.random.default_rng(1))
    P, dP = steps.values["P"], steps.grads["P"]
    out = io.StringIO()
    right = steps.compare("S", P * (dP - (dP * P).sum(-1, keepdims=True)), stream=out)
    wrong = steps.compare("S", P * dP, axes=("b", "i", "j"), stream=out)   # the row-sum term forgotten
    assert right.verdict == "exact" and right.fd_diff < 1e-8
    assert wrong.verdict == "wrong" and wrong.max_diff > 1e-2
    first, second = out.getvalue().splitlines()
    assert first.split()[:2] == ["dS", "exact"]
    assert second.split()[:2] == ["dS", "wrong"] and "dS[b=" in second and "yours" in second


def test_an_intermediate_used_twice_gets_both_contributions():
    x = np.random.default_rng(2).standard_normal((3, 4))
    steps = ForwardSteps({"x": x}, {"y": lambda a: a["x"].exp(), "z": lambda a: a["y"] * a["y"] + a["y"]})
    dz = steps.upstream
    assert steps.compare("y", dz * (2 * steps.values["y"] + 1), stream=io.StringIO()).verdict == "exact"


def test_the_given_upstream_is_used():
    steps = ForwardSteps({"x": np.arange(3.0)}, {"y": lambda a: 2 * a["x"]}, upstream=np.ones(3))
    np.testing.assert_array_equal(steps.grads["x"], [2.0, 2.0, 2.0])


def test_bad_use_is_refused_naming_what_is_wrong():
    x = np.ones((2, 3))
    with pytest.raises(ValueError, match="at least one input and one step"):
        ForwardSteps({"x": x}, {})
    with pytest.raises(ValueError, match=r"\['x'\] name both an input and a step"):
        ForwardSteps({"x": x}, {"x": lambda a: a["x"] * 2})
    with pytest.raises(TypeError, match="step 'y' must return a Tensor, got ndarray"):
        ForwardSteps({"x": x}, {"y": lambda a: a["x"].numpy()})
    with pytest.raises(ValueError, match=r"upstream must have the output's shape \(2, 3\), got \(3, 2\)"):
        ForwardSteps({"x": x}, {"y": lambda a: a["x"] * 2}, upstream=np.ones((3, 2)))
    steps = ForwardSteps({"x": x}, {"y": lambda a: a["x"] * Tensor(np.full((2, 3), 2.0))})
    with pytest.raises(KeyError, match="no value 'z'; the values are x, y"):
        steps.compare("z", x)
    with pytest.raises(ValueError, match=r"dx: mine, engine and numeric must have one shape, got \(3, 2\)"):
        steps.compare("x", np.ones((3, 2)))
    with pytest.raises(ValueError, match="axes must name the 2 axes of the gradient, got 1"):
        steps.compare("x", x, axes=("n",))
