"""Differentiating a gradient: `backward(create_graph=True)`, `autograd.grad`, `gradgradcheck`
and `autograd.functional`, with torch's semantics and torch's numbers (float64). Every primitive
of Tensor passes gradgradcheck and matches torch's double backward; a third derivative works
(the backward of every primitive is made of differentiable primitives); an op without a
differentiable backward raises, naming itself, instead of giving a silent zero."""
import numpy as np
import pytest

import autograd
from autograd import Function, GradcheckError, Tensor, grad, gradgradcheck
from autograd import functional as AF


def leaf(a):
    return Tensor(np.asarray(a, dtype=np.float64), requires_grad=True)


R = np.random.default_rng(0)
POSITIVE = np.abs(R.standard_normal((3, 4))) + 0.5
# (name, function of Tensors written the same way for both libraries, input arrays)
PRIMITIVES = [
    ("add_broadcast", lambda a, b: a + b, [R.standard_normal((3, 4)), R.standard_normal(4)]),
    ("sub_broadcast", lambda a, b: a - b, [R.standard_normal((3, 4)), R.standard_normal((3, 1))]),
    ("mul", lambda a, b: a * b * a, [R.standard_normal((3, 4)), R.standard_normal((1, 4))]),
    ("div", lambda a, b: a / b, [R.standard_normal((3, 4)), POSITIVE]),
    ("neg_and_scalars", lambda a: -a * 3.0 + 2.0 - a / 4.0, [R.standard_normal((3, 4))]),
    ("pow_scalar", lambda a: a ** 3, [R.standard_normal((3, 4))]),
    ("pow_tensor", lambda a, b: a ** b, [POSITIVE, R.standard_normal((3, 4))]),
    ("rpow", lambda b: 2.0 ** b, [R.standard_normal((3, 4))]),
    ("matmul", lambda a, b: a @ b, [R.standard_normal((2, 3, 4)), R.standard_normal((4, 5))]),
    ("matmul_vector", lambda a, b: a @ b, [R.standard_normal((3, 4)), R.standard_normal(4)]),
    ("vector_matmul", lambda a, b: a @ b, [R.standard_normal(3), R.standard_normal((3, 4))]),
    ("exp", lambda a: a.exp(), [R.standard_normal((3, 4))]),
    ("log", lambda a: a.log(), [POSITIVE]),
    ("sqrt", lambda a: a.sqrt(), [POSITIVE]),
    ("tanh", lambda a: a.tanh(), [R.standard_normal((3, 4))]),
    ("relu_times_x", lambda a: a.relu() * a, [R.standard_normal((3, 4))]),
    ("sum_axis", lambda a: (a * a).sum(axis=1), [R.standard_normal((3, 4))]),
    ("mean_keepdims", lambda a: (a * a).mean(axis=0, keepdims=True), [R.standard_normal((3, 4))]),
    ("max_axis", lambda a: a.max(axis=1) * a.sum(axis=1), [R.standard_normal((3, 4))]),
    ("reshape_permute", lambda a: (a * a).reshape(2, 6).permute(1, 0), [R.standard_normal((3, 4))]),
    ("expand", lambda a: (a * a).expand(2, 3, 4), [R.standard_normal((3, 4))]),
    ("getitem_slices", lambda a: (a * a)[1:, ::2], [R.standard_normal((3, 4))]),
]
TORCH_EXTRA = {"expand": lambda t, a: (a * a).expand(2, 3, 4), "reshape_permute": lambda t, a: (a * a).reshape(2, 6).permute(1, 0),
               "max_axis": lambda t, a: a.amax(dim=1) * a.sum(dim=1), "sum_axis": lambda t, a: (a * a).sum(dim=1),
               "mean_keepdims": lambda t, a: (a * a).mean(dim=0, keepdim=True), "relu_times_x": lambda t, a: a.relu() * a}


@pytest.mark.parametrize("name,fn,arrays", PRIMITIVES, ids=[p[0] for p in PRIMITIVES])
def test_every_primitive_passes_gradgradcheck(name, fn, arrays):
    assert gradgradcheck(fn, [leaf(a) for a in arrays])


def hvp_of(library, fn, arrays, upstream, directions):
    """d/dx <d/dx <fn(x), g>, u>: the second derivative of fn contracted with g and u, by
    `library`'s grad with create_graph (ours or torch's)."""
    if library == "ours":
        xs = [leaf(a) for a in arrays]
        first = grad(fn(*xs), xs, Tensor(upstream), create_graph=True)
        pairs = [(f, Tensor(u)) for f, u in zip(first, directions) if f.requires_grad]
        second = grad([f for f, _ in pairs], xs, [u for _, u in pairs], allow_unused=True) if pairs else [None] * len(xs)
        return [np.zeros_like(a) if s is None else s.numpy() for s, a in zip(second, arrays)]
    torch, torch_fn = library  # a first derivative that does not depend on x (linear ops) has no graph
    xs = [torch.tensor(a, requires_grad=True) for a in arrays]
    first = torch.autograd.grad(torch_fn(torch, *xs), xs, torch.tensor(upstream), create_graph=True)
    pairs = [(f, torch.tensor(u)) for f, u in zip(first, directions) if f.requires_grad]
    second = (torch.autograd.grad([f for f, _ in pairs], xs, [u for _, u in pairs], allow_unused=True) if pairs
              else [None] * len(xs))
    return [np.zeros_like(a) if s is None else s.numpy() for s, a in zip(second, arrays)]


