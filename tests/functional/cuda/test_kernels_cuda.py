"""On a GPU (skipped without one): every kernel table whose CUDA implementation applies runs it on
cuda arrays and agrees with its reference (run on the same arrays inside reference_only()),
float32 and float64, odd sizes, rows longer than 1024, empty inputs; and the fused ops on cuda
pass float64 gradchecks (random upstream gradients) and agree with torch. The same kernels are
run on the CPU by the emulator in tests/functional/cuda/test_kernels_emulated.py."""
import math

import numpy as np
import pytest

import autograd
import npformer.functional as F
from autograd import Tensor, backend
from npformer import optim
from npformer.functional.activation import bias_activation_backward, bias_activation_forward, dropout_backward
from npformer.functional.adam import AdamSettings, adam_update
from npformer.functional.embedding import scatter_add_rows
from npformer.functional.cross_entropy import cross_entropy_backward, cross_entropy_forward
from npformer.functional.layer_norm import layer_norm_backward, layer_norm_forward
from npformer.functional.dropout_add import dropout_add_forward
from npformer.functional.softmax import log_softmax_backward, log_softmax_forward, softmax_backward, softmax_forward
from npformer.runtime import kernels, random

pytestmark = pytest.mark.skipif(not backend.cuda_available(), reason="cuda: CuPy or a GPU is not available")

DTYPES = ["float32", "float64"]
LENGTHS = [1, 7, 33, 1500, 5000]


def on_cuda(*arrays):
    return [None if a is None else backend.to_device(np.asarray(a), "cuda") for a in arrays]


def both(table, *args):
    """(the CUDA implementation's result, the reference's) on the same cuda arrays."""
    assert table.select(*args) is table.implementations["cuda"][0], f"{table.__name__}: the kernel refuses"
    ours = table(*args)
    with kernels.reference_only():
        ref = table(*args)
    return ours, ref


def close(ours, ref, dtype, n=1, scale=1.0, what=""):
    tol = 16 * np.finfo(dtype).eps * math.sqrt(max(n, 1)) * scale
    if ours is None or ref is None:
        assert ours is None and ref is None, what
        return
    np.testing.assert_allclose(backend.as_numpy(ours), backend.as_numpy(ref), rtol=0, atol=tol, err_msg=what)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", LENGTHS)
