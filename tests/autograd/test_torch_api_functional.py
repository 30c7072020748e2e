"""Nested functional transforms as torch.autograd.functional computes them (issue 45, item 7):
a jvp of a function that calls jvp(..., create_graph=True), a Jacobian of a Jacobian, functional
calls inside others and under autograd.grad keep the dependence of their results on the inputs
(create_graph=True), and `strict` raises exactly where torch's does. float64 against torch."""
import numpy as np
import pytest

from autograd import Tensor, grad
from autograd import functional as AF

X = np.array([1.0, 2.0])
V = np.array([1.0, 1.0])


def cube(x):
    return x ** 3


def test_jvp_of_a_function_calling_jvp_with_create_graph_as_torch(torch):
    """The issue's case: d/dx (3 x^2 v) along v = 6 x v: torch gives [6, 12]."""
    ours = AF.jvp(lambda x: AF.jvp(cube, x, Tensor(V), create_graph=True)[1], Tensor(X), Tensor(V))
    tf = torch.autograd.functional
    theirs = tf.jvp(lambda x: tf.jvp(lambda y: y ** 3, x, torch.tensor(V), create_graph=True)[1], torch.tensor(X),
                    torch.tensor(V))
    np.testing.assert_array_equal(theirs[1].numpy(), [6.0, 12.0])
    for o, t in zip(ours, theirs):
        np.testing.assert_allclose(o.numpy(), t.numpy(), rtol=1e-14)


def test_a_jacobian_of_a_jacobian_is_torchs_and_the_hessian(torch):
    def f(x):
        return (x * x).sum() * x + x.tanh()
    tf = torch.autograd.functional
    x = np.array([0.3, -0.7, 1.1])
    ours = AF.jacobian(lambda a: AF.jacobian(f, a, create_graph=True), Tensor(x))
    theirs = tf.jacobian(lambda a: tf.jacobian(lambda b: (b * b).sum() * b + b.tanh(), a, create_graph=True),
                         torch.tensor(x))
    assert ours.shape == tuple(theirs.shape) == (3, 3, 3)
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-13, atol=1e-14)
    g = lambda a: (a ** 4).sum() + (a[0] * a[1]).tanh()  # noqa: E731
    hess_by_jacobians = AF.jacobian(lambda a: AF.jacobian(g, a, create_graph=True), Tensor(x))
    their_hessian = tf.hessian(lambda a: (a ** 4).sum() + (a[0] * a[1]).tanh(), torch.tensor(x))
    np.testing.assert_allclose(hess_by_jacobians.numpy(), their_hessian.numpy(), rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(AF.hessian(g, Tensor(x)).numpy(), their_hessian.numpy(), rtol=1e-13, atol=1e-14)


def test_without_create_graph_the_inner_result_is_a_constant_as_torch(torch):
    tf = torch.autograd.functional
    ours = AF.jacobian(lambda a: AF.jacobian(cube, a), Tensor(X))
    theirs = tf.jacobian(lambda a: tf.jacobian(lambda b: b ** 3, a), torch.tensor(X))
    np.testing.assert_array_equal(ours.numpy(), theirs.numpy())
    assert not ours.numpy().any()


@pytest.mark.parametrize("transform", ["vjp", "jvp", "hvp", "vhp"])
def test_results_with_create_graph_depend_on_the_callers_inputs_as_torch(transform, torch):
    """Differentiating a functional result with respect to the caller's own tensor (no fresh leaf cut)."""
    x_np = np.array([0.4, -1.3, 0.9])
    v_np = np.array([1.0, -2.0, 0.5])
    f = (lambda a: (a ** 4).sum()) if transform in ("hvp", "vhp") else (lambda a: a.tanh() * a)
    x, tx = Tensor(x_np, requires_grad=True), torch.tensor(x_np, requires_grad=True)
    v = Tensor(v_np)
    ours = getattr(AF, transform)(f, x, v, create_graph=True)[1]
    theirs = getattr(torch.autograd.functional, transform)(f, tx, torch.tensor(v_np), create_graph=True)[1]
    np.testing.assert_allclose(ours.numpy(), theirs.detach().numpy(), rtol=1e-13)
    assert ours.requires_grad and theirs.requires_grad
    (g,) = grad((ours * ours).sum(), x)
    (tg,) = torch.autograd.grad((theirs * theirs).sum(), tx)
    np.testing.assert_allclose(g.numpy(), tg.numpy(), rtol=1e-12)


def strict_cases(lib, ones):
    """(name, call(strict, create_graph)) on torch's functional API or ours: the cases of strict's rules."""
    x, y, v = (lib(a) for a in (X, np.array([3.0, 4.0]), V))
    return [
        ("an input unused", lambda s, c: lib.vjp(lambda a, b: a * 2, (x, y), v, strict=s, create_graph=c)),
        ("jacobian, an input unused", lambda s, c: lib.jacobian(lambda a, b: a * 2, (x, y), strict=s, create_graph=c)),
        ("jvp, an input unused", lambda s, c: lib.jvp(lambda a, b: a * 2, (x, y), (v, v), strict=s, create_graph=c)),
        ("linear", lambda s, c: lib.jacobian(lambda a: a * 2, x, strict=s, create_graph=c)),
        ("a constant output", lambda s, c: lib.jacobian(lambda a: ones(), x, strict=s, create_graph=c)),
        ("hessian of a linear function", lambda s, c: lib.hessian(lambda a: (a * 2).sum(), x, strict=s,
                                                                  create_graph=c)),
        ("cubic", lambda s, c: lib.jacobian(lambda a: a ** 3, x, strict=s, create_graph=c)),
    ]


class Ours:
    def __call__(self, array):
        return Tensor(array)

    def __getattr__(self, name):
        return getattr(AF, name)


class Theirs:
    def __init__(self, torch):
        self.torch = torch

    def __call__(self, array):
        return self.torch.tensor(array)

    def __getattr__(self, name):
        return getattr(self.torch.autograd.functional, name)


def _flat(result):
    if isinstance(result, (tuple, list)):
        return [a for r in result for a in _flat(r)]
    return [np.asarray(result.detach().numpy() if hasattr(result, "detach") else result)]


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("create_graph", [False, True])
def test_strict_raises_exactly_where_torchs_does_and_zeros_are_the_truth(strict, create_graph, torch):
    ours = strict_cases(Ours(), lambda: Tensor(np.ones(2)))
    theirs = strict_cases(Theirs(torch), lambda: torch.ones(2, dtype=torch.float64))
    for (name, call), (_, their_call) in zip(ours, theirs):
        try:
            expected = their_call(strict, create_graph)
        except RuntimeError:
            with pytest.raises(RuntimeError, match="strict=True|does not require grad"):
                call(strict, create_graph)
            continue
        got = call(strict, create_graph)
        for a, b in zip(_flat(got), _flat(expected)):
            np.testing.assert_allclose(a, b, rtol=1e-14, err_msg=name)
