"""F.gelu and nn.GELU (exact and tanh): the registry's cases (gradcheck, torch, composite twin on every
device), extreme inputs against torch, erf to float64 rounding, forward mode (the registry's cases
with check_forward_ad, torch.func.jvp, float32), and clear errors."""
import math

import numpy as np
import pytest

from autograd import Tensor
import npformer.functional as F
from npformer import nn

from helpers import assert_clear_error, compare_with_torch, forward_mode_tests, op_tests

test_gradcheck, test_matches_torch, test_matches_composite_twin = op_tests("gelu")
test_forward_mode_gradcheck, test_jvp_matches_torch, test_forward_mode_in_float32 = forward_mode_tests("gelu")


def test_erf_is_accurate_to_float64_rounding():
    from npformer.functional._erf import erf
    x = np.concatenate([np.linspace(-7, 7, 20001), [0.0, -0.0, 1e-300, 5.9999, 6.0, 40.0, np.inf, -np.inf]])
    expected = np.array([math.erf(v) for v in x])
    np.testing.assert_allclose(erf(x), expected, rtol=5e-16, atol=2e-16)
    assert np.isnan(erf(np.array([np.nan]))[0])
    assert erf(x.astype(np.float32)).dtype == np.float32


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_extreme_inputs_match_torch(approximate, torch):
    x = np.array([-40.0, -10.0, -6.0, -3.0, -1.0, -1e-8, 0.0, 0.7, 1.0, 2.5, 3.5, 6.0, 10.0, 40.0])
    compare_with_torch(torch, lambda a: F.gelu(a, approximate=approximate),
                       lambda a: torch.nn.functional.gelu(a, approximate=approximate), [x], np.random.default_rng(13))


def test_unknown_approximation_raises_a_clear_error():
    assert_clear_error(lambda: F.gelu(Tensor(np.zeros(3)), approximate="fast"), ValueError, ["approximate", "'fast'"])
    with pytest.raises(ValueError, match="approximate"):
        nn.GELU("erf")
