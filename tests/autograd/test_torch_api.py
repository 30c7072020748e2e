"""torch's autograd API where a torch user reaches for it (issue 45, item 7), each argument and
method against torch on small float64 cases: Tensor reductions with torch's names (dim, keepdim),
`t()`, `max(dim)` / `min(dim)` as (values, indices); `autograd.grad`'s is_grads_batched,
materialize_grads and only_inputs; forward AD's Tensor tangents and enter/exit_dual_level. Bad
input gets a clear error. (gradcheck's arguments: test_torch_api_gradcheck.py; Function's ctx
methods: test_torch_api_function.py; nested functional transforms: test_torch_api_functional.py.)"""
import numpy as np
import pytest

from autograd import Tensor, grad
from autograd import forward_ad as fwAD

from helpers import assert_clear_error

A = np.array([[1.0, 3.0, 3.0], [2.0, -1.0, 2.0]])  # ties in both rows: torch's first index, one gets the gradient


def both(torch, array=A):
    return Tensor(array.copy(), requires_grad=True), torch.tensor(array.copy(), requires_grad=True)


# -- Tensor: torch's names beside numpy's --------------------------------------------------------------
@pytest.mark.parametrize("method", ["sum", "mean"])
@pytest.mark.parametrize("kwargs", [{"dim": 0}, {"dim": 1, "keepdim": True}, {"dim": (0, 1)}, {"dim": [0, 1]},
                                    {"dim": -1, "keepdim": False}])
def test_sum_and_mean_take_torchs_dim_and_keepdim(method, kwargs, torch):
    ours, theirs = both(torch)
    out, ref = getattr(ours, method)(**kwargs), getattr(theirs, method)(**kwargs)
    np.testing.assert_allclose(out.numpy(), ref.detach().numpy(), rtol=1e-15)
    g = np.random.default_rng(0).standard_normal(ref.shape)
    out.backward(g)
    ref.backward(torch.tensor(g))
    np.testing.assert_allclose(ours.grad.numpy(), theirs.grad.numpy(), rtol=1e-15)


@pytest.mark.parametrize("method", ["sum", "mean"])
def test_numpys_names_still_work_and_mixing_a_pair_is_a_clear_error(method):
    x = Tensor(A)
    np.testing.assert_allclose(getattr(x, method)(axis=1, keepdims=True).numpy(),
                               getattr(A, method)(axis=1, keepdims=True))
    np.testing.assert_allclose(getattr(x, method)(1, keepdim=True).numpy(), getattr(A, method)(1, keepdims=True))
    assert_clear_error(lambda: getattr(x, method)(axis=0, dim=1), TypeError, [method, "axis=0", "dim=1", "one of"])
    assert_clear_error(lambda: getattr(x, method)(0, keepdims=True, keepdim=True), TypeError,
                       [method, "keepdims", "keepdim", "one of"])


@pytest.mark.parametrize("method", ["max", "min"])
@pytest.mark.parametrize("call", [lambda x, m: getattr(x, m)(1), lambda x, m: getattr(x, m)(dim=0),
                                  lambda x, m: getattr(x, m)(-1, keepdim=True), lambda x, m: getattr(x, m)(dim=1, keepdim=False)])
def test_max_and_min_with_a_dim_give_values_and_indices_as_torch(method, call, torch):
    ours, theirs = both(torch)
    out, ref = call(ours, method), call(theirs, method)
    assert out._fields == ("values", "indices")
    values, indices = out
    np.testing.assert_array_equal(values.numpy(), ref.values.detach().numpy())
    np.testing.assert_array_equal(indices.numpy(), ref.indices.numpy())
    assert indices.dtype == np.int64 and not indices.requires_grad
    g = np.random.default_rng(1).standard_normal(ref.values.shape)
    out.values.backward(g)
    ref.values.backward(torch.tensor(g))
    np.testing.assert_array_equal(ours.grad.numpy(), theirs.grad.numpy())   # ties: the returned index alone


@pytest.mark.parametrize("method", ["max", "min"])
def test_max_and_min_without_a_dim_are_the_global_value_ties_sharing_the_gradient(method, torch):
    ours, theirs = both(torch, np.array([[3.0, -1.0, 3.0], [-1.0, 0.0, 2.0]]))
    out, ref = getattr(ours, method)(), getattr(theirs, method)()
    assert out.shape == () and float(out) == float(ref.detach())
    out.backward()
    ref.backward()
    np.testing.assert_array_equal(ours.grad.numpy(), theirs.grad.numpy())


def test_max_and_min_with_numpys_axis_keep_numpys_behaviour_values_only():
    x = Tensor(A)
    np.testing.assert_array_equal(x.max(axis=1).numpy(), A.max(axis=1))
    np.testing.assert_array_equal(x.min(axis=(0, 1), keepdims=True).numpy(), A.min(axis=(0, 1), keepdims=True))
    assert_clear_error(lambda: x.max(0, axis=1), TypeError, ["max", "axis", "dim", "one form"])
    assert_clear_error(lambda: x.max((0, 1)), TypeError, ["max", "one int", "axis="])
    assert_clear_error(lambda: x.min(keepdim=True), TypeError, ["min", "keepdim needs a dim"])
    assert_clear_error(lambda: x.max(2), IndexError, ["max", "dim 2", "2 dimensions"])


