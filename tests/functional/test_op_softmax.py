"""F.softmax and F.log_softmax: the registry's cases (gradcheck, torch, composite twin on every
device; second derivatives: gradgradcheck, torch's double backward), extreme rows (-1000, -1e9, -inf, +/-1e4) against torch, rows entirely -inf, empty
rows, any dim, property-based tests, and clear errors."""
import warnings

import numpy as np
import pytest
from hypothesis import given, strategies as st

import autograd
from autograd import Tensor
from autograd import forward_ad as fwAD
import npformer.functional as F

from helpers import (
    DTYPES, HYPOTHESIS, assert_clear_error, assert_double_backward_matches_torch, compare_with_torch,
    double_backward_tests, forward_mode_tests, leaf, op_tests, tolerance)
from tolerances import rounding_tolerance

test_gradcheck, test_matches_torch, test_matches_composite_twin = op_tests("softmax")
test_gradgradcheck, test_double_backward_matches_torch = double_backward_tests("softmax")
test_forward_mode_gradcheck, test_jvp_matches_torch, test_forward_mode_in_float32 = forward_mode_tests("softmax")


@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
def test_double_backward_along_a_middle_axis_matches_torch(op, torch):
    assert_double_backward_matches_torch(lambda x: getattr(F, op)(x, dim=1), torch, np.random.default_rng(7),
                                         torch_fn=lambda t, x: getattr(t, op)(x, dim=1),
                                         arrays=[np.random.default_rng(8).standard_normal((2, 4, 3))])


@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
@pytest.mark.parametrize("rows", [[[-1000.0, 1.0]], [[-1e9, 0.5, 2.0], [3.0, -1e9, -1e9]],
                                  [[-np.inf, 0.5, 2.0], [3.0, -np.inf, 1.0]], [[1e4, -1e4, 0.0]]])
def test_softmax_extreme_rows_match_torch(op, rows, torch):
    """The shift by the row maximum is exact for these rows and every entry that survives exp is
    O(1) after it: the scale is 1, not the inputs' magnitude (a -1e9 entry only ever underflows)."""
    compare_with_torch(torch, getattr(F, op), lambda x: getattr(torch, op)(x, dim=-1), [rows],
                       np.random.default_rng(0), scale=1.0)


MINUS_1E9_ROWS = [
    [-1e9, -1e9, -1e9, -1e9],          # a fully masked row, seed style: uniform, like torch
    [-1e9, -np.inf, -1e9, -np.inf],    # -1e9 wins over -inf: half and half
    [-np.inf, -1e9, -np.inf, -np.inf],  # one finite entry among -inf: one-hot
    [2.0, -1e9, -np.inf, 0.5],         # a normal row with both kinds of masked entries
]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
def test_softmax_rows_of_minus_1e9_and_minus_inf_match_torch(op, dtype, torch):
    """Every entry that counts is O(1) after the shift by the row maximum: a -1e9 entry meets
    only an equal -1e9 (an exact 0) or underflows in exp. So the scale is 1, not |input| ~ 1e9.
    log_softmax of a -inf entry is -inf in both; its gradient is finite and compared too."""
    compare_with_torch(torch, getattr(F, op), lambda x: getattr(torch, op)(x, dim=-1), [MINUS_1E9_ROWS],
                       np.random.default_rng(2), dtype=dtype, atol=rounding_tolerance(dtype, terms=4), rtol=0,
                       scale=1.0)


def test_softmax_of_rows_entirely_minus_inf_is_zero_without_nan(device):
    x = leaf([[-np.inf, -np.inf, -np.inf], [0.0, 1.0, -np.inf]], device)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = F.softmax(x)
        y.backward(autograd.backend.to_device(np.ones((2, 3)) + np.arange(6).reshape(2, 3), device))
        logp = F.log_softmax(x)
    assert np.all(y.numpy()[0] == 0) and np.isclose(y.numpy()[1].sum(), 1)
    assert np.all(np.isfinite(x.grad.numpy()))
    assert np.all(x.grad.numpy()[0] == 0)
    assert np.all(logp.numpy()[0] == -np.inf) and not np.isnan(logp.numpy()).any()


