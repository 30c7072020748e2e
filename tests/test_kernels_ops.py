"""The fused ops that the kernel tables brought: `F.linear(..., activation=...)` (bias + ReLU/GELU
as the GEMM's epilogue) and `F.dropout_add` (residual + dropout, the mask drawn by the dropout
contract and drawn again in backward): float64 gradchecks with random upstream gradients on every
device, torch comparisons, the composite twins; and ReLU's edge values as torch's."""
import numpy as np
import pytest

import autograd
import npformer.functional as F
from autograd import Tensor, backend, random
from npformer.functional import composite
from npformer.functional.residual import keep_threshold

ACTIVATIONS = ["relu", "gelu", "gelu_tanh"]


def leaf(array, device, dtype="float64"):
    return Tensor(np.asarray(array, dtype=dtype), requires_grad=True, device=device)


def torch_activation(torch, kind):
    if kind == "relu":
        return torch.relu
    return lambda h: torch.nn.functional.gelu(h, approximate="tanh" if kind == "gelu_tanh" else "none")


@pytest.mark.parametrize("kind", ACTIVATIONS)
@pytest.mark.parametrize("bias", [True, False])
def test_linear_with_activation_gradcheck(kind, bias, device, rng):
    x, w, b = rng.standard_normal((2, 3, 4)), rng.standard_normal((5, 4)), rng.standard_normal(5)
    inputs = [leaf(x, device), leaf(w, device)] + ([leaf(b, device)] if bias else [])
    assert autograd.gradcheck(lambda x, w, *b: F.linear(x, w, *b, activation=kind), inputs)


@pytest.mark.parametrize("kind", ACTIVATIONS)
@pytest.mark.parametrize("dtype,tol", [("float64", 1e-10), ("float32", 2e-5)])
def test_linear_with_activation_matches_torch(kind, dtype, tol, device, torch, rng):
    x, w, b = rng.standard_normal((6, 4)), rng.standard_normal((7, 4)), rng.standard_normal(7)
    ours = [leaf(a, device, dtype) for a in (x, w, b)]
    theirs = [torch.tensor(a, dtype=getattr(torch, dtype), requires_grad=True) for a in (x, w, b)]
    out = F.linear(*ours, activation=kind)
    ref = torch_activation(torch, kind)(torch.nn.functional.linear(*theirs))
    g = rng.standard_normal(out.shape).astype(dtype)
    out.backward(backend.to_device(g, device))
    ref.backward(torch.tensor(g))
    assert out.dtype == dtype
    np.testing.assert_allclose(out.numpy(), ref.detach().numpy(), rtol=tol, atol=tol)
    for a, t in zip(ours, theirs):
        np.testing.assert_allclose(backend.as_numpy(a.grad), t.grad.numpy(), rtol=tol, atol=tol * 10)


@pytest.mark.parametrize("kind", ACTIVATIONS + [None])
def test_linear_with_activation_matches_its_composite_twin(kind, device, rng):
    x, w, b = rng.standard_normal((2, 3, 4)), rng.standard_normal((5, 4)), rng.standard_normal(5)
    ins, twin_ins = ([leaf(a, device) for a in (x, w, b)] for _ in range(2))
    out, twin = F.linear(*ins, activation=kind), composite.linear(*twin_ins, activation=kind)
    np.testing.assert_allclose(out.numpy(), twin.numpy(), rtol=1e-12, atol=1e-12)
    g = backend.to_device(rng.standard_normal(out.shape), device)
    out.backward(g)
    twin.backward(g)
    for a, t in zip(ins, twin_ins):
        np.testing.assert_allclose(backend.as_numpy(a.grad), backend.as_numpy(t.grad), rtol=1e-11, atol=1e-11)


def test_linear_rejects_an_unknown_activation():
    with pytest.raises(ValueError, match=r"activation must be None or one of \('relu', 'gelu', 'gelu_tanh'\), got 'tanh'"):
        F.linear(Tensor(np.zeros((2, 3))), Tensor(np.zeros((4, 3))), activation="tanh")


def test_relu_edge_values_are_torchs(device, torch):
    """relu(-inf) = 0, relu(NaN) = NaN; the gradient passes at NaN and is exactly 0 where x <= 0
    (also for a NaN upstream gradient), as torch's threshold_backward."""
    x = np.array([-np.inf, -1.0, 0.0, 2.0, np.inf, np.nan])
    ours, theirs = leaf(x, device), torch.tensor(x, requires_grad=True)
    out, ref = F.relu(ours), torch.relu(theirs)
    np.testing.assert_array_equal(out.numpy(), ref.detach().numpy())
    g = np.array([np.nan, np.nan, 1.0, 2.0, 3.0, 4.0])
    out.backward(backend.to_device(g, device))
    ref.backward(torch.tensor(g))
    np.testing.assert_array_equal(backend.as_numpy(ours.grad), theirs.grad.numpy())


