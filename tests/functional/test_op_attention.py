"""F.scaled_dot_product_attention, naive and memory-efficient: the registry's cases (every mask
kind, fully masked rows, float masks that require grad, k and v broadcast, returned weights,
dropout: gradcheck, torch, composite twin on every device; their second derivatives: gradgradcheck
and torch's double backward), fully masked rows, blockwise against naive in float32, large scores and additive -1e9
masks against torch, dropout semantics, empty keys, property-based tests, and clear errors.
Double backward: the memory-efficient path's blockwise second derivative against the naive path's
(blocks that do not divide T, every mask kind, dropout), its memory (no (Tq, Tk) matrix), third
derivatives on both paths against torch and gradgradcheck of the double backward itself. The naive
path's AttentionBackward (its gradient as one op): gradcheck of its double backward and jvp alone,
forward over reverse against reverse over reverse (float64, and float32 against float64), a third
derivative with a float mask and the returned weights against torch, and its own differentiable_backward."""
import math
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, strategies as st

import autograd
import npformer
import npformer.functional as F
from autograd import Tensor
from autograd import forward_ad as fwAD
from npformer.functional.activation import dropout_scale
from npformer.functional.attention import AttentionBackward
from npformer.opcases import OpCase, TOLERANCE, compare, instantiate
from npformer.functional.attention.cases import B, H, HD, TK, TQ, attention_masks

from helpers import (DTYPES, HYPOTHESIS, assert_clear_error, case_hvp, compare_runs, compare_with_torch,
                     double_backward_tests, forward_mode_tests, leaf, op_tests, tolerance)
from tolerances import Rounded, assert_close, attention_chain, rounding_tolerance, scaled, spread

test_gradcheck, test_matches_torch, test_matches_composite_twin = op_tests("attention")
test_gradgradcheck, test_double_backward_matches_torch = double_backward_tests("attention")
test_forward_mode_gradcheck, test_jvp_matches_torch, test_forward_mode_in_float32 = forward_mode_tests("attention")


PATHS = {"naive": {}, "memory_efficient": {"memory_efficient": True, "block_size": 2}}


def qkv(rng, tq=TQ, tk=TK, hd=HD, lead=(B, H)):
    return [rng.standard_normal(lead + (t, hd)) for t in (tq, tk, tk)]


def torch_jvp(torch, fn, primals, tangents):
    """torch.func.jvp(fn, primals, tangents) with attention on torch's math backend."""
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        return torch.func.jvp(fn, tuple(primals), tuple(tangents))




def jvp_of_attention(arrays, tangents, device="cpu", dtype=np.float64, mask=None, mask_tangent=None, **kwargs):
    """(out, t_out) of F.scaled_dot_product_attention(q, k, v, **kwargs) along the tangents, on
    inputs that do not require grad (forward mode alone: no graph is recorded); a float mask and
    its tangent when given."""
    def dual(array, tangent):
        return fwAD.make_dual(Tensor(array, device=device, dtype=dtype),
                              autograd.backend.to_device(tangent.astype(dtype), device))

    with fwAD.dual_level():
        duals = [dual(a, u) for a, u in zip(arrays, tangents)]
        if mask_tangent is not None:
            mask = dual(mask, mask_tangent)
        out = F.scaled_dot_product_attention(*duals, attn_mask=mask, **kwargs)
        assert out.creator is None
        primal, tangent = fwAD.unpack_dual(out)
        return primal.numpy(), tangent.numpy()


@pytest.mark.parametrize("path", PATHS)
def test_a_float_mask_that_carries_a_tangent_but_no_grad_moves_the_output(path, torch):
    """Its tangent was dropped (the mask entered the op as a constant array): J u missed t_mask."""
    rng = np.random.default_rng(21)
    arrays, tangents = qkv(rng), qkv(rng)
    mask, mask_tangent = rng.standard_normal((TQ, TK)), rng.standard_normal((TQ, TK))
    mask[2, 1:] = -np.inf
    _, ours = jvp_of_attention(arrays, tangents, mask=mask, mask_tangent=mask_tangent, is_causal=True, **PATHS[path])
    tril = torch.tensor(np.tril(np.ones((TQ, TK), dtype=bool)))
    _, theirs = torch_jvp(torch, lambda q, k, v, m: torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=m.masked_fill(~tril, -np.inf)), map(torch.tensor, arrays + [mask]),
        map(torch.tensor, tangents + [mask_tangent]))
    assert_close(ours, theirs.numpy(), scaled(1e-12, *arrays, *tangents, mask_tangent))
    only_mask = jvp_of_attention(arrays, [np.zeros_like(a) for a in arrays], mask=mask, mask_tangent=mask_tangent,
                                 **PATHS[path])[1]
    assert np.abs(only_mask).max() > 0.01


def test_a_float_mask_with_a_tangent_in_another_dtype_is_a_clear_error():
    rng = np.random.default_rng(22)
    q, k, v = (Tensor(a) for a in qkv(rng))
    with fwAD.dual_level():
        mask = fwAD.make_dual(Tensor(np.zeros((TQ, TK), np.float32)), np.ones((TQ, TK), np.float32))
        assert_clear_error(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), TypeError,
                           ["attn_mask", "carries a tangent", "float64", "float32"])


