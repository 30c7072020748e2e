"""Flash attention (npformer/functional/cuda/flash_attention.cu) and the choice of attention path.

- Everywhere (with a C++ compiler): the CUDA kernels, run by the emulator of tests/cuda_emulator.py
  through their launchers on host arrays, equal the memory-efficient path's reference for every
  head dim, dtype, mask kind, causal, dropout and Tq != Tk; and standing in for the "cpu"
  implementation of the path's kernel tables, F.scaled_dot_product_attention through them passes
  float64 gradchecks (forward mode too: the blockwise jvp rule after the kernels' forward) and
  equals the naive path (same dropout generator) and torch.
- On a GPU: the same kernels through CuPy (skipped without one).
- Everywhere: backend= / attention_backend (which path runs, and why flash does not apply), and
  the gradient of a float attn_mask that requires grad (naive and memory-efficient, vs torch).
"""
import numpy as np
import pytest

import autograd
import npformer
import npformer.functional as F
from autograd import Tensor, backend
from npformer import nn
from npformer.functional import composite
from npformer.functional.attention import attention_blockwise_backward, attention_blockwise_forward
from npformer.functional.attention import cuda as flash_attention
from npformer.runtime import random

from cuda_emulator import build_or_skip
from helpers import compare_runs, leaf
from tolerances import scaled

@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return build_or_skip(tmp_path_factory.mktemp("cuda_emulator"))


@pytest.fixture
def kernels(emulator, monkeypatch):
    """The launchers of npformer/functional/attention/cuda.py with their kernels run by the emulator."""
    monkeypatch.setattr(flash_attention, "function", emulator.function)
    emulator.launches.clear()
    return emulator


@pytest.fixture
def flash_on_cpu(kernels, monkeypatch):
    """The emulated flash kernels as the "cpu" implementation of the memory-efficient path's
    tables (as they are on "cuda"), declining a mask that needs a gradient and a sliding window
    like the real ones."""
    monkeypatch.setitem(attention_blockwise_forward.implementations, "cpu",
                        (flash_attention.attention_flash_forward, lambda *args, window=None: not args[-1]
                         and window is None))
    monkeypatch.setitem(attention_blockwise_backward.implementations, "cpu",
                        (flash_attention.attention_flash_backward, lambda *args, window=None: not args[-1]
                         and window is None))
    return kernels


def qkv(rng, b, h, tq, tk, d, dtype="float64"):
    return [rng.standard_normal((b, h, t, d)).astype(dtype) for t in (tq, tk, tk)]


def mask_kinds(rng, b, h, tq, tk):
    """name -> (blocked (True = hidden) or None, additive or None), each with a fully hidden row,
    in the shapes the kernel tables receive them (at least 2-D, broadcastable to (B, H, Tq, Tk))."""
    padding = rng.random((b, 1, 1, tk)) < 0.3
    padding[-1] = True                                             # the last batch sees no key
    full = rng.random((tq, tk)) < 0.3
    full[2] = True
    additive = rng.standard_normal((b, h, tq, tk))
    additive[0, -1, 1] = -np.inf                                   # a row of -inf
    additive[rng.random(additive.shape) < 0.2] = -np.inf
    per_key = np.where(rng.random((1, tk)) < 0.3, -np.inf, rng.standard_normal((1, tk)))
    return {
        "none": (None, None),
        "key_padding": (padding, None),
        "bool_full": (full, None),
        "float_full": (None, additive),
        "float_per_key": (None, per_key),
    }


def assert_close(ours, ref, dtype, terms, what):
    """Equal up to the rounding of sums of `terms` products: eps(dtype) * 32 sqrt(terms) relative to
    the largest reference value (at least 1)."""
    ours, ref = np.asarray(ours), np.asarray(ref)
    tol = np.finfo(dtype).eps * 32 * np.sqrt(terms) * max(1.0, float(np.abs(ref[np.isfinite(ref)]).max(initial=0)))
    assert np.array_equal(np.isfinite(ours), np.isfinite(ref)), what
    np.testing.assert_allclose(np.where(np.isfinite(ref), ours, 0), np.where(np.isfinite(ref), ref, 0),
                               rtol=0, atol=tol, err_msg=what)


