"""`Tensor.register_hook` against torch's: what a hook sees (a non-leaf's summed gradient before its
op's backward, a leaf's whole gradient of the pass before `.grad`), replacements, the order of
several hooks and of retain_grad, handles, autograd.grad, create_graph, forward mode, and the
errors. Every case runs the same code on torch and on autograd and compares, in float64."""
import numpy as np
import pytest

import autograd
from autograd import Tensor
from autograd import forward_ad as fwAD


class Lib:
    """The few calls where torch and autograd differ, so that one function runs on both."""

    def __init__(self, name, torch=None):
        self.name, self.torch = name, torch

    def leaf(self, values):
        if self.name == "torch":
            return self.torch.tensor(values, dtype=self.torch.float64, requires_grad=True)
        return Tensor(np.array(values, dtype=np.float64), requires_grad=True)

    def const(self, values):
        return self.torch.tensor(values, dtype=self.torch.float64) if self.name == "torch" else Tensor(np.array(values))

    def grad(self, *args, **kwargs):
        return (self.torch.autograd.grad if self.name == "torch" else autograd.grad)(*args, **kwargs)

    def tanh(self, t):
        return self.torch.tanh(t) if self.name == "torch" else t.tanh()

    @property
    def fwAD(self):
        return self.torch.autograd.forward_ad if self.name == "torch" else fwAD


def values(t):
    """A Tensor's (or None's) values as a numpy array, for comparing the two libraries."""
    if t is None or isinstance(t, np.ndarray):  # (autograd's unpack_dual gives the tangent as an array)
        return t if t is None else t.copy()
    return t.detach().numpy().copy() if not isinstance(t, Tensor) else t.numpy().copy()


@pytest.fixture
def both(torch):
    return [Lib("torch", torch), Lib("ours")]


def assert_same(results):
    """results: [torch's, ours], each a list (or dict) of arrays (or None), equal to 1e-12 relative."""
    theirs, ours = results
    assert type(theirs) is type(ours) and len(theirs) == len(ours), (theirs, ours)
    for key in (theirs if isinstance(theirs, dict) else range(len(theirs))):
        a, b = theirs[key], ours[key]
        if a is None or b is None:
            assert a is None and b is None, (key, a, b)
        elif isinstance(a, str):
            assert a == b, (key, a, b)
        else:
            np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-300, err_msg=str(key))


# -- what a hook sees and what it changes ---------------------------------------------------------------
def test_hooks_on_a_non_leaf_run_in_order_around_retain_grad_and_a_leafs_sees_the_total(both):
    """y's hooks see its summed gradient (from two uses), the second the first's result;
    retain_grad, registered between them, keeps the value after both (torch's retains_grad hook
    runs last); x's hook sees the gradient through the replaced one, once, before `.grad`."""
    def run(lib):
        seen = []
        x = lib.leaf([1.0, 2.0, -0.5])
        y = x * 3.0
        y.register_hook(lambda g: seen.append(("y first", values(g))) or g * 2.0)
        y.retain_grad()
        y.register_hook(lambda g: seen.append(("y second", values(g))) or g + 1.0)
        x.register_hook(lambda g: seen.append(("x", values(g))))
        ((y * y).sum() + (y * x).sum()).backward()
        return [name for name, _ in seen] + [v for _, v in seen] + [values(y.grad), values(x.grad)]

    assert_same([run(lib) for lib in both])


def test_a_leafs_hook_runs_once_per_pass_on_the_sum_of_its_uses_and_its_result_goes_into_grad(both):
    def run(lib):
        seen = []
        w = lib.leaf([1.0, 2.0])
        w.register_hook(lambda g: seen.append(values(g)) or g * g)
        ((w * 2.0).sum() + (w * w * 3.0).sum() + lib.tanh(w).sum()).backward()
        (w * 5.0).sum().backward()  # a second pass: the hook again, .grad accumulates the replaced gradients
        return seen + [values(w.grad)]

    assert_same([run(lib) for lib in both])