def fixed_mask_dropout_add(p, seed=5):
    """dropout_add drawing the same mask at every call (a fresh stream each time): a function of its
    inputs only, so finite differences apply."""
    return lambda x, r: F.dropout_add(x, r, p, generator=random.Philox(seed))


@pytest.mark.parametrize("p", [0.2, 0.7])
def test_dropout_add_gradcheck(p, device, rng):
    x, r = rng.standard_normal((3, 4, 5)), rng.standard_normal((3, 4, 5))
    assert autograd.gradcheck(fixed_mask_dropout_add(p), [leaf(x, device), leaf(r, device)])


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_dropout_add_follows_the_dropout_contract_and_matches_torch(dtype, device, torch, rng):
    """Entry i is kept iff value offset + i of the stream is >= round(p 2^16), kept entries scaled by
    1 / (1 - p); torch computes residual + x * mask with that mask; the gradients agree."""
    p, shape = 0.3, (4, 3, 11)
    x, r = rng.standard_normal(shape), rng.standard_normal(shape)
    stream = random.Philox(seed=2**40 + 3, offset=8 * 1000)
    keep = random.bits16(stream.seed, stream.offset, x.size) >= keep_threshold(p)
    ours = [leaf(a, device, dtype) for a in (x, r)]
    out = F.dropout_add(*ours, p, generator=stream)
    assert stream.offset == 8 * 1000 + x.size + (-x.size) % 8              # the stream advanced by the draw
    mask = torch.tensor(keep.reshape(shape).astype(dtype) * (1.0 / (1.0 - p)))
    theirs = [torch.tensor(a.astype(dtype), requires_grad=True) for a in (x, r)]
    ref = theirs[1] + theirs[0] * mask
    g = rng.standard_normal(shape).astype(dtype)
    out.backward(backend.to_device(g, device))
    ref.backward(torch.tensor(g))
    tol = 1e-6 if dtype == "float32" else 1e-14
    np.testing.assert_allclose(out.numpy(), ref.detach().numpy(), rtol=tol, atol=tol)
    for a, t in zip(ours, theirs):
        np.testing.assert_allclose(backend.as_numpy(a.grad), t.grad.numpy(), rtol=tol, atol=tol)
    assert abs(1 - keep.mean() - p) < 0.15


def test_dropout_add_matches_its_composite_twin_and_draws_the_same_stream(device, rng):
    x, r = rng.standard_normal((5, 9)), rng.standard_normal((5, 9))
    ins, twin_ins = ([leaf(a, device) for a in (x, r)] for _ in range(2))
    out = F.dropout_add(*ins, 0.4, generator=random.Philox(7))
    twin = composite.dropout_add(*twin_ins, 0.4, generator=random.Philox(7))
    np.testing.assert_array_equal(out.numpy(), twin.numpy())
    g = backend.to_device(rng.standard_normal(out.shape), device)
    out.backward(g)
    twin.backward(g)
    for a, t in zip(ins, twin_ins):
        np.testing.assert_allclose(backend.as_numpy(a.grad), backend.as_numpy(t.grad), rtol=1e-15, atol=0)


def test_dropout_add_edge_cases_and_errors(rng):
    x, r = Tensor(rng.standard_normal((2, 3))), Tensor(rng.standard_normal((2, 3)))
    np.testing.assert_array_equal(F.dropout_add(x, r, 0.5, training=False).numpy(), x.numpy() + r.numpy())
    np.testing.assert_array_equal(F.dropout_add(x, r, 0.0).numpy(), x.numpy() + r.numpy())
    np.testing.assert_array_equal(F.dropout_add(x, r, 1.0).numpy(), r.numpy())
    with pytest.raises(ValueError, match=r"input and residual must have one shape, got \(2, 3\) and \(3,\)"):
        F.dropout_add(x, Tensor(np.zeros(3)), 0.1)
    with pytest.raises(ValueError, match="dropout probability must be a number in"):
        F.dropout_add(x, r, 1.5)
    with pytest.raises(TypeError, match="generator must be an autograd.random.Philox or None, got Generator"):
        F.dropout_add(x, r, 0.5, generator=np.random.default_rng(0))


def test_docs_list_every_kernel_table_and_where_it_has_implementations():
    """docs/gpu.md's table "which implementation runs where" names every kernel table of npformer;
    its "cpu" and "cuda" columns start with "(" exactly where nothing is registered."""
    import pathlib

    from autograd import kernels
    text = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "gpu.md").read_text()
    text = text.split("## Kernel tables")[1].split("\n## ")[0]
    for table in kernels.TABLES:
        if not table.reference.__module__.startswith("npformer"):
            continue  # tables the tests make
        rows = [line for line in text.splitlines() if line.startswith("|") and f"`{table.__name__}`" in line]
        assert len(rows) == 1, f"docs/gpu.md: no row (or several) for the kernel table {table.__name__}"
        columns = [c.strip() for c in rows[0].split("|")]
        for device, column in (("cpu", columns[3]), ("cuda", columns[4])):
            assert (device in table.implementations) == (not column.startswith("(")), (table.__name__, device)
