"""nn.MultiheadAttention: the registry's case (gradcheck, torch, composite twin on every device),
torch parity (forward, input and parameter gradients) for every mask kind in torch.nn's
convention, returned weights, cross-attention, inputs of 1e3, gradcheck, the packed projection,
RoPE, the memory-efficient path and argument errors."""
import math

import numpy as np
import pytest

import npformer
import npformer.functional as F
from autograd import Tensor
from npformer import interop, nn
from npformer.opcases.modules import randomize_vectors
from npformer.functional.rotary.cases import torch_rope

from helpers import F32, F64, assert_torch_parity, gradcheck_module, leaf, op_tests, to_torch_kwargs
from tolerances import Rounded, assert_close, attention_chain, scaled, spread

test_gradcheck, test_matches_torch, test_matches_composite_twin = op_tests("multihead_attention")

B, T, S, E, H = 2, 4, 5, 8, 2


def mask_cases(rng, tgt_len=T, src_len=S):
    """name -> (kwargs for both sides in torch.nn's convention, whether need_weights is comparable:
    torch's explicit-softmax path returns NaN for fully masked rows)."""
    causal = np.triu(np.ones((tgt_len, src_len), dtype=bool), 1)
    padding = np.zeros((B, src_len), dtype=bool)
    padding[1, src_len - 2:] = True
    float_mask = rng.standard_normal((tgt_len, src_len))
    float_mask[0, 1] = -np.inf
    float_padding = np.where(padding, -np.inf, rng.standard_normal((B, src_len)))
    per_head = rng.random((B * H, tgt_len, src_len)) < 0.3
    per_head[:, :, 0] = False  # every row keeps a key
    fully_row = np.zeros((tgt_len, src_len), dtype=bool)
    fully_row[1] = True
    fully_batch = np.zeros((B, src_len), dtype=bool)
    fully_batch[1] = True
    return {
        "none": ({}, True),
        "causal_bool": ({"attn_mask": causal}, True),
        "causal_float": ({"attn_mask": np.where(causal, -np.inf, 0.0)}, True),
        "padding": ({"key_padding_mask": padding}, True),
        "causal_and_padding": ({"attn_mask": causal, "key_padding_mask": padding}, True),
        "float_additive": ({"attn_mask": float_mask, "key_padding_mask": float_padding}, True),
        "bool_and_float": ({"attn_mask": causal, "key_padding_mask": float_padding}, True),
        "per_head": ({"attn_mask": per_head, "key_padding_mask": padding}, True),
        "fully_masked_row": ({"attn_mask": fully_row}, False),
        "fully_padded_batch": ({"key_padding_mask": fully_batch}, False),
    }


MASKS = list(mask_cases(np.random.default_rng(0)))


@pytest.mark.filterwarnings("ignore:Support for mismatched")
@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("mask", MASKS)
def test_self_attention_matches_torch(mask, need_weights, torch):
    rng = np.random.default_rng(1)
    kwargs, weights_ok = mask_cases(rng, T, T)[mask]
    if need_weights and not weights_ok:
        pytest.skip("torch's need_weights path returns NaN for fully masked rows (ours returns 0)")
    m = randomize_vectors(nn.MultiheadAttention(E, H).double(), rng)
    t_kwargs = to_torch_kwargs(torch, kwargs)
    outs = assert_torch_parity(
        torch, m, lambda m, x: m(x, x, x, need_weights=need_weights, **kwargs),
        lambda t, x: t(x, x, x, need_weights=need_weights, **t_kwargs),
        [rng.standard_normal((B, T, E))], **F64)
    assert np.isfinite(outs[0].numpy()).all()
    if mask == "fully_masked_row":  # attention contributes 0: the output is out_proj's bias
        np.testing.assert_allclose(outs[0].numpy()[:, 1], np.broadcast_to(m.out_proj.bias.numpy(), (B, E)), **F64)


@pytest.mark.parametrize("average", [True, False])
@pytest.mark.parametrize("same_key_value", [True, False])
def test_cross_attention_and_weights_match_torch(same_key_value, average, torch, rng):
    kwargs, _ = mask_cases(rng)["causal_and_padding"]
    m = randomize_vectors(nn.MultiheadAttention(E, H).double(), rng)
    t_kwargs = to_torch_kwargs(torch, kwargs)

    def ours(m, q, k, v):
        return m(q, k, k if same_key_value else v, average_attn_weights=average, **kwargs)

    def theirs(t, q, k, v):
        return t(q, k, k if same_key_value else v, average_attn_weights=average, **t_kwargs)
    outs = assert_torch_parity(torch, m, ours, theirs, [rng.standard_normal((B, n, E)) for n in (T, S, S)], **F64)
    assert outs[1].shape == ((B, T, S) if average else (B, H, T, S))


