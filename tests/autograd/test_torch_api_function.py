"""torch's custom-Function API (issue 45, item 7), each against the same torch.autograd.Function
on small float64 cases: the setup_context style, ctx.save_for_forward, ctx.mark_dirty,
ctx.mark_non_differentiable, ctx.set_materialize_grads(False), the once_differentiable decorator,
and gradcheck's check_undefined_grad on a Function that asks for None gradients."""
import numpy as np
import pytest

import autograd
from autograd import Function, Tensor, grad
from autograd import forward_ad as fwAD
from autograd.function import once_differentiable

from helpers import assert_clear_error

X = np.array([0.5, -1.5, 2.0])
W = np.array([1.5, 0.25, -2.0])


def pair(torch, array=X):
    return Tensor(array.copy(), requires_grad=True), torch.tensor(array.copy(), requires_grad=True)


class MulSetup(Function):
    """x * w, torch 2.x's style: forward without ctx, setup_context saves."""

    @staticmethod
    def forward(x, w):
        return x * w

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, w = inputs
        ctx.save_for_backward(x, w)
        ctx.output_seen = output

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad * w, grad * x


def test_setup_context_style_as_torch(torch):
    class TorchMul(torch.autograd.Function):
        @staticmethod
        def forward(x, w):
            return x * w

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(*inputs)

        @staticmethod
        def backward(ctx, grad):
            x, w = ctx.saved_tensors
            return grad * w, grad * x

    (x, tx), (w, tw) = pair(torch), pair(torch, W)
    out, ref = MulSetup.apply(x, w), TorchMul.apply(tx, tw)
    np.testing.assert_array_equal(out.numpy(), ref.detach().numpy())
    np.testing.assert_array_equal(out.creator.output_seen, out.numpy())  # setup_context got forward's output
    out.backward(np.array([1.0, 2.0, 3.0]))
    ref.backward(torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))
    np.testing.assert_array_equal(x.grad.numpy(), tx.grad.numpy())
    np.testing.assert_array_equal(w.grad.numpy(), tw.grad.numpy())
    assert autograd.gradcheck(MulSetup.apply, (x, w))


