"""Forward mode: `autograd.forward_ad` (dual tensors, torch's API), a jvp rule for every primitive
checked against central differences, against the backward through the transpose identity
<g, J u> = <J^T g, u> (`gradcheck(check_forward_ad=True)`) and against torch.func.jvp (float64);
forward over reverse (the tangent of a gradient is H v) against reverse over reverse and torch;
`autograd.functional`'s forward-mode entries against torch's."""
import threading

import numpy as np
import pytest

from autograd import Function, GradcheckError, Tensor, grad, gradcheck
from autograd import forward_ad as fwAD
from autograd import functional as AF

from helpers import assert_clear_error
from test_higher_order import PRIMITIVES, TORCH_EXTRA, Square, hvp_of


@pytest.mark.parametrize("name,fn,arrays", PRIMITIVES, ids=[p[0] for p in PRIMITIVES])
def test_every_primitive_passes_gradcheck_with_forward_mode(name, fn, arrays):
    assert gradcheck(fn, [Tensor(a, requires_grad=True) for a in arrays], check_forward_ad=True)


def ours_jvp(fn, arrays, tangents):
    with fwAD.dual_level():
        out = fn(*[fwAD.make_dual(Tensor(a), u) for a, u in zip(arrays, tangents)])
        return fwAD.unpack_dual(out)


@pytest.mark.parametrize("name,fn,arrays", PRIMITIVES, ids=[p[0] for p in PRIMITIVES])
def test_every_primitive_matches_torch_func_jvp(name, fn, arrays, torch):
    rng = np.random.default_rng(2)
    tangents = [rng.standard_normal(a.shape) for a in arrays]
    primal, tangent = ours_jvp(fn, arrays, tangents)
    torch_fn = TORCH_EXTRA.get(name, lambda t, *xs: fn(*xs))
    t_out, t_tangent = torch.func.jvp(lambda *xs: torch_fn(torch, *xs), tuple(torch.tensor(a) for a in arrays),
                                      tuple(torch.tensor(u) for u in tangents))
    np.testing.assert_allclose(primal.numpy(), t_out.numpy(), rtol=1e-14, atol=0)
    np.testing.assert_allclose(tangent, t_tangent.numpy(), rtol=1e-12, atol=1e-13 * max(1.0, np.abs(tangent).max()))


@pytest.mark.parametrize("name,fn,arrays", PRIMITIVES, ids=[p[0] for p in PRIMITIVES])
def test_forward_over_reverse_equals_reverse_over_reverse(name, fn, arrays):
    rng = np.random.default_rng(4)
    out = fn(*[Tensor(a) for a in arrays])
    upstream, directions = rng.standard_normal(out.shape), [rng.standard_normal(a.shape) for a in arrays]
    reverse = hvp_of("ours", fn, arrays, upstream, directions)
    with fwAD.dual_level():
        xs = [fwAD.make_dual(Tensor(a, requires_grad=True), u) for a, u in zip(arrays, directions)]
        gs = grad(fn(*xs), xs, Tensor(upstream))
        forward = [fwAD.unpack_dual(g).tangent for g in gs]
    for r, f, a in zip(reverse, forward, arrays):
        np.testing.assert_allclose(np.zeros_like(a) if f is None else f, r, rtol=1e-12, atol=1e-13 * max(1, np.abs(r).max()))


class Cube(Function):
    @staticmethod
    def forward(ctx, a):
        ctx.save_for_backward(a)
        return a * a * a

    @staticmethod
    def backward(ctx, g):
        (a,) = ctx.saved_tensors
        return 3 * a * a * g


def test_an_op_without_a_jvp_rule_is_an_error_naming_it():
    with fwAD.dual_level():
        x = fwAD.make_dual(Tensor(np.ones(3)), np.ones(3))
        with pytest.raises(RuntimeError, match=r"test_forward_ad\.Cube has no forward-mode rule"):
            Cube.apply(x)
        Cube.apply(Tensor(np.ones(3)))   # no tangent reaches it: nothing to do


class SquareWithJvp(Square):
    """A jvp rule, but a backward on raw arrays only."""

    @staticmethod
    def jvp(ctx, t):
        (a,) = ctx.saved_tensors
        return 2 * a * t


def test_forward_over_reverse_through_an_op_without_differentiable_backward_is_an_error():
    with fwAD.dual_level():
        x = fwAD.make_dual(Tensor(np.ones(3), requires_grad=True), np.ones(3))
        with pytest.raises(RuntimeError, match=r"SquareWithJvp has no differentiable_backward"):
            grad(SquareWithJvp.apply(x * 2.0).sum(), x)


