"""F.swiglu (silu(gate) * up, one fused op) and nn.SwiGLU: the registry's cases (gradcheck, torch,
composite twin on every device; second derivatives: gradgradcheck, torch's double backward; forward
mode), the backward as an op (SwiGLUBackward: its double backward and jvp on their own, with gate or
up constant), a third derivative against torch, nn.SwiGLU against the feed-forward written in torch
(Llama's MLP), and clear errors (no silent broadcast)."""
import numpy as np
import pytest

import autograd
from autograd import Tensor
import npformer.functional as F
from npformer import nn

from helpers import assert_clear_error, double_backward_tests, forward_mode_tests, leaf, op_tests
from npformer.functional.silu import SwiGLUBackward, swiglu_forward
from npformer.opcases import TOLERANCE, compare

test_gradcheck, test_matches_torch, test_matches_composite_twin = op_tests("swiglu")
test_gradgradcheck, test_double_backward_matches_torch = double_backward_tests("swiglu")
test_forward_mode_gradcheck, test_jvp_matches_torch, test_forward_mode_in_float32 = forward_mode_tests("swiglu")


@pytest.mark.parametrize("needs", [(True, True), (True, False), (False, True)], ids=["both", "gate", "up"])
def test_backward_op_checks_its_double_backward_and_jvp(needs, device):
    """SwiGLUBackward on its own, (dy, gate, up) -> the formed ones of (d gate, d up), float64, the
    inputs whose gradient is formed moving with dy: its backward and jvp against central
    differences (and each other), its differentiable backward against its backward, gradgradcheck."""
    rng = np.random.default_rng(21)
    dy, gate, up = (rng.standard_normal((3, 4)) for _ in range(3))
    gate *= 3
    moving = [leaf(dy, device)] + [leaf(a, device) for a, need in zip((gate, up), needs) if need]
    constants = [autograd.backend.to_device(a, device) for a in (gate, up)]

    def backward_op(dy, *rest):
        rest = iter(rest)
        gate_in, up_in = (next(rest) if need else c for need, c in zip(needs, constants))
        gate_array, up_array = (a.data if isinstance(a, Tensor) else a for a in (gate_in, up_in))
        s = swiglu_forward(autograd.backend.get_array_module(gate_array), gate_array, up_array)[1]
        return SwiGLUBackward.apply(dy, gate_in, up_in, gate_saved=gate_array, up_saved=up_array, s=s, needs=needs)

    assert autograd.gradcheck(backward_op, moving, check_forward_ad=True)
    outs = backward_op(*moving)
    upstream = [Tensor(rng.standard_normal(o.shape), device=device) for o in outs]
    raw, composed = ([None if g is None else g.numpy() for g in autograd.grad(
        backward_op(*moving), moving, upstream, create_graph=graph, allow_unused=True)] for graph in (False, True))
    assert [g is None for g in composed] == [g is None for g in raw]   # d up = dy silu(gate): none reaches up
    comparison = compare([g for g in composed if g is not None], [g for g in raw if g is not None],
                         [f"gradient of input {i}" for i, g in enumerate(raw) if g is not None], 1e-12)
    assert comparison.passed, comparison
    assert autograd.gradgradcheck(backward_op, moving)


def test_a_create_graph_gradient_is_one_backward_node():
    rng = np.random.default_rng(22)
    gate, up = leaf(rng.standard_normal((2, 3))), leaf(rng.standard_normal((2, 3)))
    grads = autograd.grad(F.swiglu(gate, up), [gate, up], Tensor(np.ones((2, 3))), create_graph=True)
    assert {type(g.creator) for g in grads} == {SwiGLUBackward} and len({id(g.creator) for g in grads}) == 1


def test_third_derivative_matches_torch(torch):
    rng = np.random.default_rng(23)
    arrays = [3 * rng.standard_normal((3, 4)), rng.standard_normal((3, 4))]
    g = rng.standard_normal((3, 4))
    u, v = ([rng.standard_normal((3, 4)) for _ in arrays] for _ in range(2))

    def third(fn, make, grad):
        xs = [make(a) for a in arrays]
        first = grad([fn(*xs)], xs, [make(g, False)], create_graph=True)
        second = grad([sum((d * make(w, False)).sum() for d, w in zip(first, u))], xs, create_graph=True)
        third = grad([sum((d * make(w, False)).sum() for d, w in zip(second, v))], xs)
        return [d.detach().numpy() for d in third]

    ours = third(F.swiglu, lambda a, grad=True: Tensor(a, requires_grad=grad), autograd.grad)
    theirs = third(lambda a, b: torch.nn.functional.silu(a) * b, lambda a, grad=True: torch.tensor(a, requires_grad=grad),
                   torch.autograd.grad)
    comparison = compare(ours, theirs, ["d/d gate", "d/d up"], 1e-11)
    assert comparison.passed, comparison


