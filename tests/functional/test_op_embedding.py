"""F.embedding and nn.Embedding: the registry's cases (repeated ids, padding rows: gradcheck,
torch, composite twin on every device), the padding row's zero gradient, the scatter-add of the
backward, torch's initialisation, property-based tests, and clear errors."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

import autograd
import npformer
from autograd import Tensor, backend
import npformer.functional as F
from npformer import nn
from npformer.functional.embedding import scatter_add_rows

from helpers import DTYPES, HYPOTHESIS, assert_clear_error, compare_with_torch, leaf, op_tests, tolerance

test_gradcheck, test_matches_torch, test_matches_composite_twin = op_tests("embedding")


def test_embedding_padding_row_gets_exactly_zero_gradient():
    weight = leaf(np.random.default_rng(9).standard_normal((5, 3)))
    out = F.embedding(Tensor(np.array([0, 0, 3, 0])), weight, padding_idx=0)
    out.backward(np.ones((4, 3)))
    assert np.all(weight.grad[0] == 0) and np.all(weight.grad[3] == 1)
    np.testing.assert_array_equal(out.numpy()[0], weight.numpy()[0])   # the forward still looks it up


def test_scatter_add_rows_equals_add_at():
    rng = np.random.default_rng(10)
    ids = rng.integers(0, 50, 2000)
    rows = rng.standard_normal((2000, 8))
    expected = np.zeros((60, 8))
    np.add.at(expected, ids, rows)
    np.testing.assert_allclose(scatter_add_rows(ids, rows, 60), expected, atol=1e-12)


@pytest.mark.parametrize("padding_idx", [1, -1])
def test_module_padding_row_starts_at_zero_and_gets_no_gradient(padding_idx, device):
    m = nn.Embedding(6, 3, padding_idx=padding_idx).double().to(device)
    assert np.all(m.weight.numpy()[padding_idx] == 0)
    ids = np.array([[1, 5, 1], [0, 1, 2]])  # row 1 / 5 is the padding row
    m(ids).backward(backend.to_device(np.random.default_rng(1).standard_normal((2, 3, 3)), device))
    assert np.all(backend.as_numpy(m.weight.grad)[padding_idx] == 0)


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
        assert autograd.gradcheck(lambda w: F.embedding(ids, w), [leaf(weight)])


W = np.zeros((5, 4))


@pytest.mark.parametrize("call, error, words", [
    (lambda: F.embedding(np.array([0, 5]), Tensor(W)), IndexError, ["[0, 4]", "num_embeddings=5", "max 5"]),
    (lambda: F.embedding(np.array([-1, 2]), Tensor(W)), IndexError, ["min -1"]),
    (lambda: F.embedding(np.array([0.0, 1.0]), Tensor(W)), TypeError, ["integer", "float64"]),
    (lambda: F.embedding(np.array([0, 1]), Tensor(W), padding_idx=5), ValueError, ["padding_idx", "5"]),
    (lambda: F.embedding(Tensor(np.array([0, 1]), device="test"), Tensor(W)), RuntimeError, ["device", "test"]),
])
def test_bad_input_raises_a_clear_error(call, error, words):
    assert_clear_error(call, error, words)