def test_save_for_forward_is_what_jvp_reads_as_torch(torch):
    class Cube(Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)             # backward reads x
            ctx.save_for_forward(3 * x * x)      # jvp reads the derivative
            return x ** 3

        @staticmethod
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            return grad * 3 * x * x

        @staticmethod
        def jvp(ctx, t):
            (slope,) = ctx.saved_tensors
            return slope * t

    class TorchCube(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return x ** 3

        @staticmethod
        def setup_context(ctx, inputs, output):
            (x,) = inputs
            ctx.save_for_backward(x)
            ctx.save_for_forward(3 * x * x)

        @staticmethod
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            return grad * 3 * x * x

        @staticmethod
        def jvp(ctx, t):
            (slope,) = ctx.saved_tensors
            return slope * t

    u = np.array([1.0, -2.0, 0.5])
    with fwAD.dual_level():
        ours = fwAD.unpack_dual(Cube.apply(fwAD.make_dual(Tensor(X.copy()), u))).tangent.numpy()
    x = Tensor(X.copy(), requires_grad=True)
    Cube.apply(x).sum().backward()   # backward still reads what save_for_backward kept
    np.testing.assert_allclose(x.grad.numpy(), 3 * X * X, rtol=1e-15)
    import torch.autograd.forward_ad as tfw
    with tfw.dual_level():
        theirs = tfw.unpack_dual(TorchCube.apply(tfw.make_dual(torch.tensor(X), torch.tensor(u)))).tangent.numpy()
    np.testing.assert_allclose(ours, theirs, rtol=1e-15)
    assert autograd.gradcheck(Cube.apply, Tensor(X.copy(), requires_grad=True), check_forward_ad=True)


class AddOneInPlace(Function):
    @staticmethod
    def forward(x):
        x += 1.0
        return x

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_dirty(inputs[0])

    @staticmethod
    def backward(ctx, grad):
        return grad


def test_mark_dirty_returns_the_input_counts_a_version_and_rebases_its_history_as_torch(torch):
    class TorchAddOne(torch.autograd.Function):
        @staticmethod
        def forward(x):
            x.add_(1.0)
            return x

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.mark_dirty(inputs[0])

        @staticmethod
        def backward(ctx, grad):
            return grad

    (a, ta) = pair(torch)
    x, tx = a * 3.0, ta * 3.0
    saved, tsaved = x * x, tx * tx            # Mul kept x's old values
    before, tbefore = x._version, tx._version
    y, ty = AddOneInPlace.apply(x), TorchAddOne.apply(tx)
    assert y is x and ty is tx
    assert x._version > before and tx._version > tbefore
    np.testing.assert_array_equal(x.numpy(), tx.detach().numpy())
    (x * x).sum().backward(retain_graph=True)   # through the in-place node to a
    (tx * tx).sum().backward(retain_graph=True)
    np.testing.assert_allclose(a.grad.numpy(), ta.grad.numpy(), rtol=1e-15)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.sum().backward()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        tsaved.sum().backward()
    with pytest.raises(RuntimeError, match="leaf"):
        TorchAddOne.apply(torch.tensor(X.copy(), requires_grad=True))
    assert_clear_error(lambda: AddOneInPlace.apply(Tensor(X.copy(), requires_grad=True)), RuntimeError,
                       ["AddOneInPlace", "mark_dirty", "leaf that requires grad"])
    plain = Tensor(X.copy())
    assert AddOneInPlace.apply(plain) is plain and plain._version == 1 and not plain.requires_grad


def test_mark_dirty_of_an_array_forward_did_not_get_is_a_clear_error():
    class MarksAnother(Function):
        @staticmethod
        def forward(ctx, x):
            out = x * 2
            ctx.mark_dirty(out)
            return out

        @staticmethod
        def backward(ctx, grad):
            return grad * 2

    assert_clear_error(lambda: MarksAnother.apply(Tensor(X.copy(), requires_grad=True)), ValueError,
                       ["mark_dirty", "an input of forward"])


def test_mark_non_differentiable_as_torch(torch):
    seen = {}

    class SortOurs(Function):
        @staticmethod
        def forward(ctx, x):
            order = np.argsort(x, kind="stable")
            ctx.order = order
            ctx.mark_non_differentiable(order)
            return x[order], order

        @staticmethod
        def backward(ctx, g_values, g_order):
            seen["ours"] = g_order
            g = np.zeros_like(g_values)
            g[ctx.order] = g_values
            return g

    class SortTheirs(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            values, order = x.sort(stable=True)
            ctx.mark_non_differentiable(order)
            ctx.save_for_backward(order)
            return values, order

        @staticmethod
        def backward(ctx, g_values, g_order):
            seen["theirs"] = g_order
            (order,) = ctx.saved_tensors
            g = torch.zeros_like(g_values)
            g[order] = g_values
            return g

    x, tx = pair(torch)
    (values, order), (tvalues, torder) = SortOurs.apply(x), SortTheirs.apply(tx)
    assert values.requires_grad and tvalues.requires_grad
    assert not order.requires_grad and not torder.requires_grad and order.creator is None
    np.testing.assert_array_equal(order.numpy(), torder.numpy())
    (values * Tensor(W)).sum().backward()
    (tvalues * torch.tensor(W)).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), tx.grad.numpy())
    np.testing.assert_array_equal(seen["ours"], seen["theirs"].numpy())   # zeros for the indices' gradient


def two_outputs(torch=None):
    """(2 x, 3 x) with set_materialize_grads(False); backward records which gradients it got."""
    got = []
    base = Function if torch is None else torch.autograd.Function

    def forward(ctx, x):
        ctx.set_materialize_grads(False)
        return x * 2, x * 3

    def backward(ctx, g1, g2):
        got.append((g1 is None, g2 is None))
        total = 0
        if g1 is not None:
            total = total + g1 * 2
        if g2 is not None:
            total = total + g2 * 3
        return total
    return type("TwoOutputs", (base,), {"forward": staticmethod(forward), "backward": staticmethod(backward)}), got


def test_set_materialize_grads_false_gives_none_for_unused_outputs_as_torch(torch):
    ours, got = two_outputs()
    theirs, tgot = two_outputs(torch)
    x, tx = pair(torch)
    first, _ = ours.apply(x)
    tfirst, _ = theirs.apply(tx)
    first.sum().backward()
    tfirst.sum().backward()
    assert got == tgot == [(False, True)]
    np.testing.assert_array_equal(x.grad.numpy(), tx.grad.numpy())
    x.grad, tx.grad = None, None
    second = ours.apply(x)[1]
    tsecond = theirs.apply(tx)[1]
    (g,) = grad(second.sum(), x)
    (tg,) = torch.autograd.grad(tsecond.sum(), tx)
    assert got[-1] == tgot[-1] == (True, False)
    np.testing.assert_array_equal(g.numpy(), tg.numpy())
    materialized, got_again = two_outputs()
    materialized.forward = staticmethod(lambda ctx, x: (x * 2, x * 3))   # the default: zeros
    materialized.apply(Tensor(X.copy(), requires_grad=True))[0].sum().backward()
    assert got_again == [(False, False)]