@pytest.mark.parametrize("shape", [(1, 1, 67, 70, 16), (2, 3, 33, 17, 8)])
@pytest.mark.parametrize("causal", [False, True])
def test_memory_efficient_jvp_equals_naive_float32_with_the_same_dropout(shape, causal, device):
    """Block sizes that do not divide T, Tq != Tk, a padding mask, dropout from one generator
    (each key block regenerates the forward's part of the mask): the blockwise J u equals the
    naive path's up to float32 rounding over the longest sum, scaled by the magnitudes."""
    b, h, tq, tk, hd = shape
    rng = np.random.default_rng(23)
    arrays, tangents = qkv(rng, tq, tk, hd, (b, h)), qkv(rng, tq, tk, hd, (b, h))
    keep = rng.random((b, 1, 1, tk)) > 0.2
    results = [jvp_of_attention(arrays, tangents, device, np.float32, mask=keep, is_causal=causal, dropout_p=0.2,
                                generator=npformer.runtime.random.Philox(5, offset=8), **kwargs)
               for kwargs in ({}, {"memory_efficient": True, "block_size": 16})]
    unit = rounding_tolerance(np.float32, terms=max(tq, tk, hd))
    for name, ours, ref in zip(["out", "t_out"], *results):
        assert ours.dtype == np.float32
        assert_close(ours, ref, scaled(unit, *arrays, *tangents), rtol=unit, err_msg=name)


@pytest.mark.parametrize("lead", [(3, 2), (1, 3)])
def test_naive_jvp_in_threads_equals_one_thread(threads, lead):
    """The naive rule runs in (batch, head) blocks like its forward: blocks of the batch, or of the
    heads when B = 1; the returned weights' tangent and dropout included."""
    rng = np.random.default_rng(25)
    arrays, tangents = qkv(rng, lead=lead), qkv(rng, lead=lead)
    results = []
    for n in (1, 2):
        threads(n)
        with fwAD.dual_level():
            outs = F.scaled_dot_product_attention(*(fwAD.make_dual(Tensor(a), u) for a, u in zip(arrays, tangents)),
                                                  dropout_p=0.3, return_weights=True, generator=npformer.runtime.random.Philox(2))
            results.append([fwAD.unpack_dual(o).tangent for o in outs])
    for one, two in zip(*results):  # (up to the GEMMs' last bits, which BLAS may round per block)
        np.testing.assert_allclose(one, two, rtol=1e-13, atol=1e-13)


def test_memory_efficient_jvp_keeps_no_query_by_key_matrix():
    """The memory bound: numpy's allocations (tracemalloc) during the blockwise J u stay under a
    quarter of one (Tq, Tk) matrix, where the naive path's hold several."""
    import tracemalloc
    rng = np.random.default_rng(24)
    t, hd, block = 512, 8, 64
    arrays, tangents = qkv(rng, t, t, hd, (1, 1)), qkv(rng, t, t, hd, (1, 1))
    matrix = t * t * 8                                                   # bytes of one float64 (Tq, Tk) matrix
    peaks = {}
    for name, kwargs in {"naive": {}, "memory_efficient": {"memory_efficient": True, "block_size": block}}.items():
        tracemalloc.start()
        jvp_of_attention(arrays, tangents, is_causal=True, **kwargs)
        peaks[name] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peaks["memory_efficient"] < matrix / 4 < peaks["naive"] / 8, peaks



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
        assert np.all(np.isfinite(t.grad.numpy()))
    assert np.all(q.grad.numpy()[..., [0, 3], :] == 0)
    # every row masked: all zero, all gradients exactly zero
    q.grad = k.grad = v.grad = None
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=np.zeros((TQ, TK), dtype=bool), **PATHS[path])
    out.backward(autograd.backend.to_device(rng.standard_normal(out.shape), device))
    assert not out.numpy().any()
    assert not any(t.grad.numpy().any() for t in (q, k, v))


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
        results.append([out.numpy()] + [t.grad.numpy() for t in ins])
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


def sdpa_hvp(arrays, rng, **kwargs):
    """The Hessian-vector product (case_hvp: float64, random upstream g and directions u drawn from
    `rng`) of F.scaled_dot_product_attention(*arrays, **kwargs); a 4th array is a float attn_mask
    that is differentiated too."""
    def fn(q, k, v, *mask):
        return F.scaled_dot_product_attention(q, k, v, *mask, **kwargs)
    instance = instantiate(OpCase("sdpa", lambda _: arrays, fn, family="attention"), rng)
    out = instance(*instance.tensors)
    upstream, directions = [rng.standard_normal(out.shape)], [rng.standard_normal(a.shape) for a in arrays]
    return case_hvp(instance, upstream, directions)


