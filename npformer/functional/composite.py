"""Slow twins of the fused ops, built only from autograd primitives (Tensor arithmetic, exp,
log, sum, max, where, matmul, getitem, ...), so their gradients come from the tape rather
than from a hand-written backward: each op folder's `twin.py`, gathered here under the names and
signatures of npformer.functional. The test suite uses them as a second reference next to torch
and finite differences."""
import contextlib
import importlib as _importlib

from . import OPS
from ._common import _twins

for _folder in OPS:  # each folder's twins, under its public ops' names: layer_norm, softmax, ...
    _twin = _importlib.import_module(f"{__package__}.{_folder}.twin")
    _public = _importlib.import_module(f"{__package__}.{_folder}").__all__
    globals().update({name: getattr(_twin, name) for name in _public if hasattr(_twin, name)})


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
