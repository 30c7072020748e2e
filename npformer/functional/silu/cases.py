"""The registry cases of F.silu and F.swiglu: each op on ordinary inputs and its edge cases, with the
PyTorch reference written once here (npformer.opcases imports this module; tests/functional/test_op_<family>.py,
`python -m npformer.gradcheck` and the docs' op table read them)."""
import numpy as np

import npformer.functional as F
from npformer.opcases import register
from npformer.opcases.inputs import normal, op_case, op_family


def spread(shape, scale):
    """inputs: one array of `shape`, normal times `scale`, whose first row runs from -scale to scale
    (both tails of sigmoid and the region around 0 in every case)."""
    def inputs(rng):
        x = scale * rng.standard_normal(shape)
        x.reshape(-1, shape[-1])[0] = np.linspace(-scale, scale, shape[-1])
        return [x]
    return inputs


SILU = [
    op_case("F.silu", "silu", normal((3, 5), scale=3.0), F.silu, lambda t, x: t.nn.functional.silu(x)),
    op_case("F.silu (tails, |x| <= 12)", "silu", spread((2, 3, 7), 12.0), F.silu, lambda t, x: t.nn.functional.silu(x)),
]

SWIGLU = [
    op_case("F.swiglu", "swiglu", normal((2, 3, 5), (2, 3, 5), scale=2.0), F.swiglu,
            lambda t, gate, up: t.nn.functional.silu(gate) * up),
    op_case("F.swiglu (1-D, wide gate)", "swiglu", lambda rng: [spread((9,), 10.0)(rng)[0], rng.standard_normal(9)],
            F.swiglu, lambda t, gate, up: t.nn.functional.silu(gate) * up),
]


register(op_family("silu", ("F.silu", "nn.SiLU"), "silu", ("SiLUFunction", "SiLUBackward"), "SiLU"),
         op_family("swiglu", ("F.swiglu", "nn.SwiGLU"), "silu", ("SwiGLUFunction", "SwiGLUBackward"), "SwiGLU"),
         *SILU, *SWIGLU)