def test_check_undefined_grad_gives_none_to_a_function_that_asks_for_it_as_torch(torch):
    def make(base, handles_none):
        def forward(ctx, x):
            ctx.set_materialize_grads(False)
            return x * 2

        def backward(ctx, g):
            if g is None:
                if handles_none:
                    return None
                raise RuntimeError("no gradient")
            return g * 2
        return type("Doubles", (base,), {"forward": staticmethod(forward), "backward": staticmethod(backward)}).apply

    x, tx = pair(torch)
    assert autograd.gradcheck(make(Function, False), x, raise_exception=False) is False
    assert torch.autograd.gradcheck(make(torch.autograd.Function, False), tx, raise_exception=False) is False
    assert autograd.gradcheck(make(Function, False), x, check_undefined_grad=False) is True
    assert torch.autograd.gradcheck(make(torch.autograd.Function, False), tx, check_undefined_grad=False) is True
    assert autograd.gradcheck(make(Function, True), x) is True
    assert torch.autograd.gradcheck(make(torch.autograd.Function, True), tx) is True


def test_once_differentiable_as_torch(torch):
    class Square(Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        @once_differentiable
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            return 2 * x * grad

        @staticmethod
        def differentiable_backward(ctx, grad):   # present, but once_differentiable wins
            return 2 * ctx.inputs[0] * grad

    class TorchSquare(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            return 2 * x * grad

    x, tx = pair(torch)
    (g,) = grad(Square.apply(x).sum(), x, create_graph=True)
    (tg,) = torch.autograd.grad(TorchSquare.apply(tx).sum(), tx, create_graph=True)
    np.testing.assert_array_equal(g.numpy(), tg.detach().numpy())   # the first derivative, as torch's
    with pytest.raises(RuntimeError):
        tg.sum().backward()                                        # torch: no second derivative either
    assert_clear_error(lambda: g.sum().backward(), RuntimeError, ["Square", "differentiable once"])
    x.grad = None
    assert autograd.gradcheck(Square.apply, x)
    with pytest.raises(RuntimeError, match="Square"):
        autograd.gradgradcheck(Square.apply, x)


def test_bad_ctx_arguments_are_clear_errors():
    class MarksAnInput(Function):
        @staticmethod
        def forward(ctx, x):
            ctx.mark_non_differentiable(x)
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * 2

    class MaterializesMaybe(Function):
        @staticmethod
        def forward(ctx, x):
            ctx.set_materialize_grads("no")
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * 2

    x = Tensor(X.copy(), requires_grad=True)
    assert_clear_error(lambda: MarksAnInput.apply(x), ValueError, ["mark_non_differentiable", "an output of forward"])
    assert_clear_error(lambda: MaterializesMaybe.apply(x), TypeError, ["set_materialize_grads", "True or False", "str"])


def test_an_op_that_used_a_tensor_before_an_in_place_function_is_refused_not_silently_wrong(torch):
    """torch sends the gradient of `early` past the in-place Function; npformer's graph links Tensors,
    so it would go through it: a clear error instead (docs/torch_conventions.md)."""
    class TimesThree(Function):
        @staticmethod
        def forward(x):
            x *= 3.0
            return x

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.mark_dirty(inputs[0])

        @staticmethod
        def backward(ctx, grad):
            return grad * 3.0

    a = Tensor(X.copy(), requires_grad=True)
    x = a * 2.0
    early = x + 1.0
    TimesThree.apply(x)
    assert_clear_error(lambda: (early.sum() + x.sum()).backward(), RuntimeError,
                       ["Add", "before the in-place Function TimesThree", "mark_dirty"])
    x = a * 2.0
    late = TimesThree.apply(x) + 1.0   # used after: torch's gradient
    late.sum().backward()
    ta = torch.tensor(X.copy(), requires_grad=True)
    tx = ta * 2.0
    tx.mul_(3.0)
    (tx + 1.0).sum().backward()
    np.testing.assert_array_equal(a.grad.numpy(), ta.grad.numpy())
