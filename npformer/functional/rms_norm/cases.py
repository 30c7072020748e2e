"""The registry cases of F.rms_norm: the op on ordinary inputs and its edge cases, with the PyTorch
reference written once here (npformer.opcases imports this module; tests/functional/test_op_<family>.py,
`python -m npformer.gradcheck` and the docs' op table read them)."""
import npformer.functional as F
from npformer.opcases import register
from npformer.opcases.inputs import op_case, op_family


def rms_norm_case(label, shape, normalized_shape, weight, offset=0.0, **kwargs):
    """F.rms_norm over the trailing `normalized_shape`, with a weight or without; x standard normal
    plus `offset` (a row far from zero mean: the mean is not subtracted, and must not be)."""
    torch_shape = (normalized_shape,) if isinstance(normalized_shape, int) else normalized_shape   # torch's: a tuple

    def inputs(rng):
        return [offset + rng.standard_normal(shape)] + ([1 + rng.standard_normal(normalized_shape)] if weight else [])
    return op_case(f"F.rms_norm{label}", "rms_norm", inputs,
                   lambda x, *w: F.rms_norm(x, normalized_shape, *w, **kwargs),
                   lambda t, x, *w: t.nn.functional.rms_norm(x, torch_shape, *w, **kwargs),
                   input_names=("x", "weight")[:1 + weight])


RMS_NORM = [
    rms_norm_case("", (2, 3, 5), (5,), True),
    rms_norm_case(" ((4, 5), eps=1e-3)", (2, 3, 4, 5), (4, 5), True, eps=1e-3),
    rms_norm_case(" (no weight, eps=0.5)", (3, 4), 4, False, eps=0.5),
    rms_norm_case(" (mean 3, eps=1e-6)", (2, 6), (6,), True, offset=3.0, eps=1e-6),
]


register(op_family("rms_norm", ("F.rms_norm", "nn.RMSNorm"), "rms_norm", ("RMSNormFunction", "RMSNormBackward"),
                   "RMSNorm"),
         *RMS_NORM)
