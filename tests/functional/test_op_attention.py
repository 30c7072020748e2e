"""F.scaled_dot_product_attention, naive and memory-efficient: the registry's cases (every mask
kind, fully masked rows, float masks that require grad, k and v broadcast, returned weights,
dropout: gradcheck, torch, composite twin on every device), fully masked rows, blockwise against naive in float32, large scores and additive -1e9
masks against torch, dropout semantics, empty keys, property-based tests, and clear errors."""
import math

import numpy as np
import pytest
from hypothesis import given, strategies as st

import autograd
import npformer
import npformer.functional as F
from autograd import Tensor
from npformer.opcases.ops import B, H, HD, TK, TQ, attention_masks

from helpers import DTYPES, HYPOTHESIS, compare_runs, compare_with_torch, leaf, op_tests, tolerance
from tolerances import Rounded, assert_close, attention_chain, rounding_tolerance, scaled, spread

test_gradcheck, test_matches_torch, test_matches_composite_twin = op_tests("attention")

PATHS = {"naive": {}, "memory_efficient": {"memory_efficient": True, "block_size": 2}}


def qkv(rng, tq=TQ, tk=TK, hd=HD, lead=(B, H)):
    return [rng.standard_normal(lead + (t, hd)) for t in (tq, tk, tk)]



@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_fully_masked_rows_give_zero_output_and_zero_gradients(path, kind, device):
    rng = np.random.default_rng(4)
    q, k, v = (leaf(a, device) for a in qkv(rng))
    keep = np.ones((TQ, TK), dtype=bool)
    keep[[0, 3]] = False
    mask = keep if kind == "bool" else np.where(keep, 0.0, -np.inf)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **PATHS[path])
    out.backward(autograd.backend.to_device(rng.standard_normal(out.shape), device))
    assert np.all(out.numpy()[..., [0, 3], :] == 0)
    assert np.all(np.isfinite(out.numpy()))
    for t in (q, k, v):
        assert np.all(np.isfinite(autograd.backend.as_numpy(t.grad)))
    assert np.all(autograd.backend.as_numpy(q.grad)[..., [0, 3], :] == 0)
    # every row masked: all zero, all gradients exactly zero
    q.grad = k.grad = v.grad = None
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=np.zeros((TQ, TK), dtype=bool), **PATHS[path])
    out.backward(autograd.backend.to_device(rng.standard_normal(out.shape), device))
    assert not out.numpy().any()
    assert not any(autograd.backend.as_numpy(t.grad).any() for t in (q, k, v))


@pytest.mark.parametrize("shape", [(1, 1, 67, 70, 16), (2, 3, 33, 17, 8), (1, 2, 17, 40, 4)])
@pytest.mark.parametrize("causal", [False, True])
def test_memory_efficient_equals_naive_float32(shape, causal, device):
    """Block sizes that do not divide T, Tq != Tk, a padding mask: equal up to float32 rounding
    over the longest sum (a few ulps per term), scaled by the magnitudes of q, k, v and the
    upstream gradient."""
    b, h, tq, tk, hd = shape
    rng = np.random.default_rng(5)
    arrays = [a.astype(np.float32) for a in qkv(rng, tq, tk, hd, (b, h))]
    keep = rng.random((b, 1, 1, tk)) > 0.2
    upstream = rng.standard_normal((b, h, tq, hd)).astype(np.float32)
    results = []
    for kwargs in ({}, {"memory_efficient": True, "block_size": 16}):
        ins = [leaf(a, device, np.float32) for a in arrays]
        out = F.scaled_dot_product_attention(*ins, attn_mask=keep, is_causal=causal, **kwargs)
        out.backward(autograd.backend.to_device(upstream, device))
        results.append([out.numpy()] + [autograd.backend.as_numpy(t.grad) for t in ins])
    unit = rounding_tolerance(np.float32, terms=max(tq, tk, hd))
    for name, ours, ref in zip(["out", "dq", "dk", "dv"], *results):
        assert ours.dtype == np.float32
        assert_close(ours, ref, scaled(unit, *arrays, upstream), rtol=unit, err_msg=name)


