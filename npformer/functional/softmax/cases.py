"""The registry cases of F.softmax and F.log_softmax: each op on ordinary inputs and its
edge cases, with the PyTorch reference written once here (npformer.opcases imports this module; tests/functional/test_op_<family>.py,
`python -m npformer.gradcheck` and the docs' op table read them)."""
import npformer.functional as F
from npformer.opcases import register
from npformer.opcases.inputs import fixed, normal, op_case, op_family


SOFTMAX = [
    op_case("F.softmax", "softmax", normal((3, 5)), F.softmax, lambda t, x: t.softmax(x, dim=-1)),
    op_case("F.softmax (dim=0)", "softmax", normal((4, 5)), lambda x: F.softmax(x, dim=0),
            lambda t, x: t.softmax(x, dim=0)),
    op_case("F.softmax [[-1000, 1]]", "softmax", fixed([[-1000.0, 1.0]]), F.softmax, lambda t, x: t.softmax(x, dim=-1)),
    op_case("F.log_softmax", "softmax", normal((4, 5)), F.log_softmax, lambda t, x: t.log_softmax(x, dim=-1)),
    op_case("F.log_softmax (dim=0)", "softmax", normal((4, 5)), lambda x: F.log_softmax(x, dim=0),
            lambda t, x: t.log_softmax(x, dim=0)),
]


register(op_family("softmax", ("F.softmax", "F.log_softmax"), "softmax", ("SoftmaxFunction", "LogSoftmaxFunction"),
                   "Softmax"),
         *SOFTMAX)