@pytest.mark.parametrize("mask", list(attention_masks(np.random.default_rng(0), 13, 11)) + ["float mask that requires grad"])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_memory_efficient_second_derivative_equals_the_naive_paths(mask, dropout):
    """Blocks of 4 over Tq = 13 and Tk = 11 (neither divisible), every mask kind, dropout (the same
    generator: the same mask): the blockwise double backward equals the naive path's (its whole-matrix
    double backward from the saved P) up to float64 rounding relative to the largest entry."""
    rng = np.random.default_rng(21)
    kwargs = dict(attention_masks(rng, 13, 11).get(mask, {}))
    arrays = qkv(rng, 13, 11, 4)
    if mask == "float mask that requires grad":
        arrays.append(rng.standard_normal((B, 1, 13, 11)))
        kwargs["is_causal"] = True
    results = {}
    for path in ("naive", "memory_efficient"):
        generator = npformer.runtime.random.Philox(5, offset=64)
        options = {"memory_efficient": True, "block_size": 4} if path == "memory_efficient" else {}
        results[path] = sdpa_hvp(arrays, np.random.default_rng(22), dropout_p=dropout, generator=generator,
                                 **kwargs, **options)
    comparison = compare(results["memory_efficient"], results["naive"], ["q", "k", "v", "mask"][:len(arrays)],
                         TOLERANCE["twin", "float64"])
    assert comparison.passed, comparison


def peak_bytes(run):
    """The peak of the host memory that `run()` allocates (tracemalloc; numpy reports its arrays)."""
    tracemalloc.start()
    try:
        run()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_memory_efficient_second_derivative_holds_no_score_matrix():
    """An HVP through the memory-efficient path at T = 512 never allocates a (T, T) matrix: its peak
    (the (T, hd) arrays and a few (block, block) tiles) stays under a quarter of one; through the
    naive path it takes several."""
    rng = np.random.default_rng(23)
    t = 512
    arrays = qkv(rng, t, t, 4, lead=(1, 1))
    matrix = t * t * 8                                            # one (T, T) float64 matrix

    def hvp(**options):
        return lambda: sdpa_hvp(arrays, np.random.default_rng(24), is_causal=True, **options)
    hvp(memory_efficient=True, block_size=16)()                  # the first call's one-off allocations aside
    assert peak_bytes(hvp(memory_efficient=True, block_size=16)) < matrix / 4
    assert peak_bytes(hvp()) > 3 * matrix


def third_derivative(library, arrays, g, u, w, **options):
    """d/dq <d/dx <d/dx <sdpa(x), g>, u>, w> (causal) for x = (q, k, v): npformer's with `options`
    (a path), or torch's (library: the torch module, math backend)."""
    if library is None:
        xs, grad, wrap = [leaf(a) for a in arrays], autograd.grad, Tensor
        sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, **options)
    else:
        torch = library
        xs, grad, wrap = [torch.tensor(a, requires_grad=True) for a in arrays], torch.autograd.grad, torch.tensor
        sdpa = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    first = grad(sdpa(*xs), xs, wrap(g), create_graph=True)
    second = grad(first, xs, [wrap(a) for a in u], create_graph=True)
    (third,) = grad(second, xs[:1], [wrap(a) for a in w])
    return third


@pytest.mark.parametrize("path", PATHS)
def test_third_derivative_matches_torch(path, torch):
    """Third order: through the double backward of each path (AttentionBackward's and
    MemoryEfficientAttentionBackward's), whose differentiable_backward writes its formulas with Tensors."""
    rng = np.random.default_rng(25)
    arrays = qkv(rng, 5, 5, 3, lead=(1, 2))
    g = rng.standard_normal(arrays[0].shape)
    u, w = ([rng.standard_normal(a.shape) for a in arrays] for _ in range(2))
    ours = third_derivative(None, arrays, g, u, w, **PATHS[path]).numpy()
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        theirs = third_derivative(torch, arrays, g, u, w).numpy()
    comparison = compare([ours], [theirs], ["d/dq"], TOLERANCE["torch", "float64"])
    assert comparison.passed, comparison


@pytest.mark.parametrize("mask", ["float mask that requires grad", "fully masked row"])
def test_memory_efficient_double_backward_is_differentiable_itself(mask):
    """The double backward's own differentiable_backward (dropout, a fully masked row, blocks of 2):
    the second derivative it builds equals the blockwise one, and gradgradcheck of the first
    derivative (q, k, v, mask) -> dQ, dK, dV, dMask checks the third derivative against it."""
    rng = np.random.default_rng(27)
    arrays = qkv(rng, 3, 4, 2, lead=(1, 2))
    kwargs = {"dropout_p": 0.3, "memory_efficient": True, "block_size": 2}
    if mask == "fully masked row":
        keep = np.ones((3, 4), dtype=bool)
        keep[1] = False
        kwargs["attn_mask"] = keep
    else:
        arrays.append(rng.standard_normal((3, 4)))
    g = leaf(rng.standard_normal((1, 2, 3, 2)))

    def first_derivative(q, k, v, *m):
        out = F.scaled_dot_product_attention(q, k, v, *m, generator=npformer.runtime.random.Philox(2), **kwargs)
        return autograd.grad(out, [q, k, v, *m], g, create_graph=True)
    xs = [leaf(a) for a in arrays]
    directions = [Tensor(rng.standard_normal(a.shape)) for a in arrays]
    second = {graph: autograd.grad(first_derivative(*xs), xs, directions, create_graph=graph) for graph in (False, True)}
    for blockwise, composed in zip(second[False], second[True]):
        np.testing.assert_allclose(composed.numpy(), blockwise.numpy(), rtol=0,
                                   atol=1e-12 * max(1.0, np.abs(blockwise.numpy()).max()))
    assert autograd.gradgradcheck(first_derivative, xs)