def test_t_as_torch(torch):
    for shape in [(), (3,), (2, 3)]:
        a = np.arange(float(np.prod(shape))).reshape(shape)
        assert Tensor(a).t().shape == torch.tensor(a).t().shape
        np.testing.assert_array_equal(Tensor(a).t().numpy(), torch.tensor(a).t().numpy())
    ours, theirs = both(torch)
    (ours.t() * Tensor(A.T)).sum().backward()
    (theirs.t() * torch.tensor(A.T)).sum().backward()
    np.testing.assert_array_equal(ours.grad.numpy(), theirs.grad.numpy())
    assert_clear_error(lambda: Tensor(np.zeros((2, 2, 2))).t(), RuntimeError, ["t()", "<= 2 dimensions", "got 3"])


# -- autograd.grad ----------------------------------------------------------------------------------------
def test_grad_materialize_grads_gives_zeros_for_unused_inputs_as_torch(torch):
    x, tx = both(torch)
    z, tz = both(torch)
    ours = grad((x * x).sum(), [x, z], materialize_grads=True)
    theirs = torch.autograd.grad((tx * tx).sum(), [tx, tz], materialize_grads=True)
    for o, t in zip(ours, theirs):
        np.testing.assert_array_equal(o.numpy(), t.numpy())
    assert_clear_error(lambda: grad((x * x).sum(), [x, z], materialize_grads=True, allow_unused=False), ValueError,
                       ["materialize_grads", "allow_unused=False"])
    assert grad((x * x).sum(), [x, z], allow_unused=True)[1] is None


@pytest.mark.parametrize("create_graph", [False, True])
def test_grad_is_grads_batched_as_torch(create_graph, torch):
    x, tx = both(torch)
    z, tz = both(torch)
    batch = np.random.default_rng(2).standard_normal((4,) + A.shape)
    ours = grad(x * x * 3.0, [x, z], Tensor(batch), is_grads_batched=True, materialize_grads=True,
                create_graph=create_graph)
    theirs = torch.autograd.grad(tx * tx * 3.0, [tx, tz], torch.tensor(batch), is_grads_batched=True,
                                 materialize_grads=True, create_graph=create_graph)
    for o, t in zip(ours, theirs):
        assert o.shape == tuple(t.shape)
        np.testing.assert_allclose(o.numpy(), t.detach().numpy(), rtol=1e-15)
    assert ours[0].requires_grad == theirs[0].requires_grad == create_graph
    if create_graph:  # the batch of gradients is in the graph: differentiate it again
        (second,) = grad(ours[0].sum(), x)
        (their_second,) = torch.autograd.grad(theirs[0].sum(), tx)
        np.testing.assert_allclose(second.numpy(), their_second.numpy(), rtol=1e-15)
    assert_clear_error(lambda: grad(x * x, x, Tensor(np.ones(3)), is_grads_batched=True), RuntimeError,
                       ["is_grads_batched", "first axis", "(2, 3)", "(3,)"])
    assert_clear_error(lambda: grad(x * x, x, None, is_grads_batched=True), ValueError,
                       ["is_grads_batched", "grad_outputs"])


def test_grad_only_inputs_is_accepted_and_ignored_as_torch():
    x = Tensor(A.copy(), requires_grad=True)
    (g,) = grad((x * x).sum(), x, only_inputs=True, retain_graph=True)
    with pytest.warns(FutureWarning, match="only_inputs"):
        (h,) = grad((x * x).sum(), x, only_inputs=False)
    np.testing.assert_array_equal(g.numpy(), h.numpy())
    assert x.grad is None


# -- forward AD ---------------------------------------------------------------------------------------------
def test_unpack_dual_tangent_is_a_tensor_as_torch(torch):
    u = np.random.default_rng(3).standard_normal(A.shape)
    with fwAD.dual_level():
        primal, tangent = fwAD.unpack_dual(fwAD.make_dual(Tensor(A), u) * 2.0)
        assert fwAD.unpack_dual(Tensor(A)).tangent is None
    import torch.autograd.forward_ad as tfw
    with tfw.dual_level():
        their = tfw.unpack_dual(tfw.make_dual(torch.tensor(A), torch.tensor(u)) * 2.0).tangent
    assert isinstance(tangent, Tensor) and isinstance(their, torch.Tensor)
    assert not tangent.requires_grad and tangent.requires_grad == their.requires_grad
    np.testing.assert_array_equal(tangent.numpy(), their.numpy())


def test_enter_and_exit_dual_level_as_torch(torch):
    import torch.autograd.forward_ad as tfw
    level = fwAD.enter_dual_level()
    try:
        assert isinstance(level, int) and fwAD.current_level() == level
        x = fwAD.make_dual(Tensor(A), np.ones_like(A))
        assert fwAD.unpack_dual(x * 3.0).tangent is not None
    finally:
        fwAD.exit_dual_level()
    assert fwAD.current_level() is None and fwAD.unpack_dual(x).tangent is None and not x._tangents
    tlevel = tfw.enter_dual_level()
    tx = tfw.make_dual(torch.tensor(A), torch.ones(A.shape, dtype=torch.float64))
    tfw.exit_dual_level(level=tlevel)
    assert tfw.unpack_dual(tx).tangent is None   # torch drops the tangents too
    assert_clear_error(fwAD.exit_dual_level, RuntimeError, ["exit_dual_level", "no dual level is open"])
    outer = fwAD.enter_dual_level()
    inner = fwAD.enter_dual_level()   # (levels nest here; torch allows one: docs/torch_conventions.md)
    try:
        assert_clear_error(lambda: fwAD.exit_dual_level(level=outer), RuntimeError,
                           ["exit_dual_level", f"level {outer}", "innermost"])
    finally:
        fwAD.exit_dual_level(level=inner)
        fwAD.exit_dual_level(level=outer)
    with fwAD.dual_level() as level:
        assert fwAD.current_level() == level
    assert fwAD.current_level() is None
