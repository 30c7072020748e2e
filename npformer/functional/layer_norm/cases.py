"""The registry cases of F.layer_norm: each op on ordinary inputs and its
edge cases, with the PyTorch reference written once here (npformer.opcases imports this module; tests/functional/test_op_<family>.py,
`python -m npformer.gradcheck` and the docs' op table read them)."""
import npformer.functional as F
from npformer.opcases import register
from npformer.opcases.inputs import normal, op_case, op_family


def layer_norm_case(label, shape, normalized_shape, affine, **kwargs):
    """F.layer_norm over the trailing `normalized_shape` with `affine` of (weight, bias)."""
    def inputs(rng):
        params = [1 + rng.standard_normal(normalized_shape), rng.standard_normal(normalized_shape)]
        return [rng.standard_normal(shape)] + params[:affine]
    return op_case(f"F.layer_norm{label}", "layer_norm", inputs,
                   lambda x, *p: F.layer_norm(x, normalized_shape, *p, **kwargs),
                   lambda t, x, *p: t.nn.functional.layer_norm(x, normalized_shape, *p, **kwargs),
                   input_names=("x", "weight", "bias")[:1 + affine])


LAYER_NORM = [
    layer_norm_case("", (2, 3, 5), (5,), 2),
    layer_norm_case(" ((4, 5), eps=1e-3)", (2, 3, 4, 5), (4, 5), 2, eps=1e-3),
    layer_norm_case(" ((4, 5), weight only)", (2, 3, 4, 5), (4, 5), 1, eps=1e-3),
    layer_norm_case(" ((4, 5), no affine)", (2, 3, 4, 5), (4, 5), 0, eps=1e-3),
    # the bias added after torch's layer_norm: the same function, but torch's double backward of
    # layer_norm(x, shape, None, bias) fails ("Expected a proper Tensor but got None", torch 2.x)
    op_case("F.layer_norm (bias only)", "layer_norm", normal((2, 3, 5), (5,)), lambda x, b: F.layer_norm(x, 5, None, b),
            lambda t, x, b: t.nn.functional.layer_norm(x, (5,)) + b),
]


register(op_family("layer_norm", ("F.layer_norm", "nn.LayerNorm"), "layer_norm", ("LayerNormFunction",), "LayerNorm"),
         *LAYER_NORM)