def attention_backward_op(attn_mask=None, is_causal=False, keep=None, need=None, scale=0.7):
    """fn(q, k, v, mask, dout, dweights) -> what AttentionBackward returns (the gradients `need`
    asks for; None: dQ, dK, dV, and dMask when there is a float mask), with P formed from the
    arrays of q, k and the float mask on every call, as AttentionFunction's forward saves it:
    finite differences then move P as the op's rules do.
    attn_mask: a bool mask (True = takes part) or None; keep: the dropout mask (a constant) or None."""
    def fn(q, k, v, mask, dout, dweights):
        arrays = [None if t is None else t.data for t in (q, k, v, mask)]
        _, probs = F.scaled_dot_product_attention(*map(Tensor, arrays[:3]), attn_mask=attn_mask if mask is None
                                                  else arrays[3], is_causal=is_causal, scale=scale, return_weights=True)
        return AttentionBackward.apply(q, k, v, mask, dout, dweights, probs=probs.data, keep=keep,
                                       blocked=None if attn_mask is None else ~attn_mask, causal=is_causal,
                                       scale=scale, dropout_scale=dropout_scale(0.3),
                                       need=need or (True, True, True, mask is not None))
    return fn


@pytest.mark.parametrize("case", ["float mask, causal, dropout, returned weights, k and v broadcast",
                                  "bool mask with a fully masked row", "q and the mask constants"])
def test_attention_backward_op_gradcheck_and_forward_mode(case):
    """AttentionBackward alone, every input that moves requiring grad: gradcheck compares its backward
    (the double backward) with finite differences of its forward (the first-order gradients), and
    with check_forward_ad its jvp too, and the two against each other (<g, J u> = <J^T g, u>)."""
    rng = np.random.default_rng(41)
    q, k, v = rng.standard_normal((2, 2, 3, 2)), rng.standard_normal((2, 2, 4, 2)), rng.standard_normal((2, 2, 4, 3))
    dout, dweights, mask = rng.standard_normal((2, 2, 3, 3)), None, None
    keep_rows = np.ones((3, 4), dtype=bool)
    keep_rows[1] = False                                          # query row 1 sees no key
    options = {}
    if case.startswith("float mask"):
        k, v = k[:, :1], v[:1]                                    # k shared by the heads, v by the batch
        mask = np.where(keep_rows, rng.standard_normal((3, 4)), -np.inf)
        dweights = rng.standard_normal((2, 2, 3, 4))
        options = {"is_causal": True, "keep": rng.random((2, 2, 3, 4)) > 0.3}
    elif case.startswith("bool mask"):
        options = {"attn_mask": keep_rows}
    else:
        options = {"need": (False, True, True, False), "is_causal": True}
    inputs = [leaf(q), leaf(k), leaf(v), None if mask is None else leaf(mask), leaf(dout),
              None if dweights is None else leaf(dweights)]
    if case.startswith("q and"):
        inputs[0] = Tensor(q)                                     # no gradient: dQ is not computed
    assert autograd.gradcheck(attention_backward_op(**options), inputs, check_forward_ad=True,
                              names=["q", "k", "v", "mask", "dout", "dweights"])


def test_naive_create_graph_gradient_is_one_attention_backward_node():
    """The gradient built with create_graph is AttentionBackward's outputs, equal to the first-order
    gradients, and only those that are needed (v constant: dV is not computed)."""
    rng = np.random.default_rng(42)
    arrays = qkv(rng)
    g = rng.standard_normal(arrays[0].shape)
    q, k = leaf(arrays[0]), leaf(arrays[1])
    out = F.scaled_dot_product_attention(q, k, Tensor(arrays[2]), is_causal=True)
    first = autograd.grad(out, [q, k], Tensor(g), create_graph=True)
    assert {type(t.creator) for t in first} == {AttentionBackward}
    assert len(first[0].creator.output_meta) == 2
    plain = autograd.grad(F.scaled_dot_product_attention(q, k, Tensor(arrays[2]), is_causal=True), [q, k], Tensor(g))
    for ours, ref in zip(first, plain):
        np.testing.assert_array_equal(ours.numpy(), ref.numpy())


def naive_loss(options, return_weights, rng, shapes):
    """A scalar of the naive path whose upstream gradients move with every input: sum(c O + O^2)
    (+ sum(c_w Pd^2) of the returned weights), so dO and dweights have tangents and gradients too.
    options: F.scaled_dot_product_attention's keywords; "dropout" in them: a fresh generator each call."""
    options = dict(options)
    dropout = options.pop("dropout", 0.0)
    c, c_weights = rng.standard_normal(shapes[0]), rng.standard_normal(shapes[1])

    def loss(q, k, v, *mask):
        result = F.scaled_dot_product_attention(q, k, v, *mask, dropout_p=dropout, return_weights=return_weights,
                                                generator=npformer.runtime.random.Philox(3, offset=8), **options)
        out, weights = result if return_weights else (result, None)
        total = (out * Tensor(c.astype(q.dtype)) + out * out).sum()
        if weights is not None:
            total = total + (weights * weights * Tensor(c_weights.astype(q.dtype))).sum()
        return total
    return loss


