"""The composite twin of F.dropout_add: the same function built only from autograd primitives, so that
its gradients come from the tape, a test reference beside torch and finite differences
(npformer.functional.composite installs it)."""
from .._common import tensor_of
from ..activation.twin import dropout
from . import check_dropout_add


def dropout_add(input, residual, p=0.5, training=True, generator=None):
    check_dropout_add(input, residual, p, training, "dropout_add")
    return tensor_of(residual) + dropout(input, p, training, generator)   # the same stream's values as F's
