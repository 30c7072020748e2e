"""npformer.functional at the edges: extreme inputs against torch in float64, fully masked rows,
padding and ignored targets, dropout semantics, erf accuracy, clear errors for bad input, and
proof that gradcheck catches a wrong backward that a plain sum() check would miss."""
import math
import warnings

import numpy as np
import pytest

import autograd
import npformer.functional as F
from autograd import Tensor
from npformer.functional import composite
from npformer.functional.embedding import scatter_add_rows

from test_functional import compare_runs, compare_with_torch, leaf


# -- softmax / log_softmax ------------------------------------------------------------------
@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
@pytest.mark.parametrize("rows", [[[-1000.0, 1.0]], [[-1e9, 0.5, 2.0], [3.0, -1e9, -1e9]],
                                  [[-np.inf, 0.5, 2.0], [3.0, -np.inf, 1.0]], [[1e4, -1e4, 0.0]]])
def test_softmax_extreme_rows_match_torch(op, rows, torch):
    compare_with_torch(torch, getattr(F, op), lambda x: getattr(torch, op)(x, dim=-1), [rows],
                       np.random.default_rng(0))


def test_softmax_of_rows_entirely_minus_inf_is_zero_without_nan(device):
    x = leaf([[-np.inf, -np.inf, -np.inf], [0.0, 1.0, -np.inf]], device)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = F.softmax(x)
        y.backward(autograd.backend.to_device(np.ones((2, 3)) + np.arange(6).reshape(2, 3), device))
        logp = F.log_softmax(x)
    assert np.all(y.numpy()[0] == 0) and np.isclose(y.numpy()[1].sum(), 1)
    assert np.all(np.isfinite(autograd.backend.as_numpy(x.grad)))
    assert np.all(autograd.backend.as_numpy(x.grad)[0] == 0)
    assert np.all(logp.numpy()[0] == -np.inf) and not np.isnan(logp.numpy()).any()


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_softmax_along_any_dim_matches_torch(dim, torch):
    x = np.random.default_rng(1).standard_normal((3, 4, 5))
    for op in ("softmax", "log_softmax"):
        compare_with_torch(torch, lambda a: getattr(F, op)(a, dim=dim), lambda a: getattr(torch, op)(a, dim=dim),
                           [x], np.random.default_rng(2))


# -- layer_norm --------------------------------------------------------------------------------
def test_layer_norm_mean_1e4_std_1e2_matches_torch(torch, device):
    """Two-pass variance (E[x^2] - E[x]^2 would lose every digit here) plus a refined mean.
    With rstd ~ 100 the gradients are ~ 500 and float64 rounding of x alone allows ~1e-10
    relative error; torch itself is ~2e-8 off in dx (checked against 80-bit arithmetic below)."""
    rng = np.random.default_rng(3)
    x = 1e4 + 1e-2 * rng.standard_normal((4, 16))
    weight, bias = 1 + rng.standard_normal(16), rng.standard_normal(16)
    compare_with_torch(torch, lambda a, w, b: F.layer_norm(a, 16, w, b),
                       lambda a, w, b: torch.nn.functional.layer_norm(a, (16,), w, b),
                       [x, weight, bias], np.random.default_rng(0), atol=1e-7, rtol=1e-9, device=device)
    # float32 (where torch's own kernel is ~0.1 off here): against torch in float64 on the same data
    x32, g32 = x.astype(np.float32), rng.standard_normal((4, 16)).astype(np.float32)
    xt, tx = leaf(x32, device, np.float32), torch.tensor(x32.astype(np.float64), requires_grad=True)
    y, ty = F.layer_norm(xt, 16), torch.nn.functional.layer_norm(tx, (16,))
    y.backward(autograd.backend.to_device(g32, device))
    ty.backward(torch.tensor(g32.astype(np.float64)))
    np.testing.assert_allclose(y.numpy(), ty.detach().numpy(), atol=1e-5)
    np.testing.assert_allclose(autograd.backend.as_numpy(xt.grad), tx.grad.numpy(), atol=1e-4 * np.abs(tx.grad.numpy()).max())