def test_a_replacing_hook_changes_every_gradient_downstream_as_torchs_does(both):
    def run(lib, replace):
        x, b = lib.leaf([0.3, -1.2, 2.0]), lib.leaf([0.5, 0.5, -1.0])
        h = lib.tanh(x * b)
        h.register_hook(replace)
        (h * h * b).sum().backward()
        return [values(x.grad), values(b.grad)]

    for replace in (lambda g: g * 0.0, lambda g: g * 2.0, lambda g: None):
        assert_same([run(lib, replace) for lib in both])


def test_a_post_accumulate_grad_hook_sees_grad_after_the_tensor_hooks(both):
    def run(lib):
        seen = []
        w = lib.leaf([1.0, -2.0])
        w.register_post_accumulate_grad_hook(lambda p: seen.append(values(p.grad)))
        w.register_hook(lambda g: g * 10.0)
        ((w * w).sum() + w.sum()).backward()
        return seen

    assert_same([run(lib) for lib in both])


def test_a_hook_on_the_root_and_on_a_root_leaf(both):
    def run(lib):
        x = lib.leaf([1.0, 2.0])
        y = x * 2.0
        y.register_hook(lambda g: g * 3.0)
        y.backward(lib.const([1.0, -1.0]))
        v = lib.leaf([4.0, 5.0])
        v.register_hook(lambda g: g * 2.0)
        v.backward(lib.const([1.0, 3.0]))
        return [values(x.grad), values(v.grad)]

    assert_same([run(lib) for lib in both])


def test_hooks_stay_on_a_retained_graph_and_removed_hooks_are_not_called(both):
    def run(lib):
        calls = []
        x = lib.leaf([1.0, 2.0])
        y = x * x
        first = y.register_hook(lambda g: calls.append("first") or g * 2.0)
        y.register_hook(lambda g: calls.append("second"))
        on_x = x.register_hook(lambda g: calls.append("x") or g + 1.0)
        y.sum().backward(retain_graph=True)
        first.remove()
        on_x.remove()
        first.remove()  # a second remove does nothing
        y.sum().backward()
        return calls + [values(x.grad)]

    assert_same([run(lib) for lib in both])


def test_autograd_grad_returns_what_the_hooks_return_for_leaves_and_non_leaves(both):
    def run(lib):
        seen = []
        x = lib.leaf([1.0, 2.0])
        x.register_hook(lambda g: seen.append(values(g)) or g * 10.0)
        h = x * 2.0
        h.register_hook(lambda g: seen.append(values(g)) or g - 1.0)
        out = (h * h * x).sum()
        gh, gx = lib.grad(out, [h, x], retain_graph=True)
        only_h, = lib.grad(out, [h])
        return seen + [values(gh), values(gx), values(only_h)]

    assert_same([run(lib) for lib in both])


def test_backward_with_inputs_accumulates_what_the_hooks_return(both):
    def run(lib, with_leaf):
        x = lib.leaf([1.0, 2.0])
        h = x * 2.0
        h.register_hook(lambda g: g - 1.0)
        x.register_hook(lambda g: g * 3.0)
        (h * h * x).sum().backward(inputs=[h, x] if with_leaf else [h])
        return [values(h.grad), values(x.grad)]

    for with_leaf in (False, True):
        assert_same([run(lib, with_leaf) for lib in both])


def test_a_hook_sees_a_tensor_outside_any_graph_at_first_order(both):
    def run(lib):
        seen = []
        x = lib.leaf([1.0, 2.0])
        y = x * 2.0
        y.register_hook(lambda g: seen.append(("non-leaf", type(g).__name__, g.requires_grad)))
        x.register_hook(lambda g: seen.append(("leaf", type(g).__name__, g.requires_grad)))
        y.sum().backward()
        return [str((kind, requires_grad)) for kind, _, requires_grad in seen]

    results = [run(lib) for lib in both]
    assert_same(results)


