"""F.linear and nn.Linear: the registry's cases (gradcheck, torch, composite twin on every
device; second derivatives: gradgradcheck, torch's double backward), torch's initialisation, and
clear errors."""
import importlib
import math

import numpy as np
import pytest

import npformer
import autograd
from autograd import Tensor
from autograd.functional import hvp, jvp, linearize, vhp
import npformer.functional as F
from npformer import nn

from helpers import assert_clear_error, double_backward_tests, forward_mode_tests, op_tests

test_gradcheck, test_matches_torch, test_matches_composite_twin = op_tests("linear")
test_gradgradcheck, test_double_backward_matches_torch = double_backward_tests("linear")
test_forward_mode_gradcheck, test_jvp_matches_torch, test_forward_mode_in_float32 = forward_mode_tests("linear")


def test_linear_init_like_torch():
    npformer.manual_seed(0)
    m = nn.Linear(400, 300)
    bound = 1 / math.sqrt(400)  # kaiming_uniform_(a=sqrt(5)) and the bias rule both give 1/sqrt(fan_in)
    for p in (m.weight, m.bias):
        values = p.numpy()
        assert p.dtype == np.float32 and np.abs(values).max() <= bound
        assert abs(values.std() - bound / math.sqrt(3)) < 0.1 * bound / math.sqrt(3)


def test_linear_errors():
    m = nn.Linear(3, 2)
    with pytest.raises(ValueError, match="last dimension must be 3"):
        m(Tensor(np.zeros((2, 4))))
    with pytest.raises(TypeError, match="autograd.Tensor"):
        m(np.zeros((2, 3)))
    with pytest.raises(ValueError, match="in_features must be an integer >= 1, got 0"):
        nn.Linear(0, 2)


W = np.zeros((5, 4))


@pytest.mark.parametrize("call, error, words", [
    (lambda: F.linear(Tensor(np.zeros((2, 3))), Tensor(W)), ValueError, ["weight.shape[1]=4", "(2, 3)"]),
    (lambda: F.linear(Tensor(np.zeros((2, 4))), Tensor(W), Tensor(np.zeros(4))), ValueError, ["bias", "(5,)", "(4,)"]),
    (lambda: F.linear(Tensor(np.zeros((2, 4))), Tensor(np.zeros(4))), ValueError, ["2-D", "(4,)"]),
    (lambda: F.linear([1.0, 2.0], Tensor(W)), TypeError, ["input", "list"]),
    (lambda: F.linear(Tensor(np.zeros((2, 4)), device="test"), Tensor(W)), RuntimeError, ["device"]),
    (lambda: F.linear(Tensor(np.zeros((2, 4), dtype=np.float32)), Tensor(W)), TypeError, ["dtype"]),
])
def test_bad_input_raises_a_clear_error(call, error, words):
    assert_clear_error(call, error, words)


@pytest.mark.parametrize("activation", [None, "relu", "gelu"])
def test_forward_mode_is_the_same_for_any_number_of_threads(activation, threads):
    """The jvp splits its GEMMs by rows like the forward: every block's rows, and only those, written."""
    rng = np.random.default_rng(7)
    arrays = [rng.standard_normal(shape) for shape in ((6, 5, 4), (3, 4), (3,))]
    tangents = tuple(Tensor(rng.standard_normal(a.shape)) for a in arrays)
    results = []
    for n in (1, 2, 3, 4):
        threads(n)
        results.append(jvp(lambda *a: F.linear(*a, activation=activation), tuple(map(Tensor, arrays)), tangents)[1])
    for t in results[1:]:
        np.testing.assert_allclose(t.numpy(), results[0].numpy(), rtol=1e-12, atol=1e-12)


def counted_calls(monkeypatch, table_name):
    """A list that grows by one at each call of linear.py's kernel table `table_name`."""
    module = importlib.import_module("npformer.functional.linear")  # (F.linear is the function)
    calls, table = [], getattr(module, table_name)
    monkeypatch.setattr(module, table_name, lambda *a: calls.append(1) or table(*a))
    return calls


def assert_reverse_over_reverse(products, loss, inputs, u):
    for ours, theirs in zip(products, vhp(loss, inputs, u)[1]):
        np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
def test_forward_over_reverse_takes_the_pre_activation_tangent_once(activation, monkeypatch):
    """The differentiable backward forms h = x W^T + b again (its second derivative reaches x, W, b
    through h): forward over reverse takes h's tangent from the forward's jvp, not from two more
    GEMMs; the products stay those of reverse over reverse, also when linearize takes the steps
    again along other tangents."""
    calls = counted_calls(monkeypatch, "linear_tangent")
    rng = np.random.default_rng(3)
    inputs = tuple(Tensor(rng.standard_normal(shape), requires_grad=True) for shape in ((5, 4), (3, 4), (3,)))

    def loss(x, w, b):
        return (F.linear(x, w, b, activation=activation) ** 2).sum()

    u = tuple(Tensor(rng.standard_normal(a.shape)) for a in inputs)
    products = hvp(loss, inputs, u)[1]
    assert len(calls) == 3  # t_h in the forward, then the tangents of dx = dh W and dW = dh^T x
    assert_reverse_over_reverse(products, loss, inputs, u)
    jvp_fn = linearize(lambda *a: autograd.grad(loss(*a), a, create_graph=True), *inputs)[1]
    for _ in range(2):
        u = tuple(Tensor(rng.standard_normal(a.shape)) for a in inputs)
        before = len(calls)
        products = jvp_fn(*u)
        assert len(calls) - before == 3
        assert_reverse_over_reverse(products, loss, inputs, u)


def test_hvp_leaves_the_weight_gradient_values_unread(monkeypatch):
    """Forward over reverse in autograd.functional.hvp reads a parameter's gradient for its tangent
    alone: linear skips the GEMM of dW's values (two products per linear: y and dx), and H v is
    reverse over reverse's, for a weight used twice and a non-leaf input."""
    calls = counted_calls(monkeypatch, "linear_forward")
    rng = np.random.default_rng(4)
    inputs = tuple(Tensor(rng.standard_normal(shape), requires_grad=True) for shape in ((5, 4), (4, 4), (4,)))

    def loss(x, w, b):  # w used twice; the second linear's input is not a leaf
        return (F.linear(F.linear(x, w, b, activation="gelu"), w) ** 2).sum()

    u = tuple(Tensor(rng.standard_normal(a.shape)) for a in inputs)
    products = hvp(loss, inputs, u)[1]
    assert len(calls) == 4  # y of both linears, then dx of both: no dW values
    assert_reverse_over_reverse(products, loss, inputs, u)
