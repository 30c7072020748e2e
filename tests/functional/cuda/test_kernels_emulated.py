"""Every hand-written CUDA kernel, run on the CPU by the emulator (tests/cuda_emulator.h: the .cu
compiled by g++, each CUDA thread a fiber, barriers and warp shuffles honoured), through its real
launcher, against its kernel table's reference: float32 and float64, odd sizes, rows longer than
the 1024 threads of a block, empty inputs. Also checked: the launch arguments' sizes (CuPy's
conversions), writes past the end of any array, and threads that miss a barrier. Needs g++ (skips
without one); on a GPU, tests/functional/cuda/test_kernels_cuda.py runs the same comparisons on the device."""
import math

import numpy as np
import pytest

import cuda_emulator
from npformer.functional.activation import (bias_activation_backward, bias_activation_forward, dropout_backward,
                                            dropout_forward)
from npformer.functional.adam import AdamSettings, adam_update
from npformer.functional.embedding import scatter_add_rows
from npformer.functional.cross_entropy import cross_entropy_backward, cross_entropy_forward
from npformer.functional.layer_norm import layer_norm_backward, layer_norm_forward
from npformer.functional.dropout_add import dropout_add_forward
from npformer.functional.softmax import (log_softmax_backward, log_softmax_forward, softmax_backward,
                                         softmax_forward)

pytestmark = pytest.mark.skipif(cuda_emulator.compiler() is None, reason="no C++ compiler (g++) on this machine")

DTYPES = ["float32", "float64"]
ROW_LENGTHS = [1, 7, 33, 1500]  # one entry, a partial warp, a partial second warp, more than 1024 threads


@pytest.fixture(autouse=True)
def emulated(monkeypatch):
    with cuda_emulator.emulated_kernels(monkeypatch):
        yield


def cuda(table, *args):
    """Run the table's CUDA implementation (which must accept the arguments) on the emulator."""
    function, supports = table.implementations["cuda"]
    assert supports is None or supports(*args), f"{table.__name__}: the CUDA kernel refuses these arguments"
    return function(*args)


def tolerance(dtype, n=1, scale=1.0):
    """Rounding of sums of n terms of magnitude `scale` in `dtype` (the kernels sum in another order)."""
    return 16 * np.finfo(dtype).eps * np.sqrt(max(n, 1)) * scale


def close(ours, ref, tol, what=""):
    ours, ref = np.asarray(ours), np.asarray(ref)
    assert ours.shape == ref.shape and ours.dtype == ref.dtype, what
    np.testing.assert_allclose(ours, ref, rtol=0, atol=tol, err_msg=what)