@pytest.mark.parametrize("name,fn,arrays", PRIMITIVES, ids=[p[0] for p in PRIMITIVES])
def test_every_primitive_matches_torchs_double_backward(name, fn, arrays, torch):
    rng = np.random.default_rng(1)
    out = fn(*[Tensor(a) for a in arrays])
    upstream = rng.standard_normal(out.shape)
    directions = [rng.standard_normal(a.shape) for a in arrays]
    torch_fn = TORCH_EXTRA.get(name, lambda t, *xs: fn(*xs))
    ours = hvp_of("ours", fn, arrays, upstream, directions)
    theirs = hvp_of((torch, torch_fn), None, arrays, upstream, directions)
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12 * max(1.0, np.abs(b).max()))


def test_a_third_derivative_through_the_primitives():
    x = leaf([0.5, -1.5, 2.0])
    (g1,) = grad((x ** 4).sum(), x, create_graph=True)          # 4 x^3
    (g2,) = grad(g1.sum(), x, create_graph=True)               # 12 x^2
    (g3,) = grad(g2.sum(), x)                                   # 24 x
    np.testing.assert_allclose(g1.numpy(), 4 * x.numpy() ** 3)
    np.testing.assert_allclose(g2.numpy(), 12 * x.numpy() ** 2)
    np.testing.assert_allclose(g3.numpy(), 24 * x.numpy())


def test_backward_create_graph_makes_grad_differentiable_like_torch(torch):
    a = np.array([0.3, -0.7, 1.1])
    x = leaf(a)
    ((x * x).exp().sum()).backward(create_graph=True)
    assert x.grad.requires_grad and not x.grad.is_leaf
    (x.grad * x.grad).sum().backward()   # a gradient penalty: ||dL/dx||^2, added into x.grad
    t = torch.tensor(a, requires_grad=True)
    ((t * t).exp().sum()).backward(create_graph=True)
    (t.grad * t.grad).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), t.grad.detach().numpy(), rtol=1e-12)


def test_retain_graph_defaults_to_create_graph():
    x = leaf([1.0, 2.0])
    y = (x * x).sum()
    y.backward(create_graph=True)
    y.backward()          # the graph was kept
    with pytest.raises(RuntimeError, match="already freed"):
        y.backward()


def test_grad_returns_the_gradients_and_leaves_dot_grad_alone():
    x, w = leaf([1.0, 2.0]), leaf([3.0, -1.0])
    gx, gw = grad((x * w).sum(), [x, w])
    np.testing.assert_array_equal(gx.numpy(), [3.0, -1.0])
    np.testing.assert_array_equal(gw.numpy(), [1.0, 2.0])
    assert x.grad is None and w.grad is None and not gx.requires_grad


def test_grad_of_a_non_leaf_and_allow_unused():
    x, unused = leaf([1.0, 2.0]), leaf([5.0])
    h = x * 3.0
    (gh,) = grad((h * h).sum(), h)
    np.testing.assert_array_equal(gh.numpy(), 2 * h.numpy())
    with pytest.raises(RuntimeError, match=r"inputs\[1\].*not used.*allow_unused=True"):
        grad((x * x).sum(), [x, unused])
    assert grad((x * x).sum(), [x, unused], allow_unused=True)[1] is None


def test_backward_inputs_accumulates_only_into_those():
    x, w = leaf([1.0, 2.0]), leaf([3.0, -1.0])
    (x * w).sum().backward(inputs=[w])
    assert x.grad is None
    np.testing.assert_array_equal(w.grad.numpy(), [1.0, 2.0])


def test_grad_outputs_that_require_grad_are_differentiated(torch):
    """d/dg of the VJP g^T J is J u: the upstream gradient is an input of the first derivative."""
    a, u0 = np.array([0.2, -0.4, 0.9]), np.array([1.0, 2.0, -1.0])
    x, g = leaf(a), leaf(u0)
    (vjp,) = grad(x.tanh(), x, g, create_graph=True)
    (dg,) = grad(vjp.sum(), g)
    np.testing.assert_allclose(dg.numpy(), 1 - np.tanh(a) ** 2)


class Square(Function):
    """x^2 with a raw-array backward only: differentiable once."""

    @staticmethod
    def forward(ctx, a):
        ctx.save_for_backward(a)
        return a * a

    @staticmethod
    def backward(ctx, g):
        (a,) = ctx.saved_tensors
        return 2 * a * g


class TwiceSquare(Square):
    """The same op with a differentiable backward: every order works."""

    @staticmethod
    def differentiable_backward(ctx, g):
        (x,) = ctx.inputs
        return 2 * x * g