def run_kernels_and_reference(q, k, v, blocked, additive, causal, dropout, rng):
    d = q.shape[-1]
    forward = (np, q, k, v, blocked, additive, causal, d ** -0.5, 16, dropout, False)
    out, lse = flash_attention.attention_flash_forward(*forward)
    ref_out, ref_lse = attention_blockwise_forward.reference(*forward)
    dout = rng.standard_normal(ref_out.shape).astype(q.dtype)
    backward = (np, q, k, v, ref_out, ref_lse, dout, blocked, additive, causal, d ** -0.5, 16, dropout, False)
    grads = flash_attention.attention_flash_backward(*backward)
    ref_grads = attention_blockwise_backward.reference(*backward)
    terms = max(q.shape[-2], k.shape[-2]) * d
    for name, ours, ref in [("out", out, ref_out), ("lse", lse, ref_lse),
                            *zip(("dq", "dk", "dv"), grads[:3], ref_grads[:3])]:
        assert ours.dtype == q.dtype and ours.shape == ref.shape, name
        assert_close(ours, ref, q.dtype, terms, name)
    assert grads[3] is None
    return out, lse, grads


# -- the kernels against the reference, on the emulator ----------------------------------------------
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask", ["none", "key_padding", "bool_full", "float_full", "float_per_key"])
def test_kernels_equal_the_reference_for_every_mask(kernels, mask, causal):
    """float64, head dim 64, Tq != Tk not multiples of the tiles, dropout on; fully hidden rows
    give O = 0, L = -inf and zero gradients."""
    rng = np.random.default_rng(1)
    b, h, tq, tk = 2, 2, 37, 45
    blocked, additive = mask_kinds(rng, b, h, tq, tk)[mask]
    q, k, v = qkv(rng, b, h, tq, tk, 64)
    out, lse, (dq, _, _, _) = run_kernels_and_reference(q, k, v, blocked, additive, causal, (0.25, 99, 24, None), rng)
    hidden = np.isneginf(lse)
    assert not out[hidden].any() and not dq[hidden].any()
    if mask in ("key_padding", "float_full", "bool_full"):
        assert hidden.any()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_kernels_equal_the_reference_for_every_head_dim_and_dtype(kernels, head_dim, dtype):
    rng = np.random.default_rng(2)
    b, h, tq, tk = 1, 2, 70, 33
    q, k, v = qkv(rng, b, h, tq, tk, head_dim, dtype)
    blocked, _ = mask_kinds(rng, b, h, tq, tk)["key_padding"]
    run_kernels_and_reference(q, k, v, blocked, None, True, (0.1, 5, 0, None), rng)
    run_kernels_and_reference(q, k, v, None, None, False, None, rng)
    threads = {name: t for name, _, t in kernels.launches}
    rows = flash_attention.ROWS[dtype]
    assert threads[f"flash_attention_forward_{'float' if dtype == 'float32' else 'double'}_{head_dim}"] == \
        rows * head_dim // flash_attention.DIMS[dtype]


