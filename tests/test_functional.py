"""npformer.functional: gradcheck (float64, random upstream gradient, every input) and torch
parity forward and backward for every op. Edge cases, masks and property tests live in
test_functional_*.py."""
import numpy as np
import pytest

import autograd
import npformer.functional as F
from npformer.functional import composite
from autograd import Tensor

from tolerances import scaled


def leaf(array, device="cpu", dtype=np.float64):
    return Tensor(np.array(array, dtype=dtype), requires_grad=True, device=device)


def torch_leaf(torch, array, dtype=np.float64):
    return torch.tensor(np.array(array, dtype=dtype), requires_grad=True)


def compare_with_torch(torch, ours_fn, torch_fn, arrays, rng, atol=1e-10, rtol=1e-10, device="cpu",
                       dtype=np.float64, torch_dtype=None, scale=None):
    """Run both on the same inputs, backward with one random upstream gradient; compare the
    output and the gradient of every input (and that ours keeps the dtype). torch_dtype=float64
    runs torch in float64 on our float32 inputs (where torch's float32 kernel is the less exact).
    atol is set at unit scale: it is multiplied by `scale`, by default max(1, magnitude) of every
    input (tolerances.scaled), and for the gradients also by that of the upstream gradient."""
    ours_in = [leaf(a, device, dtype) for a in arrays]
    theirs_in = [torch_leaf(torch, np.asarray(a, dtype), torch_dtype or dtype) for a in arrays]
    out = ours_fn(*ours_in)
    ref = torch_fn(*theirs_in)
    assert out.dtype == dtype
    atol = scaled(atol, *arrays) if scale is None else atol * scale
    np.testing.assert_allclose(out.numpy(), ref.detach().numpy(), atol=atol, rtol=rtol)
    g = rng.standard_normal(out.shape).astype(dtype)
    out.backward(autograd.backend.to_device(g, out.device))
    ref.backward(torch.tensor(g.astype(torch_dtype or dtype)))
    for i, (a, b) in enumerate(zip(ours_in, theirs_in)):
        assert a.grad.dtype == dtype
        np.testing.assert_allclose(autograd.backend.as_numpy(a.grad), b.grad.numpy(), atol=scaled(atol, g),
                                   rtol=rtol, err_msg=f"gradient of input {i}")


def compare_runs(fn_a, fn_b, arrays, rng, device="cpu", atol=1e-12):
    """Run two implementations on separate float64 leaves holding `arrays`, backpropagate the same
    random upstream gradients through both, and compare every output and input gradient."""
    ins_a, ins_b = [leaf(a, device) for a in arrays], [leaf(a, device) for a in arrays]
    outs_a, outs_b = (r if isinstance(r, tuple) else (r,) for r in (fn_a(*ins_a), fn_b(*ins_b)))
    for i, (a, b) in enumerate(zip(outs_a, outs_b)):
        assert a.device == device and a.dtype == np.float64
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=atol, rtol=atol, err_msg=f"output {i}")
    upstream = [Tensor(rng.standard_normal(o.shape), device=device) for o in outs_a]
    for outs in (outs_a, outs_b):
        terms = [(o * g).sum() for o, g in zip(outs, upstream)]
        sum(terms[1:], terms[0]).backward()
    for i, (a, b) in enumerate(zip(ins_a, ins_b)):
        np.testing.assert_allclose(autograd.backend.as_numpy(a.grad), autograd.backend.as_numpy(b.grad),
                                   atol=atol, rtol=atol, err_msg=f"gradient of input {i}")
    return outs_a