HVP_CASES = {**{mask: (kwargs, False) for mask, kwargs in attention_masks(np.random.default_rng(0)).items()},
             "dropout, returned weights, causal": ({"dropout": 0.3, "is_causal": True}, True),
             "returned weights, padding": (attention_masks(np.random.default_rng(0))["padding"], True),
             "float mask that requires grad, dropout": ({"dropout": 0.3, "is_causal": True}, False),
             "k, v broadcast over heads / batch": ({"is_causal": True}, False)}


def hvp_inputs(case, rng):
    """q, k, v (and a float mask that is differentiated) for HVP_CASES[case]."""
    arrays = qkv(rng)
    if case.startswith("k, v broadcast"):
        arrays[1], arrays[2] = arrays[1][:, :1], arrays[2][:1]
    if case.startswith("float mask that requires grad"):
        mask = rng.standard_normal((B, 1, TQ, TK))
        mask[1, 0, 2] = -np.inf                                   # a fully masked row
        arrays.append(mask)
    return arrays


@pytest.mark.parametrize("case", HVP_CASES)
def test_naive_hvp_forward_over_reverse_equals_reverse_over_reverse(case):
    """autograd.functional.hvp (dual tensors through AttentionBackward's jvp) against
    autograd.functional.vhp (its backward, the double backward): equal up to float64 rounding
    relative to the largest entry, every mask kind, dropout, returned weights, broadcast inputs."""
    options, return_weights = HVP_CASES[case]
    rng = np.random.default_rng(43)
    arrays = hvp_inputs(case, rng)
    loss = naive_loss(options, return_weights, rng, [(B, H, TQ, HD), (B, H, TQ, TK)])
    xs = tuple(Tensor(a) for a in arrays)
    directions = tuple(Tensor(rng.standard_normal(a.shape)) for a in arrays)
    _, forward = autograd.functional.hvp(loss, xs, directions)
    _, reverse = autograd.functional.vhp(loss, xs, directions)
    comparison = compare(forward, reverse, ["q", "k", "v", "mask"][:len(arrays)], TOLERANCE["twin", "float64"])
    assert comparison.passed, comparison
    assert max(np.abs(h.numpy()).max() for h in reverse) > 0.1


@pytest.mark.parametrize("product", ["hvp", "vhp"])
def test_naive_hvp_in_float32_stays_float32_and_near_float64(product):
    """Both second-order products keep float32 and agree with float64 up to float32 rounding of
    sums over the keys and the head dim, relative to the largest entry of the float64 result
    (dropout, returned weights, causal)."""
    options, return_weights = HVP_CASES["dropout, returned weights, causal"]
    results = {}
    for dtype in (np.float64, np.float32):
        rng = np.random.default_rng(44)
        arrays = hvp_inputs("dropout", rng)
        loss = naive_loss(options, return_weights, rng, [(B, H, TQ, HD), (B, H, TQ, TK)])
        directions = tuple(Tensor(rng.standard_normal(a.shape).astype(dtype)) for a in arrays)
        results[dtype] = getattr(autograd.functional, product)(
            loss, tuple(Tensor(a.astype(dtype)) for a in arrays), directions)[1]
    for ours, ref in zip(results[np.float32], results[np.float64]):
        assert ours.dtype == np.float32
        bound = rounding_tolerance(np.float32, np.abs(ref.numpy()).max(), terms=TK + HD)
        assert_close(ours.numpy(), ref.numpy(), bound)


def naive_third_derivative(library, arrays, g, u, w):
    """d/dx <d/dx <d/dx <f(x), g>, u>, w> for x = (q, k, v, mask) of f = (O, P), the naive path with
    a float mask, causal and the returned weights: npformer's, or torch's (library: the torch
    module) through an explicit softmax."""
    if library is None:
        xs, grad, wrap = [leaf(a) for a in arrays], autograd.grad, Tensor
        f = lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=True,  # noqa: E731
                                                              return_weights=True)
    else:
        torch = library
        xs, grad, wrap = [torch.tensor(a, requires_grad=True) for a in arrays], torch.autograd.grad, torch.tensor
        hidden = torch.tensor(np.triu(np.ones(arrays[3].shape, dtype=bool), 1))

        def f(q, k, v, m):
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1]) + m
            p = torch.softmax(scores.masked_fill(hidden, -math.inf), dim=-1)
            return p @ v, p
    first = grad(f(*xs), xs, [wrap(a) for a in g], create_graph=True)
    second = grad(first, xs, [wrap(a) for a in u], create_graph=True)
    return grad(second, xs, [wrap(a) for a in w])


def test_naive_third_derivative_with_a_float_mask_and_returned_weights_matches_torch(torch):
    """Third order through AttentionBackward's differentiable_backward (the double backward's
    formulas with Tensors): every input, the mask and the returned weights' gradient included."""
    rng = np.random.default_rng(45)
    arrays = qkv(rng, 4, 5, 3, lead=(1, 2)) + [rng.standard_normal((4, 5))]
    g = [rng.standard_normal((1, 2, 4, 3)), rng.standard_normal((1, 2, 4, 5))]
    u, w = ([rng.standard_normal(a.shape) for a in arrays] for _ in range(2))
    ours = [t.numpy() for t in naive_third_derivative(None, arrays, g, u, w)]
    theirs = [t.numpy() for t in naive_third_derivative(torch, arrays, g, u, w)]
    comparison = compare(ours, theirs, ["q", "k", "v", "mask"], TOLERANCE["torch", "float64"])
    assert comparison.passed, comparison


