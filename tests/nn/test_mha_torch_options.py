"""nn.MultiheadAttention's kdim/vdim, add_bias_kv and add_zero_attn against
torch.nn.MultiheadAttention: state_dict keys, outputs, returned weights and the gradient of every
input and parameter in float64 for every mask kind (torch pads attn_mask and key_padding_mask
with a column per appended key that every query may attend to), init, interop both ways,
gradcheck on every device, the memory-efficient path and argument errors."""
import math

import numpy as np
import pytest

import npformer
from autograd import Tensor
from npformer import interop, nn

from npformer.opcases.modules import randomize_vectors
from helpers import F64, assert_torch_parity, gradcheck_module
from tolerances import scaled
from helpers import to_torch_kwargs

pytestmark = pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask")

B, T, S, E, H = 2, 4, 5, 8, 2
KDIM, VDIM = 6, 3

OPTIONS = {  # name -> constructor options
    "kdim_vdim": dict(kdim=KDIM, vdim=VDIM),
    "bias_kv": dict(add_bias_kv=True),
    "zero_attn": dict(add_zero_attn=True),
    "bias_kv_zero_attn": dict(add_bias_kv=True, add_zero_attn=True),
    "all": dict(kdim=KDIM, vdim=VDIM, add_bias_kv=True, add_zero_attn=True),
    "all_no_bias": dict(kdim=KDIM, vdim=VDIM, add_bias_kv=True, add_zero_attn=True, bias=False),
}


def randomized(rng, **options):
    """A float64 module with non-zero biases (bias_k/bias_v are random at init already)."""
    return randomize_vectors(nn.MultiheadAttention(E, H, **options).double(), rng)


def masks(rng, tgt_len, src_len):
    """name -> kwargs in torch.nn's convention. Rows whose S keys are all masked still see the
    appended keys, so torch's need_weights path is finite for them too."""
    causal = np.triu(np.ones((tgt_len, src_len), dtype=bool), 1)
    padding = np.zeros((B, src_len), dtype=bool)
    padding[1, src_len - 2:] = True
    float_mask = rng.standard_normal((tgt_len, src_len))
    float_mask[0, 1] = -np.inf
    per_head = rng.random((B * H, tgt_len, src_len)) < 0.3
    per_head[:, :, 0] = False  # every row keeps one of its S keys (else torch's output is NaN without appended keys)
    all_padded = np.zeros((B, src_len), dtype=bool)
    all_padded[1] = True
    return {
        "none": {},
        "causal": {"attn_mask": causal},
        "float": {"attn_mask": float_mask, "key_padding_mask": np.where(padding, -np.inf, 0.5)},
        "per_head_and_padding": {"attn_mask": per_head, "key_padding_mask": padding},
        "causal_float_and_bool_padding": {"attn_mask": np.where(causal, -np.inf, 0.0), "key_padding_mask": padding},
        "all_keys_padded": {"key_padding_mask": all_padded},
    }


MASKS = list(masks(np.random.default_rng(0), T, S))


def with_appended_keys(options):
    return options.get("add_bias_kv", False) or options.get("add_zero_attn", False)


@pytest.mark.parametrize("option", list(OPTIONS))
def test_state_dict_keys_and_shapes_are_torchs(option, torch):
    ours = nn.MultiheadAttention(E, H, **OPTIONS[option])
    theirs = torch.nn.MultiheadAttention(E, H, batch_first=True, **OPTIONS[option])
    assert list(ours.state_dict()) == list(theirs.state_dict())
    for (name, a), b in zip(ours.state_dict().items(), theirs.state_dict().values()):
        assert a.shape == tuple(b.shape), name
    assert (ours.in_proj_weight is None) == ("kdim" in OPTIONS[option])


@pytest.mark.parametrize("need_weights, average", [(False, True), (True, True), (True, False)])
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("option", list(OPTIONS))
def test_cross_attention_matches_torch(option, mask, need_weights, average, torch):
    rng = np.random.default_rng(1)
    options = OPTIONS[option]
    if mask == "all_keys_padded" and not with_appended_keys(options):
        pytest.skip("without appended keys a fully padded row has no key (covered in test_nn_attention)")
    kwargs = masks(rng, T, S)[mask]
    m = randomized(rng, **options)
    t_kwargs = to_torch_kwargs(torch, kwargs)
    arrays = [rng.standard_normal((B, T, E)), rng.standard_normal((B, S, options.get("kdim", E))),
              rng.standard_normal((B, S, options.get("vdim", E)))]
    extra = int(options.get("add_bias_kv", False)) + int(options.get("add_zero_attn", False))

    def ours(m, q, k, v):
        return m(q, k, v, need_weights=need_weights, average_attn_weights=average, **kwargs)

    def theirs(t, q, k, v):
        return t(q, k, v, need_weights=need_weights, average_attn_weights=average, **t_kwargs)
    outs = assert_torch_parity(torch, m, ours, theirs, arrays, **F64)
    if need_weights:
        assert outs[1].shape == ((B, T, S + extra) if average else (B, H, T, S + extra))


