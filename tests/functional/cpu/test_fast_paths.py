"""The faster paths issue 17 added for the char-level GPT step: float32 erf (one rational
function) and GELU in blocks on the threads: accuracy and the same results for any number of
threads."""
import math

import numpy as np
import pytest

from autograd import Tensor
from npformer import functional as F
from npformer.functional.activation import erf

from helpers import assert_same_with_threads


def test_float32_erf_within_its_documented_error():
    x = np.concatenate([np.linspace(-7, 7, 400_001), [0.0, -0.0, 1e-30, -1e-30, 3.4e38, -3.4e38, np.inf, -np.inf]])
    x32 = x.astype(np.float32)
    got = erf(np, x32)
    assert got.dtype == np.float32
    want = np.array([math.erf(v) for v in x32.astype(np.float64)])
    error = np.abs(got.astype(np.float64) - want)
    assert error.max() <= 4.5e-7
    ulps = error / np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)
    assert ulps.max() <= 7.5
    assert np.all(np.sign(got) == np.sign(x32)) and np.all(np.abs(got) <= 1)  # odd, bounded (erf(+-0) = +-0)
    assert np.isnan(erf(np, np.array([np.nan], dtype=np.float32)))[0]


def test_float32_normal_cdf_within_erf_float32s_error():
    from npformer.functional.activation.erf import normal_cdf_float32
    x = np.concatenate([np.linspace(-10, 10, 400_001), [0.0, -0.0, 1e-30, 3.4e38, -3.4e38, np.inf, -np.inf]])
    x32 = x.astype(np.float32)
    got = normal_cdf_float32(np, x32, np.empty_like(x32))
    want = np.array([0.5 * math.erfc(-v / math.sqrt(2)) for v in x32.astype(np.float64)])
    assert np.abs(got.astype(np.float64) - want).max() <= 2.3e-7      # half of erf_float32's 4.5e-7 (+ rounding)
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
