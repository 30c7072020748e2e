"""What the kernel tables brought beside the registry's cases (npformer/opcases: linear with an
activation, dropout_add): ReLU's edge values as torch's (the CPU's bitwise mask, the reference and
the CUDA kernel agree on them), an unknown activation refused, and docs/gpu.md's table of which
implementation runs where kept equal to the tables."""
import pathlib

import numpy as np
import pytest

import npformer.functional as F
from autograd import Tensor, backend, kernels


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
    np.testing.assert_array_equal(backend.as_numpy(ours.grad), theirs.grad.numpy())


def test_linear_rejects_an_unknown_activation():
    with pytest.raises(ValueError, match=r"activation must be None or one of \('relu', 'gelu', 'gelu_tanh'\), got 'tanh'"):
        F.linear(Tensor(np.zeros((2, 3))), Tensor(np.zeros((4, 3))), activation="tanh")


def test_docs_list_every_kernel_table_and_where_it_has_implementations():
    """docs/gpu.md's table "which implementation runs where" names every kernel table of npformer;
    its "cpu" and "cuda" columns start with "(" exactly where nothing is registered."""
    text = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "gpu.md").read_text()
    text = text.split("## Kernel tables")[1].split("\n## ")[0]
    for table in kernels.TABLES:
        if not table.reference.__module__.startswith(("npformer", "autograd")):
            continue  # tables the tests make
        rows = [line for line in text.splitlines() if line.startswith("|") and f"`{table.__name__}`" in line]
        assert len(rows) == 1, f"docs/gpu.md: no row (or several) for the kernel table {table.__name__}"
        columns = [c.strip() for c in rows[0].split("|")]
        for device, column in (("cpu", columns[3]), ("cuda", columns[4])):
            assert (device in table.implementations) == (not column.startswith("(")), (table.__name__, device)
