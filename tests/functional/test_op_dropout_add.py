"""F.dropout_add (residual + dropout, one op): the registry's cases (gradcheck, torch, composite twin
on every device; second derivatives: gradgradcheck, torch's double backward), the dropout contract, p = 0 / 1 / eval, and clear errors."""
import numpy as np
import pytest

import npformer.functional as F
from autograd import Tensor, backend
from npformer.functional.activation import dropout_threshold
from npformer.runtime import random

from helpers import assert_clear_error, double_backward_tests, forward_mode_tests, leaf, op_tests

test_gradcheck, test_matches_torch, test_matches_composite_twin = op_tests("dropout_add")
test_gradgradcheck, test_double_backward_matches_torch = double_backward_tests("dropout_add")
test_forward_mode_gradcheck, test_jvp_matches_torch, test_forward_mode_in_float32 = forward_mode_tests("dropout_add")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_mask_follows_the_dropout_contract(dtype, device, rng):
    """Entry i is kept iff value offset + i of the stream is >= round(p 2^16); kept entries are
    scaled by 1 / (1 - p); the stream advances by the draw; the gradient is dy * mask and dy."""
    p, shape = 0.3, (4, 3, 11)
    x, r = rng.standard_normal(shape), rng.standard_normal(shape)
    stream = random.Philox(seed=2**40 + 3, offset=8 * 1000)
    keep = (random.bits16(stream.seed, stream.offset, x.size) >= dropout_threshold(p)).reshape(shape)
    ours = [Tensor(a.astype(dtype), requires_grad=True, device=device) for a in (x, r)]
    out = F.dropout_add(*ours, p, generator=stream)
    assert stream.offset == 8 * 1000 + x.size + (-x.size) % 8
    mask = keep.astype(dtype) * np.asarray(1 / (1 - p), dtype)
    np.testing.assert_array_equal(out.numpy(), r.astype(dtype) + x.astype(dtype) * mask)
    g = rng.standard_normal(shape).astype(dtype)
    out.backward(backend.to_device(g, device))
    np.testing.assert_array_equal(ours[0].grad.numpy(), g * mask)
    np.testing.assert_array_equal(ours[1].grad.numpy(), g)
    assert abs(1 - keep.mean() - p) < 0.15


def test_the_math_files_formulas_are_the_ops(rng):
    """dropout_add/math.py's forward and backward, given the contract's mask, are F.dropout_add's."""
    from npformer.functional.dropout_add import math
    p, shape = 0.3, (5, 7)
    x, r, g = (rng.standard_normal(shape) for _ in range(3))
    stream = random.Philox(seed=11, offset=8 * 3)
    keep = (random.bits16(stream.seed, stream.offset, x.size) >= dropout_threshold(p)).reshape(shape)
    ours = [leaf(x), leaf(r)]
    out = F.dropout_add(*ours, p, generator=stream)
    np.testing.assert_array_equal(out.numpy(), math.dropout_add_forward(np, x, r, keep, p))
    out.backward(g)
    dx, dr = math.dropout_add_backward(np, g, keep, p)
    np.testing.assert_array_equal(ours[0].grad.numpy(), dx)
    np.testing.assert_array_equal(ours[1].grad.numpy(), dr)


def test_identity_cases_and_p_one(rng):
    x, r = leaf(rng.standard_normal((2, 3))), leaf(rng.standard_normal((2, 3)))
    np.testing.assert_array_equal(F.dropout_add(x, r, 0.5, training=False).numpy(), x.numpy() + r.numpy())
    np.testing.assert_array_equal(F.dropout_add(x, r, 0.0).numpy(), x.numpy() + r.numpy())
    y = F.dropout_add(x, r, 1.0)
    y.backward(np.ones((2, 3)))
    np.testing.assert_array_equal(y.numpy(), r.numpy())
    assert not x.grad.numpy().any() and (r.grad.numpy() == 1).all()


@pytest.mark.parametrize("call, error, words", [
    (lambda x: F.dropout_add(x, Tensor(np.zeros(3)), 0.1), ValueError, ["input and residual", "(2, 3)", "(3,)"]),
    (lambda x: F.dropout_add(x, x, 1.5), ValueError, ["dropout_add: p must be", "[0, 1]", "1.5"]),
    (lambda x: F.dropout_add(x, x, 0.5, generator=np.random.default_rng(0)), TypeError,
     ["dropout_add: generator must be an npformer.runtime.random.Philox", "Generator"]),
])
def test_bad_input_raises_a_clear_error(call, error, words):
    assert_clear_error(lambda: call(Tensor(np.zeros((2, 3)))), error, words)
