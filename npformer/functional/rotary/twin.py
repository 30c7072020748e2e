"""The composite twin of F.apply_rotary_emb: the same function built only from autograd primitives, so that
its gradients come from the tape, a test reference beside torch and finite differences
(npformer.functional.composite installs it)."""
from autograd import Tensor, concatenate

from .._common import tensor_of
from . import rotary_tables


def apply_rotary_emb(x, cos, sin):
    cos, sin = map(Tensor, rotary_tables(x, cos, sin))
    x = tensor_of(x)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
