"""The composite twin of F.silu and F.swiglu: the same functions built only from autograd primitives,
so that their gradients come from the tape, a test reference beside torch and finite differences
(npformer.functional.composite installs it)."""
from .._common import check_tensor, tensor_of
from . import check_swiglu_arguments


def sigmoid(x):
    """1 / (1 + exp(-x)) as (1 + tanh(x / 2)) / 2: tanh never overflows."""
    return 0.5 + 0.5 * (0.5 * x).tanh()


def silu(input):
    check_tensor("input", input, "silu")
    x = tensor_of(input)
    return x * sigmoid(x)


def swiglu(gate, up):
    check_swiglu_arguments(gate, up)
    return silu(gate) * up
