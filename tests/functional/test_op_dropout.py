"""F.dropout and nn.Dropout: the registry's cases (seeded: gradcheck, torch with the
contract's mask and composite twin on every device; eval against torch), the identity cases, rate, scale, mask reuse and seeding, and
clear errors."""
import numpy as np
import pytest

import autograd
import npformer
from autograd import Tensor
import npformer.functional as F
from npformer import nn
from npformer.functional import composite

from helpers import assert_clear_error, leaf, op_tests

test_gradcheck, test_matches_torch, test_matches_composite_twin = op_tests("dropout")


def test_dropout_identity_cases_and_p_one():
    x = leaf(np.random.default_rng(11).standard_normal((4, 5)))
    assert F.dropout(x, 0.0) is x and F.dropout(x, 0.5, training=False) is x
    y = F.dropout(x, 1.0)
    y.backward(np.ones((4, 5)))
    assert not y.numpy().any() and not x.grad.any()


def test_dropout_rate_scale_mask_reuse_and_seeding(device):
    x = Tensor(np.ones((200, 100), dtype=np.float32), requires_grad=True, device=device)
    y = F.dropout(x, 0.3, generator=npformer.runtime.random.Philox(0))
    values = y.numpy()
    assert y.dtype == np.float32 and y.device == device
    assert 0.28 < (values == 0).mean() < 0.32
    np.testing.assert_allclose(values[values != 0], 1 / 0.7, rtol=1e-6)
    y.backward(autograd.backend.to_device(np.full((200, 100), 2.0, dtype=np.float32), device))  # same mask, same scale
    np.testing.assert_allclose(autograd.backend.as_numpy(x.grad), 2 * values, rtol=1e-6)
    again = F.dropout(x, 0.3, generator=npformer.runtime.random.Philox(0))
    np.testing.assert_array_equal(again.numpy(), values)
    npformer.manual_seed(5)
    first = F.dropout(x, 0.3).numpy()
    npformer.manual_seed(5)
    np.testing.assert_array_equal(F.dropout(x, 0.3).numpy(), first)
    twin = composite.dropout(x, 0.3, generator=npformer.runtime.random.Philox(0))
    np.testing.assert_array_equal(twin.numpy(), values)


@pytest.mark.parametrize("p", [1e-7, 0.9999999])
def test_dropout_probabilities_near_0_and_1(p):
    """The mask compares 16 random bits to round(p * 2^16): no overflow next to p = 1."""
    y = F.dropout(Tensor(np.ones(20000)), p, generator=npformer.runtime.random.Philox(0)).numpy()
    assert (y == 0).mean() == pytest.approx(p, abs=2e-4)
    assert np.all(y[y != 0] == 1 / (1 - p))


def test_dropout_module_train_and_eval(device):
    npformer.manual_seed(3)
    m = nn.Dropout(0.25)
    x = Tensor(np.ones((200, 100), dtype="float32"), device=device)
    y = m(x).numpy()
    kept = y != 0
    assert abs(kept.mean() - 0.75) < 0.02
    np.testing.assert_allclose(y[kept], 1 / 0.75, rtol=1e-6)
    assert m.eval()(x) is x
    with pytest.raises(ValueError, match=r"p must be a real number in \[0, 1\]"):
        nn.Dropout(1.5)


def test_bad_probability_raises_a_clear_error():
    assert_clear_error(lambda: F.dropout(Tensor(np.zeros(3)), p=-0.1), ValueError, ["[0, 1]", "-0.1"])
