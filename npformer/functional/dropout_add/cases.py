"""The registry cases of F.dropout_add: each op on ordinary inputs and its
edge cases, with the PyTorch reference written once here (npformer.opcases imports this module; tests/functional/test_op_<family>.py,
`python -m npformer.gradcheck` and the docs' op table read them)."""
import npformer.functional as F
from npformer.opcases import register
from npformer.opcases.inputs import normal, op_case, op_family
from npformer.runtime import random

from ..activation.cases import _dropout_torch


def _dropout_add_torch(t, x, residual):
    """residual + dropout(x) with F.dropout's mask (_dropout_torch)."""
    return residual + _dropout_torch(t, x)


DROPOUT_ADD = [op_case("F.dropout_add (seeded)", "dropout_add", normal((4, 5), (4, 5)),
                       lambda x, r: F.dropout_add(x, r, 0.4, generator=random.Philox(7)), _dropout_add_torch)]


register(op_family("dropout_add", ("F.dropout_add",), "dropout_add", ("DropoutAddFunction",), "Dropout + residual"),
         *DROPOUT_ADD)
