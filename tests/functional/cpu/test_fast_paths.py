"""The faster paths issue 17 added for the char-level GPT step: float32 GELU's Phi (one rational
function of erf) and GELU in blocks on the threads: accuracy and the same results for any number of
threads."""
import math

import numpy as np
import pytest

from autograd import Tensor
from npformer import functional as F

from helpers import assert_same_with_threads


def test_float32_normal_cdf_within_its_rational_functions_error():
    from npformer.functional.activation.erf import normal_cdf_float32
    x = np.concatenate([np.linspace(-10, 10, 400_001), [0.0, -0.0, 1e-30, 3.4e38, -3.4e38, np.inf, -np.inf]])
    x32 = x.astype(np.float32)
    got = normal_cdf_float32(np, x32, np.empty_like(x32))
    want = np.array([0.5 * math.erfc(-v / math.sqrt(2)) for v in x32.astype(np.float64)])
    assert np.abs(got.astype(np.float64) - want).max() <= 2.3e-7      # half of the rational function's 4.5e-7 for erf (+ rounding)
    assert got.min() == 0.0 and got.max() == 1.0
    assert np.isnan(normal_cdf_float32(np, np.array([np.nan], np.float32), np.empty(1, np.float32)))[0]


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_in_blocks_matches_one_thread(threads, rng, approximate):  # noqa: F811
    x = rng.standard_normal((5, 7, 3)) * 3
    assert_same_with_threads(threads, lambda x: F.gelu(x, approximate=approximate), [x])


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_float32_matches_float64(rng, approximate):
    x = rng.standard_normal(10_000) * 4
    y64 = F.gelu(Tensor(x), approximate=approximate).numpy()
    y32 = F.gelu(Tensor(x.astype(np.float32)), approximate=approximate).numpy()
    np.testing.assert_allclose(y32, y64, rtol=2e-6, atol=2e-6)
