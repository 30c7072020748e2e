"""The composite twin of F.softmax and F.log_softmax: the same function built only from autograd primitives, so that
its gradients come from the tape, a test reference beside torch and finite differences
(npformer.functional.composite installs it)."""
from autograd import Tensor, where

from .._common import tensor_of


def _stable_shift(x, dim):
    """x - max (a constant: softmax does not depend on it), with all -inf rows shifted by 0."""
    xp = x.xp
    if x.data.size == 0:                                      # nothing to shift (an empty max has no identity)
        return x
    m = x.data.max(axis=dim, keepdims=True)
    return x - Tensor(xp.where(m == -xp.inf, 0, m))   # +inf, NaN: a NaN row, as torch's


def softmax(input, dim=-1):
    e = _stable_shift(tensor_of(input), dim).exp()
    total = e.sum(axis=dim, keepdims=True)
    return e / where(total.data == 0, 1.0, total)


def log_softmax(input, dim=-1):
    shifted = _stable_shift(tensor_of(input), dim)
    total = shifted.exp().sum(axis=dim, keepdims=True)
    return shifted - where(total.data == 0, 1.0, total).log()
