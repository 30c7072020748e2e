"""scaled_dot_product_attention, naive and memory-efficient: masks (causal, padding, both,
float additive, fully masked rows), torch parity, gradcheck, returned weights, dropout, errors."""
import numpy as np
import pytest

import autograd
import npformer.functional as F
from autograd import Tensor
from npformer.functional import composite

from test_functional import compare_runs, compare_with_torch, leaf

B, H, TQ, TK, HD = 2, 2, 5, 6, 3


def masks(rng, tq=TQ, tk=TK):
    """name -> (our kwargs, torch kwargs) for every mask kind; torch's bool True = takes part."""
    pad = np.ones((B, 1, 1, tk), dtype=bool)
    pad[1, ..., tk - 2:] = False                                   # batch 1: last two keys are padding
    tril = np.tril(np.ones((tq, tk), dtype=bool))
    fully = np.ones((tq, tk), dtype=bool)
    fully[1] = False                                               # query row 1 sees no key
    additive = rng.standard_normal((B, H, tq, tk))
    additive[0, 1, tq - 1, :3] = -np.inf
    additive[1, 0, tq - 2] = -np.inf                               # a fully masked row in a float mask
    square = np.triu(np.full((tq, tk), -np.inf), 1)                # generate_square_subsequent_mask style
    return {
        "none": ({}, {}),
        "causal": ({"is_causal": True}, {"is_causal": True}),
        "padding": ({"attn_mask": pad}, {"attn_mask": pad}),
        "causal_and_padding": ({"attn_mask": pad & tril}, {"attn_mask": pad & tril}),
        "is_causal_with_padding": ({"attn_mask": pad, "is_causal": True}, {"attn_mask": pad & tril}),
        "fully_masked_row": ({"attn_mask": fully}, {"attn_mask": fully}),
        "float_additive": ({"attn_mask": additive}, {"attn_mask": additive}),
        "float_causal": ({"attn_mask": square}, {"attn_mask": square}),
        "scale": ({"scale": 0.3, "is_causal": True}, {"scale": 0.3, "is_causal": True}),
    }


MASKS = list(masks(np.random.default_rng(0)))
PATHS = {"naive": {}, "memory_efficient": {"memory_efficient": True, "block_size": 2}}


def qkv(rng, tq=TQ, tk=TK, hd=HD, lead=(B, H)):
    return [rng.standard_normal(lead + (t, hd)) for t in (tq, tk, tk)]


def torch_kwargs(torch, kwargs):
    return {k: torch.tensor(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("mask", MASKS)
def test_matches_torch_float64(mask, path, torch):
    rng = np.random.default_rng(1)
    ours, theirs = masks(rng)[mask]
    t_kwargs = torch_kwargs(torch, theirs)
    compare_with_torch(
        torch, lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **ours, **PATHS[path]),
        lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, **t_kwargs),
        qkv(rng), rng)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("mask", ["causal", "is_causal_with_padding", "float_additive"])
def test_matches_torch_float32(mask, path, torch):
    rng = np.random.default_rng(1)
    ours, theirs = masks(rng)[mask]
    ours, theirs = ({k: v.astype(np.float32) if isinstance(v, np.ndarray) and v.dtype == np.float64 else v
                     for k, v in kwargs.items()} for kwargs in (ours, theirs))
    t_kwargs = torch_kwargs(torch, theirs)
    compare_with_torch(
        torch, lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **ours, **PATHS[path]),
        lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, **t_kwargs),
        qkv(rng), rng, atol=1e-5, rtol=1e-5, dtype=np.float32)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("mask", ["causal_and_padding", "fully_masked_row", "float_additive"])
def test_gradcheck_with_masks(mask, path, device):
    rng = np.random.default_rng(2)
    ours, _ = masks(rng, 3, 4)[mask]
    ins = [leaf(a, device) for a in qkv(rng, 3, 4, 2)]
    assert autograd.gradcheck(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **ours, **PATHS[path]), ins)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("mask", MASKS)
