"""F.embedding and nn.Embedding: the registry's cases (repeated ids, padding rows, max_norm,
scale_grad_by_freq: gradcheck, torch, composite twin on every device; second derivatives:
gradgradcheck, torch's double backward), the padding row's zero gradient, max_norm's in-place
renormalisation and scale_grad_by_freq against torch, the scatter-add of the backward, torch's
initialisation, forward mode (the registry's cases with check_forward_ad, torch.func.jvp, float32;
the padding row held still), property-based tests, and clear errors."""
import re

import numpy as np
import pytest
from hypothesis import given, strategies as st

import autograd
import npformer
from autograd import Tensor, backend
from autograd import forward_ad as fwAD
from autograd.gradcheck import vjp
import npformer.functional as F
from npformer import nn, opcases
from npformer.functional.embedding import scatter_add_rows

from helpers import (
    DTYPES, HYPOTHESIS, assert_clear_error, compare_with_torch, double_backward_tests, forward_mode_tests, leaf,
    op_tests, tolerance)

test_gradcheck, test_matches_torch, test_matches_composite_twin = op_tests("embedding")
test_gradgradcheck, test_double_backward_matches_torch = double_backward_tests("embedding")


def padding_row(case):
    """The padding row of an F.embedding case (its weight is input 0), from its name; None without one."""
    found = re.search(r"padding_idx=(-?\d+)", case.name)
    return None if found is None or case.module is not None else int(found.group(1))


def padding_row_held_still(case):
    """For torch.func.jvp: the padding row's tangent set to 0. Ours holds that row still, as the
    backward holds its gradient at 0; torch's forward AD moves it (its backward does not). A
    module case moves its input only: nothing to hold."""
    row = padding_row(case)
    if row is None:
        return None

    def hold(tangents):
        tangents[0][row] = 0
        return tangents
    return hold


test_forward_mode_gradcheck, test_jvp_matches_torch, test_forward_mode_in_float32 = forward_mode_tests(
    "embedding", padding_row_held_still)
# (scale_grad_by_freq's backward is not a transpose of the lookup: torch's gradient scaling, not a derivative)
PADDED = [c for c in opcases.cases("embedding") if padding_row(c) is not None and "scale_grad_by_freq" not in c.name]


@pytest.mark.parametrize("case", PADDED, ids=[c.name for c in PADDED])
def test_forward_mode_holds_the_padding_row_still(case):
    """J u is 0 at the padding positions and W's tangent gathered elsewhere (central differences
    along a u that leaves the padding row alone), and <g, J u> = <J^T g, u> with the backward for
    any u (gradcheck cannot run: its finite differences see the padding row)."""
    rng = np.random.default_rng(3)
    (weight,) = opcases.instantiate(case, rng).arrays
    row, u = padding_row(case), rng.standard_normal(weight.shape)
    with fwAD.dual_level():
        out, tangent = fwAD.unpack_dual(case.fn(fwAD.make_dual(Tensor(weight), u)))
    tangent = tangent.numpy()
    at_padding = (out.numpy() == weight[row]).all(axis=-1)            # the positions that look the row up
    assert at_padding.any() and not tangent[at_padding].any()
    still, eps = u.copy(), 1e-6
    still[row] = 0
    plus, minus = (case.fn(Tensor(weight + sign * eps * still)).numpy() for sign in (1, -1))
    numeric = (plus - minus) / (2 * eps)
    np.testing.assert_allclose(tangent, numeric, rtol=1e-7, atol=1e-9)
    g = rng.standard_normal(tangent.shape)
    _, _, (dweight,) = vjp(case.fn, [Tensor(weight, requires_grad=True)], [g])
    np.testing.assert_allclose((g * tangent).sum(), (dweight * u).sum(), rtol=1e-12)


