"""Row reductions for other ops (x, axis signature), apart from math.py because they dispatch (kernel tables)."""
from autograd import backend
from npformer.runtime.kernels import kernel_table

from . import math


def stable_row_max(x, axis):
    """math.stable_max with the row maximum of the table row_max (the CPU's argmax along long rows)."""
    xp = backend.get_array_module(x)
    if x.shape[axis] == 0:
        return math.stable_max(xp, x, axis)
    m = row_max(x, axis)
    xp.copyto(m, 0.0, where=m == -xp.inf)  # not m[mask] = 0: on a GPU that waits for the count
    return m


@kernel_table
def row_max(x, axis):
    """x.max(axis, keepdims=True) of a non-empty axis (NaN if the row holds one)."""
    return x.max(axis=axis, keepdims=True)


@kernel_table
def row_sum(x, axis):
    """x.sum(axis, keepdims=True)."""
    return x.sum(axis=axis, keepdims=True)


@kernel_table
def row_dot(a, b):
    """sum(a * b) along the last axis, keepdims: (..., n), (..., n) -> (..., 1)."""
    return (a * b).sum(axis=-1, keepdims=True)