@pytest.mark.parametrize("mask", ["float mask that requires grad, returned weights", "fully masked row"])
def test_naive_double_backward_is_differentiable_itself(mask):
    """AttentionBackward's differentiable_backward (dropout, causal): the second derivative it builds
    equals its raw double backward, and gradgradcheck of the first derivative (q, k, v[, mask]) ->
    (dQ, dK, dV[, dMask]) checks the third derivative against finite differences."""
    rng = np.random.default_rng(46)
    arrays = qkv(rng, 3, 4, 2, lead=(1, 2))
    kwargs = {"dropout_p": 0.3, "is_causal": True}
    upstream = [leaf(rng.standard_normal((1, 2, 3, 2)))]
    if mask == "fully masked row":
        keep = np.ones((3, 4), dtype=bool)
        keep[1] = False
        kwargs["attn_mask"] = keep
    else:
        arrays.append(rng.standard_normal((3, 4)))
        kwargs["return_weights"] = True
        upstream.append(leaf(rng.standard_normal((1, 2, 3, 4))))

    def first_derivative(*xs):
        outs = F.scaled_dot_product_attention(*xs, generator=npformer.runtime.random.Philox(2), **kwargs)
        return autograd.grad(outs, list(xs), upstream, create_graph=True)
    xs = [leaf(a) for a in arrays]
    directions = [Tensor(rng.standard_normal(a.shape)) for a in arrays]
    second = {graph: autograd.grad(first_derivative(*xs), xs + upstream, directions, create_graph=graph)
              for graph in (False, True)}
    for raw, composed in zip(second[False], second[True]):
        np.testing.assert_allclose(composed.numpy(), raw.numpy(), rtol=0,
                                   atol=1e-12 * max(1.0, np.abs(raw.numpy()).max()))
    assert autograd.gradgradcheck(first_derivative, xs)


# -- grouped-query attention (enable_gqa) and the sliding window ------------------------------------
def repeated_heads(key, value, heads):
    """key and value with each of their H_kv heads repeated for its H / H_kv query heads (torch's
    repeat_interleave over dim -3), as differentiable Tensor indexing."""
    index = np.arange(heads) // (heads // key.shape[-3])
    return key[..., index, :, :], value[..., index, :, :]


GROUPED_OPTIONS = {
    "naive, causal": {"is_causal": True},
    "naive, causal, dropout, return_weights": {"is_causal": True, "dropout_p": 0.3, "return_weights": True},
    "naive, padding, dropout": {"attn_mask": np.arange(TK) < TK - 2, "dropout_p": 0.3},
    "naive, per-head float mask, window 3, dropout": {"attn_mask": np.random.default_rng(4).standard_normal((6, TQ, TK)),
                                                      "is_causal": True, "sliding_window": 3, "dropout_p": 0.3},
    "memory-efficient, causal, window 2": {"is_causal": True, "sliding_window": 2, **PATHS["memory_efficient"]},
    "memory-efficient, per-head mask, dropout": {"attn_mask": np.random.default_rng(3).random((B, 6, TQ, TK)) > 0.3,
                                                 "dropout_p": 0.3, **PATHS["memory_efficient"]},
}


@pytest.mark.parametrize("kv_heads", [1, 2, 3])
@pytest.mark.parametrize("options", GROUPED_OPTIONS)
def test_grouped_query_gradients_are_those_through_explicitly_repeated_heads(options, kv_heads):
    """enable_gqa=True (H = 6 query heads, groups of 6, 3 and 2) against the same call on K and V
    repeated per query head (dropout from one generator state): outputs, first derivatives (dK, dV:
    the sum over each group), the second derivative (create_graph) and J u all agree to float64
    rounding."""
    kwargs = GROUPED_OPTIONS[options]
    rng = np.random.default_rng(31)
    arrays = [rng.standard_normal((B, 6, TQ, HD))] + [rng.standard_normal((B, kv_heads, TK, HD)) for _ in range(2)]
    dout, u = rng.standard_normal((B, 6, TQ, HD)), [rng.standard_normal(a.shape) for a in arrays]

    def sdpa(q, k, v, grouped):
        generator = npformer.runtime.random.Philox(4)
        if grouped:
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, generator=generator, **kwargs)
        return F.scaled_dot_product_attention(q, *repeated_heads(k, v, 6), generator=generator, **kwargs)

    dweights = rng.standard_normal((B, 6, TQ, TK))
    results = []
    for grouped in (True, False):
        xs = [leaf(a) for a in arrays]
        outs = sdpa(*xs, grouped)
        outs = outs if isinstance(outs, tuple) else (outs,)               # (out, weights) with return_weights
        first = autograd.grad(list(outs), xs, [Tensor(dout), Tensor(dweights)][:len(outs)], create_graph=True)
        second = autograd.grad(first, xs, [Tensor(a) for a in u])
        with fwAD.dual_level():
            tangent = sdpa(*(fwAD.make_dual(Tensor(a), t) for a, t in zip(arrays, u)), grouped)
            tangent = fwAD.unpack_dual(tangent[0] if isinstance(tangent, tuple) else tangent).tangent
        results.append([o.numpy() for o in outs] + [g.numpy() for g in first + second] + [tangent])
    assert results[0][-5].shape == (B, kv_heads, TK, HD)
    names = ["out"] + ["weights"] * ("return_weights" in kwargs) + ["dq", "dk", "dv", "d2q", "d2k", "d2v", "t_out"]
    for name, ours, ref in zip(names, *results):
        assert ours.shape == ref.shape, name
        assert_close(ours, ref, scaled(1e-13, ref), rtol=1e-12, err_msg=name)


