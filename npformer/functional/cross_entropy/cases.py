"""The registry cases of F.cross_entropy: each op on ordinary inputs and its
edge cases, with the PyTorch reference written once here (npformer.opcases imports this module; tests/functional/test_op_<family>.py,
`python -m npformer.gradcheck` and the docs' op table read them)."""
import numpy as np

import npformer.functional as F
from npformer.opcases import register, torch_args
from npformer.opcases.inputs import CONSTANTS, normal, op_case, op_family


def cross_entropy_case(label, inputs, target, finite_differences=True, **kwargs):
    """F.cross_entropy(x, target, **kwargs) against torch's (class weights become torch tensors)."""
    target = np.asarray(target)
    return op_case(f"F.cross_entropy ({label})", "cross_entropy", inputs,
                   lambda x: F.cross_entropy(x, target, **kwargs),
                   lambda t, x: t.nn.functional.cross_entropy(x, t.tensor(target), **torch_args(t, kwargs, x)),
                   finite_differences=finite_differences)


_CLASS_WEIGHT = np.array([0.5, 1.0, 2.0, 0.1, 3.0])
CROSS_ENTROPY = [
    cross_entropy_case("smoothing", normal((3, 5)), [2, 0, 4], label_smoothing=0.1),
    cross_entropy_case("smoothing, ignore, weight", normal((5, 5)), [2, -100, 4, 0, 4],
                       weight=np.array([0.5, 1.0, 2.0, 0.3, 1.5]), label_smoothing=0.1),
    # finite differences of logits of 1e4 are meaningless (rounding of the loss ~1e-12 * 1e4 / eps)
    cross_entropy_case("logits 1e4", lambda rng: [1e4 * np.sign(rng.standard_normal((4, 5)))], [0, 1, 2, 4],
                       finite_differences=False),
    cross_entropy_case("smoothing, ignored targets", normal((6, 5)), [0, -100, 2, 4, -100, 1], label_smoothing=0.1),
    cross_entropy_case("ignore_index=0 as padding", normal((6, 5)), [0, 0, 2, 4, 3, 0], label_smoothing=0.1,
                       ignore_index=0),
    cross_entropy_case("sum", normal((4, 5)), [0, -100, 2, 4], reduction="sum"),
    cross_entropy_case("none, smoothing", normal((4, 5)), [0, -100, 2, 4], reduction="none", label_smoothing=0.2),
    cross_entropy_case("spatial (N, C, d1, d2)", normal((2, 5, 3, 2)), [[[0, 1], [4, -100], [2, 2]]] * 2,
                       label_smoothing=0.1),
    cross_entropy_case("spatial, none", normal((2, 5, 3)), [[0, 1, 4], [2, -100, 3]], reduction="none"),
    cross_entropy_case("unbatched", normal((5,)), 3),
    cross_entropy_case("weights", normal((6, 5)), [0, -100, 2, 4, 3, 3], weight=_CLASS_WEIGHT),
    cross_entropy_case("weights, smoothing", normal((6, 5)), [0, -100, 2, 4, 3, 3], weight=_CLASS_WEIGHT,
                       label_smoothing=0.3),
    cross_entropy_case("weights, smoothing, sum", normal((6, 5)), [0, -100, 2, 4, 3, 3], weight=_CLASS_WEIGHT,
                       label_smoothing=0.3, reduction="sum"),
]



def probabilities(rng, shape, axis):
    """Class probabilities (soft labels) of `shape`, normalised along the class `axis`."""
    q = rng.random(shape) + 0.05
    return q / q.sum(axis=axis, keepdims=True)


def probability_case(label, shape, differentiate_target=False, **kwargs):
    """F.cross_entropy(x, target probabilities, **kwargs) against torch's; the target is a constant
    drawn once, or, with differentiate_target, an input that is differentiated like the logits."""
    axis = 0 if len(shape) == 1 else 1
    torch_ce = lambda t, x, q: t.nn.functional.cross_entropy(x, q, **torch_args(t, kwargs, x))  # noqa: E731
    if differentiate_target:
        return op_case(f"F.cross_entropy (probabilities, {label})", "cross_entropy",
                       lambda rng: [rng.standard_normal(shape), probabilities(rng, shape, axis)],
                       lambda x, q: F.cross_entropy(x, q, **kwargs), torch_ce)
    target = probabilities(CONSTANTS, shape, axis)
    return op_case(f"F.cross_entropy (probabilities, {label})", "cross_entropy", normal(shape),
                   lambda x: F.cross_entropy(x, target.astype(x.dtype), **kwargs),
                   lambda t, x: torch_ce(t, x, t.tensor(target).to(x.dtype)))


CROSS_ENTROPY += [
    probability_case("mean", (4, 5)),
    probability_case("smoothing, weights", (4, 5), weight=_CLASS_WEIGHT, label_smoothing=0.2),
    probability_case("sum, weights", (4, 5), weight=_CLASS_WEIGHT, reduction="sum"),
    probability_case("spatial (N, C, d1), none, smoothing", (2, 5, 3), reduction="none", label_smoothing=0.1),
    probability_case("unbatched", (5,)),
    probability_case("target differentiated, smoothing", (3, 5), differentiate_target=True, label_smoothing=0.1),
]


register(op_family("cross_entropy", ("F.cross_entropy",), "cross_entropy", ("CrossEntropyFunction",),
                   "Cross-entropy"),
         *CROSS_ENTROPY)