def test_empty_rows_match_torch(torch):
    """A softmax over zero entries is empty, as in torch."""
    for name in ("softmax", "log_softmax"):
        x = Tensor(np.zeros((2, 0)), requires_grad=True)
        y = getattr(F, name)(x, dim=-1)
        assert y.shape == tuple(getattr(torch, name)(torch.zeros(2, 0), -1).shape)
        y.backward(np.zeros((2, 0)))
        assert x.grad.shape == (2, 0)


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_softmax_along_any_dim_matches_torch(dim, torch):
    x = np.random.default_rng(1).standard_normal((3, 4, 5))
    for op in ("softmax", "log_softmax"):
        compare_with_torch(torch, lambda a: getattr(F, op)(a, dim=dim), lambda a: getattr(torch, op)(a, dim=dim),
                           [x], np.random.default_rng(2))


@HYPOTHESIS
@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=3), dim_index=st.integers(0, 2),
       log=st.booleans(), minus_inf=st.booleans(), dtype=DTYPES, seed=st.integers(0, 2**31))
def test_softmax_and_log_softmax_properties(shape, dim_index, log, minus_inf, dtype, seed, torch):
    rng = np.random.default_rng(seed)
    dim = dim_index % len(shape)
    x = 5 * rng.standard_normal(shape)
    if minus_inf:  # -inf entries, but never a whole row (torch gives NaN there; ours 0 is tested elsewhere)
        blocked = rng.random(shape) < 0.3
        np.put_along_axis(blocked, rng.integers(shape[dim], size=(1,) * len(shape)), False, axis=dim)
        x = np.where(blocked, -np.inf, x)
    op = "log_softmax" if log else "softmax"
    fn = lambda a: getattr(F, op)(a, dim=dim)   # noqa: E731
    compare_with_torch(torch, fn, lambda a: getattr(torch, op)(a, dim=dim), [x], rng, dtype=dtype, **tolerance(dtype))
    if dtype == np.float64 and not (log and minus_inf):  # finite differences of -inf outputs are NaN
        assert autograd.gradcheck(fn, [leaf(x)], check_forward_ad=True)


def test_dim_out_of_range_raises_a_clear_error():
    assert_clear_error(lambda: F.softmax(Tensor(np.zeros((2, 3))), dim=2), IndexError, ["dim", "[-2, 1]", "2"])


@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
def test_forward_mode_through_minus_inf_entries_and_rows(op, torch):
    """-inf entries (masked keys) get a finite tangent that matches torch's; a row that is entirely
    -inf (torch: NaN) gets softmax's tangent 0 and log_softmax's t_x, the transposes of what the
    backward gives it (0 and dy): no NaN in either mode."""
    rng = np.random.default_rng(8)
    x = np.array([[-np.inf, 0.5, 2.0, -np.inf], [3.0, -np.inf, 1.0, -1.0], [-np.inf] * 4])
    u, g = rng.standard_normal(x.shape), rng.standard_normal(x.shape)
    fn = getattr(F, op)
    with fwAD.dual_level():
        tangent = fwAD.unpack_dual(fn(fwAD.make_dual(Tensor(x), u))).tangent
    _, theirs = torch.func.jvp(lambda a: getattr(torch, op)(a, dim=-1), (torch.tensor(x[:2]),), (torch.tensor(u[:2]),))
    np.testing.assert_allclose(tangent[:2], theirs.numpy(), rtol=1e-12, atol=1e-15)
    np.testing.assert_array_equal(tangent[2], 0 if op == "softmax" else u[2])
    x_leaf = leaf(x)
    fn(x_leaf).backward(g)
    np.testing.assert_allclose((g * tangent).sum(), (x_leaf.grad.numpy() * u).sum(), rtol=1e-12)
