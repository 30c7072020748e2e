"""Issue 42's layers: grouped-query MultiheadAttention (against torch's scaled_dot_product_attention
with enable_gqa=True and against repeated key/value heads, on the same weights), sliding-window
causal self-attention (against the explicitly masked reference) and its KV cache bounded by the
window, cached decoding with H_kv heads equal to the uncached forward, RMSNorm and SwiGLU layers
(state_dict keys and shapes, a Llama-style block against torch), TransformerConfig's new settings
(round trip, old dicts, errors)."""
import contextlib
import dataclasses
import json

import numpy as np
import pytest

from autograd import Tensor
from npformer import load_checkpoint, nn, save_checkpoint
from npformer.nn.config import stored_config
from npformer.opcases.modules import randomize_vectors

from helpers import F64

B, T, E, H, FF = 2, 6, 16, 4, 12
HD = E // H


def config(**settings):
    """A small float64 config without dropout."""
    return nn.TransformerConfig(**dict(dict(d_model=E, nhead=H, dim_feedforward=FF, dropout=0.0, dtype="float64",
                                            num_encoder_layers=2, num_decoder_layers=2), **settings))


def padding(length=T, pad=2):
    """(B, length) bool, True = padding: row 1 left-padded by `pad`."""
    mask = np.zeros((B, length), dtype=bool)
    mask[1, :pad] = True
    return mask


def holes(length=T):
    """(B, length) bool, True = padding: keys 2 (row 1) and 4 (row 0), so that every query keeps
    key 0 under a causal mask (torch's SDPA gives NaN where a query keeps none)."""
    mask = np.zeros((B, length), dtype=bool)
    mask[1, 2] = mask[0, 4] = True
    return mask


def band(tgt_len, src_len, window=None):
    """(T, S) bool, True = key j takes part for query i: j <= i (and j > i - window)."""
    i, j = np.arange(tgt_len)[:, None], np.arange(src_len)[None, :]
    allowed = j <= i
    return allowed if window is None else allowed & (j > i - window)


