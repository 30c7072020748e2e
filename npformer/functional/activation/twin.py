"""The composite twin of F.relu, F.gelu and F.dropout: the same function built only from autograd primitives, so that
its gradients come from the tape, a test reference beside torch and finite differences
(npformer.functional.composite installs it)."""
from autograd import Tensor, where
from autograd.checks import check_bool, check_real

from .._common import tensor_of
from . import TANH_C, TANH_K, dropout_mask, dropout_scale
from .erf import BOUNDS, SQRT_2, erf_far, erf_middle, erf_near, erf_small


def relu(input):
    return tensor_of(input).relu()


def erf(z):
    """erf of a Tensor from fdlibm's branch formulas, each fed only its own interval's entries."""
    a_data = abs(z.data)
    a = where(z.data < 0, -z, z)
    pieces = [((a_data < BOUNDS[0]), 0.5, erf_small),
              ((a_data >= BOUNDS[0]) & (a_data < BOUNDS[1]), 1.0, erf_middle),
              ((a_data >= BOUNDS[1]) & (a_data < BOUNDS[2]), 2.0,
               lambda t: erf_near(t, Tensor.exp)),
              ((a_data >= BOUNDS[2]) & (a_data < BOUNDS[3]), 4.0,
               lambda t: erf_far(t, Tensor.exp))]
    result = 1.0  # |z| >= 6
    for inside, filler, formula in reversed(pieces):
        result = where(inside, formula(where(inside, a, filler)), result)
    return where(z.data < 0, -result, result)


def gelu(input, approximate="none"):
    x = tensor_of(input)
    if approximate == "tanh":
        return 0.5 * x * (1.0 + (TANH_C * (x + TANH_K * x * x * x)).tanh())
    return x * (0.5 * (1.0 + erf(x / SQRT_2)))


def dropout(input, p=0.5, training=True, generator=None):
    x = tensor_of(input)
    p = check_real(p, "p", "dropout", at_least=0, at_most=1)
    if not check_bool(training, "training", "dropout") or p == 0.0:
        return input
    keep = dropout_mask(x.shape, p, x.device, generator)     # the same values of the same stream as F.dropout
    scale = keep.astype(x.dtype)
    scale *= dropout_scale(p)                                 # in place: a 0-d array stays an array of x's dtype
    return x * Tensor(scale)