def test_row_kernels_equal_their_references(n, dtype, rng):
    x = rng.standard_normal((9, n)).astype(dtype)
    x[0] = -np.inf
    dy = rng.standard_normal(x.shape).astype(dtype)
    x, dy = on_cuda(x, dy)
    xp = backend.get_array_module(x)
    y, y_ref = both(softmax_forward, xp, x, -1)
    close(y, y_ref, dtype, n)
    close(*both(softmax_backward, xp, y_ref, dy, -1), dtype, n, 4)
    logp, logp_ref = both(log_softmax_forward, xp, x[1:], -1)
    close(logp, logp_ref, dtype, n, 20)
    close(*both(log_softmax_backward, xp, logp_ref, dy[1:], -1), dtype, n, 4 * n)
    w, b = on_cuda(rng.standard_normal(n).astype(dtype), rng.standard_normal(n).astype(dtype))
    for out, ref in zip(*both(layer_norm_forward, xp, x[1:] * 3 + 50, w, b, 1e-5)):
        close(out, ref, dtype, n, 60 * float(abs(ref).max()))
    _, xhat, rstd = layer_norm_forward(xp, x[1:], w, b, 1e-5)
    for out, ref in zip(*both(layer_norm_backward, xp, dy[1:], xhat, rstd, w, True, True, True)):
        close(out, ref, dtype, n, 10 * float(abs(ref).max()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("c", [3, 1500, 8000])
@pytest.mark.parametrize("smoothing,weighted", [(0.0, False), (0.1, True)])
def test_cross_entropy_kernels_equal_their_references(c, smoothing, weighted, dtype, rng):
    m = 37
    logits = (3 * rng.standard_normal((m, c))).astype(dtype)
    target, valid = rng.integers(0, c, m), rng.random(m) > 0.2
    weight = rng.uniform(0.5, 2, c).astype(dtype) if weighted else None
    dloss = np.where(valid, rng.standard_normal(m), 0).astype(dtype)
    logits, target, valid, weight, dloss = on_cuda(logits, np.where(valid, target, 0), valid, weight, dloss)
    (loss, probs), (loss_ref, probs_ref) = both(cross_entropy_forward, backend.module_for("cuda"), logits, target, valid, weight,
                                                                 smoothing)
    close(probs, probs_ref, dtype, c)
    close(loss, loss_ref, dtype, c, 40)
    close(*both(cross_entropy_backward, backend.module_for("cuda"), probs_ref, target, weight, smoothing, dloss), dtype, c, 4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["relu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("shape", [(5, 7), (3, 5000), (0, 4)])
def test_activation_dropout_embedding_adam_kernels_equal_their_references(kind, shape, dtype, rng):
    x, bias, dy = on_cuda(*(rng.standard_normal(s).astype(dtype) for s in (shape, shape[-1:], shape)))
    xp = backend.get_array_module(x)
    (y, saved), (y_ref, saved_ref) = both(bias_activation_forward, xp, x, bias, kind)
    close(y, y_ref, dtype, 1, 10)
    close(*both(bias_activation_backward, xp, dy, saved_ref, kind), dtype, 1, 10)
    stream = (2**50 + 1, 8 * 2**32, 0.3)                            # seed, offset, p
    np.testing.assert_array_equal(*(backend.as_numpy(y) for y, _ in both(dropout_add_forward, xp, x, dy, *stream)))
    np.testing.assert_array_equal(*map(backend.as_numpy, both(dropout_backward, xp, dy, None, *stream)))
    if x.size:
        ids = backend.to_device(rng.integers(0, 4, shape[0]), "cuda")
        close(*both(scatter_add_rows, backend.module_for("cuda"), ids, x, 4), dtype, shape[0], 4)
    settings = AdamSettings(0.1, 0.98, 0.02, 1e-8, 0.01, "decoupled", 1e-3 / (1 - 0.9 ** 3), math.sqrt(1 - 0.98 ** 3),
                            1 - 1e-5)
    ours = [a.copy() for a in (x, dy, x, abs(dy))]
    refs = [a.copy() for a in (x, dy, x, abs(dy))]
    adam_update(backend.cupy, *ours, backend.cupy.empty_like(x), settings)
    with kernels.reference_only():
        adam_update(backend.cupy, *refs, backend.cupy.empty_like(x), settings)
    for a, b in zip(ours, refs):
        close(a, b, dtype, 1, 4)


FUSED = {  # name -> (op on Tensors, torch's, input shapes)
    "layer_norm": (lambda x, w, b: F.layer_norm(x, (1500,), w, b),
                   lambda t: lambda x, w, b: t.nn.functional.layer_norm(x, (1500,), w, b), [(3, 1500), (1500,), (1500,)]),
    "log_softmax": (F.log_softmax, lambda t: lambda x: t.log_softmax(x, -1), [(4, 1100)]),
    "softmax": (F.softmax, lambda t: lambda x: t.softmax(x, -1), [(4, 1100)]),
    "cross_entropy": (lambda x: F.cross_entropy(x, np.array([3, 0, 1099, -100]), label_smoothing=0.1),
                      lambda t: lambda x: t.nn.functional.cross_entropy(x, t.tensor([3, 0, 1099, -100]),
                                                                        label_smoothing=0.1), [(4, 1100)]),
    "linear_gelu": (lambda x, w, b: F.linear(x, w, b, activation="gelu"),
                    lambda t: lambda x, w, b: t.nn.functional.gelu(t.nn.functional.linear(x, w, b)),
                    [(5, 6), (7, 6), (7,)]),
    "linear_relu": (lambda x, w, b: F.linear(x, w, b, activation="relu"),
                    lambda t: lambda x, w, b: t.relu(t.nn.functional.linear(x, w, b)), [(5, 6), (7, 6), (7,)]),
    "embedding": (lambda w: F.embedding(np.array([[1, 3, 3], [0, 6, 1]]), w),
                  lambda t: lambda w: t.nn.functional.embedding(t.tensor([[1, 3, 3], [0, 6, 1]]), w), [(7, 1100)]),
}


@pytest.mark.parametrize("name", sorted(FUSED))
def test_fused_ops_on_cuda_match_torch_in_float64(name, torch, rng):
    ours_fn, theirs_fn, shapes = FUSED[name]
    arrays = [rng.standard_normal(s) for s in shapes]
    ours = [Tensor(a, requires_grad=True, device="cuda", dtype="float64") for a in arrays]
    theirs = [torch.tensor(a, requires_grad=True) for a in arrays]
    out, ref = ours_fn(*ours), theirs_fn(torch)(*theirs)
    g = rng.standard_normal(out.shape)
    out.backward(backend.to_device(g, "cuda"))
    ref.backward(torch.tensor(g))
    np.testing.assert_allclose(out.numpy(), ref.detach().numpy(), rtol=1e-9, atol=1e-9)
    for a, t in zip(ours, theirs):
        np.testing.assert_allclose(a.grad.numpy(), t.grad.numpy(), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name", sorted(FUSED))
def test_fused_ops_on_cuda_pass_gradcheck(name, rng):
    ours_fn, _, shapes = FUSED[name]
    shapes = [tuple(min(d, 40) if name not in ("layer_norm",) else d for d in s) for s in shapes]
    if name in ("cross_entropy", "log_softmax", "softmax", "embedding"):
        shapes = [s[:-1] + (1100,) for s in shapes]
    arrays = [Tensor(rng.standard_normal(s), requires_grad=True, device="cuda") for s in shapes]
    assert autograd.gradcheck(ours_fn, arrays)


def test_dropout_add_and_adam_run_on_cuda(rng):
    x = Tensor(rng.standard_normal((3, 1001)), requires_grad=True, device="cuda")
    r = Tensor(rng.standard_normal((3, 1001)), requires_grad=True, device="cuda")
    assert autograd.gradcheck(lambda a, b: F.dropout_add(a, b, 0.3, generator=random.Philox(9)), [x, r])
    opt = optim.AdamW([x], lr=1e-2)
    x.grad = Tensor(backend.to_device(rng.standard_normal(x.shape), "cuda"))
    opt.step()
    assert np.isfinite(x.numpy()).all()