# -- the torch reference ------------------------------------------------------------------------
def torch_attention(torch, p, query, key, value, heads, kv_heads, allowed=None, repeat=False):
    """Attention in torch on the parameters `p` ({name: torch leaf}, our names): q, k, v projected
    (packed in_proj_weight, or q/k/v_proj_weight), H_kv key/value heads, torch's SDPA with
    enable_gqa=True (or, repeat=True, every kv head repeated for its H / H_kv query heads),
    `allowed` (bool, True = takes part), out_proj. -> (output, head-averaged weights)."""
    Fn = torch.nn.functional
    width, hd = query.shape[-1], query.shape[-1] // heads
    kv = kv_heads * hd
    rows = {"q": slice(0, width), "k": slice(width, width + kv), "v": slice(width + kv, width + 2 * kv)}
    bias = p.get("in_proj_bias")

    def project(x, name, n):
        w = p["in_proj_weight"][rows[name]] if "in_proj_weight" in p else p[f"{name}_proj_weight"]
        y = Fn.linear(x, w, None if bias is None else bias[rows[name]])
        return y.view(x.shape[0], x.shape[1], n, hd).transpose(1, 2)
    q, k, v = project(query, "q", heads), project(key, "k", kv_heads), project(value, "v", kv_heads)
    mask = None if allowed is None else torch.tensor(allowed)
    if repeat:
        k, v = k.repeat_interleave(heads // kv_heads, dim=1), v.repeat_interleave(heads // kv_heads, dim=1)
        out = Fn.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    else:
        out = Fn.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    every_key = k if repeat else k.repeat_interleave(heads // kv_heads, dim=1)
    scores = q @ every_key.transpose(-1, -2) / hd ** 0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, -float("inf"))
    weights = scores.softmax(-1).mean(1)
    B_, T_ = query.shape[:2]
    return Fn.linear(out.transpose(1, 2).reshape(B_, T_, width), p["out_proj.weight"], p.get("out_proj.bias")), weights


def assert_matches(torch, module, ours, theirs, arrays, rng, atol=F64["atol"]):
    """ours(module, *Tensors) and theirs({name: torch parameter}, *torch leaves), each returning
    one output or a tuple (the first is backpropagated with one random upstream gradient): every
    output, every input gradient and every parameter gradient agree."""
    xs = [Tensor(a, requires_grad=True) for a in arrays]
    module.zero_grad()
    outs = ours(module, *xs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    upstream = rng.standard_normal(outs[0].shape)
    (outs[0] * Tensor(upstream)).sum().backward()
    params = {name: torch.tensor(p.numpy(), requires_grad=True) for name, p in module.named_parameters()}
    ts = [torch.tensor(a, requires_grad=True) for a in arrays]
    refs = theirs(params, *ts)
    refs = refs if isinstance(refs, tuple) else (refs,)
    (refs[0] * torch.tensor(upstream)).sum().backward()
    for i, (o, r) in enumerate(zip(outs, refs)):
        if o is not None:
            np.testing.assert_allclose(o.numpy(), r.detach().numpy(), atol=atol, rtol=0, err_msg=f"output {i}")
    for i, (x, t) in enumerate(zip(xs, ts)):
        assert (x.grad is None) == (t.grad is None), f"gradient of input {i} on one side only"
        if x.grad is not None:
            np.testing.assert_allclose(x.grad.numpy(), t.grad.numpy(), atol=atol, rtol=0,
                                       err_msg=f"gradient of input {i}")
    for name, p in module.named_parameters():
        np.testing.assert_allclose(p.grad.numpy(), params[name].grad.numpy(), atol=atol, rtol=0,
                                   err_msg=f"gradient of {name}")
    return outs


# -- grouped-query attention ----------------------------------------------------------------------
def test_grouped_in_proj_layout_and_state_dict():
    m = nn.MultiheadAttention(E, H, num_kv_heads=2, dtype="float64")
    kv = 2 * HD
    assert (m.num_heads, m.num_kv_heads, m.head_dim, m.kv_dim) == (H, 2, HD, kv)
    assert {k: v.shape for k, v in m.state_dict().items()} == {
        "in_proj_weight": (E + 2 * kv, E), "in_proj_bias": (E + 2 * kv,), "out_proj.weight": (E, E),
        "out_proj.bias": (E,)}
    assert m.config.num_kv_heads == 2 and "num_kv_heads=2" in repr(m)
    same = nn.MultiheadAttention(E, H, num_kv_heads=H)  # num_kv_heads == num_heads: torch's layout
    assert same.in_proj_weight.shape == (3 * E, E) and not same.grouped


@pytest.mark.filterwarnings("ignore:Support for mismatched")
@pytest.mark.parametrize("path", ["naive", "memory_efficient", "weights"])
@pytest.mark.parametrize("mask", ["none", "causal", "causal_padding", "padding"])
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_grouped_query_self_attention_matches_torch(kv_heads, mask, path, torch, rng):
    m = randomize_vectors(nn.MultiheadAttention(E, H, num_kv_heads=kv_heads, dtype="float64",
                                                memory_efficient=path == "memory_efficient", block_size=2), rng)
    kwargs = {"is_causal": mask.startswith("causal")}
    allowed = band(T, T) if kwargs["is_causal"] else np.ones((T, T), dtype=bool)
    if mask.endswith("padding"):
        kwargs["key_padding_mask"] = holes()
        allowed = allowed & ~holes()[:, None, None, :]
    need = path == "weights"

    def ours(m, x):
        out, weights = m(x, x, x, need_weights=need, **kwargs)
        return out, weights

    def theirs(p, x):
        out, weights = torch_attention(torch, p, x, x, x, H, kv_heads, None if mask == "none" else allowed)
        return out, weights if need else None
    assert_matches(torch, m, ours, theirs, [rng.standard_normal((B, T, E))], rng)


def test_torch_reference_with_enable_gqa_equals_repeated_heads(torch, rng):
    """The reference itself: torch's SDPA(enable_gqa=True) is attention with each kv head repeated."""
    m = randomize_vectors(nn.MultiheadAttention(E, H, num_kv_heads=2, dtype="float64"), rng)
    p = {name: torch.tensor(t.numpy()) for name, t in m.named_parameters()}
    x = torch.tensor(rng.standard_normal((B, T, E)))
    grouped = torch_attention(torch, p, x, x, x, H, 2, band(T, T))[0]
    repeated = torch_attention(torch, p, x, x, x, H, 2, band(T, T), repeat=True)[0]
    np.testing.assert_allclose(grouped.numpy(), repeated.numpy(), **F64)
    ours = m(Tensor(x.numpy()), Tensor(x.numpy()), Tensor(x.numpy()), is_causal=True)[0]
    np.testing.assert_allclose(ours.numpy(), repeated.numpy(), **F64)


@pytest.mark.parametrize("same_key_value", [True, False])
def test_grouped_cross_attention_matches_torch(same_key_value, torch, rng):
    m = randomize_vectors(nn.MultiheadAttention(E, H, num_kv_heads=1, dtype="float64"), rng)
    pad = padding(5, 1)

    def ours(m, q, k, v):
        return m(q, k, k if same_key_value else v, key_padding_mask=pad)

    def theirs(p, q, k, v):
        return torch_attention(torch, p, q, k, k if same_key_value else v, H, 1, ~pad[:, None, None, :])
    assert_matches(torch, m, ours, theirs, [rng.standard_normal((B, n, E)) for n in (T, 5, 5)], rng)


def test_grouped_separate_projections_kdim_vdim(torch, rng):
    m = randomize_vectors(nn.MultiheadAttention(E, H, kdim=6, vdim=5, num_kv_heads=2, dtype="float64"), rng)
    assert (m.q_proj_weight.shape, m.k_proj_weight.shape, m.v_proj_weight.shape) == ((E, E), (8, 6), (8, 5))
    assert m.in_proj_bias.shape == (E + 16,)
    assert_matches(torch, m, lambda m, q, k, v: m(q, k, v),
                   lambda p, q, k, v: torch_attention(torch, p, q, k, v, H, 2),
                   [rng.standard_normal((B, T, E)), rng.standard_normal((B, 5, 6)), rng.standard_normal((B, 5, 5))],
                   rng)


def test_qkv_bias_without_the_other_biases(torch, rng):
    """Qwen2's layout: bias=False, qkv_bias=True: in_proj_bias only, out_proj without a bias."""
    m = randomize_vectors(nn.MultiheadAttention(config=config(num_kv_heads=2, bias=False, qkv_bias=True)), rng)
    assert sorted(m.state_dict()) == ["in_proj_bias", "in_proj_weight", "out_proj.weight"]
    assert m.out_proj.bias is None and m.in_proj_bias.shape == (E + 2 * 2 * HD,)
    assert_matches(torch, m, lambda m, x: m(x, x, x, is_causal=True)[0],
                   lambda p, x: torch_attention(torch, p, x, x, x, H, 2, band(T, T))[0],
                   [rng.standard_normal((B, T, E))], rng)
    plain = nn.MultiheadAttention(config=config(bias=True, qkv_bias=False))
    assert plain.in_proj_bias is None and plain.out_proj.bias is not None


def test_grouped_add_bias_kv_and_zero_attn():
    m = nn.MultiheadAttention(E, H, add_bias_kv=True, add_zero_attn=True, num_kv_heads=2, dtype="float64")
    assert m.bias_k.shape == m.bias_v.shape == (1, 1, 2 * HD)
    x = Tensor(np.random.default_rng(0).standard_normal((B, T, E)), requires_grad=True)
    out, weights = m(x, x, x, is_causal=True)
    assert out.shape == (B, T, E) and weights.shape == (B, T, T + 2)
    out.sum().backward()
    assert np.isfinite(m.bias_k.grad.numpy()).all() and np.isfinite(x.grad.numpy()).all()


def test_recording_attention_of_grouped_heads(rng):
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(config=config(num_kv_heads=2, sliding_window=3)), 2)
    x = Tensor(rng.standard_normal((B, T, E)))
    plain = model(x, is_causal=True).numpy()
    with nn.record_attention(model) as recorder:
        recorded = model(x, is_causal=True)
        recorded.sum().backward()
    np.testing.assert_allclose(recorded.numpy(), plain, **F64)
    probs = recorder.records[0].weights.numpy()
    assert probs.shape == (B, H, T, T)
    assert np.all(probs[..., ~band(T, T, 3)] == 0)


# -- sliding window -------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:Support for mismatched")
@pytest.mark.parametrize("memory_efficient", [False, True])
@pytest.mark.parametrize("with_padding", [False, True])
@pytest.mark.parametrize("window", [1, 2, 3, T + 2])
def test_sliding_window_attention_matches_the_masked_reference(window, with_padding, memory_efficient, torch, rng):
    m = randomize_vectors(nn.MultiheadAttention(config=config(
        num_kv_heads=2, sliding_window=window, memory_efficient=memory_efficient, block_size=2)), rng)
    if with_padding and window < 3:
        pytest.skip("a query whose window holds only padding keys gets NaN from torch's SDPA (0 from ours)")
    allowed = np.broadcast_to(band(T, T, window), (B, 1, T, T))
    kwargs = {}
    if with_padding:
        kwargs["key_padding_mask"] = holes()
        allowed = allowed & ~holes()[:, None, None, :]
    assert_matches(torch, m, lambda m, x: m(x, x, x, is_causal=True, need_weights=False, **kwargs)[0],
                   lambda p, x: torch_attention(torch, p, x, x, x, H, 2, allowed)[0],
                   [rng.standard_normal((B, T, E))], rng)


def test_window_applies_to_causal_self_attention_only(rng):
    """A window as wide as the sequence changes nothing; without is_causal a window is an error (never dropped unseen)."""
    wide = randomize_vectors(nn.MultiheadAttention(config=config(sliding_window=T)), rng)
    narrow = nn.MultiheadAttention(config=config(sliding_window=2))
    plain = nn.MultiheadAttention(config=config())
    narrow.load_state_dict(wide.state_dict())
    plain.load_state_dict(wide.state_dict())
    x = Tensor(rng.standard_normal((B, T, E)))
    np.testing.assert_allclose(wide(x, x, x, is_causal=True)[0].numpy(), plain(x, x, x, is_causal=True)[0].numpy(),
                               **F64)
    with pytest.raises(ValueError, match="sliding_window=2 applies to causal self-attention only"):
        narrow(x, x, x)
    blocked = ~band(T, T, 2)  # torch.nn's convention: True = may not attend
    np.testing.assert_allclose(narrow(x, x, x, is_causal=True)[0].numpy(),
                               plain(x, x, x, attn_mask=blocked)[0].numpy(), **F64)


def test_window_with_appended_keys(rng):
    """add_bias_kv / add_zero_attn materialise the causal mask: the window stays in it."""
    options = dict(add_bias_kv=True, add_zero_attn=True)
    narrow = randomize_vectors(nn.MultiheadAttention(config=config(sliding_window=2, num_kv_heads=2), **options), rng)
    plain = nn.MultiheadAttention(config=config(num_kv_heads=2), **options)
    plain.load_state_dict(narrow.state_dict())
    x = Tensor(rng.standard_normal((B, T, E)))
    np.testing.assert_allclose(narrow(x, x, x, is_causal=True)[0].numpy(),
                               plain(x, x, x, attn_mask=~band(T, T, 2))[0].numpy(), **F64)


@pytest.mark.parametrize("with_padding", [False, True])
def test_sliding_window_stacks_equal_the_explicit_mask(with_padding, rng):
    """Encoder and decoder stacks with a window, is_causal, equal the same weights without a
    window given the banded mask; the decoder's cross-attention has no window."""
    windowed = config(sliding_window=2, num_kv_heads=2, norm_first=True)
    pad = padding(T, 1) if with_padding else None
    enc = randomize_vectors(nn.TransformerEncoder(nn.TransformerEncoderLayer(config=windowed), 2), rng)
    enc_plain = nn.TransformerEncoder(nn.TransformerEncoderLayer(config=dataclasses.replace(windowed,
                                                                                           sliding_window=None)), 2)
    enc_plain.load_state_dict(enc.state_dict())
    x, memory = Tensor(rng.standard_normal((B, T, E))), Tensor(rng.standard_normal((B, 3, E)))
    np.testing.assert_allclose(enc(x, is_causal=True, src_key_padding_mask=pad).numpy(),
                               enc_plain(x, mask=~band(T, T, 2), src_key_padding_mask=pad).numpy(), **F64)
    dec = randomize_vectors(nn.TransformerDecoder(nn.TransformerDecoderLayer(config=windowed), 2), rng)
    assert dec.layers[0].multihead_attn.config.sliding_window is None
    dec_plain = nn.TransformerDecoder(nn.TransformerDecoderLayer(config=dataclasses.replace(windowed,
                                                                                           sliding_window=None)), 2)
    dec_plain.load_state_dict(dec.state_dict())
    np.testing.assert_allclose(dec(x, memory, tgt_is_causal=True, tgt_key_padding_mask=pad).numpy(),
                               dec_plain(x, memory, tgt_mask=~band(T, T, 2), tgt_key_padding_mask=pad).numpy(), **F64)


# -- cached decoding --------------------------------------------------------------------------------
def llama_config(**settings):
    return config(**dict(dict(norm="rmsnorm", activation="swiglu", rotary=True, norm_first=True, bias=False),
                         **settings))


@pytest.mark.parametrize("inference", [False, True])
@pytest.mark.parametrize("prompt", [1, 4])
@pytest.mark.parametrize("window", [None, 1, 3])
@pytest.mark.parametrize("kv_heads", [1, 2, H])
def test_cached_decoding_equals_the_uncached_forward(kv_heads, window, prompt, inference, rng):
    """A prompt at once, then one position at a time, through the KV cache (H_kv heads; with a
    window, the last W - 1 positions only) equals the whole sequence's causal forward."""
    n = 10
    enc = randomize_vectors(nn.TransformerEncoder(nn.TransformerEncoderLayer(
        config=llama_config(num_kv_heads=kv_heads, sliding_window=window)), 2, nn.make_norm(llama_config())), rng)
    x = Tensor(rng.standard_normal((B, n, E)))
    full = enc(x, is_causal=True).numpy()
    cache = enc.init_cache()
    with nn.inference_mode() if inference else contextlib.nullcontext():
        steps = [enc.step(x[:, :prompt], cache).numpy()]
        for t in range(prompt, n):
            steps.append(enc.step(x[:, t:t + 1], cache).numpy())
            held = t + 1 if window is None else min(t + 1, window - 1)
            for layer in cache.layers:
                assert layer.self_k.shape == layer.self_v.shape == (B, kv_heads, held, HD)
            assert cache.held == held and len(cache) == t + 1
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, **F64)


