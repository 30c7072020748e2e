"""What the kernel tables brought beside the registry's cases (npformer/opcases: linear with an
activation, dropout_add): ReLU's edge values as torch's (the CPU's bitwise mask, the reference and
the CUDA kernel agree on them), an unknown activation refused, and docs/gpu.md's table of which
implementation runs where kept equal to the tables."""
import pathlib

import numpy as np
import pytest

import npformer.functional as F
from autograd import Tensor, backend
from npformer.runtime import kernels


def test_relu_edge_values_are_torchs(device, torch):
    """relu(-inf) = 0, relu(NaN) = NaN; the gradient passes at NaN and is exactly 0 where x <= 0
    (also for a NaN upstream gradient), as torch's threshold_backward."""
    x = np.array([-np.inf, -1.0, 0.0, 2.0, np.inf, np.nan])
    ours, theirs = Tensor(x, requires_grad=True, device=device), torch.tensor(x, requires_grad=True)
    out, ref = F.relu(ours), torch.relu(theirs)
    np.testing.assert_array_equal(out.numpy(), ref.detach().numpy())
    g = np.array([np.nan, np.nan, 1.0, 2.0, 3.0, 4.0])
    out.backward(backend.to_device(g, device))
    ref.backward(torch.tensor(g))
    np.testing.assert_array_equal(ours.grad.numpy(), theirs.grad.numpy())


def test_linear_rejects_an_unknown_activation():
    with pytest.raises(ValueError, match=r"activation must be None or one of \('relu', 'gelu', 'gelu_tanh'\), got 'tanh'"):
        F.linear(Tensor(np.zeros((2, 3))), Tensor(np.zeros((4, 3))), activation="tanh")


def test_docs_list_every_kernel_table_and_where_it_has_implementations():
    """docs/gpu.md's table "which implementation runs where" names every kernel table of npformer;
    its "cpu" and "cuda" columns start with "(" exactly where nothing is registered."""
    text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "gpu.md").read_text()
    text = text.split("## Kernel tables")[1].split("\n## ")[0]
    for table in kernels.TABLES:
        if not table.reference.__module__.startswith(("npformer", "autograd")):
            continue  # tables the tests make
        rows = [line for line in text.splitlines() if line.startswith("|") and f"`{table.__name__}`" in line]
        assert len(rows) == 1, f"docs/gpu.md: no row (or several) for the kernel table {table.__name__}"
        columns = [c.strip() for c in rows[0].split("|")]
        for device, column in (("cpu", columns[3]), ("cuda", columns[4])):
            assert (device in table.implementations) == (not column.startswith("(")), (table.__name__, device)


class Claimed(np.ndarray):
    """An array whose entries must not be read (a failure report prints only its shape)."""

    def __repr__(self):
        return f"<claimed array of shape {self.shape}>"

    __str__ = __repr__


def claims(shape, dtype="float32"):
    """A C-contiguous array of `shape` over one entry of memory (never read): what the CUDA launchers
    and their `supports` see of an array of 2^31 entries or more, without the memory."""
    strides = np.cumprod((1,) + shape[:0:-1])[::-1] * np.dtype(dtype).itemsize
    view = np.lib.stride_tricks.as_strided(np.zeros(1, dtype), shape, tuple(int(s) for s in strides), writeable=False)
    return view.view(Claimed)


def test_cuda_row_kernels_leave_rows_of_2_31_entries_to_the_reference():
    """The row kernels take the row length as an int (np.int32(n) raised OverflowError at the
    launch, and i += blockDim.x overflows near 2^31): such rows go to the reference."""
    from npformer.functional.embedding import scatter_add_rows
    from npformer.functional.cross_entropy import cross_entropy_backward, cross_entropy_forward
    from npformer.functional.layer_norm import layer_norm_backward, layer_norm_forward
    from npformer.functional.softmax import (log_softmax_backward, log_softmax_forward, softmax_backward,
                                             softmax_forward)
    for n, expected in ((2**31 - 1 - 1024, True), (2**31 - 1024, False), (2**31, False)):
        x, t, ones = claims((1, n)), np.zeros(1, np.int64), np.ones(1, bool)
        w, rstd = claims((n,)), np.ones((1, 1), np.float32)
        calls = [(softmax_forward, np, x, -1), (softmax_backward, np, x, x, -1), (log_softmax_forward, np, x, -1),
                 (log_softmax_backward, np, x, x, -1), (cross_entropy_forward, np, x, t, ones, None, 0.0),
                 (cross_entropy_backward, np, x, t, None, 0.0, np.ones(1, np.float32)),
                 (layer_norm_forward, np, x, w, w, 1e-5), (layer_norm_backward, np, x, x, rstd, w, True, True, True),
                 (scatter_add_rows, np, t, x, 1)]
        supported = {table.__name__: table.implementations["cuda"][1](*args) for table, *args in calls}
        assert supported == dict.fromkeys(supported, expected), n    # (no repr of the arrays: never read them)


@pytest.mark.parametrize("kind", ["relu", "gelu"])
def test_cuda_activation_launcher_takes_a_flat_array_of_2_31_entries(kind, monkeypatch):
    """Without a bias the kernels never read the row length: a 1-D input of 2^31 + 1 entries is
    launched (its length went as an int: np.int32(2^31 + 1) raised OverflowError)."""
    from npformer.functional.activation import bias_activation_forward
    from npformer.functional.activation import cuda as activation
    launches = []
    monkeypatch.setattr(activation, "function", lambda *names: lambda grid, block, args: launches.append(args))
    x = claims((2**31 + 1,))
    supported = bias_activation_forward.implementations["cuda"][1](np, x, None, kind)
    assert supported
    try:
        activation.bias_activation_forward_cuda(np, x, None, kind)     # outputs allocated, never touched
    except MemoryError:
        pytest.skip("no address space for an untouched 8 GiB output on this machine")
    size = [int(args[-2 if kind == "relu" else -3]) for args in launches]
    assert size == [2**31 + 1]                                       # the entries, a long long