@pytest.mark.parametrize("mask", ["none", "causal", "per_head_and_padding"])
@pytest.mark.parametrize("option", ["bias_kv", "zero_attn", "bias_kv_zero_attn"])
def test_self_attention_matches_torch(option, mask, torch):
    """query is key is value: one packed projection GEMM, then the appended keys."""
    rng = np.random.default_rng(2)
    kwargs = masks(rng, T, T)[mask]
    m = randomized(rng, **OPTIONS[option])
    t_kwargs = to_torch_kwargs(torch, kwargs)
    assert_torch_parity(torch, m, lambda m, x: m(x, x, x, **kwargs), lambda t, x: t(x, x, x, **t_kwargs),
                        [rng.standard_normal((B, T, E))], **F64)


@pytest.mark.parametrize("option", ["bias_kv_zero_attn", "all"])
def test_is_causal_without_attn_mask_equals_the_causal_attn_mask(option, torch, rng):
    """torch needs attn_mask with is_causal; ours builds it: the appended keys stay visible."""
    m = randomized(rng, **OPTIONS[option])
    q = Tensor(rng.standard_normal((B, T, E)))
    k = Tensor(rng.standard_normal((B, T, OPTIONS[option].get("kdim", E))))
    v = Tensor(rng.standard_normal((B, T, OPTIONS[option].get("vdim", E))))
    causal = np.triu(np.ones((T, T), dtype=bool), 1)
    padding = masks(rng, T, T)["per_head_and_padding"]["key_padding_mask"]
    for extra in ({}, {"key_padding_mask": padding}):
        got = m(q, k, v, is_causal=True, **extra)
        want = m(q, k, v, attn_mask=causal, **extra)
        for a, b in zip(got, want):
            np.testing.assert_allclose(a.numpy(), b.numpy(), **F64)
    theirs = interop.to_torch(m)
    ref = theirs(*(torch.tensor(x.numpy()) for x in (q, k, v)), attn_mask=torch.tensor(causal), is_causal=True)
    np.testing.assert_allclose(m(q, k, v, is_causal=True)[0].numpy(), ref[0].detach().numpy(), **F64)


@pytest.mark.parametrize("option", list(OPTIONS))
def test_gradcheck(option, device, rng):
    options = OPTIONS[option]
    m = nn.MultiheadAttention(4, 2, **{**options, **{k: 3 for k in ("kdim", "vdim") if k in options}})
    randomize_vectors(m, rng)
    padding = np.array([[False, False, True], [True, True, True]])  # the second row sees appended keys only
    kwargs = {"key_padding_mask": padding} if with_appended_keys(options) else {}
    arrays = [rng.standard_normal((B, 2, 4)), rng.standard_normal((B, 3, m.kdim)), rng.standard_normal((B, 3, m.vdim))]
    gradcheck_module(m, lambda m, q, k, v: m(q, k, v, average_attn_weights=False, **kwargs), arrays, device)


