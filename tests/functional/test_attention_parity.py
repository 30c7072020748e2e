"""Attention and the Transformer layers side by side with torch where users study backprop
through attention: float masks that require grad get torch's gradient through
nn.MultiheadAttention and the layers (they were dropped: the mask's data was taken), flags are
bools (need_weights='no' returned weights), F.scaled_dot_product_attention on torch's
conventions (is_causal with a mask, Tq != Tk, a fully masked row: 0 and finite gradients where
torch's SDPA gives them), dropout in eval mode, and interop keeping every dropout rate of a
layer both ways."""
import numpy as np
import pytest

import npformer.functional as F
from autograd import Tensor, no_grad
from autograd.gradcheck import vjp
from npformer import interop, nn
from npformer.opcases.modules import randomize_vectors

from helpers import assert_torch_parity
from tolerances import scaled

pytestmark = [pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask"),
              pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")]

B, T, S, E, H = 2, 3, 4, 6, 2


def float_masks(rng, tgt_len=T, src_len=S):
    """name -> {argument: float array} (torch.nn's convention: added to the scores), every row
    keeping at least one key; the masks are inputs that require grad."""
    attn = rng.standard_normal((tgt_len, src_len))
    attn[0, 1] = -np.inf
    per_head = rng.standard_normal((B * H, tgt_len, src_len))
    padding = rng.standard_normal((B, src_len))
    padding[1, -1] = -np.inf
    return {"attn_2d": {"attn_mask": attn}, "attn_3d": {"attn_mask": per_head},
            "padding": {"key_padding_mask": padding}, "both": {"attn_mask": attn, "key_padding_mask": padding}}


MASKS = list(float_masks(np.random.default_rng(0)))


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("mask", MASKS)
def test_float_masks_that_require_grad_get_torchs_gradient(mask, need_weights, device, torch, rng):
    masks = float_masks(rng)[mask]
    names = list(masks)
    ours = randomize_vectors(nn.MultiheadAttention(E, H).double(), rng)
    q, kv = rng.standard_normal((B, T, E)), rng.standard_normal((B, S, E))

    def run(module, q, kv, *mask_tensors):
        return module(q, kv, kv, need_weights=need_weights, **dict(zip(names, mask_tensors)))

    assert_torch_parity(torch, ours, run, run, [q, kv, *masks.values()], atol=1e-12, device=device)


@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_and_decoder_layer_masks_that_require_grad_get_torchs_gradient(norm_first, torch, rng):
    encoder = randomize_vectors(nn.TransformerEncoderLayer(E, H, 8, dropout=0.0, norm_first=norm_first).double(), rng)
    decoder = randomize_vectors(nn.TransformerDecoderLayer(E, H, 8, dropout=0.0, norm_first=norm_first).double(), rng)
    src, tgt = rng.standard_normal((B, S, E)), rng.standard_normal((B, T, E))
    src_mask, tgt_mask, memory_mask = (rng.standard_normal(shape) for shape in ((S, S), (T, T), (T, S)))
    padding = rng.standard_normal((B, S))
    assert_torch_parity(torch, encoder, lambda m, x, a, p: m(x, src_mask=a, src_key_padding_mask=p),
                        lambda m, x, a, p: m(x, src_mask=a, src_key_padding_mask=p),
                        [src, src_mask, padding], atol=1e-11)

    def decode(m, x, memory, a, b, p):
        return m(x, memory, tgt_mask=a, memory_mask=b, memory_key_padding_mask=p)
    assert_torch_parity(torch, decoder, decode, decode, [tgt, src, tgt_mask, memory_mask, padding], atol=1e-11)


def test_a_mask_gradient_accumulates_over_the_layers_of_a_stack(torch, rng):
    layer = randomize_vectors(nn.TransformerEncoderLayer(E, H, 8, dropout=0.0).double(), rng)
    stack = nn.TransformerEncoder(layer, 2, nn.LayerNorm(E).double())
    src, mask = rng.standard_normal((B, S, E)), rng.standard_normal((S, S))
    assert_torch_parity(torch, stack, lambda m, x, a: m(x, mask=a), lambda m, x, a: m(x, mask=a), [src, mask],
                        atol=1e-11)


def test_a_mask_that_requires_grad_with_appended_keys_matches_torch(device, torch, rng):
    ours = randomize_vectors(nn.MultiheadAttention(E, H, add_bias_kv=True, add_zero_attn=True).double(), rng)
    q, kv = rng.standard_normal((B, T, E)), rng.standard_normal((B, S, E))
    mask, padding = rng.standard_normal((T, S)), rng.standard_normal((B, S))

    def run(module, q, kv, a, p):
        return module(q, kv, kv, attn_mask=a, key_padding_mask=p)
    assert_torch_parity(torch, ours, run, run, [q, kv, mask, padding], atol=1e-12, device=device)


def test_a_mask_that_requires_grad_of_another_dtype_is_refused(rng):
    attention = nn.MultiheadAttention(E, H).double()
    x = Tensor(rng.standard_normal((B, T, E)))
    mask = Tensor(rng.standard_normal((T, T)).astype(np.float32), requires_grad=True)
    with pytest.raises(TypeError, match="attn_mask.*float64.*float32"):
        attention(x, x, x, attn_mask=mask)
    with no_grad():  # no gradient asked for: cast like any float mask
        attention(x, x, x, attn_mask=mask)


@pytest.mark.parametrize("call, name", [
    (lambda m, x: m(x, x, x, need_weights="no"), "need_weights"),
    (lambda m, x: m(x, x, x, average_attn_weights=0), "average_attn_weights"),
    (lambda m, x: m(x, x, x, is_causal="yes"), "is_causal"),
])
def test_multihead_attention_flags_must_be_bools(call, name, rng):
    attention = nn.MultiheadAttention(E, H)
    x = Tensor(rng.standard_normal((B, T, E)).astype(np.float32))
    with pytest.raises(TypeError, match=f"{name} must be True or False"):
        call(attention, x)
    out, weights = attention(x, x, x, need_weights=np.bool_(False), is_causal=np.bool_(True))
    assert weights is None


@pytest.mark.parametrize("kwargs, name", [(dict(is_causal="yes"), "is_causal"),
                                          (dict(return_weights="no"), "return_weights"),
                                          (dict(is_causal=1), "is_causal")])
def test_sdpa_flags_must_be_bools(kwargs, name, rng):
    q = Tensor(rng.standard_normal((1, 2, 3, 4)))
    with pytest.raises(TypeError, match=f"{name} must be True or False"):
        F.scaled_dot_product_attention(q, q, q, **kwargs)
    with pytest.raises(TypeError, match=f"{name} must be True or False"):
        F.attention_backend(q, q, q, **kwargs)


@pytest.mark.parametrize("make, call", [
    (lambda: nn.TransformerEncoderLayer(E, H, 8), lambda m, x: m(x, is_causal="yes")),
    (lambda: nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, 8), 1), lambda m, x: m(x, is_causal="yes")),
    (lambda: nn.TransformerDecoderLayer(E, H, 8), lambda m, x: m(x, x, tgt_is_causal="yes")),
    (lambda: nn.TransformerDecoder(nn.TransformerDecoderLayer(E, H, 8), 1), lambda m, x: m(x, x, memory_is_causal=1)),
    (lambda: nn.Transformer(E, H, 1, 1, 8), lambda m, x: m(x, x, src_is_causal="no")),
])
def test_layer_flags_must_be_bools(make, call, rng):
    x = Tensor(rng.standard_normal((B, T, E)).astype(np.float32))
    with pytest.raises(TypeError, match="is_causal must be True or False"):
        call(make(), x)


