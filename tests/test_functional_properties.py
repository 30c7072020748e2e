"""Property-based tests (hypothesis): random shapes, heads, masks (with fully masked rows) and
dtypes. For each example: no NaN, torch agrees forward and backward, and (float64) gradcheck holds.
Example counts are bounded so the file runs in well under a minute (set
NPFORMER_HYPOTHESIS_EXAMPLES to search longer)."""
import os

import numpy as np
from hypothesis import given, settings, strategies as st

import autograd
import npformer.functional as F

from test_functional import compare_with_torch, leaf

SETTINGS = settings(max_examples=int(os.environ.get("NPFORMER_HYPOTHESIS_EXAMPLES", 20)), deadline=None)
DTYPES = st.sampled_from([np.float64, np.float32])


def tolerance(dtype):
    return {"atol": 1e-10, "rtol": 1e-10} if dtype == np.float64 else {"atol": 1e-5, "rtol": 1e-4}


def assert_finite(*tensors):
    for t in tensors:
        assert np.all(np.isfinite(autograd.backend.as_numpy(t.data if hasattr(t, "data") else t)))


@SETTINGS
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
    assert_finite(out, *(t.grad for t in ins))
    if dtype == np.float64:
        assert autograd.gradcheck(fn, [leaf(a) for a in arrays])


@SETTINGS
@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=3), trailing=st.integers(1, 2),
       affine=st.sampled_from(["none", "weight", "both"]), offset=st.sampled_from([0.0, 10.0, -1e3]),
       spread=st.sampled_from([1e-2, 1.0, 30.0]), dtype=DTYPES, seed=st.integers(0, 2**31))
def test_layer_norm_properties(shape, trailing, affine, offset, spread, dtype, seed, torch):
    rng = np.random.default_rng(seed)
    trailing = min(trailing, len(shape))
    norm_shape = tuple(shape[-trailing:])
    x = offset + spread * rng.standard_normal(shape)
    params = [1 + rng.standard_normal(norm_shape), rng.standard_normal(norm_shape)][:{"none": 0, "weight": 1, "both": 2}[affine]]
    fn = lambda a, *p: F.layer_norm(a, norm_shape, *p)   # noqa: E731
    # |mean| >> std: the rounding of x itself is amplified by rstd (up to 1e5 here), and torch's
    # float32 kernel loses more than ours: float32 is compared with torch in float64
    tol = tolerance(dtype) if dtype == np.float64 else {"atol": 1e-4, "rtol": 1e-3}
    if offset and spread < 1:
        tol = {"atol": 1e-7, "rtol": 1e-8} if dtype == np.float64 else {"atol": 2e-2, "rtol": 1e-2}
    compare_with_torch(torch, fn, lambda a, *p: torch.nn.functional.layer_norm(a, norm_shape, *p),
                       [x] + params, rng, dtype=dtype, torch_dtype=np.float64, **tol)
    if dtype == np.float64 and spread >= 1:
        assert autograd.gradcheck(fn, [leaf(a) for a in [x] + params])


@SETTINGS
@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=3), dim_index=st.integers(0, 2),
       log=st.booleans(), minus_inf=st.booleans(), dtype=DTYPES, seed=st.integers(0, 2**31))
def test_softmax_and_log_softmax_properties(shape, dim_index, log, minus_inf, dtype, seed, torch):
    rng = np.random.default_rng(seed)
    dim = dim_index % len(shape)
    x = 5 * rng.standard_normal(shape)
    if minus_inf:  # -inf entries, but never a whole row (torch gives NaN there; ours 0 is tested elsewhere)
        blocked = rng.random(shape) < 0.3
        np.put_along_axis(blocked, rng.integers(shape[dim], size=(1,) * len(shape)), False, axis=dim)
        x = np.where(blocked, -np.inf, x)
    op = "log_softmax" if log else "softmax"
    fn = lambda a: getattr(F, op)(a, dim=dim)   # noqa: E731
    compare_with_torch(torch, fn, lambda a: getattr(torch, op)(a, dim=dim), [x], rng, dtype=dtype, **tolerance(dtype))
    if dtype == np.float64 and not (log and minus_inf):  # finite differences of -inf outputs are NaN
        assert autograd.gradcheck(fn, [leaf(x)])


@SETTINGS
@given(n=st.integers(1, 4), c=st.integers(2, 5), spatial=st.lists(st.integers(1, 3), max_size=2),
       reduction=st.sampled_from(["mean", "sum", "none"]), smoothing=st.sampled_from([0.0, 0.1, 0.3]),
       weighted=st.booleans(), scale=st.sampled_from([1.0, 30.0]), dtype=DTYPES, seed=st.integers(0, 2**31))
def test_cross_entropy_properties(n, c, spatial, reduction, smoothing, weighted, scale, dtype, seed, torch):
    rng = np.random.default_rng(seed)
    logits = scale * rng.standard_normal((n, c, *spatial))
    target = rng.integers(0, c, (n, *spatial))
    target[rng.random(target.shape) < 0.3] = -100
    target.reshape(-1)[0] = rng.integers(0, c)                    # at least one valid target
    kwargs = {"reduction": reduction, "label_smoothing": smoothing}
    if weighted:
        kwargs["weight"] = (rng.random(c) + 0.1).astype(dtype)
    t_kwargs = {k: torch.tensor(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
    fn = lambda a: F.cross_entropy(a, target, **kwargs)   # noqa: E731
    compare_with_torch(torch, fn, lambda a: torch.nn.functional.cross_entropy(a, torch.tensor(target), **t_kwargs),
                       [logits], rng, dtype=dtype, **tolerance(dtype))
    if dtype == np.float64:
        assert autograd.gradcheck(fn, [leaf(logits)])


@SETTINGS
@given(vocab=st.integers(1, 8), dim=st.integers(1, 4), ids_shape=st.lists(st.integers(0, 4), min_size=1, max_size=3),
       padding=st.booleans(), dtype=DTYPES, seed=st.integers(0, 2**31))
def test_embedding_properties(vocab, dim, ids_shape, padding, dtype, seed, torch):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, ids_shape)                        # repeats are likely; may be empty
    weight = rng.standard_normal((vocab, dim))
    padding_idx = int(rng.integers(vocab)) if padding else None
    fn = lambda w: F.embedding(ids, w, padding_idx=padding_idx)   # noqa: E731
    compare_with_torch(torch, fn, lambda w: torch.nn.functional.embedding(torch.tensor(ids), w, padding_idx=padding_idx),
                       [weight], rng, dtype=dtype, **tolerance(dtype))
    if dtype == np.float64 and not padding and ids.size:
        assert autograd.gradcheck(lambda w: F.embedding(ids, w), [leaf(weight)])