@pytest.mark.parametrize("inference", [False, True])
@pytest.mark.parametrize("window", [None, 2, 3])
def test_cached_decoding_of_left_padded_prompts(window, inference, rng):
    """Left-padded prompts: the cache keeps the padding's columns of the kept positions only, and
    every real position equals the padded forward."""
    n, prompt = 9, 4
    enc = randomize_vectors(nn.TransformerEncoder(nn.TransformerEncoderLayer(
        config=llama_config(num_kv_heads=2, sliding_window=window)), 2), rng)
    x = Tensor(rng.standard_normal((B, n, E)))
    pad = np.zeros((B, n), dtype=bool)
    pad[1, :2] = True
    full = enc(x, is_causal=True, src_key_padding_mask=pad).numpy()
    cache = enc.init_cache()
    with nn.inference_mode() if inference else contextlib.nullcontext():
        steps = [enc.step(x[:, :prompt], cache, key_padding_mask=pad[:, :prompt]).numpy()]
        assert cache.attendable.shape == (B, cache.held)
        for t in range(prompt, n):
            steps.append(enc.step(x[:, t:t + 1], cache).numpy())
            assert cache.attendable.shape == (B, cache.held) == (B, cache.layers[0].self_k.shape[2])
    got = np.concatenate(steps, axis=1)
    np.testing.assert_allclose(got[~pad], full[~pad], **F64)