def sdpa_cases(rng, tq, tk):
    """name -> (our kwargs, torch's kwargs) in F.scaled_dot_product_attention's convention."""
    keep = rng.random((B, H, tq, tk)) < 0.6
    keep[..., 0] = True
    empty_row = np.ones((tq, tk), dtype=bool)
    empty_row[1] = False
    additive = np.where(keep, rng.standard_normal(keep.shape), -np.inf)
    return {
        "bool_4d": dict(attn_mask=keep),
        "bool_2d_causal": dict(attn_mask=keep[0, 0], is_causal=True),
        "float_broadcast_heads": dict(attn_mask=additive[:, :1]),
        "causal_only": dict(is_causal=True),
        "fully_masked_row": dict(attn_mask=empty_row),
        "fully_masked_float_row": dict(attn_mask=np.where(empty_row, 0.0, -np.inf)),
        "scale": dict(attn_mask=keep, scale=np.float64(0.3)),
    }


@pytest.mark.parametrize("tq, tk", [(3, 3), (2, 5), (5, 2)])
@pytest.mark.parametrize("case", list(sdpa_cases(np.random.default_rng(0), 3, 3)))
@pytest.mark.parametrize("path", ["naive", "memory_efficient"])
def test_sdpa_matches_torch_on_its_conventions(case, tq, tk, path, torch, rng):
    """Output and gradients of q, k, v with a random upstream gradient; a fully masked row
    gives 0 and zero (finite) gradients on both sides (torch's SDPA math path)."""
    kwargs = sdpa_cases(rng, tq, tk)[case]
    arrays = [rng.standard_normal((B, H, tq, 3)), rng.standard_normal((B, H, tk, 3)),
              rng.standard_normal((B, H, tk, 2))]
    ours_in = [Tensor(a, requires_grad=True) for a in arrays]
    theirs_in = [torch.tensor(a, requires_grad=True) for a in arrays]
    theirs_kwargs = {k: torch.tensor(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
    if kwargs.get("is_causal") and "attn_mask" in kwargs:  # torch refuses both under autograd: combine them
        theirs_kwargs.update(is_causal=False, attn_mask=theirs_kwargs["attn_mask"] & torch.ones(tq, tk).tril().bool())
    if "scale" in theirs_kwargs:
        theirs_kwargs["scale"] = float(theirs_kwargs["scale"])
    (out,), (g,), grads = vjp(lambda *x: F.scaled_dot_product_attention(*x, backend=path, block_size=2, **kwargs),
                              ours_in, seed=int(rng.integers(2**31)))
    ref = torch.nn.functional.scaled_dot_product_attention(*theirs_in, **theirs_kwargs)
    ref.backward(torch.tensor(g))
    atol = scaled(1e-12, *arrays)
    np.testing.assert_allclose(out.numpy(), ref.detach().numpy(), atol=atol, rtol=0)
    for name, mine, theirs in zip("qkv", grads, theirs_in):
        assert np.isfinite(mine).all()
        np.testing.assert_allclose(mine, theirs.grad.numpy(), atol=scaled(atol, g), rtol=0, err_msg=f"d{name}")


@pytest.mark.parametrize("need_weights, average", [(False, True), (True, True), (True, False)])
def test_attention_dropout_is_off_in_eval_mode_like_torch(need_weights, average, torch, rng):
    ours = randomize_vectors(nn.MultiheadAttention(E, H, dropout=0.5).double(), rng).eval()
    q, kv = rng.standard_normal((B, T, E)), rng.standard_normal((B, S, E))

    def run(module, q, kv):
        return module(q, kv, kv, need_weights=need_weights, average_attn_weights=average)
    assert_torch_parity(torch, ours, run, run, [q, kv], atol=1e-12)


@pytest.mark.parametrize("layer", [nn.TransformerEncoderLayer, nn.TransformerDecoderLayer])
def test_layer_dropout_rates_survive_interop_both_ways(layer, torch):
    config = nn.TransformerConfig(d_model=E, nhead=H, dim_feedforward=8, dropout=0.1, attention_dropout=0.2,
                                  activation_dropout=0.3, norm_first=True, activation="gelu", layer_norm_eps=1e-3)
    ours = layer(config=config)
    theirs = interop.to_torch(ours)
    attentions = [theirs.self_attn] + ([theirs.multihead_attn] if hasattr(theirs, "multihead_attn") else [])
    assert [a.dropout for a in attentions] == [0.2] * len(attentions)
    assert theirs.dropout.p == 0.3 and theirs.dropout1.p == theirs.dropout2.p == 0.1
    back = interop.from_torch(theirs)
    assert back.config == ours.config
    assert (back.self_attn.dropout, back.dropout.p, back.dropout1.p) == (0.2, 0.3, 0.1)
    plain = interop.from_torch(type(theirs)(E, H, 8, dropout=0.25, batch_first=True))
    assert plain.config.attention_dropout_p == plain.config.activation_dropout_p == plain.config.dropout == 0.25


def test_transformer_and_stack_dropout_rates_survive_interop_both_ways(torch):
    config = nn.TransformerConfig(d_model=E, nhead=H, dim_feedforward=8, dropout=0.1, attention_dropout=0.2,
                                  activation_dropout=0.0, num_encoder_layers=1, num_decoder_layers=2)
    for ours in (nn.Transformer(config=config), nn.TransformerEncoder(nn.TransformerEncoderLayer(config=config), 2),
                 nn.TransformerDecoder(nn.TransformerDecoderLayer(config=config), 1)):
        theirs = interop.to_torch(ours)
        rates = {(type(m).__name__, m.dropout) for m in theirs.modules() if isinstance(m, torch.nn.MultiheadAttention)}
        assert rates == {("MultiheadAttention", 0.2)}, type(ours).__name__
        back = interop.from_torch(theirs)
        rates = ("dropout", "attention_dropout", "activation_dropout")
        assert [back.config[r] for r in rates] == [0.1, 0.2, 0.0], type(ours).__name__
        assert back.config == ours.config or not isinstance(ours, nn.Transformer)  # a stack has no layer counts