@pytest.mark.parametrize("option", list(OPTIONS))
def test_float32_on_every_device_matches_torch(option, device, torch, rng):
    options = OPTIONS[option]
    m = randomize_vectors(nn.MultiheadAttention(E, H, **options), rng)
    kwargs = masks(rng, T, S)["per_head_and_padding"]
    t_kwargs = to_torch_kwargs(torch, kwargs)
    arrays = [rng.standard_normal((B, T, E)).astype("float32"),
              rng.standard_normal((B, S, m.kdim)).astype("float32"),
              rng.standard_normal((B, S, m.vdim)).astype("float32")]
    assert_torch_parity(torch, m, lambda m, q, k, v: m(q, k, v, **kwargs), lambda t, q, k, v: t(q, k, v, **t_kwargs),
                        arrays, device=device, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("option", list(OPTIONS))
def test_from_torch_keeps_every_number(option, torch, rng):
    torch.manual_seed(0)
    theirs = torch.nn.MultiheadAttention(E, H, batch_first=True, dtype=torch.float64, **OPTIONS[option])
    ours = interop.from_torch(theirs)
    assert ours.kdim == theirs.kdim and ours.vdim == theirs.vdim and ours.add_zero_attn == theirs.add_zero_attn
    for name, array in ours.state_dict().items():
        np.testing.assert_array_equal(array, theirs.state_dict()[name].numpy())
    back = interop.to_torch(ours)
    for name, t in back.state_dict().items():
        assert torch.equal(t, theirs.state_dict()[name]), name


def test_memory_efficient_equals_naive_with_appended_keys(rng, device):
    options = OPTIONS["all"]
    naive = randomized(rng, **options).to(device)
    blockwise = nn.MultiheadAttention(E, H, memory_efficient=True, block_size=2, **options).double().to(device)
    blockwise.load_state_dict(naive.state_dict())
    kwargs = masks(rng, T, S)["per_head_and_padding"]
    q = Tensor(rng.standard_normal((B, T, E)), device=device)
    k = Tensor(rng.standard_normal((B, S, KDIM)), device=device)
    v = Tensor(rng.standard_normal((B, S, VDIM)), device=device)
    np.testing.assert_allclose(blockwise(q, k, v, need_weights=False, **kwargs)[0].numpy(),
                               naive(q, k, v, need_weights=False, **kwargs)[0].numpy(),
                               atol=scaled(1e-12, q, k, v, *(p.data for p in naive.parameters())))


def test_init_like_torch():
    npformer.manual_seed(0)
    m = nn.MultiheadAttention(256, 4, kdim=128, vdim=64, add_bias_kv=True)
    for name, fan_in in (("q_proj_weight", 256), ("k_proj_weight", 128), ("v_proj_weight", 64)):
        bound = math.sqrt(6 / (256 + fan_in))  # xavier_uniform_ on each matrix
        w = getattr(m, name).numpy()
        assert np.abs(w).max() <= bound and abs(w.std() - bound / math.sqrt(3)) < 0.05 * bound, name
    std = math.sqrt(2 / (256 + 256))  # xavier_normal_ on (1, 1, E): fan_in = fan_out = E
    for b in (m.bias_k, m.bias_v):
        assert b.shape == (1, 1, 256) and abs(b.numpy().std() - std) < 0.15 * std
    assert np.all(m.in_proj_bias.numpy() == 0)


def test_projection_gemm_count_with_separate_weights(monkeypatch):
    """Separate q/k/v_proj_weight: three projections even when query is key is value."""
    import npformer.functional as F
    calls = []
    real = F.linear
    monkeypatch.setattr(F, "linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    m = nn.MultiheadAttention(E, H, kdim=E, vdim=VDIM)
    x, v = Tensor(np.ones((1, 3, E), dtype="float32")), Tensor(np.ones((1, 3, VDIM), dtype="float32"))
    m(x, x, v)
    assert len(calls) == 4  # q, k, v, out_proj


@pytest.mark.parametrize("bad, error, message", [
    (dict(kdim=0), ValueError, "MultiheadAttention: kdim must be an integer >= 1, got 0"),
    (dict(vdim=2.5), TypeError, "MultiheadAttention: vdim must be an integer >= 1"),
    (dict(kdim=True), TypeError, r"MultiheadAttention: kdim must be an integer >= 1, got True \(a bool"),
    (dict(add_bias_kv="no"), TypeError, "MultiheadAttention: add_bias_kv must be True or False, got 'no'"),
    (dict(add_zero_attn=1), TypeError, "MultiheadAttention: add_zero_attn must be True or False, got 1"),
])
def test_bad_dims_are_refused(bad, error, message):
    with pytest.raises(error, match=message):
        nn.MultiheadAttention(E, H, **bad)


def test_key_and_value_features_are_checked():
    m = nn.MultiheadAttention(E, H, kdim=KDIM, vdim=VDIM)
    q = Tensor(np.ones((1, 2, E)))
    with pytest.raises(ValueError, match=rf"key must be \(batch, seq, {KDIM}\)"):
        m(q, q, Tensor(np.ones((1, 2, VDIM))))
    with pytest.raises(ValueError, match=rf"value must be \(batch, seq, {VDIM}\)"):
        m(q, Tensor(np.ones((1, 2, KDIM))), q)


def test_repr_names_the_options():
    text = repr(nn.MultiheadAttention(E, H, kdim=KDIM, add_bias_kv=True, add_zero_attn=True))
    assert f"kdim={KDIM}" in text and "add_bias_kv=True" in text and "add_zero_attn=True" in text
    assert "vdim" not in text
