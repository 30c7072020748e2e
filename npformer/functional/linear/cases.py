"""The registry cases of F.linear: each op on ordinary inputs and its
edge cases, with the PyTorch reference written once here (npformer.opcases imports this module; tests/functional/test_op_<family>.py,
`python -m npformer.gradcheck` and the docs' op table read them)."""
import npformer.functional as F
from npformer.opcases import register
from npformer.opcases.inputs import normal, op_case, op_family


def _linear_torch(t, *args):
    return t.nn.functional.linear(*args)


def _linear_activation_torch(kind):
    def reference(t, *args):
        h = t.nn.functional.linear(*args)
        return t.relu(h) if kind == "relu" else t.nn.functional.gelu(h, approximate="tanh" if kind == "gelu_tanh" else "none")
    return reference


LINEAR = [
    op_case("F.linear", "linear", normal((2, 3, 4), (5, 4), (5,)), F.linear, _linear_torch),
    op_case("F.linear (no bias)", "linear", normal((2, 7, 5), (6, 5)), F.linear, _linear_torch),
] + [  # the bias and the activation fused after the GEMM; ReLU's inputs kept away from its kink
    op_case(f"F.linear (activation={kind})", "linear",
            (lambda rng: [rng.standard_normal((2, 3, 4)), rng.standard_normal((5, 4)), 0.5 + rng.random(5)])
            if kind == "relu" else normal((2, 3, 4), (5, 4), (5,)),
            lambda x, w, b, kind=kind: F.linear(x, w, b, activation=kind), _linear_activation_torch(kind))
    for kind in ("relu", "gelu", "gelu_tanh")
]


register(op_family("linear", ("F.linear", "nn.Linear"), "linear", ("LinearFunction",), "Linear"),
         *LINEAR)