def test_embedding_padding_row_gets_exactly_zero_gradient():
    weight = leaf(np.random.default_rng(9).standard_normal((5, 3)))
    out = F.embedding(Tensor(np.array([0, 0, 3, 0])), weight, padding_idx=0)
    out.backward(np.ones((4, 3)))
    assert np.all(weight.grad.numpy()[0] == 0) and np.all(weight.grad.numpy()[3] == 1)
    np.testing.assert_array_equal(out.numpy()[0], weight.numpy()[0])   # the forward still looks it up


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.5, float("inf")])
def test_max_norm_renormalises_the_referenced_rows_in_place_like_torch(norm_type, device, torch):
    """Only the rows that the ids refer to and whose norm exceeds max_norm change, in the weight
    itself (torch's embedding_renorm_), before the lookup; the other rows keep their bits."""
    rng = np.random.default_rng(12)
    weight = rng.standard_normal((6, 4)) * 2.0
    weight[1] *= 0.05                                            # referenced, under max_norm: kept
    ids = np.array([[1, 3, 3], [0, 3, 1]])
    ours = Tensor(weight.copy(), requires_grad=True, device=device)
    out = F.embedding(ids, ours, max_norm=1.0, norm_type=norm_type)
    theirs = torch.tensor(weight.copy(), requires_grad=True)
    expected = torch.nn.functional.embedding(torch.tensor(ids), theirs, max_norm=1.0, norm_type=norm_type)
    np.testing.assert_allclose(ours.numpy(), theirs.detach().numpy(), rtol=1e-14, atol=0)
    np.testing.assert_allclose(out.numpy(), expected.detach().numpy(), rtol=1e-14, atol=0)
    untouched = [1, 2, 4, 5]
    np.testing.assert_array_equal(ours.numpy()[untouched], weight[untouched])
    assert np.all(np.linalg.norm(ours.numpy()[[0, 3]], ord=norm_type, axis=1) <= 1.0)


def test_scale_grad_by_freq_divides_each_row_by_its_count(device):
    weight = leaf(np.random.default_rng(13).standard_normal((5, 3)), device)
    out = F.embedding(np.array([0, 0, 3, 0, 2]), weight, padding_idx=2, scale_grad_by_freq=True)
    out.backward(backend.to_device(np.ones((5, 3)), device))
    np.testing.assert_array_equal(weight.grad.numpy(), np.array([[1.0] * 3, [0] * 3, [0] * 3, [1] * 3, [0] * 3]))


def test_scatter_add_rows_equals_add_at():
    rng = np.random.default_rng(10)
    ids = rng.integers(0, 50, 2000)
    rows = rng.standard_normal((2000, 8))
    expected = np.zeros((60, 8))
    np.add.at(expected, ids, rows)
    np.testing.assert_allclose(scatter_add_rows(np, ids, rows, 60), expected, atol=1e-12)


@pytest.mark.parametrize("padding_idx", [1, -1])
def test_module_padding_row_starts_at_zero_and_gets_no_gradient(padding_idx, device):
    m = nn.Embedding(6, 3, padding_idx=padding_idx).double().to(device)
    assert np.all(m.weight.numpy()[padding_idx] == 0)
    ids = np.array([[1, 5, 1], [0, 1, 2]])  # row 1 / 5 is the padding row
    m(ids).backward(backend.to_device(np.random.default_rng(1).standard_normal((2, 3, 3)), device))
    assert np.all(m.weight.grad.numpy()[padding_idx] == 0)


def test_embedding_init_and_errors():
    npformer.manual_seed(0)
    m = nn.Embedding(1000, 50)
    assert abs(m.weight.numpy().std() - 1.0) < 0.02
    with pytest.raises(IndexError, match=r"\[0, 999\]"):
        m(np.array([[0, 1000]]))
    with pytest.raises(TypeError, match="integer"):
        m(np.array([[0.0, 1.0]]))
    with pytest.raises(ValueError, match="padding_idx"):
        nn.Embedding(5, 2, padding_idx=5)