def test_large_scores_stay_finite_and_match_torch(torch):
    """|q|, |k| ~ 1e3: scores ~ 1e6; the subtracted row max keeps exp finite. The tolerance is
    float64 rounding over the keys at unit scale, scaled by the inputs' magnitudes (1e6)."""
    rng = np.random.default_rng(6)
    arrays = [a * 1e3 for a in qkv(rng)[:2]] + [qkv(rng)[2]]
    for path in PATHS.values():
        compare_with_torch(torch, lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, **path),
                           lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
                           arrays, np.random.default_rng(7), atol=rounding_tolerance(np.float64, terms=TK),
                           rtol=0)


def test_returned_weights_are_probabilities_and_take_gradient(torch):
    """return_weights=True: (out, P); a loss on both outputs matches torch's explicit softmax."""
    rng = np.random.default_rng(8)
    arrays = qkv(rng)
    pad = attention_masks(rng)["is_causal with padding"]["attn_mask"]
    keep = pad & np.tril(np.ones((TQ, TK), dtype=bool))
    ins = [leaf(a) for a in arrays]
    out, weights = F.scaled_dot_product_attention(*ins, attn_mask=keep, return_weights=True)
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in arrays)
    scores = (tq @ tk.transpose(-1, -2)) / np.sqrt(HD)
    t_weights = torch.softmax(scores.masked_fill(~torch.tensor(keep), float("-inf")), dim=-1)
    t_out = t_weights @ tv
    np.testing.assert_allclose(weights.numpy(), t_weights.detach().numpy(), atol=scaled(1e-12, *arrays))
    np.testing.assert_allclose(out.numpy(), t_out.detach().numpy(), atol=scaled(1e-12, *arrays))
    g_out, g_w = rng.standard_normal(out.shape), rng.standard_normal(weights.shape)
    loss = (out * Tensor(g_out)).sum() + (weights * Tensor(g_w)).sum()
    loss.backward()
    ((t_out * torch.tensor(g_out)).sum() + (t_weights * torch.tensor(g_w)).sum()).backward()
    for ours, ref in zip(ins, (tq, tk, tv)):
        np.testing.assert_allclose(ours.grad, ref.grad.numpy(), atol=scaled(1e-10, *arrays, g_out, g_w))
    assert autograd.gradcheck(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, return_weights=True),
                              [leaf(a) for a in qkv(rng, 3, 4, 2)])


def test_dropout_zeroes_some_weights(device):
    """(The registry's "F.sdpa (seeded dropout, return_weights)" checks gradients and the twin.)"""
    q, k, v = (Tensor(a, device=device) for a in qkv(np.random.default_rng(9), 4, 4, 2))
    _, weights = F.scaled_dot_product_attention(q, k, v, dropout_p=0.3, is_causal=True, return_weights=True,
                                                generator=npformer.runtime.random.Philox(11))
    assert (weights.numpy() == 0).any()


@pytest.mark.parametrize("causal", [False, True])
def test_memory_efficient_dropout_equals_naive_with_the_same_generator(causal, device):
    """Both paths drop entry i of the flat (B, H, Tq, Tk) probabilities iff value offset + i of the
    stream passes the keep test: the blockwise path draws each block's part alone (forward and
    backward), and gives the naive path's output and gradients."""
    rng = np.random.default_rng(12)
    arrays = qkv(rng, 5, 7, 3)
    p, block = 0.3, 3

    def run(path):
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=causal, **path,
                                                              generator=npformer.runtime.random.Philox(21, offset=16))
    compare_runs(run({"memory_efficient": True, "block_size": block}), run({}), arrays, rng, device)
    assert autograd.gradcheck(run({"memory_efficient": True, "block_size": block}),
                              [leaf(a, device) for a in qkv(rng, 4, 4, 2)])