def test_the_cache_stays_bounded_by_the_window(rng):
    """Decoding 200 positions with window 4 after a prompt of 50: every layer holds 3 positions,
    in buffers of a bounded capacity (the prompt's keys are not kept)."""
    window = 4
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(config=llama_config(num_kv_heads=1,
                                                                               sliding_window=window)), 2)
    cache = enc.init_cache()
    with nn.inference_mode():
        enc.step(Tensor(rng.standard_normal((1, 50, E))), cache)
        capacities = set()
        for _ in range(200):
            enc.step(Tensor(rng.standard_normal((1, 1, E))), cache)
            for layer in cache.layers:
                assert layer.self_k.shape == (1, 1, window - 1, HD)
                assert layer.self_k.data.base is layer.buffers[0]
                capacities.add(layer.buffers[0].shape[2])
    assert len(cache) == 250 and max(capacities) <= 16


def test_seq2seq_decoder_cache_with_grouped_heads_and_a_window(rng):
    dec = randomize_vectors(nn.TransformerDecoder(nn.TransformerDecoderLayer(
        config=llama_config(num_kv_heads=2, sliding_window=3)), 2), rng)
    tgt, memory = Tensor(rng.standard_normal((B, 7, E))), Tensor(rng.standard_normal((B, 4, E)))
    pad = padding(4, 1)
    full = dec(tgt, memory, tgt_is_causal=True, memory_key_padding_mask=pad).numpy()
    cache = dec.init_cache(memory, memory_key_padding_mask=pad)
    assert cache.layers[0].cross_k.shape == (B, 2, 4, HD)
    with nn.inference_mode():
        steps = [dec.step(tgt[:, t:t + 1], cache).numpy() for t in range(7)]
    assert cache.layers[0].self_k.shape == (B, 2, 2, HD)
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, **F64)