def test_a_function_without_differentiable_backward_refuses_a_second_derivative():
    x = leaf([1.0, -2.0])
    (g,) = grad(Square.apply(x).sum(), x, create_graph=True)   # the first derivative is fine
    np.testing.assert_array_equal(g.numpy(), [2.0, -4.0])
    with pytest.raises(RuntimeError, match=r"test_higher_order\.Square is differentiable once"):
        grad(g.sum(), x)
    with pytest.raises(RuntimeError, match="differentiable once"):
        gradgradcheck(Square.apply, [leaf([1.0, -2.0])])


def test_a_function_with_differentiable_backward_passes_gradgradcheck():
    assert gradgradcheck(TwiceSquare.apply, [leaf([1.0, -2.0, 0.5])])


def test_gradgradcheck_catches_a_wrong_double_backward():
    class WrongTwice(Square):
        @staticmethod
        def differentiable_backward(ctx, g):
            (x,) = ctx.inputs
            return 2 * x * x * g / x.detach()   # right values, wrong derivative: d/dx is 4g, not 2g
    with pytest.raises(GradcheckError):
        gradgradcheck(WrongTwice.apply, [leaf([1.0, -2.0, 0.5])])


def test_grad_is_a_tensor_and_assignments_are_checked():
    x = leaf([1.0, 2.0])
    (x * x).sum().backward()
    assert isinstance(x.grad, Tensor) and x.grad.dtype == np.float64
    with pytest.raises(TypeError, match="grad: expected a Tensor or None, got ndarray"):
        x.grad = np.zeros(2)
    with pytest.raises(ValueError, match=r"grad: expected a Tensor of shape \(2,\)"):
        x.grad = Tensor(np.zeros(3))
    x.grad = None


def test_bad_arguments_of_grad_are_clear_errors():
    x = leaf([1.0, 2.0])
    y = (x * x).sum()
    with pytest.raises(TypeError, match="grad: inputs must be a Tensor"):
        grad(y, [np.ones(2)])
    with pytest.raises(RuntimeError, match=r"inputs\[0\] does not require grad"):
        grad(y, Tensor(np.ones(2)))
    with pytest.raises(ValueError, match="grad_outputs has 2 entries"):
        grad(y, x, [None, None])
    with pytest.raises(TypeError, match="create_graph"):
        grad(y, x, create_graph="yes")


def cubic(x, w):
    return ((x @ w).tanh() * x.sum(axis=1, keepdims=True)).sum()


@pytest.mark.parametrize("fn_name", ["vjp", "hvp", "vhp", "hessian", "jacobian"])
def test_autograd_functional_matches_torch(fn_name, torch):
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((2, 3)), rng.standard_normal((3, 2))
    ins, t_ins = (Tensor(x), Tensor(w)), (torch.tensor(x), torch.tensor(w))
    vectors = (rng.standard_normal(x.shape), rng.standard_normal(w.shape))
    if fn_name == "jacobian":
        ours = AF.jacobian(lambda x, w: (x @ w).tanh(), ins)
        theirs = torch.autograd.functional.jacobian(lambda x, w: (x @ w).tanh(), t_ins)
    elif fn_name == "hessian":
        ours, theirs = AF.hessian(cubic, ins), torch.autograd.functional.hessian(cubic, t_ins)
        ours, theirs = [b for row in ours for b in row], [b for row in theirs for b in row]
    elif fn_name == "vjp":
        v = rng.standard_normal((2, 2))
        f = lambda x, w: (x @ w).tanh()  # noqa: E731
        ours = AF.vjp(f, ins, Tensor(v))
        theirs = torch.autograd.functional.vjp(f, t_ins, torch.tensor(v))
        ours, theirs = [ours[0], *ours[1]], [theirs[0], *theirs[1]]
    else:
        fn = getattr(AF, fn_name)
        ours = fn(cubic, ins, tuple(Tensor(v) for v in vectors))
        theirs = getattr(torch.autograd.functional, fn_name)(cubic, t_ins, tuple(torch.tensor(v) for v in vectors))
        ours, theirs = [ours[0], *ours[1]], [theirs[0], *theirs[1]]
    for a, b in zip(ours if isinstance(ours, (list, tuple)) else [ours], theirs if isinstance(theirs, (list, tuple)) else [theirs]):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-12, atol=1e-13)


def test_functional_leaves_the_callers_tensors_alone_and_checks_v():
    x = leaf([1.0, 2.0])
    AF.hvp(lambda x: (x ** 3).sum(), x, Tensor(np.ones(2)))
    assert x.grad is None
    with pytest.raises(ValueError, match=r"hvp: v\[0\] has shape \(3,\), expected \(2,\)"):
        AF.hvp(lambda x: (x ** 3).sum(), x, Tensor(np.ones(3)))
    with pytest.raises(RuntimeError, match="one element"):
        AF.hvp(lambda x: x ** 3, x, Tensor(np.ones(2)))


def test_gradgradcheck_of_a_scalar_output():
    """The upstream gradient of a 0-d output is a 0-d input of the first derivative: finite
    differences must keep it 0-d (numpy's ascontiguousarray would make it (1,))."""
    assert gradgradcheck(lambda a: (a * a * a).sum(), [leaf([0.5, -1.5, 2.0])])