def test_float32_matches_torch(torch, rng, device):
    kwargs, _ = mask_cases(rng, T, T)["causal_and_padding"]
    m = randomize_vectors(nn.MultiheadAttention(E, H), rng)
    t_kwargs = to_torch_kwargs(torch, kwargs)
    assert_torch_parity(torch, m, lambda m, x: m(x, x, x, **kwargs), lambda t, x: t(x, x, x, **t_kwargs),
                        [rng.standard_normal((B, T, E)).astype("float32")], device=device, **F32)


def test_need_weights_false_returns_none():
    m = nn.MultiheadAttention(E, H)
    x = Tensor(np.ones((1, 2, E), dtype="float32"))
    assert m(x, x, x, need_weights=False)[1] is None


def test_is_causal_without_mask_applies_the_causal_mask(rng):
    m = randomize_vectors(nn.MultiheadAttention(E, H).double(), rng)
    x = Tensor(rng.standard_normal((B, T, E)))
    causal = np.triu(np.ones((T, T), dtype=bool), 1)
    np.testing.assert_allclose(m(x, x, x, is_causal=True)[0].numpy(), m(x, x, x, attn_mask=causal)[0].numpy(), **F64)
    padding = mask_cases(rng, T, T)["padding"][0]["key_padding_mask"]
    np.testing.assert_allclose(m(x, x, x, is_causal=True, key_padding_mask=padding)[0].numpy(),
                               m(x, x, x, attn_mask=causal, key_padding_mask=padding)[0].numpy(), **F64)


@pytest.mark.parametrize("mask", ["none", "causal_and_padding", "float_additive", "fully_masked_row"])
def test_gradcheck_self_attention(mask, device):
    rng = np.random.default_rng(2)
    kwargs, _ = mask_cases(rng, 3, 3)[mask] if mask != "float_additive" else (None, None)
    if mask == "float_additive":
        kwargs = {"attn_mask": rng.standard_normal((3, 3))}
    m = randomize_vectors(nn.MultiheadAttention(4, 2), rng)
    gradcheck_module(m, lambda m, x: m(x, x, x, average_attn_weights=False, **kwargs),
                     [rng.standard_normal((B, 3, 4))], device)


def test_gradcheck_cross_attention(device, rng):
    m = randomize_vectors(nn.MultiheadAttention(4, 2), rng)
    padding = np.array([[False, False], [False, True]])
    gradcheck_module(m, lambda m, q, k, v: m(q, k, v, key_padding_mask=padding),
                     [rng.standard_normal((B, 3, 4)), rng.standard_normal((B, 2, 4)), rng.standard_normal((B, 2, 4))],
                     device)