def cases(rng, ops=F):
    """name -> (ours, torch's (given the torch module), input arrays); ops=composite gives the twins."""
    x = rng.standard_normal((3, 5))
    ids = np.array([[1, 3, 3], [0, 6, 1]])
    tgt = np.array([2, 0, 4])
    q, k, v = (rng.standard_normal((2, 2, 4, 3)) for _ in range(3))
    cos, sin = F.rotary_cos_sin(4, 6, dtype="float64")
    return {
        "linear": (ops.linear, lambda t: t.nn.functional.linear,
                   [rng.standard_normal((2, 3, 4)), rng.standard_normal((5, 4)), rng.standard_normal(5)]),
        "relu": (ops.relu, lambda t: t.relu, [x]),
        "gelu": (ops.gelu, lambda t: t.nn.functional.gelu, [3 * x]),
        "gelu_tanh": (lambda a: ops.gelu(a, approximate="tanh"),
                      lambda t: lambda a: t.nn.functional.gelu(a, approximate="tanh"), [3 * x]),
        "softmax": (lambda a: ops.softmax(a, dim=0), lambda t: lambda a: t.softmax(a, dim=0), [x]),
        "log_softmax": (ops.log_softmax, lambda t: lambda a: t.log_softmax(a, dim=-1), [x]),
        "layer_norm": (lambda a, w, b: ops.layer_norm(a, (5,), w, b),
                       lambda t: lambda a, w, b: t.nn.functional.layer_norm(a, (5,), w, b),
                       [x, 1 + rng.standard_normal(5), rng.standard_normal(5)]),
        "embedding": (lambda w: ops.embedding(ids, w),
                      lambda t: lambda w: t.nn.functional.embedding(t.tensor(ids), w),
                      [rng.standard_normal((7, 3))]),
        # the padding row is held constant on purpose: finite differences would see it, so no gradcheck
        "embedding_padding": (lambda w: ops.embedding(ids, w, padding_idx=1),
                      lambda t: lambda w: t.nn.functional.embedding(t.tensor(ids), w, padding_idx=1),
                      [rng.standard_normal((7, 3))]),
        "cross_entropy": (lambda a: ops.cross_entropy(a, tgt, label_smoothing=0.1),
                          lambda t: lambda a: t.nn.functional.cross_entropy(a, t.tensor(tgt), label_smoothing=0.1),
                          [x]),
        "attention": (lambda q, k, v: ops.scaled_dot_product_attention(q, k, v, is_causal=True),
                      lambda t: lambda q, k, v: t.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
                      [q, k, v]),
        "attention_memory_efficient": (
            lambda q, k, v: ops.scaled_dot_product_attention(q, k, v, is_causal=True, memory_efficient=True,
                                                           block_size=2),
            lambda t: lambda q, k, v: t.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
            [q, k, v]),
        "rotary": (lambda a: ops.apply_rotary_emb(a, cos, sin), lambda t: lambda a: _torch_rope(t, a, cos, sin),
                   [rng.standard_normal((2, 4, 6))]),
        # every chunk reaches the output, so the backward assembles all three gradients
        "split_heads": (lambda a: _mix_heads(*ops.split_heads(a, 2, chunks=3)),
                        lambda t: lambda a: _mix_heads(*a.reshape(2, 4, 3, 2, 2).permute(2, 0, 3, 1, 4)),
                        [rng.standard_normal((2, 4, 12))]),
        "split_heads_one_chunk": (lambda a: ops.split_heads(a, 3) * 2.0,
                                  lambda t: lambda a: a.reshape(2, 4, 3, 2).transpose(1, 2) * 2.0,
                                  [rng.standard_normal((2, 4, 6))]),
    }


def _mix_heads(q, k, v):
    return q * k + 2.0 * v


def _torch_rope(torch, x, cos, sin):
    half = x.shape[-1] // 2
    c, s = torch.tensor(cos), torch.tensor(sin)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


CASES = list(cases(np.random.default_rng(0)))


@pytest.mark.parametrize("name", [c for c in CASES if c != "embedding_padding"])
def test_gradcheck(name, device):
    ours, _, arrays = cases(np.random.default_rng(1))[name]
    assert autograd.gradcheck(ours, [leaf(a, device) for a in arrays])


@pytest.mark.parametrize("name", CASES)
def test_matches_torch_float64(name, torch):
    ours, theirs, arrays = cases(np.random.default_rng(2))[name]
    compare_with_torch(torch, ours, theirs(torch), arrays, np.random.default_rng(3))


@pytest.mark.parametrize("name", CASES)
def test_matches_torch_float32(name, torch):
    """float32 stays float32 and agrees with torch to atol 1e-5, rtol 1e-5."""
    ours, theirs, arrays = cases(np.random.default_rng(2))[name]
    compare_with_torch(torch, ours, theirs(torch), arrays, np.random.default_rng(3), atol=1e-5, rtol=1e-5,
                       dtype=np.float32)


@pytest.mark.parametrize("name", CASES)
def test_matches_composite_twin(name, device):
    fused, _, arrays = cases(np.random.default_rng(4))[name]
    twin, _, _ = cases(np.random.default_rng(4), composite)[name]
    compare_runs(fused, twin, arrays, np.random.default_rng(5), device)


@pytest.mark.parametrize("shape, num_heads, chunks, match", [
    ((2, 4, 12), 5, 1, "chunks=1, num_heads=5"), ((2, 12), 2, 3, "batch, seq"), ((2, 4, 12), 0, 3, "num_heads")])
def test_split_heads_rejects_bad_shapes(shape, num_heads, chunks, match):
    with pytest.raises(ValueError, match=match):
        F.split_heads(Tensor(np.zeros(shape)), num_heads, chunks=chunks)
