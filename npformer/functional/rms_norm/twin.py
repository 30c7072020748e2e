"""The composite twin of F.rms_norm: the same function built only from autograd primitives, so that
its gradients come from the tape, a test reference beside torch and finite differences
(npformer.functional.composite installs it)."""
from .._common import tensor_of
from . import rms_norm_arguments


def rms_norm(input, normalized_shape, weight=None, eps=None):
    _, shape, _, eps = rms_norm_arguments(input, normalized_shape, weight, eps)
    x = tensor_of(input)
    axes = tuple(range(x.ndim - len(shape), x.ndim))
    y = x / ((x * x).mean(axis=axes, keepdims=True) + eps).sqrt()
    return y * weight if weight is not None else y
