"""Numerics at the edges against torch in float64 (and float32 where it matters), filling what
test_functional_edges.py and test_functional_attention.py leave out: cross-entropy on +/-1e4
logits with smoothing, class weights and padding; softmax rows of -1e9 (the seed articles'
masked_fill value) mixed with -inf, and attention under such a mask with a fully padded row;
very large q/k magnitudes over several memory-efficient blocks and through MultiheadAttention.
Then `autograd.detect_anomaly()` on a real model, and 2,000 training steps without a NaN."""
import math
import re

import numpy as np
import pytest

import autograd
import npformer.functional as F
from autograd import Tensor
from npformer import interop, nn, optim
from npformer.data import PAD, SequenceTask
from npformer.models import Seq2SeqTransformer
from npformer.training import Trainer

from test_functional import compare_with_torch, leaf
from tolerances import Rounded, assert_close, rounding_tolerance

PATHS = {"naive": {}, "memory_efficient": {"memory_efficient": True, "block_size": 2}}
F64 = np.float64


def spread(probs):
    """The largest 1 - max_j P_ij over the attention rows that see a key: how far from one-hot
    the softmax is. A score error e moves row i's probabilities by at most 2 (1 - max_j P_ij) e
    each (4 (1 - max_j P_ij) e together), so a saturated softmax passes none of it on."""
    probs = np.asarray(probs)
    seen = probs.sum(axis=-1) > 0
    return float((1.0 - probs.max(axis=-1))[seen].max(initial=0.0))


def attention_chain(dtype, q, k, v, dout, scale, hd, tq, tk, spread=1.0):
    """Rounded out, dq, dk, dv of out = softmax(scale q k^T) v (per head: tq queries, tk keys,
    head size hd) from the Rounded q, k, v and upstream gradient dout, for a softmax `spread`
    away from one-hot (1: any). Each step is a sum of products (Rounded.dot) except the softmax,
    which moves each probability by at most 2 spread times the error of its scores and rounds
    by a few ulps of 1 per key. With |q|, |k| ~ 1e3 the scores are ~1e6 and carry ~1e-9 of
    rounding: a softmax that mixes keys passes that on to every gradient, a saturated one does not."""
    scores = q.dot(k, hd, dtype, scale)                                    # (tq, tk)
    probs = Rounded(1.0, 2 * spread * scores.error + rounding_tolerance(dtype, terms=tk))
    out = probs.dot(v, tk, dtype)
    out.size = v.size                                                      # a convex combination of v's rows
    # dP = dout v^T;  dS = P * (dP - sum_j P_j dP_j);  dq = scale dS k;  dk = scale dS^T q;  dv = P^T dout
    d_probs = dout.dot(v, hd, dtype)
    d_scores = Rounded(2 * d_probs.size, 2 * d_probs.error + (2 + tk) * probs.error * d_probs.size
                       + rounding_tolerance(dtype, d_probs.size, terms=tk))
    return out, d_scores.dot(k, tk, dtype, scale), d_scores.dot(q, tq, dtype, scale), probs.dot(dout, tq, dtype)


# -- cross-entropy on logits of +/-1e4 ---------------------------------------------------------------
def logits_1e4(rng, shape):
    """Entries 1e4, -1e4 or 0 plus N(0, 1): the softmax is one-hot up to exp(-1e4) = 0."""
    return 1e4 * rng.choice([-1.0, 0.0, 1.0], size=shape) + rng.standard_normal(shape)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("options", ["smoothing", "weights_smoothing_padding"])