@pytest.mark.skipif(np.finfo(np.longdouble).eps > 1e-17, reason="needs 80-bit long double as the reference")
def test_layer_norm_mean_1e4_std_1e2_is_accurate_to_float64_rounding(device):
    rng = np.random.default_rng(3)
    x, weight, g = 1e4 + 1e-2 * rng.standard_normal((4, 16)), 1 + rng.standard_normal(16), rng.standard_normal((4, 16))
    xl, wl, gl = (a.astype(np.longdouble) for a in (x, weight, g))
    centered = xl - xl.mean(axis=1, keepdims=True)
    rstd = 1 / np.sqrt((centered * centered).mean(axis=1, keepdims=True) + np.longdouble(1e-5))
    xhat, gh = centered * rstd, gl * wl
    dx = rstd * (gh - gh.mean(axis=1, keepdims=True) - xhat * (gh * xhat).mean(axis=1, keepdims=True))
    xt = leaf(x, device)
    y = F.layer_norm(xt, 16, Tensor(weight, device=device))
    y.backward(autograd.backend.to_device(g, device))
    np.testing.assert_allclose(y.numpy(), (xhat * wl).astype(np.float64), atol=1e-14)
    np.testing.assert_allclose(autograd.backend.as_numpy(xt.grad), dx.astype(np.float64), atol=1e-8, rtol=1e-11)


@pytest.mark.parametrize("affine", ["both", "weight", "none"])
def test_layer_norm_multi_dim_shape_and_optional_affine(affine, torch, device):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 3, 4, 5))
    params = {"both": [1 + rng.standard_normal((4, 5)), rng.standard_normal((4, 5))],
              "weight": [1 + rng.standard_normal((4, 5))], "none": []}[affine]
    compare_with_torch(torch, lambda a, *p: F.layer_norm(a, (4, 5), *p, eps=1e-3),
                       lambda a, *p: torch.nn.functional.layer_norm(a, (4, 5), *p, eps=1e-3),
                       [x] + params, rng, device=device)


# -- cross_entropy -----------------------------------------------------------------------------
CE_CASES = {
    "logits_1e4": (lambda rng: 1e4 * np.sign(rng.standard_normal((4, 5))), np.array([0, 1, 2, 4]), {}),
    "smoothing_ignore": (lambda rng: rng.standard_normal((6, 5)), np.array([0, -100, 2, 4, -100, 1]),
                         {"label_smoothing": 0.1}),
    "pad_ignore_index": (lambda rng: rng.standard_normal((6, 5)), np.array([0, 0, 2, 4, 3, 0]),
                         {"label_smoothing": 0.1, "ignore_index": 0}),
    "sum": (lambda rng: rng.standard_normal((4, 5)), np.array([0, -100, 2, 4]), {"reduction": "sum"}),
    "none": (lambda rng: rng.standard_normal((4, 5)), np.array([0, -100, 2, 4]),
             {"reduction": "none", "label_smoothing": 0.2}),
    "spatial": (lambda rng: rng.standard_normal((2, 5, 3, 2)), np.array([[[0, 1], [4, -100], [2, 2]]] * 2),
                {"label_smoothing": 0.1}),
    "spatial_none": (lambda rng: rng.standard_normal((2, 5, 3)), np.array([[0, 1, 4], [2, -100, 3]]),
                     {"reduction": "none"}),
    "unbatched": (lambda rng: rng.standard_normal(5), np.array(3), {}),
    "weights": (lambda rng: rng.standard_normal((6, 5)), np.array([0, -100, 2, 4, 3, 3]),
                {"weight": np.array([0.5, 1.0, 2.0, 0.1, 3.0])}),
    "weights_smoothing": (lambda rng: rng.standard_normal((6, 5)), np.array([0, -100, 2, 4, 3, 3]),
                          {"weight": np.array([0.5, 1.0, 2.0, 0.1, 3.0]), "label_smoothing": 0.3}),
    "weights_smoothing_sum": (lambda rng: rng.standard_normal((6, 5)), np.array([0, -100, 2, 4, 3, 3]),
                              {"weight": np.array([0.5, 1.0, 2.0, 0.1, 3.0]), "label_smoothing": 0.3,
                               "reduction": "sum"}),
}