def test_reordering_a_windowed_cache(rng):
    enc = randomize_vectors(nn.TransformerEncoder(nn.TransformerEncoderLayer(
        config=llama_config(num_kv_heads=2, sliding_window=3)), 1), rng)
    x = rng.standard_normal((B, 6, E))
    swapped_rows = x[::-1].copy()
    with nn.inference_mode():
        cache = enc.init_cache()
        enc.step(Tensor(x[:, :4]), cache)
        cache.reorder(np.array([1, 0]))
        after = enc.step(Tensor(swapped_rows[:, 4:5]), cache).numpy()
        swapped = enc.init_cache()
        enc.step(Tensor(swapped_rows[:, :4]), swapped)
        expected = enc.step(Tensor(swapped_rows[:, 4:5]), swapped).numpy()
    np.testing.assert_allclose(after, expected, **F64)


# -- RMSNorm, SiLU and SwiGLU layers ----------------------------------------------------------------
def test_rmsnorm_swiglu_layers_state_dict_keys_and_shapes():
    c = llama_config(num_kv_heads=2)
    kv = 2 * HD
    layer = nn.TransformerEncoderLayer(config=c)
    assert {k: v.shape for k, v in layer.state_dict().items()} == {
        "self_attn.in_proj_weight": (E + 2 * kv, E), "self_attn.out_proj.weight": (E, E),
        "linear1.weight": (FF, E), "linear3.weight": (FF, E), "linear2.weight": (E, FF),
        "norm1.weight": (E,), "norm2.weight": (E,)}
    assert layer.norm1.eps == c.layer_norm_eps and type(layer.norm1).__name__ == "RMSNorm"
    decoder_layer = nn.TransformerDecoderLayer(config=c)
    assert {k for k in decoder_layer.state_dict() if "norm" in k} == {"norm1.weight", "norm2.weight", "norm3.weight"}
    assert decoder_layer.multihead_attn.in_proj_weight.shape == (E + 2 * kv, E)
    model = nn.Transformer(config=c)
    assert {k for k in model.state_dict() if ".norm." in k} == {"encoder.norm.weight", "decoder.norm.weight"}
    assert not any(k.endswith("bias") for k in model.state_dict())
    with_bias = nn.TransformerEncoderLayer(config=config(activation="swiglu"))
    assert with_bias.linear3.bias.shape == (FF,) and with_bias.norm1.bias.shape == (E,)  # LayerNorm
    assert not hasattr(nn.TransformerEncoderLayer(config=config(activation="silu")), "linear3")


