"""npformer.runtime.kernels: each fused computation runs the implementation registered for its device,
else its reference; every registered implementation equals its reference (CUDA ones on a GPU)."""
import importlib
import threading

import numpy as np
import pytest

from autograd import backend
from npformer.functional.softmax import softmax_backward, softmax_forward
from npformer.runtime import kernels


def make_table():
    @kernels.kernel_table
    def double(x, scale=1.0):
        """the reference"""
        return 2 * x * scale

    @double.register("cpu", supports=lambda x, scale=1.0: x.ndim == 1)
    def double_cpu(x, scale=1.0):
        return ("cpu", 2 * x * scale)

    return double


def test_a_table_runs_the_implementation_of_the_device_where_it_supports_the_arguments():
    double = make_table()
    assert double(np.ones(3))[0] == "cpu"
    np.testing.assert_array_equal(double(np.ones((2, 2))), 2 * np.ones((2, 2)))   # unsupported: the reference
    np.testing.assert_array_equal(backend.as_numpy(double(backend.to_device(np.ones(3), "test"))), 2 * np.ones(3))
    assert double.__name__ == "double" and double.__doc__ == "the reference"
    with pytest.raises(ValueError, match=r"register: device must be one of .*got 'gpu'"):
        double.register("gpu")


def test_reference_only_is_per_thread():
    double = make_table()
    seen = {}

    def other():
        seen["other"] = double(np.ones(3))[0]

    with kernels.reference_only():
        assert isinstance(double(np.ones(3)), np.ndarray)
        worker = threading.Thread(target=other)
        worker.start()
        worker.join()
    assert seen["other"] == "cpu" and double(np.ones(3))[0] == "cpu"


def test_choose_says_which_implementation_runs_and_why():
    """choose(*args) -> (implementation, reason), without running it; select and a call follow it."""
    double = make_table()
    cpu = double.implementations["cpu"][0]
    on_test = backend.to_device(np.ones(3), "test")
    assert double.choose(np.ones(3)) == (cpu, "cpu: supports(...) accepted")
    assert double.choose(np.ones((2, 2))) == (double.reference, "reference: cpu's supports(...) refused")
    assert double.choose(on_test) == (double.reference, "reference: no test implementation")
    assert double.choose(3.0, scale=np.ones(3)) == (double.reference, "reference: no array argument")
    with kernels.reference_only():
        assert kernels.is_reference_only()
        assert double.choose(np.ones(3)) == (double.reference, "reference: inside reference_only()")
    assert not kernels.is_reference_only()
    for args in [(np.ones(3),), (np.ones((2, 2)),), (on_test,)]:
        assert double.select(*args) is double.choose(*args)[0]

    @kernels.kernel_table
    def plain(x):
        return x
    assert plain.choose(np.ones(3)) == (plain.reference, "reference: nothing else is registered")
    plain.register("cpu")(lambda x: -x)
    assert plain.choose(np.ones(3))[1] == "cpu: takes every argument" and plain(np.ones(3))[0] == -1


def test_runs_reference_is_true_for_the_reference_and_its_splits_only():
    double = make_table()
    assert double.runs_reference(double.reference) and not double.runs_reference(double.implementations["cpu"][0])

    @double.register("cpu", splits_reference=True)
    def double_in_blocks(x, scale=1.0):
        return double.reference(x, scale)
    assert double.runs_reference(double.choose(np.ones(3))[0]) and double.reference_splits == {double_in_blocks}


ROW_LENGTHS = [1, 7, 64, 1000, 3000]


