"""The CPU's fast dropout paths give the bits of the references, for any thread count: the Philox
rounds shortened for fresh counters (across a multiple of 2^32 counters too), the keep test drawn
in cache-sized chunks, dropout applied and differentiated chunk by chunk (and dropout + residual,
which runs it). Chunks are made
tiny here (random._CHUNK) so that odd sizes, offsets and chunk and block boundaries all occur."""
import numpy as np
import pytest

from npformer.functional.activation import dropout_backward, dropout_forward, keep_mask
from npformer.functional.dropout_add import dropout_add_forward
from npformer.runtime import threads as _threads
from npformer.runtime import random
from npformer.runtime.kernels import reference_only


@pytest.fixture(params=[1, 2, 3], ids=lambda n: f"{n}threads")
def small_chunks(request, monkeypatch):
    """n threads, blocks split from 48 counters on, 40 counters (320 values) per chunk alone, 24 on threads."""
    saved = _threads.get_num_threads()
    monkeypatch.setattr(_threads, "MIN_PARALLEL_ENTRIES", 0)
    monkeypatch.setattr(random, "_CHUNK", 40)
    monkeypatch.setattr(random, "_PARALLEL_CHUNK", 24)
    _threads.set_num_threads(request.param)
    yield request.param
    _threads.set_num_threads(saved)


FIRST_COUNTERS = [0, 5, 2**32 - 57, 3 * 2**32 - 1, 2**64 // 8 - 2**32]   # some chunks straddle 2^32 counters


@pytest.mark.parametrize("first", FIRST_COUNTERS)
@pytest.mark.parametrize("seed", [0, 0xa4093822299f31d0, 2**64 - 1])
def test_cpu_philox_equals_the_reference(first, seed, small_chunks):
    counters = np.arange(first, first + 301, dtype=np.uint64)
    key = random._key(seed)
    with reference_only():
        expected = random.philox_bits16(counters, key)
        expected_keep = random.philox_at_least(counters, key, 6554)
    np.testing.assert_array_equal(random.philox_bits16(counters, key), expected)
    np.testing.assert_array_equal(random.philox_at_least(counters, key, 6554), expected_keep)
    np.testing.assert_array_equal(expected_keep, expected >= 6554)
    shuffled = np.random.default_rng(first % 1000).permutation(counters)      # any counters, in any order
    with reference_only():
        expected = random.philox_bits16(shuffled, key)
    np.testing.assert_array_equal(random.philox_bits16(shuffled, key), expected)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape, offset", [((7,), 0), ((3, 1001), 5), ((2, 37, 41), 8 * 2**32 - 24)])
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_cpu_dropout_equals_the_reference_bit_for_bit(shape, offset, p, dtype, small_chunks):
    rng = np.random.default_rng(1)
    x, residual, dy = (rng.standard_normal(shape).astype(dtype) for _ in range(3))
    x.reshape(-1)[:3] = [np.inf, -0.0, np.nan]                                # inf * 0, signed zeros, NaN
    with np.errstate(invalid="ignore"):                                       # inf * 0 (dropped) is NaN, as in torch
        with reference_only():
            y_ref, keep_ref = dropout_forward(np, x, 7, offset, p)
            add_ref, _ = dropout_add_forward(np, x, residual, 7, offset, p)
            dx_ref = dropout_backward(np, dy, keep_ref, 7, offset, p)
        y, keep = dropout_forward(np, x, 7, offset, p)
        add, keep_add = dropout_add_forward(np, x, residual, 7, offset, p)
        dx = dropout_backward(np, dy, keep, 7, offset, p)
    np.testing.assert_array_equal(keep, keep_mask(shape, p, 7, offset, "cpu"))
    np.testing.assert_array_equal(keep_add, keep)
    for ours, ref in ((y, y_ref), (add, add_ref), (dx, dx_ref)):
        assert ours.dtype == dtype and ours.shape == shape
        np.testing.assert_array_equal(ours.view(f"u{ours.itemsize}"), ref.view(f"u{ref.itemsize}"))
