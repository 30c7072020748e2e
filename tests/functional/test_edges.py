"""Edges of the ops judged against torch on torch's own kinds of special inputs: infinities,
NaN, signed zeros, subnormals and 0-d tensors. Each op either matches torch (values and
gradients, NaN where torch has NaN) or refuses clearly; it never silently differs."""
import numpy as np
import pytest

import npformer.functional as F
from autograd import Tensor, backend, no_grad
from npformer import nn
from npformer.functional import composite

from tolerances import assert_close, rounding_tolerance



def special(dtype, largest=True):
    """Infinities, the largest finite values (unless not `largest`), signed zeros, subnormals, NaN
    and ordinary values."""
    big, tiny = np.finfo(dtype).max, np.finfo(dtype).smallest_subnormal
    values = [-np.inf, -2.0, -tiny, -0.0, 0.0, tiny, 0.5, 2.0, np.inf, np.nan] + ([-big, big] if largest else [])
    return np.array(values, dtype=dtype)


def run(op, x, upstream, device, dtype):
    """op(x) and d<op(x), upstream>/dx for a leaf holding `x` on `device`, as host arrays."""
    leaf = Tensor(x.astype(dtype), requires_grad=True, device=device)
    out = op(leaf)
    out.backward(backend.to_device(upstream.astype(dtype), device))
    return out.numpy(), leaf.grad.numpy()


def run_torch(torch, op, x, upstream, dtype):
    leaf = torch.tensor(x.astype(dtype), requires_grad=True)
    out = op(leaf)
    out.backward(torch.tensor(upstream.astype(dtype)))
    return out.detach().numpy(), leaf.grad.numpy()


ACTIVATIONS = {  # name: (ours, torch's, whether the dtype's largest values are compared)
    "relu": (F.relu, lambda torch: torch.relu, True),
    "relu_module": (nn.ReLU(), lambda torch: torch.nn.ReLU(), True),
    # GELU's x^2 and x^3 overflow at the dtype's largest values: the tanh form's gradient is NaN
    # there, in torch as in ours
    "gelu": (F.gelu, lambda torch: torch.nn.functional.gelu, False),
    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"),
                  lambda torch: lambda x: torch.nn.functional.gelu(x, approximate="tanh"), False),
}


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("name", ACTIVATIONS)
def test_activations_at_infinities_nan_zeros_and_subnormals_match_torch(name, dtype, device, torch):
    """relu(-inf) = 0 (not -inf * 0 = NaN), and the gradient at NaN is the upstream gradient
    (torch's threshold_backward); GELU is NaN at +-inf exactly where torch's is. The reference is
    torch in float64 on the same values (torch's float32 GELU kernel returns NaN for tanh(+inf)).
    y = x f(x) with f's rounding ~eps: |dy| <= eps |x| (and the gradient's |upstream| (1 + |x|))."""
    ours_op, torch_op, largest = ACTIVATIONS[name]
    x = special(dtype, largest)
    upstream = np.random.default_rng(0).standard_normal(x.shape).astype(dtype)
    with np.errstate(all="ignore"):
        y, dx = run(ours_op, x, upstream, device, dtype)
        ty, tdx = (r.astype(dtype) for r in run_torch(torch, torch_op(torch), x, upstream, np.float64))
    assert y.dtype == dx.dtype == dtype
    size = np.nan_to_num(np.minimum(np.abs(x.astype(np.float64)), 1e300))       # NaN and inf: no tolerance
    assert_close(y, ty, rounding_tolerance(dtype, 1.0 + size), err_msg="output")
    assert_close(dx, tdx, rounding_tolerance(dtype, np.abs(upstream), 1.0 + size), err_msg="gradient")


def test_relu_twin_and_tensor_relu_pass_the_gradient_at_nan(torch):
    """The composite twin (Tensor.relu, an autograd primitive) agrees with the fused op and torch."""
    x = special(np.float64)
    upstream = np.random.default_rng(1).standard_normal(x.shape)
    ty, tdx = run_torch(torch, torch.relu, x, upstream, np.float64)
    with composite.installed():
        y, dx = run(F.relu, x, upstream, "cpu", np.float64)
    np.testing.assert_array_equal(y, ty)
    np.testing.assert_array_equal(dx, tdx)
    nan, minus_inf = np.isnan(x), x == -np.inf
    assert dx[nan] == upstream[nan] and y[minus_inf] == 0.0


@pytest.mark.parametrize("twin", [False, True])
@pytest.mark.parametrize("dim", [0, -1])
@pytest.mark.parametrize("name, value", [("softmax", 1.0), ("log_softmax", 0.0)])
def test_softmax_of_a_0d_tensor_is_one_and_log_softmax_zero_like_torch(name, value, dim, twin, device, torch):
    """A 0-d tensor is one row of one entry: softmax 1, log_softmax 0, zero gradient; dim 0 and -1 both."""
    x = np.array(0.7)
    upstream = np.array(-1.3)
    with composite.installed() if twin else np.errstate():
        y, dx = run(lambda t: getattr(F, name)(t, dim=dim), x, upstream, device, np.float64)
    ty, tdx = run_torch(torch, lambda t: getattr(torch, name)(t, dim=dim), x, upstream, np.float64)
    assert y.shape == ty.shape == () and dx.shape == ()
    assert y == ty == value and dx == tdx == 0.0


def test_softmax_of_a_0d_array_and_of_a_0d_infinity(torch):
    """Raw 0-d arrays work too; a 0-d +inf or NaN gives NaN, in torch (inf - inf) as in ours."""
    assert F.softmax(np.array(3.0, dtype=np.float32)).numpy() == 1.0
    assert F.log_softmax(np.array(-2.0)).numpy() == 0.0
    for value in (np.inf, np.nan):
        with np.errstate(invalid="ignore"):
            ours = F.softmax(np.array(value)).numpy()
        assert np.isnan(ours) and torch.softmax(torch.tensor(value), 0).isnan().item()


def test_cross_entropy_refuses_a_class_weight_that_requires_grad_like_torch(torch):
    """torch raises in grad mode and computes under no_grad; so do we (never a silently missing gradient)."""
    rng = np.random.default_rng(2)
    logits, target, w = rng.standard_normal((4, 3)), np.array([0, 2, 1, 2]), np.array([0.5, 2.0, 1.0])
    weight = Tensor(w, requires_grad=True)
    with pytest.raises(RuntimeError, match="weight requires grad"):
        F.cross_entropy(Tensor(logits, requires_grad=True), target, weight=weight)
    with pytest.raises(RuntimeError, match="not differentiable with respect to argument 'weight'"):
        torch.nn.functional.cross_entropy(torch.tensor(logits), torch.tensor(target),
                                          weight=torch.tensor(w, requires_grad=True))
    with no_grad():
        loss = F.cross_entropy(Tensor(logits), target, weight=weight)
    ref = torch.nn.functional.cross_entropy(torch.tensor(logits), torch.tensor(target), weight=torch.tensor(w))
    np.testing.assert_allclose(loss.numpy(), ref.numpy(), rtol=1e-14)
    detached = F.cross_entropy(Tensor(logits), target, weight=weight.detach())
    np.testing.assert_allclose(detached.numpy(), ref.numpy(), rtol=1e-14)