@HYPOTHESIS
@given(vocab=st.integers(1, 8), dim=st.integers(1, 4), ids_shape=st.lists(st.integers(0, 4), min_size=1, max_size=3),
       padding=st.booleans(), dtype=DTYPES, seed=st.integers(0, 2**31))
def test_embedding_properties(vocab, dim, ids_shape, padding, dtype, seed, torch):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, ids_shape)                        # repeats are likely; may be empty
    weight = rng.standard_normal((vocab, dim))
    padding_idx = int(rng.integers(vocab)) if padding else None
    fn = lambda w: F.embedding(ids, w, padding_idx=padding_idx)   # noqa: E731
    compare_with_torch(torch, fn, lambda w: torch.nn.functional.embedding(torch.tensor(ids), w, padding_idx=padding_idx),
                       [weight], rng, dtype=dtype, **tolerance(dtype))
    if dtype == np.float64 and not padding and ids.size:
        assert autograd.gradcheck(lambda w: F.embedding(ids, w), [leaf(weight)], check_forward_ad=True)


W = np.zeros((5, 4))


@pytest.mark.parametrize("call, error, words", [
    (lambda: F.embedding(np.array([0, 5]), Tensor(W)), IndexError, ["[0, 4]", "num_embeddings=5", "max 5"]),
    (lambda: F.embedding(np.array([-1, 2]), Tensor(W)), IndexError, ["min -1"]),
    (lambda: F.embedding(np.array([0.0, 1.0]), Tensor(W)), TypeError, ["integer", "float64"]),
    (lambda: F.embedding(np.array([0, 1]), Tensor(W), padding_idx=5), ValueError, ["padding_idx", "5"]),
    (lambda: F.embedding(Tensor(np.array([0, 1]), device="test"), Tensor(W)), RuntimeError, ["device", "test"]),
    (lambda: F.embedding(np.array([0, 1]), Tensor(W), max_norm=-1.0), ValueError, ["max_norm", ">= 0", "-1.0"]),
    (lambda: F.embedding(np.array([0, 1]), Tensor(W), max_norm=1.0, norm_type=0), ValueError, ["norm_type", "> 0"]),
    (lambda: F.embedding(np.array([0, 1]), Tensor(W), max_norm="1"), TypeError, ["max_norm", "str"]),
    (lambda: F.embedding(np.array([0, 1]), Tensor(W), scale_grad_by_freq=1), TypeError, ["scale_grad_by_freq"]),
])
def test_bad_input_raises_a_clear_error(call, error, words):
    assert_clear_error(call, error, words)


def test_the_gradient_of_embedding_is_one_op_that_scatters_the_rows_in_every_order():
    """The embedding's create_graph gradient is ScatterAddRowsFunction (the first-order kernel):
    checked as an op of its own (gradcheck, gradgradcheck through its differentiable backward, the
    lookup), its tangent the scatter-add of the tangent, repeated ids adding up."""
    from npformer.functional.embedding import ScatterAddRowsFunction

    rng = np.random.default_rng(8)
    ids = np.array([3, 0, 3, 1, 3])
    rows = Tensor(rng.standard_normal((5, 2)), requires_grad=True)

    def scattered_cubed(rows):
        return ScatterAddRowsFunction.apply(rows, ids=ids, num_rows=4) ** 3

    assert autograd.gradcheck(scattered_cubed, [rows])
    assert autograd.gradgradcheck(scattered_cubed, [rows])
    tangent = rng.standard_normal((5, 2))
    with fwAD.dual_level():
        t = fwAD.unpack_dual(ScatterAddRowsFunction.apply(fwAD.make_dual(rows, tangent), ids=ids, num_rows=4)).tangent
    expected = np.zeros((4, 2))
    np.add.at(expected, ids, tangent)
    np.testing.assert_allclose(t, expected, rtol=1e-15, atol=1e-15)
