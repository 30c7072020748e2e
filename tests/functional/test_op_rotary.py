"""F.apply_rotary_emb, F.rotary_cos_sin and nn.RotaryEmbedding: the registry's cases (gradcheck,
torch, composite twin on every device), the tables and the rotation's properties, offsets,
scores that depend only on relative positions, and clear errors."""
import numpy as np
import pytest

import autograd
import npformer.functional as F
from autograd import Tensor
from npformer import nn

from helpers import F64, assert_clear_error, op_tests

test_gradcheck, test_matches_torch, test_matches_composite_twin = op_tests("rotary")


def test_rotary_tables_and_rotation_properties():
    cos, sin = F.rotary_cos_sin(6, 8, base=100.0, dtype="float64")
    t, i = np.arange(6)[:, None], np.arange(4)[None, :]
    np.testing.assert_allclose(cos, np.cos(t * 100.0 ** (-2 * i / 8)), atol=1e-15)
    assert F.rotary_cos_sin(6, 8)[0].dtype == np.float32
    x = np.random.default_rng(14).standard_normal((2, 6, 8))
    y = F.apply_rotary_emb(Tensor(x), cos, sin).numpy()
    half_norm = lambda a: a[..., :4] ** 2 + a[..., 4:] ** 2                   # each pair is rotated
    np.testing.assert_allclose(half_norm(y), half_norm(x), atol=1e-12)
    np.testing.assert_allclose(y[:, 0], x[:, 0], atol=1e-15)                   # position 0: no rotation
    # a slice of the table rotates later positions (decoding with an offset)
    np.testing.assert_allclose(F.apply_rotary_emb(Tensor(x[:, 3:]), cos[3:], sin[3:]).numpy(), y[:, 3:], atol=1e-15)


def test_rotary_module_offset_rotates_like_the_tail_of_a_longer_sequence(rng, device):
    """(The registry's "nn.RotaryEmbedding" compares with torch at offset 0.)"""
    rope = nn.RotaryEmbedding(6)
    ours = Tensor(rng.standard_normal((2, 2, 5, 6)), requires_grad=True, device=device)
    np.testing.assert_allclose(rope(ours[:, :, 3:], offset=3).numpy(), rope(ours).numpy()[:, :, 3:], **F64)
    autograd.gradcheck(lambda a: rope(a, offset=2), [ours])


def test_rotary_scores_depend_only_on_relative_position(rng):
    rope = nn.RotaryEmbedding(8)
    q, k = rng.standard_normal(8), rng.standard_normal(8)
    seq = Tensor(np.stack([q, k] * 6)[None].reshape(1, 12, 8))  # q at even positions, k at odd ones
    rotated = rope(seq).numpy()[0]
    scores = [rotated[i] @ rotated[i + 3] for i in (0, 2, 4, 6, 8)]  # q at i, k at i+3
    np.testing.assert_allclose(scores, scores[0], rtol=1e-5)
    with pytest.raises(ValueError, match="even"):
        nn.RotaryEmbedding(5)


def test_rotary_position_ids_rotate_each_row_at_its_positions(rng, device):
    """Issue 29 item 2's op: position_ids (B, T) per row, as Hugging Face's Llama takes them. A
    contiguous row equals the offset, a packed row restarts at 0, a (T,) array serves every row.
    (The registry's "nn.RotaryEmbedding (position_ids)" compares with torch and checks gradients.)"""
    rope = nn.RotaryEmbedding(6)
    x = Tensor(rng.standard_normal((2, 2, 5, 6)), requires_grad=True, device=device)
    positions = np.array([[3, 4, 5, 6, 7], [0, 1, 2, 0, 1]])
    out = rope(x, position_ids=positions).numpy()
    np.testing.assert_allclose(out[0], rope(x[:1], offset=3).numpy()[0], **F64)
    np.testing.assert_allclose(out[1, :, :3], rope(x[1:, :, :3]).numpy()[0], **F64)   # the first sequence
    np.testing.assert_allclose(out[1, :, 3:], rope(x[1:, :, 3:]).numpy()[0], **F64)   # the second restarts
    np.testing.assert_allclose(rope(x, position_ids=np.arange(2, 7)).numpy(), rope(x, offset=2).numpy(), **F64)
    np.testing.assert_allclose(rope(rope(x, position_ids=positions), position_ids=-positions).numpy(), x.numpy(),
                               **F64)                                          # a negative position rotates back
    autograd.gradcheck(lambda a: rope(a, position_ids=positions), [x])


@pytest.mark.parametrize("position_ids, words", [
    (np.zeros((2, 4), dtype=np.int64), ["position_ids", "(2, 5)", "(2, 4)"]),
    (np.zeros((2, 5)), ["position_ids", "integers", "float64"]),
])
def test_rotary_refuses_bad_position_ids(position_ids, words):
    assert_clear_error(lambda: nn.RotaryEmbedding(6)(Tensor(np.zeros((2, 2, 5, 6))), position_ids=position_ids),
                       ValueError, ["RotaryEmbedding"] + words)


@pytest.mark.parametrize("call, error, words", [
    (lambda: F.apply_rotary_emb(Tensor(np.zeros((2, 5))), np.zeros((2, 2)), np.zeros((2, 2))), ValueError,
     ["even head_dim", "(2, 5)"]),
    (lambda: F.apply_rotary_emb(Tensor(np.zeros((2, 4))), np.zeros((3, 2)), np.zeros((2, 2))), ValueError,
     ["cos", "(2, 2)", "(3, 2)"]),
    (lambda: F.rotary_cos_sin(4, 5), ValueError, ["head_dim", "5"]),
])
def test_bad_input_raises_a_clear_error(call, error, words):
    assert_clear_error(call, error, words)


@pytest.mark.parametrize("dtype", ["x", None, "int32", {}])
def test_rotary_cos_sin_refuses_a_dtype_that_is_not_floating(dtype):  # was numpy's "data type 'x' not understood"
    with pytest.raises(TypeError, match=r"rotary_cos_sin: dtype must be a floating dtype or its name"):
        F.rotary_cos_sin(4, 4, dtype=dtype)