def test_cross_entropy_logits_1e4_with_smoothing_weights_and_padding_match_torch(reduction, options, torch):
    rng = np.random.default_rng(0)
    logits = logits_1e4(rng, (8, 6))
    target = np.array([1, 0, 3, 5, 0, 2, 4, 1])          # class 0 is PAD when it is ignored
    kwargs = {"label_smoothing": 0.1, "reduction": reduction}
    if options == "weights_smoothing_padding":
        kwargs.update(ignore_index=0, weight=np.array([1.0, 0.5, 2.0, 1.0, 0.1, 3.0]))
    t_kwargs = {k: torch.tensor(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
    # logp = x - max - log(sum exp(x - max)) rounds by ~eps |x|; the loss sums C of them (weights <= 3):
    # at unit scale C * 3 terms, scaled by |logits| ~ 8e3 inside compare_with_torch
    compare_with_torch(torch, lambda x: F.cross_entropy(x, target, **kwargs),
                       lambda x: torch.nn.functional.cross_entropy(x, torch.tensor(target), **t_kwargs),
                       [logits], rng, atol=rounding_tolerance(F64, terms=3 * 6), rtol=0)


def test_cross_entropy_logits_1e4_float32_is_finite_and_matches_torch_float64(torch):
    """float32 ulp at 1e4 is ~1e-3: the loss (~1e3..1e4) is exact to that, and the gradient
    (probabilities, O(1)) moves by as much (logits off by 1e-3 shift probabilities by 1e-3):
    float32 rounding at unit scale, scaled by |logits| inside compare_with_torch."""
    rng = np.random.default_rng(1)
    logits = logits_1e4(rng, (2, 7, 5)).astype(np.float32)        # (N, C, d1): spatial targets
    target = rng.integers(0, 7, (2, 5))
    target[0, :2] = -100
    compare_with_torch(torch, lambda x: F.cross_entropy(x, target, label_smoothing=0.2),
                       lambda x: torch.nn.functional.cross_entropy(x, torch.tensor(target), label_smoothing=0.2),
                       [logits], rng, atol=rounding_tolerance(np.float32, terms=5), rtol=0, dtype=np.float32,
                       torch_dtype=np.float64)


# -- softmax rows of -1e9 and -inf ---------------------------------------------------------------------
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


@pytest.mark.parametrize("path", PATHS)
def test_attention_with_an_additive_minus_1e9_mask_and_a_fully_padded_row_matches_torch(path, torch):
    """An additive -1e9 mask (the seeds' masking constant): every row with a visible key equals the
    bool-masked result (exp(-1e9) is exactly 0); a row whose keys are all -1e9 is shifted as a
    whole, so it attends as if unmasked, as in torch. Its scores sit next to 1e9, where float64
    spacing is 1.2e-7: that row agrees with torch and the unmasked result only to ~eps * 1e9."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, 2, 5, 4)) for _ in range(3))
    keep = rng.random((2, 1, 5, 5)) > 0.3
    keep[..., 0] = True                                             # every row sees key 0 ...
    keep[0, 0, 2] = False                                           # ... but query 2 of batch 0: none
    mask = np.where(keep, 0.0, -1e9)
    near_1e9 = rounding_tolerance(F64, 1e9, terms=5)                # scores of 1e9 summed over 5 keys
    compare_with_torch(torch, lambda *a: F.scaled_dot_product_attention(*a, attn_mask=mask, **PATHS[path]),
                       lambda *a: torch.nn.functional.scaled_dot_product_attention(*a, attn_mask=torch.tensor(mask)),
                       [q, k, v], rng, atol=near_1e9, rtol=0)
    run = lambda **kw: F.scaled_dot_product_attention(Tensor(q), Tensor(k), Tensor(v), **kw, **PATHS[path]).numpy()
    additive, by_bool, unmasked = run(attn_mask=mask), run(attn_mask=keep), run()
    visible = np.ones((2, 2, 5), dtype=bool)
    visible[0, :, 2] = False
    assert_close(additive[visible], by_bool[visible], rounding_tolerance(F64, np.abs(v).max(), terms=5))
    assert_close(additive[0, :, 2], unmasked[0, :, 2], near_1e9 * np.abs(v).max())
    assert np.abs(additive[0, :, 2]).min() > 0                      # not the 0 of a bool/-inf mask


# -- attention with very large q/k ------------------------------------------------------------------------
@pytest.mark.parametrize("path", PATHS)
def test_attention_large_qk_over_many_blocks_with_padding_matches_torch(path, torch):
    """|q|, |k| ~ 1e3 (scores ~ 1e6): the online softmax rescales by exp(m_old - m_new) = 0 across
    key blocks of 2; a padding mask and a fully padded batch row (output 0, like torch)."""
    rng = np.random.default_rng(4)
    q, k = (1e3 * rng.standard_normal((2, 2, 7, 4)) for _ in range(2))
    v = rng.standard_normal((2, 2, 7, 4))
    keep = rng.random((2, 1, 1, 7)) > 0.3
    keep[1, ..., 5:] = False
    kwargs = {"attn_mask": keep, "is_causal": True}
    ours = [leaf(a) for a in (q, k, v)]
    theirs = [torch.tensor(a, requires_grad=True) for a in (q, k, v)]
    out = F.scaled_dot_product_attention(*ours, **kwargs, **PATHS[path])
    ref = torch.nn.functional.scaled_dot_product_attention(*theirs, attn_mask=torch.tensor(keep & np.tril(
        np.ones((7, 7), dtype=bool))))
    g = rng.standard_normal(out.shape)
    out.backward(g)
    ref.backward(torch.tensor(g))
    probs = torch.softmax((0.5 * torch.tensor(q) @ torch.tensor(k).transpose(-1, -2)).masked_fill(
        ~torch.tensor(keep & np.tril(np.ones((7, 7), dtype=bool))), -math.inf), -1).nan_to_num()
    chain = attention_chain(F64, *map(Rounded.of, (q, k, v, g)), scale=0.5, hd=4, tq=7, tk=7, spread=spread(probs))
    assert_close(out, ref, chain[0].error, err_msg="output")
    for name, a, b, bound in zip("qkv", ours, theirs, chain[1:]):
        assert_close(a.grad, b.grad, bound.error, err_msg=f"gradient of {name}")


@pytest.mark.parametrize("path", PATHS)
def test_attention_large_qk_float32_stays_finite_and_close_to_torch_float64(path, torch):
    """float32 scores of ~1e6 carry ~0.1 of rounding: a probability moves by at most 4 (1 - the
    row's largest probability) times that, so saturated rows (gaps of 1e5) stay exact to float32
    rounding of v while a row that mixes keys may move by much more."""
    rng = np.random.default_rng(5)
    q, k = (1e3 * rng.standard_normal((1, 2, 9, 8)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((1, 2, 9, 8)).astype(np.float32)
    out = F.scaled_dot_product_attention(Tensor(q), Tensor(k), Tensor(v), is_causal=True, **PATHS[path])
    q64, k64, v64 = (torch.tensor(a, dtype=torch.float64) for a in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(q64, k64, v64, is_causal=True)
    assert out.dtype == np.float32
    scale = 1 / math.sqrt(8)
    causal = torch.ones(9, 9, dtype=torch.bool).tril()
    probs = torch.softmax((scale * q64 @ k64.transpose(-1, -2)).masked_fill(~causal, -math.inf), -1).numpy()
    scores = Rounded.of(q).dot(Rounded.of(k), 8, np.float32, scale)
    spread = 1.0 - probs.max(axis=-1, keepdims=True)                        # (1, 2, 9, 1): 0 when saturated
    tolerance = 4 * spread * scores.error * np.abs(v).max() + rounding_tolerance(np.float32, np.abs(v).max(), terms=9)
    assert_close(out, ref, tolerance)


def test_multihead_attention_on_inputs_of_1e3_matches_torch(torch):
    """Inputs x 1e3 make q, k ~ 1e3 after the projections; output and every gradient (inputs
    and parameters) against torch.nn.MultiheadAttention with the same weights, float64. Every
    tolerance follows the op chain (projections, attention, output projection, and back) from
    the magnitudes of the inputs, the weights and the upstream gradient, and torch's attention
    weights say how far from one-hot the softmax is. Here it saturates (score gaps >= 2e4), so
    the exact query gradient is 0, and torch's (computed another way) is rounding noise of the
    size the chain allows."""
    autograd.manual_seed(6)
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

    (B, T, E), S, hd = query.shape, memory.shape[1], ours.head_dim
    x, m, dout = Rounded.of(query), Rounded.of(memory), Rounded.of(g)
    w_q, w_k, w_v = (Rounded.of(ours.in_proj_weight.data[i * E:(i + 1) * E]) for i in range(3))
    w_o = Rounded.of(ours.out_proj.weight)
    q, k, v = x.dot(w_q, E, F64), m.dot(w_k, E, F64), m.dot(w_v, E, F64)            # projections (B, L, E)
    d_o = dout.dot(w_o, E, F64)                                                      # back through out_proj
    o, dq, dk, dv = attention_chain(F64, q, k, v, d_o, 1 / math.sqrt(hd), hd, T, S, spread(probs))
    d_query = dq.dot(w_q, E, F64)                                                    # dx = dq W_q
    d_memory = dk.dot(w_k, E, F64).error + dv.dot(w_v, E, F64).error                # dm = dk W_k + dv W_v
    tolerances = {
        "output": o.dot(w_o, E, F64).error,
        "in_proj_weight": np.repeat([dq.dot(x, B * T, F64).error, dk.dot(m, B * S, F64).error,
                                     dv.dot(m, B * S, F64).error], E)[:, None],   # dW = d{q,k,v}^T {x, m, m}
        "in_proj_bias": np.repeat([dq.dot(Rounded(1.0), B * T, F64).error, dk.dot(Rounded(1.0), B * S, F64).error,
                                   dv.dot(Rounded(1.0), B * S, F64).error], E),
        "out_proj.weight": dout.dot(o, B * T, F64).error,                          # dW_o = dout^T o
        "out_proj.bias": dout.dot(Rounded(1.0), B * T, F64).error,
    }
    assert_close(out, ref, tolerances["output"], err_msg="output")
    assert_close(q_in.grad, tq.grad, d_query.error, err_msg="gradient of query")
    assert_close(m_in.grad, tm.grad, d_memory, err_msg="gradient of key/value")
    named = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        assert_close(p.grad, named[name].grad, tolerances[name], err_msg=f"gradient of {name}")


# -- anomaly detection on a real model ------------------------------------------------------------------------
def small_model():
    autograd.manual_seed(0)
    return Seq2SeqTransformer(10, 10, d_model=8, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                              dim_feedforward=16, dropout=0.0, pad_idx=PAD)


SRC, TGT_IN, TGT_OUT = np.array([[3, 5, 4, 0]]), np.array([[1, 4, 5, 3]]), np.array([[4, 5, 3, 2]])


def test_detect_anomaly_names_the_op_and_the_line_that_called_the_model():
    model = small_model()
    model.src_embed.weight.data[5, 0] = math.inf                  # a diverged embedding row
    with np.errstate(all="ignore"):                                # without the detector: NaN logits, silently
        assert np.isnan(model(SRC, TGT_IN).numpy()).all()
    with autograd.detect_anomaly(), pytest.raises(FloatingPointError) as info:
        logits = model(SRC, TGT_IN)  # noqa: F841
    message = str(info.value)
    assert message.startswith("npformer.functional.embedding.EmbeddingFunction forward produced NaN or Inf")
    assert re.search(r'test_numerics\.py", line \d+, in test_detect_anomaly.*\n\s+logits = model\(SRC, TGT_IN\)',
                     message), message


def test_detect_anomaly_catches_an_infinite_gradient_in_backward():
    """A norm penalty on a bias that is still zero (its init): sqrt'(0) = inf in backward only."""
    model = small_model()
    bias = model.transformer.encoder.layers[0].self_attn.in_proj_bias
    assert not bias.numpy().any()
    with autograd.detect_anomaly(), np.errstate(divide="ignore", invalid="ignore"):
        loss = F.cross_entropy(model(SRC, TGT_IN).reshape(-1, 10), TGT_OUT.reshape(-1))
        penalty = (bias ** 2).sum().sqrt()
        with pytest.raises(FloatingPointError, match=r"(?s)^autograd\.tensor\.Sqrt backward produced NaN or Inf.*"
                                                     r"penalty = \(bias \*\* 2\)\.sum\(\)\.sqrt\(\)"):
            (loss + 1e-3 * penalty).backward()


def test_detect_anomaly_is_silent_and_changes_nothing_on_a_healthy_step():
    grads = []
    for anomaly in (False, True):
        model = small_model()
        with autograd.detect_anomaly() if anomaly else np.errstate():
            loss = F.cross_entropy(model(SRC, TGT_IN).reshape(-1, 10), TGT_OUT.reshape(-1), label_smoothing=0.1)
            loss.backward()
        grads.append([p.grad for p in model.parameters()])
    for with_detector, without in zip(*grads):
        np.testing.assert_array_equal(with_detector, without)


# -- training stability -----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_two_thousand_steps_at_lr_1e3_with_clipping_never_make_a_nan():
    """The seed preset's model (vocab 20, d_model 32, 4 heads, d_ff 64, 2 + 2 layers, dropout 0.1)
    on reversal of length 6 through the Trainer: Adam at lr 1e-3, clipping at 1.0, batches of 8
    (~35 s of one core: the step cost is per-op overhead, so the batch is small). Every loss and
    gradient norm (before clipping: the Trainer would skip a non-finite update) and every final
    parameter is finite, and the run learned the task rather than quietly stalling."""
    autograd.manual_seed(0)
    model = Seq2SeqTransformer(20, 20, d_model=32, nhead=4, num_encoder_layers=2, num_decoder_layers=2,
                               dim_feedforward=64, dropout=0.1, max_len=8, pad_idx=PAD)
    task = SequenceTask("reverse", vocab_size=20, min_len=6, seed=0, heldout_size=200)
    trainer = Trainer(model, optim.Adam(model.parameters(), lr=1e-3), task, batch_size=8, clip_norm=1.0,
                      grad_norm_every=0, progress=False)
    result = trainer.fit(2000)
    losses, norms = np.array(trainer.history["loss"]), np.array(trainer.history["grad_norm"])
    assert len(losses) == len(norms) == 2000
    assert np.isfinite(losses).all() and np.isfinite(norms).all()
    assert all(np.isfinite(p.numpy()).all() for p in model.parameters())
    assert losses[-100:].mean() < 0.25 * losses[:100].mean(), (losses[:100].mean(), losses[-100:].mean())
    assert result["token_accuracy"] > 0.9, result


@pytest.mark.parametrize("memory_efficient", [False, True])
def test_empty_rows_and_empty_keys_match_torch(torch, memory_efficient):
    """A softmax over zero entries is empty, and attention over zero keys is 0, as in torch."""
    for name in ("softmax", "log_softmax"):
        x = Tensor(np.zeros((2, 0)), requires_grad=True)
        y = getattr(F, name)(x, dim=-1)
        assert y.shape == tuple(getattr(torch, name)(torch.zeros(2, 0), -1).shape)
        y.backward(np.zeros((2, 0)))
        assert x.grad.shape == (2, 0)
    rng = np.random.default_rng(0)
    q = Tensor(rng.standard_normal((1, 2, 3, 4)), requires_grad=True)
    k, v = (Tensor(np.zeros((1, 2, 0, 4)), requires_grad=True) for _ in range(2))
    out = F.scaled_dot_product_attention(q, k, v, memory_efficient=memory_efficient)
    ref = torch.nn.functional.scaled_dot_product_attention(torch.tensor(q.data), torch.zeros(1, 2, 0, 4,
                                                           dtype=torch.float64), torch.zeros(1, 2, 0, 4, dtype=torch.float64))
    np.testing.assert_array_equal(out.data, ref.numpy())
    out.backward(rng.standard_normal(out.shape))
    np.testing.assert_array_equal(q.grad, 0.0)