def test_matches_composite_twin(mask, path, device):
    rng = np.random.default_rng(3)
    ours, _ = masks(rng)[mask]
    compare_runs(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **ours, **PATHS[path]),
                 lambda q, k, v: composite.scaled_dot_product_attention(q, k, v, **ours), qkv(rng), rng, device)


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
    """Block sizes that do not divide T, Tq != Tk, a padding mask: within 1e-5 in float32."""
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
    for ours, ref in zip(*results):
        assert ours.dtype == np.float32
        np.testing.assert_allclose(ours, ref, atol=1e-5, rtol=1e-5)


def test_large_scores_stay_finite_and_match_torch(torch):
    """|q|, |k| ~ 1e3: scores ~ 1e6; the subtracted row max keeps exp finite."""
    rng = np.random.default_rng(6)
    arrays = [a * 1e3 for a in qkv(rng)[:2]] + [qkv(rng)[2]]
    for path in PATHS.values():
        compare_with_torch(torch, lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, **path),
                           lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
                           arrays, np.random.default_rng(7), atol=1e-7, rtol=1e-7)


def test_returned_weights_are_probabilities_and_take_gradient(torch):
    """return_weights=True: (out, P); a loss on both outputs matches torch's explicit softmax."""
    rng = np.random.default_rng(8)
    arrays = qkv(rng)
    keep = masks(rng)["is_causal_with_padding"][1]["attn_mask"]
    ins = [leaf(a) for a in arrays]
    out, weights = F.scaled_dot_product_attention(*ins, attn_mask=keep, return_weights=True)
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in arrays)
    scores = (tq @ tk.transpose(-1, -2)) / np.sqrt(HD)
    t_weights = torch.softmax(scores.masked_fill(~torch.tensor(keep), float("-inf")), dim=-1)
    t_out = t_weights @ tv
    np.testing.assert_allclose(weights.numpy(), t_weights.detach().numpy(), atol=1e-12)
    np.testing.assert_allclose(out.numpy(), t_out.detach().numpy(), atol=1e-12)
    g_out, g_w = rng.standard_normal(out.shape), rng.standard_normal(weights.shape)
    loss = (out * Tensor(g_out)).sum() + (weights * Tensor(g_w)).sum()
    loss.backward()
    ((t_out * torch.tensor(g_out)).sum() + (t_weights * torch.tensor(g_w)).sum()).backward()
    for ours, ref in zip(ins, (tq, tk, tv)):
        np.testing.assert_allclose(ours.grad, ref.grad.numpy(), atol=1e-10)
    assert autograd.gradcheck(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, return_weights=True),
                              [leaf(a) for a in qkv(rng, 3, 4, 2)])


def test_dropout_matches_twin_and_gradcheck(device):
    rng = np.random.default_rng(9)
    arrays = qkv(rng, 4, 4, 2)

    def run(ops, ins):
        gen = autograd.random.Philox(11)
        return ops.scaled_dot_product_attention(*ins, dropout_p=0.3, is_causal=True, generator=gen,
                                                return_weights=True)

    _, weights = compare_runs(lambda *ins: run(F, ins), lambda *ins: run(composite, ins), arrays, rng, device)
    assert (weights.numpy() == 0).any()
    assert autograd.gradcheck(lambda q, k, v: run(F, (q, k, v)), [leaf(a, device) for a in arrays])


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
                                                              generator=autograd.random.Philox(21, offset=16))
    compare_runs(run({"memory_efficient": True, "block_size": block}), run({}), arrays, rng, device)
    assert autograd.gradcheck(run({"memory_efficient": True, "block_size": block}),
                              [leaf(a, device) for a in qkv(rng, 4, 4, 2)])


def test_dropout_rate_and_extremes():
    rng = np.random.default_rng(10)
    q, k, v = (Tensor(a) for a in qkv(rng, 64, 64, 4, (1, 1)))
    gen = autograd.random.Philox(0)
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
