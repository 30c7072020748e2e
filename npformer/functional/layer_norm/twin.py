"""The composite twin of F.layer_norm: the same function built only from autograd primitives, so that
its gradients come from the tape, a test reference beside torch and finite differences
(npformer.functional.composite installs it)."""
from autograd.checks import check_shape

from .._common import tensor_of


def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    x = tensor_of(input)
    shape = check_shape(normalized_shape, "normalized_shape", "layer_norm")
    axes = tuple(range(x.ndim - len(shape), x.ndim))
    centered = x - x.mean(axis=axes, keepdims=True)
    y = centered / ((centered * centered).mean(axis=axes, keepdims=True) + eps).sqrt()
    if weight is not None:
        y = y * weight
    return y + bias if bias is not None else y