def test_make_norm():
    assert type(nn.make_norm(config())).__name__ == "LayerNorm"
    assert nn.make_norm(config(bias=False)).bias is None
    rms = nn.make_norm(config(norm="rmsnorm", layer_norm_eps=1e-6))
    assert type(rms).__name__ == "RMSNorm" and rms.eps == 1e-6 and rms.weight.dtype == np.float64
    with pytest.raises(TypeError, match=r"make_norm: config must be a TransformerConfig, got dict"):
        nn.make_norm({"norm": "rmsnorm"})


@pytest.mark.parametrize("activation", ["swiglu", "silu"])
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_llama_block_matches_torch(kv_heads, activation, torch, rng):
    """A pre-norm RMSNorm block (x + attn(rms(x)), then + ff(rms(x))) with grouped heads and RoPE
    off, against the same block written in torch."""
    layer = randomize_vectors(nn.TransformerEncoderLayer(config=llama_config(
        num_kv_heads=kv_heads, rotary=False, activation=activation, layer_norm_eps=1e-6)), rng)
    Fn = torch.nn.functional

    def theirs(p, x):
        h = Fn.rms_norm(x, (E,), p["norm1.weight"], 1e-6)
        attn = {k[len("self_attn."):]: v for k, v in p.items() if k.startswith("self_attn.")}
        x = x + torch_attention(torch, attn, h, h, h, H, kv_heads, band(T, T))[0]
        h = Fn.rms_norm(x, (E,), p["norm2.weight"], 1e-6)
        hidden = Fn.silu(h @ p["linear1.weight"].T)
        if activation == "swiglu":
            hidden = hidden * (h @ p["linear3.weight"].T)
        return x + hidden @ p["linear2.weight"].T
    assert_matches(torch, layer, lambda m, x: m(x, is_causal=True), theirs, [rng.standard_normal((B, T, E))], rng)