def test_kernels_broadcast_leading_axes_and_drop_everything_at_p_1(kernels):
    """k, v shared by the heads (1, H, Tk, D) and a 2-D query; p = 1 keeps nothing."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 3, 9, 32))
    k, v = rng.standard_normal((1, 3, 20, 32)), rng.standard_normal((1, 3, 20, 32))
    run_kernels_and_reference(q, k, v, None, None, False, (0.3, 1, 8, None), rng)
    out, _, grads = run_kernels_and_reference(q, k, v, None, None, True, (1.0, 1, 8, None), rng)
    assert not out.any() and not grads[2].any()
    run_kernels_and_reference(rng.standard_normal((5, 32)), rng.standard_normal((7, 32)),
                              rng.standard_normal((7, 32)), None, None, True, None, rng)


def test_kernels_give_a_nan_row_the_nan_logsumexp_of_the_reference(kernels):
    """A NaN score (here a NaN query) makes l NaN: O and L are NaN as in the reference (L was -inf,
    the mark of a fully hidden row), and a fully hidden row keeps O = 0, L = -inf."""
    rng = np.random.default_rng(7)
    for dtype in ("float32", "float64"):
        q, k, v = qkv(rng, 1, 1, 5, 6, 32, dtype)
        q[0, 0, 1, 3] = np.nan
        blocked = np.zeros((5, 6), bool)
        blocked[2] = True
        forward = (np, q, k, v, blocked, None, False, 0.25, 16, None, False)
        (out, lse), (ref_out, ref_lse) = (flash_attention.attention_flash_forward(*forward),
                                          attention_blockwise_forward.reference(*forward))
        np.testing.assert_array_equal(np.isnan(lse), np.isnan(ref_lse))
        np.testing.assert_array_equal(np.isnan(out), np.isnan(ref_out))
        assert np.isnan(lse[0, 0, 1]) and np.isneginf(lse[0, 0, 2]) and not out[0, 0, 2].any()


def test_kernels_decline_a_bool_and_a_float_mask_together(monkeypatch):
    """The kernels read one mask (Mask::kind): given both, the additive one was dropped without a
    word; such a call of the tables goes to the reference."""
    monkeypatch.setattr(flash_attention, "flash_unsupported", lambda *args: None)   # as on "cuda"
    rng = np.random.default_rng(8)
    q, k, v = qkv(rng, 1, 1, 5, 6, 32)
    blocked, additive = rng.random((5, 6)) < 0.3, rng.standard_normal((5, 6))
    out, lse = q[..., :1] * 0, q[..., 0] * 0
    for masks, expected in (((blocked, None), True), ((None, additive), True), ((blocked, additive), False)):
        assert flash_attention._forward_supported(np, q, k, v, *masks, False, 0.2, 16, None, False) is expected
        assert flash_attention._backward_supported(np, q, k, v, out, lse, q, *masks, False, 0.2, 16, None, False) \
            is expected


def test_a_missing_barrier_would_be_caught(kernels):
    """The emulator runs the threads of a block in a new random order between barriers: every
    order gives the same (right) result, which a kernel that reads shared memory before a
    barrier would not (see tests/cuda_emulator.h)."""
    rng = np.random.default_rng(4)
    q, k, v = qkv(rng, 1, 1, 40, 40, 64)
    results = []
    for seed in (0, 1, 2):
        kernels.seed = seed
        results.append(flash_attention.attention_flash_forward(np, q, k, v, None, None, True, 0.125, 16, None, False)[0])
    assert all(np.array_equal(r, results[0]) for r in results[1:])


def test_the_emulator_checks_argument_types(kernels):
    """An argument whose type is not the kernel parameter's is refused (CuPy would pass it): an
    int32 where the kernel takes a long long, a Python int (a long long) for an unsigned int."""
    launch = kernels.function("dropout", "dropout_apply", np.dtype("float32"))
    x = np.ones(10, dtype=np.float32)
    with pytest.raises(TypeError, match=r"argument 2 is a int32.*type code 'l'"):
        launch((1,), (32,), (x, x.copy(), np.int32(10), 0, np.uint64(0), np.uint64(0), np.uint32(0), np.float32(1)))
    with pytest.raises(TypeError, match=r"argument 6 is a int \(type code 'l'\) for a parameter of type code 'I'"):
        launch((1,), (32,), (x, x.copy(), 10, 0, np.uint64(0), np.uint64(0), 5, np.float32(1)))


# -- F.scaled_dot_product_attention through the emulated kernels ------------------------------------
def sdpa_masks(rng, tq, tk):
    """name -> kwargs of F.scaled_dot_product_attention, each mask with a fully hidden row."""
    keep = rng.random((tq, tk)) > 0.3
    keep[1] = False
    padding = np.ones((2, 1, 1, tk), dtype=bool)
    padding[1, ..., -2:] = False
    additive = rng.standard_normal((1, 1, tq, tk))
    additive[0, 0, 0] = -np.inf
    return {"causal": {"is_causal": True}, "bool": {"attn_mask": keep},
            "padding_and_causal": {"attn_mask": padding, "is_causal": True}, "float": {"attn_mask": additive}}


@pytest.mark.parametrize("mask", ["causal", "bool", "padding_and_causal", "float"])
def test_sdpa_through_the_kernels_passes_gradcheck(flash_on_cpu, mask):
    rng = np.random.default_rng(5)
    kwargs = sdpa_masks(rng, 3, 4)[mask]
    ins = [leaf(a) for a in qkv(rng, 2, 1, 3, 4, 32)]
    assert autograd.gradcheck(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, backend="flash", **kwargs), ins)
    assert {name.split("_float")[0].split("_double")[0] for name, _, _ in flash_on_cpu.launches} == \
        {"flash_attention_forward", "flash_attention_backward_dq", "flash_attention_backward_dkdv"}


def test_sdpa_dropout_through_the_kernels_passes_gradcheck(flash_on_cpu):
    rng = np.random.default_rng(6)
    ins = [leaf(a) for a in qkv(rng, 1, 2, 3, 4, 32)]
    assert autograd.gradcheck(lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, dropout_p=0.4, is_causal=True, backend="flash", generator=random.Philox(3)), ins)


@pytest.mark.parametrize("mask", ["causal", "float"])
def test_a_second_derivative_through_the_kernels_passes_gradgradcheck(flash_on_cpu, mask):
    """With create_graph the first backward still runs the kernels, and its own backward is the
    blockwise double backward (on the arrays' device): a second derivative through the flash path."""
    rng = np.random.default_rng(15)
    kwargs = sdpa_masks(rng, 2, 3)[mask]
    ins = [leaf(a) for a in qkv(rng, 1, 1, 2, 3, 32)]
    assert autograd.gradgradcheck(lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, dropout_p=0.3, backend="flash", generator=random.Philox(4), **kwargs), ins)
    assert "flash_attention_backward_dq" in {name.split("_float")[0].split("_double")[0]
                                             for name, _, _ in flash_on_cpu.launches}


