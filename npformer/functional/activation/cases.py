"""The registry cases of F.relu, F.gelu and F.dropout: each op on ordinary inputs and its
edge cases, with the PyTorch reference written once here (npformer.opcases imports this module; tests/functional/test_op_<family>.py,
`python -m npformer.gradcheck` and the docs' op table read them)."""
import npformer.functional as F
from npformer.opcases import register
from npformer.opcases.inputs import away_from_zero, normal, op_case, op_family, seeded

from . import dropout_scale, keep_mask


RELU = [op_case("F.relu", "relu", away_from_zero((3, 5)), F.relu, lambda t, x: t.relu(x))]

GELU = [
    op_case("F.gelu", "gelu", normal((3, 5), scale=3.0), F.gelu, lambda t, x: t.nn.functional.gelu(x)),
    op_case("F.gelu (tanh)", "gelu", normal((3, 5), scale=3.0), lambda x: F.gelu(x, approximate="tanh"),
            lambda t, x: t.nn.functional.gelu(x, approximate="tanh")),
]

def _dropout_torch(t, x):
    """x * m with m the mask of a fresh Philox(7) stream (the dropout contract)."""
    keep = keep_mask(tuple(x.shape), 0.4, 7, 0, "cpu")
    return x * t.as_tensor(keep * dropout_scale(0.4)).to(x.dtype)   # not via numpy: torch.func's x has no storage


DROPOUT = [op_case("F.dropout (seeded)", "dropout", normal((4, 5)),
                   lambda x: F.dropout(x, 0.4, generator=seeded(7, x)), _dropout_torch)]


register(op_family("relu", ("F.relu", "nn.ReLU"), "activation", ("ReLUFunction",), "ReLU"),
         op_family("gelu", ("F.gelu", "nn.GELU"), "activation", ("GELUFunction",), "GELU"),
         op_family("dropout", ("F.dropout", "nn.Dropout"), "activation", ("DropoutFunction",), "Dropout"),
         *RELU, *GELU, *DROPOUT)