@pytest.mark.parametrize("path", PATHS)
def test_grouped_query_third_derivative_matches_torch(path, torch):
    """Third order through the double backward's differentiable_backward, with grouped heads."""
    rng = np.random.default_rng(32)
    arrays = [rng.standard_normal((1, 4, 5, 3))] + [rng.standard_normal((1, 2, 5, 3)) for _ in range(2)]
    g = rng.standard_normal(arrays[0].shape)
    u, w = ([rng.standard_normal(a.shape) for a in arrays] for _ in range(2))

    def third(library, sdpa):
        if library is None:
            xs, grad, wrap = [leaf(a) for a in arrays], autograd.grad, Tensor
        else:
            xs, grad, wrap = [torch.tensor(a, requires_grad=True) for a in arrays], torch.autograd.grad, torch.tensor
        first = grad(sdpa(*xs), xs, wrap(g), create_graph=True)
        second = grad(first, xs, [wrap(a) for a in u], create_graph=True)
        return [t.numpy() for t in grad(second, xs, [wrap(a) for a in w])]

    ours = third(None, lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True,
                                                                       **PATHS[path]))
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        theirs = third(torch, lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True))
    comparison = compare(ours, theirs, ["d/dq", "d/dk", "d/dv"], TOLERANCE["torch", "float64"])
    assert comparison.passed, comparison