# -- create_graph and forward mode ------------------------------------------------------------------------
def test_under_create_graph_what_a_hook_computes_is_differentiated(both):
    """The hooks return the gradient times a function of x: x's gradient, then the gradient of its
    sum with respect to x (reverse over reverse), equal torch's."""
    def run(lib):
        x = lib.leaf([0.5, -1.0, 2.0])
        h = lib.tanh(x) * x
        h.register_hook(lambda g: g * h)
        x.register_hook(lambda g: g * lib.tanh(x))
        gx, = lib.grad((h * h).sum(), x, create_graph=True)
        ggx, = lib.grad((gx * gx).sum(), x)
        return [values(gx), values(ggx)]

    assert_same([run(lib) for lib in both])


def test_backward_with_create_graph_accumulates_the_hooks_result_as_a_graph(both):
    def run(lib):
        x = lib.leaf([0.5, -1.0])
        x.register_hook(lambda g: g * x)
        (x * x * x).sum().backward(create_graph=True)
        first = values(x.grad)
        grad_of_grad, = lib.grad(x.grad.sum(), x)
        return [first, values(grad_of_grad)]

    assert_same([run(lib) for lib in both])


def test_in_forward_mode_a_hook_sees_and_returns_gradients_that_carry_tangents(both):
    """Forward over reverse: inside a dual level, the hook's gradient carries its tangent, and the
    tangent of what it returns (the gradient times y, itself dual) flows into x's gradient."""
    def run(lib):
        seen = []
        ad = lib.fwAD
        with ad.dual_level():
            x = ad.make_dual(lib.leaf([0.5, -1.0, 2.0]), lib.const([1.0, 0.5, -2.0]))
            y = lib.tanh(x) * x
            y.register_hook(lambda g: seen.append(values(ad.unpack_dual(g).tangent)) or g * y)
            g, = lib.grad((y * y).sum(), x)
            primal, tangent = ad.unpack_dual(g)
            return seen + [values(primal), values(tangent)]

    assert_same([run(lib) for lib in both])


# -- errors -----------------------------------------------------------------------------------------------
def test_a_hook_on_a_tensor_without_grad_and_a_hook_that_is_not_callable_are_refused(torch):
    with pytest.raises(RuntimeError, match="cannot register a hook on a tensor that doesn't require gradient"):
        torch.tensor([1.0]).register_hook(lambda g: g)
    with pytest.raises(RuntimeError, match="cannot register a hook on a tensor that does not require grad"):
        Tensor(np.ones(2)).register_hook(lambda g: g)
    with pytest.raises(TypeError, match="hook must be a callable hook\\(grad\\) -> Tensor or None, got int"):
        Tensor(np.ones(2), requires_grad=True).register_hook(3)


@pytest.mark.parametrize("returned, error, message", [
    (lambda g: Tensor(np.ones(3)), RuntimeError, r"returned a gradient of shape \(3,\), dtype float64 on 'cpu': "
                                                 r"expected shape \(2,\), dtype float64"),
    (lambda g: g.float(), RuntimeError, r"returned a gradient of shape \(2,\), dtype float32 .*expected shape "
                                        r"\(2,\), dtype float64"),
    (lambda g: 3.0, TypeError, "returned float: a hook returns a Tensor"),
    (lambda g: g.numpy(), TypeError, "returned ndarray: a hook returns a Tensor"),
], ids=["shape", "dtype", "number", "array"])
@pytest.mark.parametrize("on", ["leaf", "non-leaf"])
def test_a_hook_that_returns_something_else_than_a_gradient_of_the_tensor_is_an_error(returned, error, message, on):
    x = Tensor(np.ones(2), requires_grad=True)
    y = x * 2.0
    (x if on == "leaf" else y).register_hook(returned)
    with pytest.raises(error, match=message):
        (y * y).sum().backward()