def rows(rng, n, device, dtype="float64"):
    x = rng.standard_normal((5, 3, n)).astype(dtype)
    x[0, 0] = -np.inf                                    # a fully masked row
    x[1, 1, : (n + 1) // 2] = -np.inf                    # a half masked one
    return backend.to_device(x, device)


@pytest.mark.parametrize("n", ROW_LENGTHS)
def test_softmax_implementations_equal_the_reference(n, device, rng):
    """Whatever each device registers (einsum row sums on the CPU, CUDA kernels on a GPU) gives
    the reference's softmax and gradient to rounding, in place too."""
    x = rows(rng, n, device)
    dy = backend.to_device(rng.standard_normal(x.shape), device)
    xp = backend.get_array_module(x)
    with kernels.reference_only():
        y_ref = softmax_forward(xp, x, -1)
        dx_ref = softmax_backward(xp, y_ref, dy, -1)
    y = softmax_forward(xp, x, -1)
    dx = softmax_backward(xp, y, dy, -1)
    tol = 8 * np.finfo(np.float64).eps * np.sqrt(n)          # rounding of sums of n terms of size <= 1
    np.testing.assert_allclose(backend.as_numpy(y), backend.as_numpy(y_ref), rtol=0, atol=tol)
    dy_scale = float(np.abs(backend.as_numpy(dy)).max())
    np.testing.assert_allclose(backend.as_numpy(dx), backend.as_numpy(dx_ref), rtol=0, atol=tol * dy_scale)
    assert not backend.as_numpy(y)[0, 0].any()               # the fully masked row is zeros
    in_place = x.copy()
    softmax_forward(xp, in_place, -1, out=in_place)
    np.testing.assert_array_equal(backend.as_numpy(in_place), backend.as_numpy(y))


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16"])
def test_row_max_equals_the_reference_with_nan_and_infinities(dtype, device, rng):
    """The row maximum of every device is the reference's max exactly: rows of -inf, a NaN
    anywhere in a row (max propagates it), +inf (on the CPU the rows of 3,000 take the argmax
    path, the others max: below ROW_MAX_MIN_ENTRIES; the next test covers both)."""
    from npformer.functional.softmax import row_max
    for n in ROW_LENGTHS:
        x = backend.as_numpy(rows(rng, n, "cpu", dtype))
        x[2, 0, n // 2] = np.nan
        x[3, 1, -1] = np.inf
        x = backend.to_device(x, device)
        with kernels.reference_only():
            want = backend.as_numpy(row_max(x, -1))
        got = backend.as_numpy(row_max(x, -1))
        assert got.shape == (5, 3, 1) and got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
    assert row_max.select(np.ones((2, 3)), 0) is row_max.reference          # not the last axis: the reference


def test_row_max_cpu_equals_max_on_large_rows_in_any_layout(rng, monkeypatch):
    """From ROW_MAX_MIN_ENTRIES entries the CPU runs the argmax path: the same values as max,
    for a non-contiguous array too (a transposed view)."""
    softmax = importlib.import_module("npformer.functional.softmax")   # (F.softmax is the function)
    from npformer.functional.softmax import cpu as softmax_cpu
    x = rng.standard_normal((4, 64, 64)).astype(np.float32)
    x[1, 2, 3] = np.nan
    assert x.size >= softmax_cpu.ROW_MAX_MIN_ENTRIES and softmax.row_max.select(x, -1) is softmax_cpu.row_max_cpu
    for a in (x, x.swapaxes(-1, -2), x[:, ::2]):
        np.testing.assert_array_equal(softmax.row_max(a, -1), a.max(axis=-1, keepdims=True))
    monkeypatch.setattr(softmax_cpu, "ROW_MAX_MIN_ENTRIES", 0)                  # the small shapes of the test above
    for shape in [(1,), (3, 1), (2, 3, 5)]:
        a = rng.standard_normal(shape)
        np.testing.assert_array_equal(softmax.row_max(a, -1), a.max(axis=-1, keepdims=True))


def test_cuda_softmax_kernels_run_and_fall_back_where_they_do_not_apply(rng):
    """On a GPU: float32 rows of any length through the kernel; a softmax along another axis or
    of a non-contiguous array takes the reference."""
    if not backend.cuda_available():
        pytest.skip("cuda: CuPy or a GPU is not available on this machine")
    forward = softmax_forward
    x = rows(rng, 3000, "cuda", "float32")
    xp = backend.get_array_module(x)
    assert forward.select(xp, x, -1).__name__ == "softmax_forward_cuda"
    assert forward.select(xp, x, 1) is forward.reference
    assert forward.select(xp, x[..., ::2], -1) is forward.reference
    with kernels.reference_only():
        ref = forward(xp, x, -1)
    np.testing.assert_allclose(backend.as_numpy(forward(xp, x, -1)), backend.as_numpy(ref), rtol=0, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 8, 64])
def test_layer_norm_cpu_blocks_equal_the_reference_and_run_from_cpu_min_entries(rows, rng):
    """The CPU's row-block layer norm gives the reference's y, xhat and rstd to rounding; the table
    runs it from CPU_MIN_ENTRIES entries on (below, the reference's fewer calls are faster)."""
    normalization = importlib.import_module("npformer.functional.layer_norm")   # (F.layer_norm is the function)
    from npformer.functional.layer_norm import cpu as normalization_cpu
    d = 768
    x = rng.standard_normal((rows, d)) * 3 + 5
    w, b = rng.standard_normal(d), rng.standard_normal(d)
    ours = normalization_cpu.layer_norm_forward_cpu(np, x, w, b, 1e-5)
    ref = normalization.layer_norm_forward.reference(np, x, w, b, 1e-5)
    tol = 16 * np.finfo(np.float64).eps * np.sqrt(d)     # rounding of row sums of d terms, relative
    for got, want in zip(ours, ref):
        np.testing.assert_allclose(got, want, rtol=0, atol=tol * (1 + np.abs(want).max()))
    chosen = normalization.layer_norm_forward.select(np, x, w, b, 1e-5)
    expected = normalization_cpu.layer_norm_forward_cpu if x.size >= normalization_cpu.CPU_MIN_ENTRIES else \
        normalization.layer_norm_forward.reference
    assert chosen is expected