def test_grouped_query_views_make_no_copy_of_key_and_value():
    """The grouped heads are views: query (B, H, T, hd) as (B, H_kv, G, T, hd), key and value as
    (B, H_kv, 1, T, hd); torch's head order (query head h reads kv head h // G)."""
    from npformer.functional.attention import _GroupedHeads
    rng = np.random.default_rng(33)
    q, k, v = rng.standard_normal((2, 6, 4, 3)), rng.standard_normal((2, 3, 5, 3)), rng.standard_normal((2, 3, 5, 3))
    grouped = _GroupedHeads.of(q, k, v, None, "test")
    gq, gk, gv, _ = grouped.inputs(q, k, v, None)
    assert gq.shape == (2, 3, 2, 4, 3) and gk.shape == gv.shape == (2, 3, 1, 5, 3)
    assert all(np.shares_memory(a, b) for a, b in ((gq, q), (gk, k), (gv, v)))
    out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True).numpy()
    for h in range(6):
        one_head = F.scaled_dot_product_attention(q[:, h], k[:, h // 2], v[:, h // 2]).numpy()
        np.testing.assert_allclose(out[:, h], one_head, rtol=1e-14, atol=1e-14)
    assert _GroupedHeads.of(q, k[:, :1], v[:, :1], None, "test").kv_heads == 1     # multi-query
    assert _GroupedHeads.of(q, q, q, None, "test") is None                          # nothing to group
    # the naive path folds each group's queries into the query axis: a view of a contiguous query
    assert np.shares_memory(grouped.folded(q, 4), q) and grouped.folded(q, 4).shape == (2, 3, 8, 3)


@pytest.mark.parametrize("tq, tk, window, block", [(64, 64, 16, 8), (40, 64, 9, 8), (64, 40, 5, 8), (33, 33, 1, 4),
                                                   (20, 20, 50, 8)])
def test_sliding_window_visits_only_the_key_blocks_that_meet_the_window(tq, tk, window, block, monkeypatch):
    """Each query block visits exactly the key blocks holding a key that one of its queries sees
    (i - W < j <= i), in forward, backward, the double backward and J u; the result equals the
    naive path with the window's bool mask (fully hidden rows too, where Tq > Tk)."""
    from npformer.functional.attention import blockwise
    visits = []
    starts = blockwise.key_starts

    def counted(q_start, q_stop, *args):
        blocks = starts(q_start, q_stop, *args)
        visits.append((q_start, tuple(blocks)))
        return blocks

    monkeypatch.setattr(blockwise, "key_starts", counted)
    i, j = np.arange(tq)[:, None], np.arange(tk)[None, :]
    allowed = (j <= i) & (j > i - window)
    expected = {qs: tuple(ks for ks in range(0, tk, block) if allowed[qs:qs + block, ks:ks + block].any())
                for qs in range(0, tq, block)}
    rng = np.random.default_rng(34)
    arrays = qkv(rng, tq, tk, 4, (1, 2))
    dout, g = rng.standard_normal((1, 2, tq, 4)), [rng.standard_normal(a.shape) for a in arrays]
    results = []
    for kwargs in ({"is_causal": True, "sliding_window": window, "memory_efficient": True, "block_size": block},
                   {"attn_mask": allowed}):
        visits.clear()
        xs = [leaf(a) for a in arrays]
        out = F.scaled_dot_product_attention(*xs, **kwargs)
        first = autograd.grad(out, xs, Tensor(dout), create_graph=True)
        second = autograd.grad(first, xs, [Tensor(a) for a in g])
        with fwAD.dual_level():
            tangent = fwAD.unpack_dual(F.scaled_dot_product_attention(
                *(fwAD.make_dual(Tensor(a), t) for a, t in zip(arrays, g)), **kwargs)).tangent
        results.append([out.numpy(), *(a.numpy() for a in first + second), tangent])
        if "sliding_window" in kwargs:
            # forward, backward (create_graph: MemoryEfficientAttentionBackward's forward), the double
            # backward's two passes, then forward mode's forward and J u: each walks every query block once
            assert len(visits) == 6 * len(expected), len(visits)
            for q_start, blocks in visits:
                assert blocks == expected[q_start], (q_start, blocks, expected[q_start])
    for ours, ref in zip(*results):
        assert_close(ours, ref, scaled(1e-13, ref), rtol=1e-12)


def test_sliding_window_work_grows_with_the_window_not_the_length():
    """Key blocks visited per forward: W / bk + 1 per query block once the window is full (the
    first W / bk query blocks see fewer), so doubling T doubles them (causal without the window:
    about four times)."""
    from npformer.functional.attention.blockwise import key_starts

    def visited(t, window, block=64):
        return sum(len(key_starts(qs, min(qs + block, t), t, block, True, window)) for qs in range(0, t, block))

    for t in (4096, 8192):   # 9 blocks for each query block from 512 on, 1 + 2 + ... + 8 before
        assert visited(t, 512) == 9 * (t // 64 - 8) + 36
    assert visited(8192, None) > 3.9 * visited(4096, None)


def test_the_window_of_attention_backend_and_the_flash_kernels():
    """attention_backend takes enable_gqa and sliding_window; the flash kernels refuse a window."""
    from npformer.functional.attention import flash_unsupported
    rng = np.random.default_rng(35)
    q, k = rng.standard_normal((1, 4, 8, 32)), rng.standard_normal((1, 2, 8, 32))
    assert F.attention_backend(q, k, k, is_causal=True, enable_gqa=True, sliding_window=4)[0] == "naive"
    path, reason = F.attention_backend(q, k, k, is_causal=True, enable_gqa=True, sliding_window=4,
                                       backend="memory_efficient")
    assert path == "memory_efficient" and "sliding_window=4" in reason
    assert "sliding_window=4" in flash_unsupported(q, q, q, None, False, 4)
    assert flash_unsupported(q, q, q, None, False, None) != flash_unsupported(q, q, q, None, False, 4)


@pytest.mark.parametrize("kwargs, error, words", [
    ({"sliding_window": 2}, ValueError, ["sliding_window=2", "is_causal=True"]),
    ({"sliding_window": 0, "is_causal": True}, ValueError, ["sliding_window", ">= 1", "0"]),
    ({"sliding_window": 2.5, "is_causal": True}, TypeError, ["sliding_window", "2.5"]),
    ({"sliding_window": True, "is_causal": True}, TypeError, ["sliding_window", "bool"]),
    ({"enable_gqa": "yes"}, TypeError, ["enable_gqa"]),
    ({"key": np.zeros((B, 3, TK, HD)), "value": np.zeros((B, 3, TK, HD)), "enable_gqa": True}, ValueError,
     ["enable_gqa=True", "dividing", "H = 4", "(2, 3, 6, 3)"]),
    ({"value": np.zeros((B, 1, TK, HD)), "enable_gqa": True}, ValueError, ["enable_gqa=True", "same number of heads"]),
    ({"query": np.zeros((TQ, HD)), "key": np.zeros((TK, HD)), "value": np.zeros((TK, HD)), "enable_gqa": True},
     ValueError, ["enable_gqa=True", "head axis", "(5, 3)"]),
    ({"attn_mask": np.ones((B, 2, TQ, TK), dtype=bool), "enable_gqa": True}, ValueError,
     ["attn_mask", "(2, 4, 5, 6)", "(2, 2, 5, 6)"]),
    ({}, ValueError, ["broadcast", "(2, 4, 5, 3)", "(2, 2, 6, 3)", "enable_gqa=True"]),
])
def test_grouped_query_and_window_arguments_raise_clear_errors(kwargs, error, words):
    """Without enable_gqa, mismatched head counts are the broadcast error they were (with a hint)."""
    args = {"query": np.zeros((B, 4, TQ, HD)), "key": np.zeros((B, 2, TK, HD)), "value": np.zeros((B, 2, TK, HD))}
    if "enable_gqa" not in kwargs and "sliding_window" in kwargs:
        args["key"] = args["value"] = np.zeros((B, 4, TK, HD))
    args.update(kwargs)
    for op in (F.scaled_dot_product_attention, F.attention_backend):
        assert_clear_error(lambda: op(**args), error, words)