@pytest.mark.parametrize("mask", ["causal", "bool", "padding_and_causal", "float"])
def test_a_second_derivative_through_the_kernels_equals_the_naive_paths(flash_on_cpu, mask):
    """The Hessian-vector product through the flash kernels (dropout, every mask kind) equals the
    naive path's (the same generator) up to float64 rounding."""
    rng = np.random.default_rng(16)
    kwargs = sdpa_masks(rng, 9, 11)[mask]
    arrays = qkv(rng, 2, 2, 9, 11, 32)
    g, u = rng.standard_normal((2, 2, 9, 32)), [rng.standard_normal(a.shape) for a in arrays]

    def hvp(path):
        xs = [leaf(a) for a in arrays]
        out = F.scaled_dot_product_attention(*xs, dropout_p=0.2, backend=path, generator=random.Philox(8), **kwargs)
        first = autograd.grad(out, xs, Tensor(g), create_graph=True)
        return [s.numpy() for s in autograd.grad(first, xs, [Tensor(a) for a in u])]
    flash, naive = hvp("flash"), hvp("naive")
    assert flash_on_cpu.launches
    for ours, reference in zip(flash, naive):
        np.testing.assert_allclose(ours, reference, rtol=0, atol=1e-12 * max(1.0, np.abs(reference).max()))


@pytest.mark.parametrize("mask", ["causal", "bool", "padding_and_causal", "float"])
def test_forward_mode_through_the_kernels_runs_the_blockwise_jvp_on_their_output(flash_on_cpu, mask):
    """The kernels have no forward mode: J u comes from attention_blockwise_jvp on their O and L,
    with their dropout mask (finite differences run the kernels' forward)."""
    rng = np.random.default_rng(10)
    kwargs = sdpa_masks(rng, 3, 4)[mask]
    ins = [leaf(a) for a in qkv(rng, 2, 1, 3, 4, 32)]
    assert autograd.gradcheck(lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, dropout_p=0.3, backend="flash", generator=random.Philox(4), **kwargs), ins, check_forward_ad=True)
    assert "flash_attention_forward" in {name.split("_float")[0].split("_double")[0] for name, _, _ in
                                         flash_on_cpu.launches}


@pytest.mark.parametrize("mask", ["causal", "bool", "padding_and_causal", "float"])
def test_sdpa_through_the_kernels_equals_the_naive_path_with_the_same_dropout(flash_on_cpu, mask):
    rng = np.random.default_rng(7)
    kwargs = sdpa_masks(rng, 19, 21)[mask]
    arrays = qkv(rng, 2, 2, 19, 21, 64)

    def run(path):
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.2, backend=path,
                                                              generator=random.Philox(8, offset=40), **kwargs)
    compare_runs(run("flash"), run("naive"), arrays, rng, atol=1e-12)