@pytest.mark.parametrize("case", CE_CASES)
def test_cross_entropy_matches_torch_gradcheck_and_twin(case, torch):
    rng = np.random.default_rng(5)
    make, target, kwargs = CE_CASES[case]
    logits = make(rng)
    t_kwargs = {k: torch.tensor(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
    compare_with_torch(torch, lambda x: F.cross_entropy(x, target, **kwargs),
                       lambda x: torch.nn.functional.cross_entropy(x, torch.tensor(target), **t_kwargs),
                       [logits], rng)
    if case != "logits_1e4":  # finite differences of 1e4-sized logits are meaningless
        assert autograd.gradcheck(lambda x: F.cross_entropy(x, target, **kwargs), [leaf(logits)])
    compare_runs(lambda x: F.cross_entropy(x, target, **kwargs), lambda x: composite.cross_entropy(x, target, **kwargs),
                 [logits], rng)


def test_cross_entropy_every_target_ignored():
    logits = leaf(np.zeros((3, 4)))
    with pytest.raises(ValueError, match="every target equals ignore_index=-100"):
        F.cross_entropy(logits, np.full(3, -100))
    total = F.cross_entropy(logits, np.full(3, -100), reduction="sum")
    total.backward()
    assert total.item() == 0 and not logits.grad.any()
    assert not F.cross_entropy(logits, np.full(3, -100), reduction="none").numpy().any()


def test_cross_entropy_float32_stays_float32(torch):
    rng = np.random.default_rng(6)
    target = np.array([1, 2, -100, 0])
    compare_with_torch(torch, lambda x: F.cross_entropy(x, target, label_smoothing=0.1),
                       lambda x: torch.nn.functional.cross_entropy(x, torch.tensor(target), label_smoothing=0.1),
                       [rng.standard_normal((4, 3))], rng, atol=1e-6, rtol=1e-5, dtype=np.float32)


# -- embedding ----------------------------------------------------------------------------------
@pytest.mark.parametrize("padding_idx", [None, 2, -1])
def test_embedding_repeated_ids_and_padding_match_torch(padding_idx, torch, device):
    ids = np.array([[2, 2, 2, 5], [0, 5, 2, 6], [6, 6, 1, 1]])
    weight = np.random.default_rng(7).standard_normal((7, 4))
    compare_with_torch(torch, lambda w: F.embedding(ids, w, padding_idx=padding_idx),
                       lambda w: torch.nn.functional.embedding(torch.tensor(ids), w, padding_idx=padding_idx),
                       [weight], np.random.default_rng(8), device=device)


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


# -- dropout ------------------------------------------------------------------------------------
def test_dropout_identity_cases_and_p_one():
    x = leaf(np.random.default_rng(11).standard_normal((4, 5)))
    assert F.dropout(x, 0.0) is x and F.dropout(x, 0.5, training=False) is x
    y = F.dropout(x, 1.0)
    y.backward(np.ones((4, 5)))
    assert not y.numpy().any() and not x.grad.any()


def test_dropout_rate_scale_mask_reuse_and_seeding(device):
    x = Tensor(np.ones((200, 100), dtype=np.float32), requires_grad=True, device=device)
    y = F.dropout(x, 0.3, generator=autograd.random.Philox(0))
    values = y.numpy()
    assert y.dtype == np.float32 and y.device == device
    assert 0.28 < (values == 0).mean() < 0.32
    np.testing.assert_allclose(values[values != 0], 1 / 0.7, rtol=1e-6)
    y.backward(autograd.backend.to_device(np.full((200, 100), 2.0, dtype=np.float32), device))  # same mask, same scale
    np.testing.assert_allclose(autograd.backend.as_numpy(x.grad), 2 * values, rtol=1e-6)
    again = F.dropout(x, 0.3, generator=autograd.random.Philox(0))
    np.testing.assert_array_equal(again.numpy(), values)
    autograd.manual_seed(5)
    first = F.dropout(x, 0.3).numpy()
    autograd.manual_seed(5)
    np.testing.assert_array_equal(F.dropout(x, 0.3).numpy(), first)
    twin = composite.dropout(x, 0.3, generator=autograd.random.Philox(0))
    np.testing.assert_array_equal(twin.numpy(), values)


@pytest.mark.parametrize("p", [1e-7, 0.9999999])
def test_dropout_probabilities_near_0_and_1(p):
    """The mask compares 16 random bits to round(p * 2^16): no overflow next to p = 1."""
    y = F.dropout(Tensor(np.ones(20000)), p, generator=autograd.random.Philox(0)).numpy()
    assert (y == 0).mean() == pytest.approx(p, abs=2e-4)
    assert np.all(y[y != 0] == 1 / (1 - p))


def test_dropout_gradcheck_with_a_seeded_generator(device):
    x = leaf(np.random.default_rng(12).standard_normal((3, 4)), device)
    assert autograd.gradcheck(lambda a: F.dropout(a, 0.4, generator=autograd.random.Philox(3)), [x])


# -- GELU and erf ---------------------------------------------------------------------------------
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


# -- rotary embeddings ---------------------------------------------------------------------------
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


# -- clear errors at the API boundary -------------------------------------------------------------
W = np.zeros((5, 4))
BAD_INPUTS = [
    (lambda: F.linear(Tensor(np.zeros((2, 3))), Tensor(W)), ValueError, ["weight.shape[1]=4", "(2, 3)"]),
    (lambda: F.linear(Tensor(np.zeros((2, 4))), Tensor(W), Tensor(np.zeros(4))), ValueError, ["bias", "(5,)", "(4,)"]),
    (lambda: F.linear(Tensor(np.zeros((2, 4))), Tensor(np.zeros(4))), ValueError, ["2-D", "(4,)"]),
    (lambda: F.linear([1.0, 2.0], Tensor(W)), TypeError, ["input", "list"]),
    (lambda: F.gelu(Tensor(np.zeros(3)), approximate="fast"), ValueError, ["approximate", "'fast'"]),
    (lambda: F.dropout(Tensor(np.zeros(3)), p=-0.1), ValueError, ["[0, 1]", "-0.1"]),
    (lambda: F.relu(Tensor(np.zeros(3, dtype=np.int64))), TypeError, ["floating", "int64"]),
    (lambda: F.softmax(Tensor(np.zeros((2, 3))), dim=2), IndexError, ["dim", "[-2, 1]", "2"]),
    (lambda: F.layer_norm(Tensor(np.zeros((2, 3))), (4,)), ValueError, ["normalized_shape", "(4,)", "(2, 3)"]),
    (lambda: F.layer_norm(Tensor(np.zeros((2, 3))), 3, Tensor(np.zeros(4))), ValueError, ["weight", "(3,)", "(4,)"]),
    (lambda: F.embedding(np.array([0, 5]), Tensor(W)), IndexError, ["[0, 4]", "num_embeddings=5", "max 5"]),
    (lambda: F.embedding(np.array([-1, 2]), Tensor(W)), IndexError, ["min -1"]),
    (lambda: F.embedding(np.array([0.0, 1.0]), Tensor(W)), TypeError, ["integer", "float64"]),
    (lambda: F.embedding(np.array([0, 1]), Tensor(W), padding_idx=5), ValueError, ["padding_idx", "5"]),
    (lambda: F.cross_entropy(Tensor(np.zeros((3, 4))), np.array([0, 4, 1])), IndexError, ["[0, 3]", "max 4"]),
    (lambda: F.cross_entropy(Tensor(np.zeros((3, 4))), np.array([0.0, 1.0, 1.0])), TypeError, ["integer", "float64"]),
    (lambda: F.cross_entropy(Tensor(np.zeros((3, 4))), np.array([0, 1])), ValueError, ["target shape", "(3,)", "(2,)"]),
    (lambda: F.cross_entropy(Tensor(np.zeros((3, 4))), np.array([0, 1, 1]), reduction="avg"), ValueError,
     ["reduction", "'avg'"]),
    (lambda: F.cross_entropy(Tensor(np.zeros((3, 4))), np.array([0, 1, 1]), weight=Tensor(np.ones(3))), ValueError,
     ["weight", "(4,)", "(3,)"]),
    (lambda: F.apply_rotary_emb(Tensor(np.zeros((2, 5))), np.zeros((2, 2)), np.zeros((2, 2))), ValueError,
     ["even head_dim", "(2, 5)"]),
    (lambda: F.apply_rotary_emb(Tensor(np.zeros((2, 4))), np.zeros((3, 2)), np.zeros((2, 2))), ValueError,
     ["cos", "(2, 2)", "(3, 2)"]),
    (lambda: F.rotary_cos_sin(4, 5), ValueError, ["head_dim", "5"]),
    (lambda: F.embedding(Tensor(np.array([0, 1]), device="test"), Tensor(W)), RuntimeError, ["device", "test"]),
    (lambda: F.linear(Tensor(np.zeros((2, 4)), device="test"), Tensor(W)), RuntimeError, ["device"]),
    (lambda: F.linear(Tensor(np.zeros((2, 4), dtype=np.float32)), Tensor(W)), TypeError, ["dtype"]),
]


@pytest.mark.parametrize("call, error, words", BAD_INPUTS)
def test_bad_input_raises_a_clear_error(call, error, words):
    with pytest.raises(error) as info:
        call()
    for word in words:
        assert word in str(info.value), f"{word!r} not in {info.value}"