def test_gradcheck_with_forward_mode_catches_a_wrong_jvp_rule():
    class WrongJvp(Cube):
        @staticmethod
        def jvp(ctx, t):
            (a,) = ctx.saved_tensors
            return 2 * a * a * t      # the derivative is 3 a^2
    with pytest.raises(GradcheckError, match="forward mode, output 0"):
        gradcheck(WrongJvp.apply, [Tensor(np.array([0.5, -1.0, 2.0]), requires_grad=True)], check_forward_ad=True)


def test_the_transpose_identity_catches_a_jvp_and_a_backward_wrong_the_same_way():
    """A jvp and a backward that agree with each other but not with the function: the finite
    differences catch the jvp; a jvp right and a backward wrong: the identity ties them."""
    class WrongBackward(Cube):
        @staticmethod
        def backward(ctx, g):
            (a,) = ctx.saved_tensors
            return 2 * a * a * g

        @staticmethod
        def jvp(ctx, t):
            (a,) = ctx.saved_tensors
            return 3 * a * a * t
    x = Tensor(np.array([0.5, -1.0, 2.0]), requires_grad=True)
    with pytest.raises(GradcheckError):
        gradcheck(WrongBackward.apply, [x], check_forward_ad=True)


def test_dual_levels_are_per_thread_and_tangents_go_with_their_level():
    with fwAD.dual_level():
        x = fwAD.make_dual(Tensor(np.ones(2)), np.full(2, 3.0))
        y = x * 2.0
        seen = []
        thread = threading.Thread(target=lambda: seen.append(fwAD.current_level()))
        thread.start()
        thread.join()
        assert seen == [None]
        np.testing.assert_array_equal(fwAD.unpack_dual(y).tangent, [6.0, 6.0])
    assert fwAD.unpack_dual(y).tangent is None and y._tangents == {}


def test_make_dual_checks_its_arguments():
    with pytest.raises(RuntimeError, match="no dual level is active"):
        fwAD.make_dual(Tensor(np.ones(2)), np.ones(2))
    with fwAD.dual_level():
        with pytest.raises(ValueError, match=r"tangent must have shape \(2,\), dtype float64"):
            fwAD.make_dual(Tensor(np.ones(2)), np.ones(3))
        with pytest.raises(TypeError, match="tangent must be an array or a Tensor, got list"):
            fwAD.make_dual(Tensor(np.ones(2)), [1.0, 2.0])
        with pytest.raises(TypeError, match="must be floating"):
            fwAD.make_dual(Tensor(np.ones(2, dtype=int)), np.ones(2, dtype=int))


def cubic(x, w):
    return ((x @ w).tanh() * x.sum(axis=1, keepdims=True)).sum()


@pytest.mark.parametrize("what", ["jvp", "hvp_forward_over_reverse", "jacobian_forward", "hessian_forward"])
def test_functional_forward_mode_matches_torch(what, torch):
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((2, 3)), rng.standard_normal((3, 2))
    ins, t_ins = (Tensor(x), Tensor(w)), (torch.tensor(x), torch.tensor(w))
    vs = (rng.standard_normal(x.shape), rng.standard_normal(w.shape))
    f = lambda x, w: (x @ w).tanh()  # noqa: E731
    if what == "jvp":
        ours = [AF.jvp(f, ins, tuple(Tensor(v) for v in vs))[1]]
        theirs = [torch.autograd.functional.jvp(f, t_ins, tuple(torch.tensor(v) for v in vs))[1]]
    elif what == "hvp_forward_over_reverse":
        ours = list(AF.hvp(cubic, ins, tuple(Tensor(v) for v in vs))[1])
        theirs = list(torch.autograd.functional.hvp(cubic, t_ins, tuple(torch.tensor(v) for v in vs))[1])
    elif what == "jacobian_forward":
        ours = list(AF.jacobian(f, ins, strategy="forward-mode"))
        theirs = list(torch.autograd.functional.jacobian(f, t_ins))
    else:
        ours = [b for row in AF.hessian(cubic, ins, outer_jacobian_strategy="forward-mode") for b in row]
        theirs = [b for row in torch.autograd.functional.hessian(cubic, t_ins) for b in row]
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-12, atol=1e-13)


