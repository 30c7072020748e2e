"""What a custom `autograd.Function`'s backward may return, as torch's engine allows it: a gradient
of a shape the input broadcasts to is summed back to the input's shape (torch's rule, compared
with torch), extra trailing Nones are dropped, numbers and numpy scalars are arrays. The
mistakes (a wrong count, shape, dtype or device) are in the error table of tests/test_errors.py."""
import numpy as np
import pytest

import autograd
from autograd import Tensor


class Scale(autograd.Function):
    """out = x * w with w broadcast over x; backward forgets to sum dw over the broadcast axes."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        return dy * w, dy * x, None, None  # dw has x's shape; two trailing Nones


@pytest.mark.parametrize("x_shape, w_shape", [((2, 3, 5), (5,)), ((2, 3, 5), (3, 1)), ((4, 5), (1, 5)),
                                              ((3,), ())])
def test_a_gradient_of_a_broadcast_shape_is_summed_back_like_torch(x_shape, w_shape, torch, rng):
    x_np, w_np = rng.standard_normal(x_shape), rng.standard_normal(w_shape)
    dy = rng.standard_normal(x_shape)
    x, w = Tensor(x_np, requires_grad=True), Tensor(w_np, requires_grad=True)
    Scale.apply(x, w).backward(dy)
    assert w.grad.shape == w_shape and x.grad.shape == x_shape

    class TorchScale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            return a * b

        @staticmethod
        def backward(ctx, g):
            a, b = ctx.saved_tensors
            return g * b, g * a, None, None

    xt = torch.tensor(x_np, requires_grad=True)
    wt = torch.tensor(w_np, requires_grad=True)
    TorchScale.apply(xt, wt).backward(torch.tensor(dy))
    scale = np.abs(dy).sum() * (np.abs(x_np).max() + 1)
    np.testing.assert_allclose(w.grad, wt.grad.numpy(), rtol=0, atol=1e-13 * scale)
    np.testing.assert_allclose(x.grad, xt.grad.numpy(), rtol=0, atol=1e-13 * scale)
    autograd.gradcheck(Scale.apply, [x, w])


def test_adam_steps_a_parameter_whose_custom_gradient_was_summed_back(rng):
    from npformer import optim

    w = Tensor(np.ones(5, np.float32), requires_grad=True)
    x = Tensor(rng.standard_normal((2, 3, 5)).astype(np.float32))
    opt = optim.Adam([w], lr=0.1)
    Scale.apply(x, w).sum().backward()
    opt.step()
    assert w.data.shape == (5,) and np.isfinite(w.data).all() and not np.allclose(w.data, 1)


class Halve(autograd.Function):
    """A 0-d op whose forward and backward return numpy scalars (as numpy's reductions do)."""

    @staticmethod
    def forward(ctx, x):
        return np.float64(x.sum() / 2)

    @staticmethod
    def backward(ctx, dy):
        return np.float64(dy / 2)


def test_numbers_and_numpy_scalars_are_arrays():
    x = Tensor(np.array(3.0), requires_grad=True)
    y = Halve.apply(x)
    assert y.shape == () and y.item() == 1.5
    y.backward()
    assert isinstance(x.grad, Tensor) and isinstance(x.grad.data, np.ndarray) and x.grad.shape == () and x.grad.item() == 0.5


def test_gradients_of_inputs_that_need_none_are_not_checked(rng):
    """A wrong gradient for an input that does not require grad is never used, so never refused."""
    class Loose(autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            return x * w

        @staticmethod
        def backward(ctx, dy):
            return dy, "unused"

    x = Tensor(rng.standard_normal(3), requires_grad=True)
    Loose.apply(x, Tensor(np.ones(3))).sum().backward()
    np.testing.assert_array_equal(x.grad, np.ones(3))