def test_hvp_forward_over_reverse_matches_reverse_over_reverse_in_both_dtypes():
    from autograd.functional import hvp, vhp
    rng = np.random.default_rng(24)
    arrays = [2 * rng.standard_normal((3, 5)), rng.standard_normal((3, 5))]
    c, directions = rng.standard_normal((3, 5)), [rng.standard_normal((3, 5)) for _ in arrays]
    results = {}
    for dtype in (np.float64, np.float32):
        def loss(gate, up):
            return (F.swiglu(gate, up).tanh() * Tensor(c.astype(dtype))).sum()
        inputs = tuple(Tensor(a.astype(dtype)) for a in arrays)
        tangents = tuple(Tensor(d.astype(dtype)) for d in directions)
        results[dtype] = [[p.numpy() for p in product(loss, inputs, tangents)[1]] for product in (hvp, vhp)]
    forward, reverse = results[np.float64]
    assert compare(forward, reverse, ["gate", "up"], TOLERANCE["twin", "float64"]).passed
    for ours, reference in zip(results[np.float32], results[np.float64]):
        assert all(a.dtype == np.float32 for a in ours)
        assert compare(ours, reference, ["gate", "up"], TOLERANCE["torch", "float32"]).passed


def test_large_gates_are_finite_in_float32():
    gate = np.array([-1e30, -200.0, -90.0, 0.0, 90.0, 200.0, 1e30], np.float32)
    up = np.full(7, 0.5, np.float32)
    gt, ut = leaf(gate, dtype=np.float32), leaf(up, dtype=np.float32)
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        y = F.swiglu(gt, ut)
        y.backward(np.ones(7, np.float32))
    for a in (y.numpy(), gt.grad.numpy(), ut.grad.numpy()):
        assert a.dtype == np.float32 and np.isfinite(a).all()


@pytest.mark.parametrize("bias", [True, False])
def test_module_matches_llamas_feed_forward_in_torch(bias, torch):
    """nn.SwiGLU: linear2(silu(linear1(x)) * linear3(x)) (Llama's gate_proj, up_proj, down_proj),
    output and every parameter's gradient against the same weights in torch, float64."""
    ff = nn.SwiGLU(6, 10, bias=bias, dtype="float64")
    assert ff.linear2.out_features == 6 and ff.linear1.out_features == ff.linear3.out_features == 10
    names = [name for name, _ in ff.named_parameters()]
    assert names == [f"linear{i}.{p}" for i in (1, 3, 2) for p in (("weight", "bias") if bias else ("weight",))]
    rng = np.random.default_rng(25)
    x, g = rng.standard_normal((2, 3, 6)), rng.standard_normal((2, 3, 6))
    xt = leaf(x)
    ff(xt).backward(g)
    params = {name: torch.tensor(p.numpy(), requires_grad=True) for name, p in ff.named_parameters()}
    tx = torch.tensor(x, requires_grad=True)

    def linear(i, a):
        return torch.nn.functional.linear(a, params[f"linear{i}.weight"], params.get(f"linear{i}.bias"))

    out = linear(2, torch.nn.functional.silu(linear(1, tx)) * linear(3, tx))
    out.backward(torch.tensor(g))
    np.testing.assert_allclose(ff(Tensor(x)).numpy(), out.detach().numpy(), rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(xt.grad.numpy(), tx.grad.numpy(), rtol=1e-11, atol=1e-12)
    for name, p in ff.named_parameters():
        np.testing.assert_allclose(p.grad.numpy(), params[name].grad.numpy(), rtol=1e-11, atol=1e-12, err_msg=name)


def test_module_out_features_and_errors():
    assert nn.SwiGLU(4, 8, out_features=3)(Tensor(np.zeros((2, 4), np.float32))).shape == (2, 3)
    with pytest.raises(ValueError, match="last dimension must be 4"):
        nn.SwiGLU(4, 8)(Tensor(np.zeros((2, 5), np.float32)))
    with pytest.raises(ValueError, match="hidden_features"):
        nn.SwiGLU(4, 0)
    with pytest.raises(TypeError, match="bias"):
        nn.SwiGLU(4, 8, bias="no")


@pytest.mark.parametrize("call, error, words", [
    (lambda: F.swiglu(Tensor(np.zeros((2, 3))), Tensor(np.zeros((1, 3)))), ValueError,
     ["swiglu", "same shape", "(2, 3)", "(1, 3)"]),
    (lambda: F.swiglu(Tensor(np.zeros((2, 3))), Tensor(np.zeros(3))), ValueError, ["no broadcasting", "(3,)"]),
    (lambda: F.swiglu(Tensor(np.zeros(3)), Tensor(np.zeros(3, np.float32))), TypeError, ["float32", "float64"]),
    (lambda: F.swiglu(Tensor(np.zeros(3, np.int64)), Tensor(np.zeros(3))), TypeError, ["gate", "floating", "int64"]),
    (lambda: F.swiglu(Tensor(np.zeros(3)), None), TypeError, ["up", "NoneType"]),
])
def test_bad_input_raises_a_clear_error(call, error, words):
    assert_clear_error(call, error, words)