# -- TransformerConfig ------------------------------------------------------------------------------
def test_new_settings_round_trip_and_are_stored():
    c = config(norm="rmsnorm", num_kv_heads=2, sliding_window=5, qkv_bias=True, bias=False, activation="swiglu")
    values = json.loads(json.dumps(c.to_dict()))
    assert nn.TransformerConfig.from_dict(values) == c
    stored = stored_config(nn.Transformer(config=c))
    assert {k: stored[k] for k in ("norm", "num_kv_heads", "sliding_window", "qkv_bias", "activation")} == {
        "norm": "rmsnorm", "num_kv_heads": 2, "sliding_window": 5, "qkv_bias": True, "activation": "swiglu"}
    assert (c.kv_heads, c.qkv_bias_p, config().kv_heads, config().qkv_bias_p) == (2, True, H, True)


def test_old_config_dicts_read_with_the_defaults():
    old = {k: v for k, v in config().to_dict().items()
           if k not in ("norm", "num_kv_heads", "sliding_window", "qkv_bias")}
    c = nn.TransformerConfig.from_dict(old)
    assert (c.norm, c.num_kv_heads, c.sliding_window, c.qkv_bias) == ("layernorm", None, None, None)


def test_a_checkpoint_of_a_modern_transformer_round_trips(tmp_path, rng):
    c = llama_config(num_kv_heads=2, sliding_window=3, qkv_bias=True)
    model = randomize_vectors(nn.Transformer(config=c), rng)
    path = save_checkpoint(tmp_path / "modern.npz", model)
    target = nn.Transformer(config=c)
    ckpt = load_checkpoint(path, target)
    assert nn.TransformerConfig.from_dict(ckpt["config"]) == dataclasses.replace(
        c, memory_efficient=False, block_size=512, attention_backend=None, device=None, dtype=None)
    for name, p in model.state_dict().items():
        np.testing.assert_array_equal(target.state_dict()[name], p)
    with pytest.raises(Exception, match=r"config differs from the model's: sliding_window: file 3, model 5"):
        load_checkpoint(path, nn.Transformer(config=dataclasses.replace(c, sliding_window=5)))


@pytest.mark.parametrize("settings, error, match", [
    (dict(nhead=4, num_kv_heads=3), ValueError,
     r"TransformerConfig: nhead=4 is not divisible by num_kv_heads=3; .*choose num_kv_heads in \[1, 2, 4\]"),
    (dict(num_kv_heads=0), ValueError, r"TransformerConfig: num_kv_heads must be an integer >= 1, got 0"),
    (dict(num_kv_heads=2.0), TypeError, r"num_kv_heads must be an integer >= 1, got 2\.0 of type float"),
    (dict(norm="batchnorm"), ValueError,
     r"TransformerConfig: norm must be one of \('layernorm', 'rmsnorm'\), got 'batchnorm'"),
    (dict(sliding_window=0), ValueError, r"TransformerConfig: sliding_window must be an integer >= 1, got 0"),
    (dict(sliding_window=2.5), TypeError, r"sliding_window must be an integer >= 1, got 2\.5 of type float"),
    (dict(qkv_bias=1), TypeError, r"TransformerConfig: qkv_bias must be True or False, got 1 of type int"),
])
def test_bad_new_settings_name_the_argument(settings, error, match):
    with pytest.raises(error, match=match):
        nn.TransformerConfig(**settings)


def test_constructors_name_their_own_arguments():
    with pytest.raises(ValueError, match=r"MultiheadAttention: num_heads=4 is not divisible by num_kv_heads=3"):
        nn.MultiheadAttention(E, 4, num_kv_heads=3)
    with pytest.raises(ValueError, match=r"from_dict|norm must be one of"):
        nn.TransformerConfig.from_dict({"norm": "layer"})
    with pytest.raises(TypeError, match=r"MultiheadAttention: pass the settings either in config= or as arguments"):
        nn.MultiheadAttention(num_kv_heads=2, config=config())