@pytest.mark.parametrize("case, expected", [("self", 2), ("cross", 3), ("separate", 4)])
def test_projection_gemm_count(case, expected, monkeypatch):
    """Self-attention projects q, k, v with one packed GEMM; cross-attention packs k and v."""
    calls = []
    real = F.linear
    monkeypatch.setattr(F, "linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    m = nn.MultiheadAttention(E, H)
    q, kv, v = (Tensor(np.ones((1, 3, E), dtype="float32")) for _ in range(3))
    key, value = {"self": (q, q), "cross": (kv, kv), "separate": (kv, v)}[case]
    m(q, key, value)
    assert len(calls) == expected


def test_init_like_torch():
    npformer.manual_seed(0)
    m = nn.MultiheadAttention(64, 4)
    bound = math.sqrt(6 / (64 + 3 * 64))  # xavier_uniform_ over the packed (3E, E) matrix
    w = m.in_proj_weight.numpy()
    assert np.abs(w).max() <= bound and abs(w.std() - bound / math.sqrt(3)) < 0.05 * bound
    assert np.all(m.in_proj_bias.numpy() == 0) and np.all(m.out_proj.bias.numpy() == 0)
    assert np.abs(m.out_proj.weight.numpy()).max() <= 1 / math.sqrt(64)


def test_rotary_matches_torch_composition(torch, rng):
    """RoPE on q and k inside attention against the same math written with torch ops."""
    m = randomize_vectors(nn.MultiheadAttention(E, H, rotary=True).double(), rng)
    state = {k: torch.tensor(v, requires_grad=True) for k, v in m.state_dict().items()}
    x = rng.standard_normal((B, T, E))
    padding = mask_cases(rng, T, T)["padding"][0]["key_padding_mask"]
    ours_x, theirs_x = Tensor(x, requires_grad=True), torch.tensor(x, requires_grad=True)
    out = m(ours_x, ours_x, ours_x, key_padding_mask=padding, is_causal=True)[0]

    q, k, v = torch.nn.functional.linear(theirs_x, state["in_proj_weight"], state["in_proj_bias"]).chunk(3, dim=-1)
    q, k, v = (t.reshape(B, T, H, E // H).transpose(1, 2) for t in (q, k, v))
    allowed = torch.tensor(~padding)[:, None, None, :] & torch.ones(T, T, dtype=torch.bool).tril()
    o = torch.nn.functional.scaled_dot_product_attention(torch_rope(torch, q), torch_rope(torch, k), v,
                                                         attn_mask=allowed)
    ref = torch.nn.functional.linear(o.transpose(1, 2).reshape(B, T, E), state["out_proj.weight"],
                                     state["out_proj.bias"])
    np.testing.assert_allclose(out.numpy(), ref.detach().numpy(), **F64)
    g = rng.standard_normal(out.shape)
    out.backward(Tensor(g))
    ref.backward(torch.tensor(g))
    np.testing.assert_allclose(ours_x.grad, theirs_x.grad.numpy(), **F64)
    for name, p in m.named_parameters():
        np.testing.assert_allclose(p.grad, state[name].grad.numpy(), err_msg=name, **F64)
    gradcheck_module(nn.MultiheadAttention(4, 2, rotary=True), lambda m, x: m(x, x, x, is_causal=True),
                     [rng.standard_normal((1, 3, 4))])


def test_memory_efficient_equals_naive(rng, device):
    naive = randomize_vectors(nn.MultiheadAttention(E, H, dropout=0.2), rng).double().to(device)
    blockwise = nn.MultiheadAttention(E, H, dropout=0.2, memory_efficient=True, block_size=2).double().to(device)
    blockwise.load_state_dict(naive.state_dict())
    kwargs = mask_cases(rng, T, T)["causal_and_padding"][0]
    x = Tensor(rng.standard_normal((B, T, E)), device=device)
    for m in (naive, blockwise):
        m.eval()
    np.testing.assert_allclose(blockwise(x, x, x, need_weights=False, **kwargs)[0].numpy(),
                               naive(x, x, x, need_weights=False, **kwargs)[0].numpy(),
                               atol=scaled(1e-12, x, *(p.data for p in naive.parameters())))
    blockwise.train()  # with attention dropout too
    assert blockwise(x, x, x, need_weights=False, **kwargs)[0].shape == (B, T, E)
    assert blockwise(x, x, x, need_weights=True)[1].shape == (B, T, T)  # weights: the naive kernel


def test_attention_dropout_only_in_training(rng):
    m = nn.MultiheadAttention(E, H, dropout=0.5).double()
    x = Tensor(rng.standard_normal((B, T, E)))
    npformer.manual_seed(0)
    train_out = m(x, x, x)[0].numpy()
    eval_out = m.eval()(x, x, x)[0].numpy()
    assert not np.allclose(train_out, eval_out)
    np.testing.assert_array_equal(m(x, x, x)[0].numpy(), eval_out)


def test_errors():
    with pytest.raises(ValueError, match="embed_dim=10 must be divisible by num_heads=3"):
        nn.MultiheadAttention(10, 3)
    with pytest.raises(ValueError, match="batch-first"):
        nn.MultiheadAttention(8, 2, batch_first=False)
    m = nn.MultiheadAttention(E, H)
    x = Tensor(np.zeros((B, T, E), dtype="float32"))
    y = Tensor(np.zeros((B + 1, T, E), dtype="float32"))
    with pytest.raises(ValueError, match="batch sizes differ"):
        m(x, y, y)
    with pytest.raises(ValueError, match=r"query must be \(batch, seq, 8\)"):
        m(Tensor(np.zeros((T, E), dtype="float32")), x, x)
    with pytest.raises(ValueError, match=r"attn_mask must have shape \(4, 4\) or \(4, 4, 4\)"):
        m(x, x, x, attn_mask=np.zeros((3, 4), dtype=bool))
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \(batch, S\) = \(2, 4\)"):
        m(x, x, x, key_padding_mask=np.zeros((2, 5), dtype=bool))
    with pytest.raises(TypeError, match="attn_mask must be a bool or floating mask, got dtype int64"):
        m(x, x, x, attn_mask=np.zeros((T, T), dtype=np.int64))
    with pytest.raises(TypeError, match="autograd.Tensor"):
        m(np.zeros((B, T, E)), x, x)


def test_multihead_attention_on_inputs_of_1e3_matches_torch(torch):
    """Inputs x 1e3 make q, k ~ 1e3 after the projections; output and every gradient (inputs
    and parameters) against torch.nn.MultiheadAttention with the same weights, float64. Every
    tolerance follows the op chain (projections, attention, output projection, and back) from
    the magnitudes of the inputs, the weights and the upstream gradient, and torch's attention
    weights say how far from one-hot the softmax is. Here it saturates (score gaps >= 2e4), so
    the exact query gradient is 0, and torch's (computed another way) is rounding noise of the
    size the chain allows."""
    npformer.manual_seed(6)
    rng = np.random.default_rng(6)
    ours = nn.MultiheadAttention(8, 2).double()
    theirs = interop.to_torch(ours)
    query, memory = 1e3 * rng.standard_normal((2, 5, 8)), 1e3 * rng.standard_normal((2, 6, 8))
    padding = np.zeros((2, 6), dtype=bool)
    padding[1, 4:] = True
    q_in, m_in = leaf(query), leaf(memory)
    tq, tm = torch.tensor(query, requires_grad=True), torch.tensor(memory, requires_grad=True)
    out, _ = ours(q_in, m_in, m_in, key_padding_mask=padding, need_weights=False)
    ref, _ = theirs(tq, tm, tm, key_padding_mask=torch.tensor(padding), need_weights=False)
    with torch.no_grad():                                    # torch's fused path above; its weights from the other
        _, probs = theirs(tq, tm, tm, key_padding_mask=torch.tensor(padding), average_attn_weights=False)
    g = rng.standard_normal(out.shape)
    out.backward(g)
    ref.backward(torch.tensor(g))

    (B, T, E), S, hd, f64 = query.shape, memory.shape[1], ours.head_dim, np.float64
    x, m, dout, one = Rounded.of(query), Rounded.of(memory), Rounded.of(g), Rounded(1.0)
    w_q, w_k, w_v = (Rounded.of(ours.in_proj_weight.data[i * E:(i + 1) * E]) for i in range(3))
    w_o = Rounded.of(ours.out_proj.weight)
    q, k, v = x.dot(w_q, E, f64), m.dot(w_k, E, f64), m.dot(w_v, E, f64)            # projections (B, L, E)
    d_o = dout.dot(w_o, E, f64)                                                      # back through out_proj
    o, dq, dk, dv = attention_chain(f64, q, k, v, d_o, 1 / math.sqrt(hd), hd, T, S, spread(probs))
    tolerances = {
        "output": o.dot(w_o, E, f64).error,
        "query": dq.dot(w_q, E, f64).error,                                          # dx = dq W_q
        "memory": dk.dot(w_k, E, f64).error + dv.dot(w_v, E, f64).error,             # dm = dk W_k + dv W_v
        "in_proj_weight": np.repeat([dq.dot(x, B * T, f64).error, dk.dot(m, B * S, f64).error,
                                     dv.dot(m, B * S, f64).error], E)[:, None],   # dW = d{q,k,v}^T {x, m, m}
        "in_proj_bias": np.repeat([dq.dot(one, B * T, f64).error, dk.dot(one, B * S, f64).error,
                                   dv.dot(one, B * S, f64).error], E),
        "out_proj.weight": dout.dot(o, B * T, f64).error,                          # dW_o = dout^T o
        "out_proj.bias": dout.dot(one, B * T, f64).error,
    }
    assert_close(out, ref, tolerances["output"], err_msg="output")
    assert_close(q_in.grad, tq.grad, tolerances["query"], err_msg="gradient of query")
    assert_close(m_in.grad, tm.grad, tolerances["memory"], err_msg="gradient of key/value")
    named = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        assert_close(p.grad, named[name].grad, tolerances[name], err_msg=f"gradient of {name}")