def test_dropout_rate_and_extremes():
    rng = np.random.default_rng(10)
    q, k, v = (Tensor(a) for a in qkv(rng, 64, 64, 4, (1, 1)))
    gen = npformer.runtime.random.Philox(0)
    _, w = F.scaled_dot_product_attention(q, k, v, dropout_p=0.25, generator=gen, return_weights=True)
    dropped = (w.numpy() == 0).mean()
    assert 0.22 < dropped < 0.28
    # kept entries are the probabilities scaled by 1/(1-p)
    _, p = F.scaled_dot_product_attention(q, k, v, return_weights=True)
    kept = w.numpy() != 0
    np.testing.assert_allclose(w.numpy()[kept], p.numpy()[kept] / 0.75, rtol=1e-12)
    for memory_efficient in (False, True):
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=1.0, memory_efficient=memory_efficient)
        assert not out.numpy().any()


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
    near_1e9 = rounding_tolerance(np.float64, 1e9, terms=5)         # scores of 1e9 summed over 5 keys
    compare_with_torch(torch, lambda *a: F.scaled_dot_product_attention(*a, attn_mask=mask, **PATHS[path]),
                       lambda *a: torch.nn.functional.scaled_dot_product_attention(*a, attn_mask=torch.tensor(mask)),
                       [q, k, v], rng, atol=near_1e9, rtol=0)
    run = lambda **kw: F.scaled_dot_product_attention(Tensor(q), Tensor(k), Tensor(v), **kw, **PATHS[path]).numpy()
    additive, by_bool, unmasked = run(attn_mask=mask), run(attn_mask=keep), run()
    visible = np.ones((2, 2, 5), dtype=bool)
    visible[0, :, 2] = False
    assert_close(additive[visible], by_bool[visible], rounding_tolerance(np.float64, np.abs(v).max(), terms=5))
    assert_close(additive[0, :, 2], unmasked[0, :, 2], near_1e9 * np.abs(v).max())
    assert np.abs(additive[0, :, 2]).min() > 0                      # not the 0 of a bool/-inf mask


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
    chain = attention_chain(np.float64, *map(Rounded.of, (q, k, v, g)), scale=0.5, hd=4, tq=7, tk=7,
                            spread=spread(probs))
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
    mixing = 1.0 - probs.max(axis=-1, keepdims=True)                        # (1, 2, 9, 1): 0 when saturated
    bound = 4 * mixing * scores.error * np.abs(v).max() + rounding_tolerance(np.float32, np.abs(v).max(), terms=9)
    assert_close(out, ref, bound)


@pytest.mark.parametrize("memory_efficient", [False, True])
def test_empty_keys_match_torch(torch, memory_efficient):
    """Attention over zero keys is 0, as in torch."""
    rng = np.random.default_rng(0)
    q = Tensor(rng.standard_normal((1, 2, 3, 4)), requires_grad=True)
    k, v = (Tensor(np.zeros((1, 2, 0, 4)), requires_grad=True) for _ in range(2))
    out = F.scaled_dot_product_attention(q, k, v, memory_efficient=memory_efficient)
    ref = torch.nn.functional.scaled_dot_product_attention(torch.tensor(q.data), torch.zeros(1, 2, 0, 4,
                                                           dtype=torch.float64), torch.zeros(1, 2, 0, 4, dtype=torch.float64))
    np.testing.assert_array_equal(out.data, ref.numpy())
    out.backward(rng.standard_normal(out.shape))
    np.testing.assert_array_equal(q.grad, 0.0)


@HYPOTHESIS
@given(b=st.integers(1, 2), h=st.integers(1, 2), tq=st.integers(1, 4), tk=st.integers(1, 4),
       hd=st.integers(1, 3), mask_kind=st.sampled_from(["none", "bool", "float", "causal", "causal+bool"]),
       memory_efficient=st.booleans(), block_size=st.integers(1, 3), dtype=DTYPES, seed=st.integers(0, 2**31))