def test_linearize_gives_jvp_without_running_func_again(torch):
    """autograd.functional.linearize (torch.func.linearize): jvp_fn(u) equals jvp(func, x, u) and
    torch.func.linearize's, along several tangents, while func itself runs once."""
    rng = np.random.default_rng(7)
    x0, w0 = rng.standard_normal((4, 6)), rng.standard_normal((5, 6))
    calls = []

    def f(x, w):
        calls.append(1)
        return (x @ w.T).tanh().exp(), (x * x).sum()

    (y, s), jvp_fn = AF.linearize(f, Tensor(x0), Tensor(w0))
    _, torch_jvp = torch.func.linearize(lambda x, w: ((x @ w.T).tanh().exp(), (x * x).sum()),
                                        torch.tensor(x0), torch.tensor(w0))
    for _ in range(3):
        u, U = rng.standard_normal(x0.shape), rng.standard_normal(w0.shape)
        ours = jvp_fn(Tensor(u), Tensor(U))
        direct = AF.jvp(f, (Tensor(x0), Tensor(w0)), (Tensor(u), Tensor(U)))[1]
        theirs = torch_jvp(torch.tensor(u), torch.tensor(U))
        for a, b, c in zip(ours, direct, theirs):
            np.testing.assert_array_equal(a.numpy(), b.numpy())
            np.testing.assert_allclose(a.numpy(), c.numpy(), rtol=1e-12, atol=1e-14)
    assert len(calls) == 1 + 3                       # linearize's run, then only the direct jvp's


def test_linearize_of_a_gradient_gives_hessian_vector_products():
    """Forward over reverse, recorded once: the tangent of the gradient is H u, as hvp and vhp give it."""
    rng = np.random.default_rng(8)
    x0 = rng.standard_normal((6, 4))
    loss = lambda w: ((Tensor(x0) @ w.T).tanh() ** 2).exp().sum()   # noqa: E731
    w0 = rng.standard_normal((3, 4))

    def gradient(w):
        return grad(loss(w), [w])[0]

    g, hvp_fn = AF.linearize(gradient, Tensor(w0, requires_grad=True))
    for _ in range(3):
        u = rng.standard_normal(w0.shape)
        product = hvp_fn(Tensor(u)).numpy()
        np.testing.assert_allclose(product, AF.hvp(loss, Tensor(w0), Tensor(u))[1].numpy(), rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(product, AF.vhp(loss, Tensor(w0), Tensor(u))[1].numpy(), rtol=1e-10, atol=1e-12)


def test_linearize_refuses_a_tangent_made_inside_func():
    def f(x):
        return x * fwAD.make_dual(Tensor(np.ones(3)), np.ones(3))

    with pytest.raises(RuntimeError, match="linearize: a tangent reached Mul other than through the primals"):
        AF.linearize(f, Tensor(np.arange(3.0)))


def test_linearize_checks_its_tangents():
    _, jvp_fn = AF.linearize(lambda x: x * 2, Tensor(np.ones(3)))
    assert_clear_error(lambda: jvp_fn(Tensor(np.ones(4))), ValueError, ["linearize", "tangents[0]", "(3,)", "(4,)"])


class ScaledByTwo(Function):
    """y = 2 x, whose differentiable backward records what tangent_only_grads says of its input."""
    seen = []

    @staticmethod
    def forward(ctx, x):
        return 2 * x

    @staticmethod
    def backward(ctx, dy):
        return 2 * dy

    @staticmethod
    def differentiable_backward(ctx, dy):
        ScaledByTwo.seen.append(ctx.tangent_only_grads)
        return 2 * dy

    @staticmethod
    def jvp(ctx, t):
        return 2 * t


def test_hvp_reads_only_the_tangents_of_the_gradients_it_asks_for():
    """autograd.functional.hvp's backward marks the inputs whose gradient only its tangent is read
    (Function.tangent_only_grads): the wanted tensors, not what passes through them; a backward that
    func itself runs (a gradient penalty) is an ordinary pass, and so is any other pass."""
    rng = np.random.default_rng(5)
    x = Tensor(rng.standard_normal(4), requires_grad=True)
    u = Tensor(rng.standard_normal(4))

    def penalty(x):  # |grad of sum(exp(2 x))|^2 + sum((2 x)^3): a gradient inside func
        (g,) = grad(ScaledByTwo.apply(x).exp().sum(), x, create_graph=True)
        return (g * g).sum() + (ScaledByTwo.apply(x) ** 3).sum()

    ScaledByTwo.seen.clear()
    products = AF.hvp(penalty, x, u)[1]
    # func's own pass: ordinary (nothing marked); hvp's pass: x's gradient ends at the caller
    assert frozenset() in ScaledByTwo.seen and frozenset({0}) in ScaledByTwo.seen
    np.testing.assert_allclose(products.numpy(), AF.vhp(penalty, x, u)[1].numpy(), rtol=1e-12, atol=1e-12)
    ScaledByTwo.seen.clear()
    grad(ScaledByTwo.apply(x).sum(), x, create_graph=True)
    assert ScaledByTwo.seen == [frozenset()]
