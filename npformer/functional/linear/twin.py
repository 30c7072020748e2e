"""The composite twin of F.linear: the same function built only from autograd primitives, so that
its gradients come from the tape, a test reference beside torch and finite differences
(npformer.functional.composite installs it)."""
from autograd import Tensor

from .._common import tensor_of
from ..activation.twin import gelu, relu


def linear(input, weight, bias=None, activation=None):
    y = tensor_of(input) @ tensor_of(weight).T
    y = y + bias if bias is not None else y
    if activation == "relu":
        return relu(y)
    return gelu(y, approximate="tanh" if activation == "gelu_tanh" else "none") if activation else y