def rows_with_masks(rng, shape, dtype):
    x = rng.standard_normal(shape).astype(dtype)
    if x.shape[0] > 2:
        x[0] = -np.inf                               # a fully masked row
        x[1, : (x.shape[1] + 1) // 2] = -np.inf      # a half masked one
    return x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", ROW_LENGTHS)
def test_softmax_kernels(n, dtype, rng):
    x = rows_with_masks(rng, (4, n), dtype)
    dy = rng.standard_normal(x.shape).astype(dtype)
    y_ref = softmax_forward.reference(np, x, -1)
    close(cuda(softmax_forward, np, x, -1), y_ref, tolerance(dtype, n))
    close(cuda(softmax_backward, np, y_ref, dy, -1), softmax_backward.reference(np, y_ref, dy, -1), tolerance(dtype, n, 4))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", ROW_LENGTHS)
def test_log_softmax_kernels(n, dtype, rng):
    x = rows_with_masks(rng, (2, 3, n), dtype)
    dy = rng.standard_normal(x.shape).astype(dtype)
    ref = log_softmax_forward.reference(np, x, -1)
    ours = cuda(log_softmax_forward, np, x, -1)
    assert (np.isneginf(ours) == np.isneginf(ref)).all()
    finite = np.isfinite(ref)
    close(ours[finite], ref[finite], tolerance(dtype, n, 10))
    logp = np.where(finite, ref, -np.inf).astype(dtype)
    close(cuda(log_softmax_backward, np, logp, dy, -1), log_softmax_backward.reference(np, logp, dy, -1),
          tolerance(dtype, n, 4 * n))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", ROW_LENGTHS)
@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_kernels(n, dtype, affine, rng):
    rows = 37 if n < 1024 else 3                            # 37: more than one 32-row slab of the dweight kernel
    x = (rng.standard_normal((rows, n)) * 3 + 50).astype(dtype)   # a mean far from 0: the refinement step matters
    w = rng.standard_normal(n).astype(dtype) if affine else None
    b = rng.standard_normal(n).astype(dtype) if affine else None
    dy = rng.standard_normal(x.shape).astype(dtype)
    y, xhat, rstd = layer_norm_forward.reference(np, x, w, b, 1e-5)
    for ours, ref, name in zip(cuda(layer_norm_forward, np, x, w, b, 1e-5), (y, xhat, rstd), ("y", "xhat", "rstd")):
        close(ours, ref, tolerance(dtype, n, 60 * np.abs(ref).max()), name)
    needs = (True, affine, affine)
    ref = layer_norm_backward.reference(np, dy, xhat, rstd, w, *needs)
    for ours, r, name in zip(cuda(layer_norm_backward, np, dy, xhat, rstd, w, *needs), ref, ("dx", "dweight", "dbias")):
        if r is None:
            assert ours is None
        else:
            close(ours, r, tolerance(dtype, max(n, rows), 10 * np.abs(r).max()), name)


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_kernels_on_empty_inputs(dtype):
    x, w = np.zeros((0, 5), dtype), np.ones(5, dtype)
    y, xhat, rstd = cuda(layer_norm_forward, np, x, w, w, 1e-5)
    assert y.shape == xhat.shape == (0, 5) and rstd.shape == (0, 1)
    dx, dw, db = cuda(layer_norm_backward, np, x, xhat, rstd, w, True, True, True)
    assert dx.shape == (0, 5) and not dw.any() and not db.any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("c", [3, 1500])
@pytest.mark.parametrize("smoothing,weighted", [(0.0, False), (0.1, False), (0.2, True)])
def test_cross_entropy_kernels(c, dtype, smoothing, weighted, rng):
    m = 9
    logits = (3 * rng.standard_normal((m, c))).astype(dtype)
    target = rng.integers(0, c, m)
    valid = np.ones(m, bool)
    valid[[2, 5]] = False                                   # ignore_index rows (their target is 0)
    target[~valid] = 0
    weight = rng.uniform(0.5, 2.0, c).astype(dtype) if weighted else None
    loss_ref, probs_ref = cross_entropy_forward.reference(np, logits, target, valid, weight, smoothing)
    loss, probs = cuda(cross_entropy_forward, np, logits, target, valid, weight, smoothing)
    close(probs, probs_ref, tolerance(dtype, c))
    close(loss, loss_ref, tolerance(dtype, c, 40))
    assert (loss[~valid] == 0).all()
    dloss = np.where(valid, rng.standard_normal(m), 0).astype(dtype)
    close(cuda(cross_entropy_backward, np, probs_ref, target, weight, smoothing, dloss),
          cross_entropy_backward.reference(np, probs_ref, target, weight, smoothing, dloss), tolerance(dtype, c, 4))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["relu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("shape,with_bias", [((5, 7), True), ((3, 1500), False), ((2, 3, 33), True), ((0, 4), True)])
def test_bias_activation_kernels(kind, dtype, shape, with_bias, rng):
    x = (3 * rng.standard_normal(shape)).astype(dtype)
    if x.size and kind == "relu":
        x.reshape(-1)[:3] = (-np.inf, np.nan, 0.0)          # torch's relu(-inf) = 0, relu(NaN) = NaN
    bias = rng.standard_normal(shape[-1]).astype(dtype) if with_bias else None
    dy = rng.standard_normal(shape).astype(dtype)
    if x.size:
        dy.reshape(-1)[0] = np.nan                          # a NaN gradient of a dropped entry gives 0
    y_ref, saved_ref = bias_activation_forward.reference(np, x, bias, kind)
    y, saved = cuda(bias_activation_forward, np, x, bias, kind)
    ok = np.isfinite(y_ref)
    assert (np.isnan(y) == np.isnan(y_ref)).all()
    close(y[ok], y_ref[ok], tolerance(dtype, 1, 10))
    for ours, ref in zip(saved, saved_ref):
        np.testing.assert_allclose(ours, ref, rtol=0, atol=tolerance(dtype, 1, 10))
    dh_ref = bias_activation_backward.reference(np, dy, saved_ref, kind)
    dh = cuda(bias_activation_backward, np, dy, saved_ref, kind)
    assert (np.isnan(dh) == np.isnan(dh_ref)).all()
    close(dh[~np.isnan(dh_ref)], dh_ref[~np.isnan(dh_ref)], tolerance(dtype, 1, 10))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [1, 7, 8, 1003])
@pytest.mark.parametrize("p", [0.1, 0.5, 0.999, 1.0])
def test_dropout_kernels_draw_the_reference_mask_exactly(size, p, dtype, rng):
    """The masks drawn in the kernels are the reference's, bit for bit, at offsets past 2^32 counters
    and not multiples of 8, and from a device (seed, base) state as under graph capture."""
    x = rng.standard_normal((size,)).astype(dtype)
    residual = rng.standard_normal((size,)).astype(dtype)
    dy = rng.standard_normal((size,)).astype(dtype)
    state = np.array([2**63 + 5, 8 * 2**33], dtype=np.uint64)
    for seed, offset, st in ((123456789012345, 8 * 2**32 + 16, None), (5, 8 * 2**32 + 3, None), (0, 24, state)):
        y, keep = cuda(dropout_add_forward, np, x, residual, seed, offset, p, st)
        assert keep is None                                           # drawn again in backward
        np.testing.assert_array_equal(y, dropout_add_forward.reference(np, x, residual, seed, offset, p, st)[0])
        y, keep = cuda(dropout_forward, np, x, seed, offset, p, st)
        np.testing.assert_array_equal(y, dropout_forward.reference(np, x, seed, offset, p, st)[0])
        np.testing.assert_array_equal(cuda(dropout_backward, np, dy, None, seed, offset, p, st),
                                      dropout_backward.reference(np, dy, None, seed, offset, p, st))


@pytest.mark.parametrize("dtype", DTYPES)
def test_dropout_kernels_keep_the_shape_of_a_0d_array(dtype):
    """A 0-d input gives a 0-d output (ascontiguousarray makes a 0-d array 1-d, in numpy and CuPy)."""
    x = np.array(1.5, dtype)
    y = cuda(dropout_forward, np, x, 7, 8, 0.5)[0]
    assert y.shape == () and y == dropout_forward.reference(np, x, 7, 8, 0.5)[0]
    dx = cuda(dropout_backward, np, x, None, 7, 8, 0.5)
    assert dx.shape == () and dx == dropout_backward.reference(np, x, None, 7, 8, 0.5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [5, 1500])
def test_embedding_backward_kernel(dim, dtype, rng):
    ids = rng.integers(0, 6, 40)                            # many repeats: atomic adds meet
    rows = rng.standard_normal((40, dim)).astype(dtype)
    close(cuda(scatter_add_rows, np, ids, rows, 6), scatter_add_rows.reference(np, ids, rows, 6),
          tolerance(dtype, 40, 4))
    assert not cuda(scatter_add_rows, np, ids[:0], rows[:0], 6).any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant,wd", [("plain", 0.0), ("l2", 0.01), ("decoupled", 0.01)])
def test_adam_kernel_equals_the_host_arithmetic_bit_for_bit(variant, wd, dtype, rng):
    """Compiled without FMA contraction, the kernel is the reference's arithmetic exactly; the
    step-dependent scalars come by value or from the device row (graph capture)."""
    lr, beta1, beta2, step = 1e-3, 0.9, 0.98, 7
    settings = AdamSettings(1 - beta1, beta2, 1 - beta2, 1e-8, wd, variant, lr / (1 - beta1 ** step),
                            math.sqrt(1 - beta2 ** step), 1 - lr * wd)   # Python floats, as Adam makes them
    replayed = np.array(settings.step_scalars)
    for row in (None, replayed):
        arrays = [rng.standard_normal(1003).astype(dtype) for _ in range(3)] + [rng.uniform(0, 1, 1003).astype(dtype)]
        ours = [a.copy() for a in arrays]
        cuda(adam_update, np, ours[0], ours[1], ours[2], ours[3], np.empty_like(ours[0]), settings, row)
        adam_update.reference(np, arrays[0], arrays[1], arrays[2], arrays[3], np.empty_like(arrays[0]), settings, row)
        for a, b in zip(ours, arrays):
            np.testing.assert_array_equal(a, b)


# -- the emulator itself finds the bugs it is there for ---------------------------------------------------------
BROKEN = r"""
#include "reduce.cuh"
template <typename T> __global__ void leaves_early(T* x, long long n) {   // threads past n skip the barrier
    if (threadIdx.x >= n) return;
    x[threadIdx.x] = block_sum(x[threadIdx.x]);
}
template <typename T> __global__ void writes_past_the_end(T* x, long long n) { x[n] = T(1); }
template <typename T> __global__ void takes_an_int(T* x, int n) { if (threadIdx.x < n) x[threadIdx.x] = T(n); }
"""


@pytest.fixture
def broken(monkeypatch, tmp_path):
    from npformer.functional import cuda
    for header in cuda.SOURCE_DIR.glob("*.cuh"):
        (tmp_path / header.name).write_text(header.read_text())
    (tmp_path / "broken.cu").write_text(BROKEN)
    monkeypatch.setattr(cuda, "SOURCE_DIR", tmp_path)
    monkeypatch.setitem(cuda.SOURCES, "broken", ("leaves_early", "writes_past_the_end", "takes_an_int"))
    return lambda kernel: cuda_emulator.load("broken", kernel, np.dtype("float32"))


def test_the_emulator_reports_threads_that_miss_a_barrier(broken):
    with pytest.raises(cuda_emulator.LaunchError, match="not every lane of warp 1 reaches|returned while .* wait"):
        broken("leaves_early")((1,), (64,), (np.ones(64, np.float32), np.int64(40)))


def test_the_emulator_reports_writes_past_the_end(broken):
    with pytest.raises(cuda_emulator.LaunchError, match="write past the end"):
        broken("writes_past_the_end")((1,), (32,), (np.ones(4, np.float32), np.int64(4)))


def test_the_emulator_checks_the_argument_types_as_cupy_passes_them(broken):
    x = np.zeros(32, np.float32)
    with pytest.raises(cuda_emulator.LaunchError, match=r"argument 1 is a int \(type code .l.\) for a parameter of type code .i."):
        broken("takes_an_int")((1,), (32,), (x, 5))          # a Python int goes as a long long
    with pytest.raises(cuda_emulator.LaunchError, match=r"float64 \(type code .D.\) for a parameter of type code .F."):
        broken("takes_an_int")((1,), (32,), (np.zeros(32), np.int32(5)))      # a float64 array for a float*
    with pytest.raises(cuda_emulator.LaunchError, match="not C-contiguous"):
        broken("takes_an_int")((1,), (32,), (np.zeros(64, np.float32)[::2], np.int32(5)))
    broken("takes_an_int")((1,), (32,), (x, np.int32(5)))
    np.testing.assert_array_equal(x[:6], [5, 5, 5, 5, 5, 0])