@pytest.mark.parametrize("mask", ["causal", "bool", "padding_and_causal", "float"])
def test_sdpa_through_the_kernels_matches_torch(flash_on_cpu, mask, torch):
    from helpers import compare_with_torch
    rng = np.random.default_rng(8)
    kwargs = sdpa_masks(rng, 11, 13)[mask]
    theirs = {k: torch.tensor(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
    compare_with_torch(torch, lambda q, k, v: F.scaled_dot_product_attention(q, k, v, backend="flash", **kwargs),
                       lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, **theirs),
                       qkv(rng, 2, 2, 11, 13, 32), rng)


def test_a_mask_that_needs_a_gradient_runs_the_reference_on_the_flash_path(flash_on_cpu, torch):
    rng = np.random.default_rng(9)
    arrays = qkv(rng, 1, 2, 5, 6, 32)
    mask = Tensor(rng.standard_normal((5, 6)), requires_grad=True)
    ins = [leaf(a) for a in arrays]
    out = F.scaled_dot_product_attention(*ins, attn_mask=mask, backend="memory_efficient")
    assert flash_on_cpu.launches == []
    assert F.attention_backend(*ins, attn_mask=mask, backend="memory_efficient")[0] == "memory_efficient"
    upstream = rng.standard_normal(out.shape)
    out.backward(upstream)
    t_ins = [torch.tensor(a, requires_grad=True) for a in arrays]
    t_mask = torch.tensor(mask.data, requires_grad=True)
    torch.nn.functional.scaled_dot_product_attention(*t_ins, attn_mask=t_mask).backward(torch.tensor(upstream))
    np.testing.assert_allclose(mask.grad, t_mask.grad.numpy(), atol=scaled(1e-12, *arrays, mask.data, upstream))


# -- the mask's gradient on every path ---------------------------------------------------------------
@pytest.mark.parametrize("path", [{"backend": "naive"}, {"backend": "memory_efficient", "block_size": 2}])
@pytest.mark.parametrize("shape", [(2, 2, 4, 5), (2, 1, 4, 5), (4, 5), (1, 5), (5,)])
def test_a_float_mask_that_requires_grad_gets_ds_like_torch(path, shape, torch):
    """torch differentiates a float attn_mask: d(mask) = dS, summed over its broadcast axes."""
    rng = np.random.default_rng(10)
    arrays = qkv(rng, 2, 2, 4, 5, 3)
    mask_data = rng.standard_normal(shape)
    mask_data.reshape(-1)[1] = -np.inf                   # a hidden entry: no gradient there
    ins, mask = [leaf(a) for a in arrays], leaf(mask_data)
    out = F.scaled_dot_product_attention(*ins, attn_mask=mask, is_causal=True, **path)
    upstream = rng.standard_normal(out.shape)
    out.backward(upstream)
    t_ins = [torch.tensor(a, requires_grad=True) for a in arrays]
    t_mask = torch.tensor(mask_data, requires_grad=True)
    causal = torch.ones(4, 5, dtype=torch.bool).tril()
    ref = torch.nn.functional.scaled_dot_product_attention(*t_ins, attn_mask=t_mask.masked_fill(~causal, -np.inf))
    ref.backward(torch.tensor(upstream))
    tolerance = scaled(1e-12, *arrays, mask_data, upstream)
    np.testing.assert_allclose(out.numpy(), ref.detach().numpy(), atol=tolerance)
    assert mask.grad.shape == shape
    np.testing.assert_allclose(mask.grad, t_mask.grad.numpy(), atol=tolerance)
    for ours, theirs in zip(ins, t_ins):
        np.testing.assert_allclose(ours.grad, theirs.grad.numpy(), atol=tolerance)


@pytest.mark.parametrize("path", [{"backend": "naive"}, {"backend": "memory_efficient", "block_size": 3}])
def test_mask_gradient_gradcheck_and_composite_twin(path, device):
    rng = np.random.default_rng(11)
    arrays = qkv(rng, 1, 2, 4, 5, 3) + [rng.standard_normal((1, 2, 4, 5))]

    def run(ops):
        return lambda q, k, v, m: ops.scaled_dot_product_attention(q, k, v, attn_mask=m, dropout_p=0.3,
                                                                   generator=random.Philox(4), **path)
    compare_runs(run(F), run(composite), arrays, rng, device)
    assert autograd.gradcheck(run(F), [leaf(a, device) for a in arrays])


def test_a_mask_that_requires_grad_needs_the_query_dtype():
    q = Tensor(np.zeros((2, 3, 4)))
    with pytest.raises(TypeError, match="dtype of the query"):
        F.scaled_dot_product_attention(q, q, q, attn_mask=Tensor(np.zeros((3, 3), np.float32), requires_grad=True))


# -- which path runs, and why --------------------------------------------------------------------------
def test_attention_backend_says_which_path_runs_and_why():
    q = Tensor(np.zeros((1, 2, 8, 64)))
    assert F.attention_backend(q, q, q) == ("naive", "the default where flash attention does not apply: the "
                                            "flash kernels run on CUDA arrays, these are on 'cpu'")
    path, reason = F.attention_backend(q, q, q, backend="memory_efficient")
    assert path == "memory_efficient" and "CUDA arrays" in reason
    assert F.attention_backend(q, q, q, memory_efficient=True)[0] == "memory_efficient"
    assert F.attention_backend(q, q, q, return_weights=True)[0] == "naive"
    odd = Tensor(np.zeros((1, 2, 8, 48)))
    assert "head dims 48 (query, key) and 48 (value)" in F.attention_backend(odd, odd, odd)[1]
    half = Tensor(np.zeros((1, 2, 8, 64), dtype=np.float16))
    assert "dtype ['float16']" in F.attention_backend(half, half, half)[1]
    grad_mask = Tensor(np.zeros((8, 8)), requires_grad=True)
    assert "requires a gradient" in F.attention_backend(q, q, q, attn_mask=grad_mask)[1]
    with autograd.no_grad():
        assert "requires a gradient" not in F.attention_backend(q, q, q, attn_mask=grad_mask)[1]


def test_the_flash_path_is_chosen_where_the_kernels_apply(flash_on_cpu):
    q = Tensor(np.zeros((1, 2, 8, 32)))
    assert F.attention_backend(q, q, q) == ("flash", "the default where flash attention applies")
    assert F.attention_backend(q, q, q, backend="memory_efficient")[0] == "flash"
    with npformer.runtime.kernels.reference_only():
        assert F.attention_backend(q, q, q) == (
            "naive",
            "the default where flash attention does not apply: npformer.runtime.kernels.reference_only() is active")


@pytest.mark.parametrize("kwargs, words", [
    ({"backend": "flash"}, ["backend='flash' cannot run this call", "CUDA arrays"]),
    ({"backend": "fast"}, ["backend must be None or one of", "'fast'"]),
    ({"backend": "naive", "memory_efficient": True}, ["contradicts"]),
    ({"backend": "flash", "return_weights": True}, ["return_weights", "'flash'"]),
    ({"backend": "memory_efficient", "block_size": 0}, ["block_size", "0"]),
    ({"dropout_p": 0.1, "generator": np.random.default_rng(0)}, ["generator must be an npformer.runtime.random.Philox",
                                                                 "Generator"]),
])
def test_bad_path_arguments_raise_clear_errors(kwargs, words):
    q = Tensor(np.zeros((1, 2, 4, 32)))
    with pytest.raises((ValueError, TypeError)) as info:
        F.scaled_dot_product_attention(q, q, q, **kwargs)
    for word in words:
        assert word in str(info.value)


def test_multihead_attention_takes_a_backend(rng):
    """backend= reaches F.scaled_dot_product_attention (need_weights=True keeps the naive path)."""
    mha = nn.MultiheadAttention(8, 2, backend="memory_efficient").double()
    x = Tensor(rng.standard_normal((2, 5, 8)))
    naive = nn.MultiheadAttention(8, 2).double()
    naive.load_state_dict(mha.state_dict())
    out, _ = mha(x, x, x, need_weights=False)
    ref, _ = naive(x, x, x, need_weights=False)
    np.testing.assert_allclose(out.numpy(), ref.numpy(), atol=scaled(1e-12, x, *(p.data for p in mha.parameters())))
    out, weights = mha(x, x, x)
    assert weights.shape == (2, 5, 5)
    with pytest.raises(ValueError, match="backend"):
        nn.MultiheadAttention(8, 2, backend="fast")


# -- on a GPU --------------------------------------------------------------------------------------------
@pytest.fixture
def cuda():
    if not backend.cuda_available():
        pytest.skip("cuda: CuPy or a GPU is not available on this machine")
    return "cuda"


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_cuda_kernels_equal_the_reference(cuda, head_dim, dtype):
    rng = np.random.default_rng(12)
    b, h, tq, tk = 2, 3, 130, 77
    for blocked, additive in mask_kinds(rng, b, h, tq, tk).values():
        for causal, dropout in ((False, None), (True, (0.2, 7, 16, None))):
            arrays = [backend.to_device(a, cuda) for a in qkv(rng, b, h, tq, tk, head_dim, dtype)]
            masks = [None if m is None else backend.to_device(m if m.dtype == bool else m.astype(dtype), cuda)
                     for m in (blocked, additive)]
            forward = (backend.module_for(cuda), *arrays, *masks, causal, head_dim ** -0.5, 32, dropout, False)
            out, lse = flash_attention.attention_flash_forward(*forward)
            ref_out, ref_lse = attention_blockwise_forward.reference(*forward)
            dout = backend.to_device(rng.standard_normal(ref_out.shape).astype(dtype), cuda)
            backward = (backend.module_for(cuda), *arrays, ref_out, ref_lse, dout, *masks, causal, head_dim ** -0.5, 32, dropout, False)
            grads = flash_attention.attention_flash_backward(*backward)
            ref_grads = attention_blockwise_backward.reference(*backward)
            for name, ours, ref in [("out", out, ref_out), ("lse", lse, ref_lse),
                                    *zip(("dq", "dk", "dv"), grads[:3], ref_grads[:3])]:
                assert_close(backend.as_numpy(ours), backend.as_numpy(ref), dtype, max(tq, tk) * head_dim, name)


@pytest.mark.parametrize("mask", ["causal", "bool", "padding_and_causal", "float"])
def test_cuda_flash_gradcheck_naive_and_torch(cuda, mask, torch):
    rng = np.random.default_rng(13)
    kwargs = sdpa_masks(rng, 3, 4)[mask]
    cuda_kwargs = {k: backend.to_device(v, cuda) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
    arrays = qkv(rng, 2, 2, 3, 4, 32)
    ins = [leaf(a, cuda) for a in arrays]
    assert F.attention_backend(*ins, **cuda_kwargs)[0] == "flash"
    assert autograd.gradcheck(lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, backend="flash", dropout_p=0.3, generator=random.Philox(2), **cuda_kwargs), ins)

    def run(path):
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.3, backend=path,
                                                              generator=random.Philox(5), **cuda_kwargs)
    compare_runs(run("flash"), run("naive"), arrays, rng, cuda)
    out = F.scaled_dot_product_attention(*ins, backend="flash", **cuda_kwargs)
    theirs = {k: torch.tensor(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
    ref = torch.nn.functional.scaled_dot_product_attention(*(torch.tensor(a) for a in arrays), **theirs)
    np.testing.assert_allclose(out.numpy(), ref.numpy(), atol=scaled(1e-12, *arrays))


def test_cuda_dropout_kernel_draws_the_contract_mask(cuda):
    x = Tensor(np.ones((301, 7), dtype=np.float32), requires_grad=True, device=cuda)
    y = F.dropout(x, 0.3, generator=random.Philox(9, offset=8))
    keep = random.bits16(9, 8, x.size) >= round(0.3 * 2**16)
    np.testing.assert_array_equal(y.numpy().reshape(-1) != 0, keep)
    y.backward(backend.to_device(np.full(x.shape, 2.0, dtype=np.float32), cuda))
    np.testing.assert_allclose(x.grad.numpy(), 2 * y.numpy(), rtol=1e-6)


def test_grouped_query_attention_through_the_kernels_passes_gradcheck(flash_on_cpu):
    """enable_gqa=True on the flash path: the kernels take the grouped views (key and value made
    contiguous per query head by the launchers) and dK, dV are summed over each group."""
    rng = np.random.default_rng(16)
    ins = [leaf(rng.standard_normal((1, 4, 3, 32)))] + [leaf(rng.standard_normal((1, 2, 4, 32))) for _ in range(2)]
    assert autograd.gradcheck(lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=True, backend="flash"), ins)
    assert "flash_attention_backward_dkdv" in {name.split("_float")[0].split("_double")[0]
                                               for name, _, _ in flash_on_cpu.launches}


def test_a_sliding_window_never_runs_the_kernels(flash_on_cpu):
    """The kernels have no window: backend='flash' refuses it by name, the memory-efficient path
    runs the blockwise reference (no launch) and matches the naive path."""
    rng = np.random.default_rng(17)
    q, k, v = qkv(rng, 1, 2, 9, 9, 32)
    with pytest.raises(ValueError, match="sliding_window=3"):
        F.scaled_dot_product_attention(q, k, v, is_causal=True, sliding_window=3, backend="flash")
    flash_on_cpu.launches.clear()
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, sliding_window=3, backend="memory_efficient",
                                         block_size=4).numpy()
    assert not flash_on_cpu.launches
    np.testing.assert_allclose(out, F.scaled_dot_product_attention(q, k, v, is_causal=True, sliding_window=3).numpy(),
                               rtol=1e-12, atol=1e-12)
