"""Slow twins of the fused ops, built only from autograd primitives (Tensor arithmetic, exp,
log, sum, max, where, matmul, getitem, ...), so their gradients come from the tape rather
than from a hand-written backward: each op folder's `twin.py`, gathered here under the names and
signatures of npformer.functional. The test suite uses them as a second reference next to torch
and finite differences."""
import contextlib

from ._common import _twins
from .activation.twin import dropout, erf, gelu, relu  # noqa: F401  (the twins, by op name)
from .attention.twin import scaled_dot_product_attention, split_heads  # noqa: F401
from .cross_entropy.twin import cross_entropy  # noqa: F401
from .dropout_add.twin import dropout_add  # noqa: F401
from .embedding.twin import embedding  # noqa: F401
from .layer_norm.twin import layer_norm  # noqa: F401
from .linear.twin import linear  # noqa: F401
from .rotary.twin import apply_rotary_emb  # noqa: F401
from .softmax.twin import log_softmax, softmax  # noqa: F401


@contextlib.contextmanager
def installed():
    """Within the block, in the calling thread, npformer.functional's ops run these twins, so
    every module that calls `F.op(...)` (npformer.nn, npformer.models) runs on autograd
    primitives instead. Other threads keep the fused ops."""
    old = _twins.active
    _twins.active = True
    try:
        yield
    finally:
        _twins.active = old