def test_attention_properties(b, h, tq, tk, hd, mask_kind, memory_efficient, block_size, dtype, seed, torch):
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal((b, h, t, hd)) for t in (tq, tk, tk)]
    ours, theirs = {}, {}
    keep = rng.random((b, 1, tq, tk)) > 0.4                       # rows may end up fully masked
    keep[..., rng.integers(tq), :] = rng.random() < 0.5            # often one fully masked row
    tril = np.tril(np.ones((tq, tk), dtype=bool))
    if mask_kind == "bool":
        ours["attn_mask"] = theirs["attn_mask"] = keep
    elif mask_kind == "float":
        additive = np.where(keep, rng.standard_normal((b, 1, tq, tk)), -np.inf).astype(dtype)
        ours["attn_mask"] = theirs["attn_mask"] = additive
    elif mask_kind == "causal":
        ours["is_causal"] = theirs["is_causal"] = True
    elif mask_kind == "causal+bool":
        ours.update(attn_mask=keep, is_causal=True)
        theirs["attn_mask"] = keep & tril
    path = {"memory_efficient": memory_efficient, "block_size": block_size}
    t_kwargs = {k: torch.tensor(v) if isinstance(v, np.ndarray) else v for k, v in theirs.items()}

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, **ours, **path)

    compare_with_torch(torch, fn, lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, **t_kwargs),
                       arrays, rng, dtype=dtype, **tolerance(dtype))
    ins = [leaf(a, dtype=dtype) for a in arrays]
    out = fn(*ins)
    out.backward(np.ones(out.shape, dtype))
    for t in (out.data, *(t.grad for t in ins)):
        assert np.all(np.isfinite(autograd.backend.as_numpy(t)))
    if dtype == np.float64:
        assert autograd.gradcheck(fn, [leaf(a) for a in arrays])


@pytest.mark.parametrize("kwargs, error, words", [
    ({"query": np.zeros(3)}, ValueError, ["at least 2-D"]),
    ({"key": np.zeros((B, H, TK, HD + 1))}, ValueError, ["key (..., Tk, hd)"]),
    ({"value": np.zeros((B, H, TK + 1, HD))}, ValueError, ["value (..., Tk, hdv)"]),
    ({"key": np.zeros((3, H, TK, HD)), "value": np.zeros((3, H, TK, HD))}, ValueError, ["broadcast"]),
    ({"attn_mask": np.ones((TQ, TK + 1), dtype=bool)}, ValueError, ["attn_mask", "(2, 2, 5, 6)", "(5, 7)"]),
    ({"attn_mask": np.ones((TQ, TK), dtype=np.int64)}, TypeError, ["attn_mask", "int64"]),
    ({"dropout_p": 1.5}, ValueError, ["dropout", "1.5"]),
    ({"return_weights": True, "memory_efficient": True}, ValueError, ["return_weights"]),
    ({"memory_efficient": True, "block_size": 0}, ValueError, ["block_size", "0"]),
    ({"query": np.zeros((B, H, TQ, HD), dtype=np.int64)}, TypeError, ["query", "floating", "int64"]),
])
def test_bad_arguments_raise_clear_errors(kwargs, error, words):
    args = {"query": np.zeros((B, H, TQ, HD)), "key": np.zeros((B, H, TK, HD)), "value": np.zeros((B, H, TK, HD))}
    args.update(kwargs)
    args = {k: Tensor(v) if k in ("query", "key", "value") else v for k, v in args.items()}
    with pytest.raises(error) as info:
        F.scaled_dot_product_attention(**args)
    for word in words:
        assert word in str(info.value)


def test_mixed_devices_raise():
    q = Tensor(np.zeros((1, 2, 3)), device="test")
    k = Tensor(np.zeros((1, 2, 3)))
    with pytest.raises(RuntimeError, match="device"):
        F.scaled_dot_product_attention(q, k, k)
    with pytest.raises(RuntimeError, match="attn_mask"):
        F.scaled_dot_product_attention(q, q, q, attn_mask=Tensor(np.ones((2, 2), dtype=bool)))
