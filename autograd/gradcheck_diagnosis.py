"""What kind of mistake a failed gradient check sees (a second read beside gradcheck_extras.py):
`autograd.gradcheck` adds these verdicts and notes to its own, so that a message says more
than "wrong".

- `nonfinite_note`: the NaN and inf of yours (or of the reference), counted, the first entry named.
- `kink_note`: at the worst entry of a wrong input, the one-sided slopes differ (ReLU at 0): the
  central difference is their average, which no backward gives.
- `right_for_ones_verdict`: the backward is right for an all-ones upstream gradient (the
  gradient of sum()) and wrong for the random one: it misuses the gradient it is given.
- `in_place_verdict` (`writers_of_upstream` names the op): a backward wrote into the upstream
  gradient it was given (vjp hands it a copy and compares).
- `layout_verdicts`: the function run and backpropagated again on non-contiguous copies of the
  same values (`strided`) must give the same outputs and gradients.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from . import backend
from .gradcheck import _max, _outputs, judge, numeric_gradient, random_generator, vjp
from .modes import enable_grad, no_grad
from .tensor import Tensor

__all__ = ["LAYOUT_RTOL", "backward_verdicts", "in_place_verdict", "kink_explainer", "kink_note", "layout_verdicts", "nonfinite_note",
           "right_for_ones_verdict", "same", "slopes_note", "strided", "writers_of_upstream"]


def backward_verdicts(loss: Callable[[], float], fn: Callable, inputs: list, names: list, checked: list, outs: list,
                      upstream: list, analytic: list, verdicts: list, written: list, eps: float, atol: float,
                      rtol: float, seed: int, report: list | None, options: dict | None = None) -> list:
    """The verdicts gradcheck adds after judging each input (`verdicts`, one per checked input):
    the random direction over all inputs (gradcheck_extras), then all-ones, in-place and layout
    (each only where it finds something), then torch's checks that `options` ask for
    (gradcheck_extras.torch_option_verdicts: reentrant, undefined and batched gradients)."""
    from .gradcheck_extras import TORCH_OPTIONS, random_direction_verdict, torch_option_verdicts

    added = [random_direction_verdict(loss, inputs, checked, analytic, eps, atol, rtol, seed, report)]
    wrong = [i for i, (passed, _) in zip(checked, verdicts) if not passed]
    if wrong:
        added += right_for_ones_verdict(fn, inputs, wrong, eps, atol, rtol)
    if written:
        added.append(in_place_verdict(fn, inputs, written, seed))
    added += layout_verdicts(fn, inputs, names, checked, outs, upstream, analytic)
    return added + torch_option_verdicts(fn, inputs, names, checked, upstream, analytic, atol, rtol, seed,
                                         TORCH_OPTIONS if options is None else options)


def nonfinite_note(yours: Any, reference: Any) -> str:
    """For `judge`: ", yours has NaN at 2 entries (the first at index (1, 2))" for each of yours
    and the reference with a NaN or inf where the other is not the same; "" when there is none."""
    xp = backend.get_array_module(reference)
    note = ""
    for what, values in (("yours", yours), ("the reference", reference)):
        finite = xp.isfinite(values) | (yours == reference)
        if not bool(finite.all()):
            first = tuple(int(k) for k in xp.unravel_index(int(xp.argmin(finite)), reference.shape))
            kinds = " and ".join(kind for kind, bad in (("NaN", xp.isnan(values)), ("inf", xp.isinf(values)))
                                 if bool(bad.any()))
            note += f", {what} has {kinds} at {int((~finite).sum())} entries (the first at index {first})"
    return note


def same(a: Any, b: Any) -> bool:
    """Whether two arrays hold the same values (NaN equal to NaN)."""
    xp = backend.get_array_module(a)
    return a.shape == b.shape and bool(((a == b) | (xp.isnan(a) & xp.isnan(b))).all())


def writers_of_upstream(outs: Sequence[Tensor], seed: int = 0) -> list[str]:
    """The ops of the graph behind `outs` whose backward writes into the gradient it is given:
    each node's backward run on fresh random gradients, which are then compared with copies."""
    from .function import backward_order, op_name

    rng = random_generator(seed, stream=5)
    names = []
    for node in backward_order([o.creator for o in outs if o.creator is not None]):
        device = next((t.device for t in node.inputs if t is not None), "cpu")
        grads = [backend.to_device(rng.standard_normal(shape).astype(dtype), device) for shape, dtype in node.output_meta]
        given = [g.copy() for g in grads]
        node.backward(node, *given)
        if not all(same(a, b) for a, b in zip(given, grads)):
            names.append(op_name(type(node)))
    return names


LAYOUT_RTOL = 1e-10  # the same values in another memory layout: BLAS may round differently, by a few ulps


def strided(array: Any) -> Any:
    """A non-contiguous array of `array`'s values in the other memory order: every other element
    of a buffer twice its size, its axes reversed (a transposed, strided view)."""
    view = backend.get_array_module(array).empty(array.shape[::-1] + (2,), dtype=array.dtype)[..., 0].transpose()
    view[...] = array
    return view


def layout_verdicts(fn: Callable, inputs: list, names: list, checked: list, outs: list, upstream: list,
                    analytic: list) -> list:
    """The failed verdicts of fn run again on non-contiguous inputs (every Tensor input's and
    parameter's values as a strided view: `strided`) and backpropagated from non-contiguous
    copies of the same upstream gradients: outputs and gradients must equal the contiguous run's
    (`outs`, `analytic`) to LAYOUT_RTOL of their largest entry. [] when they do."""
    tensors = [t for t in inputs if isinstance(t, Tensor)]
    originals = [t.data for t in tensors]
    try:
        for t in tensors:
            t.data = strided(t.data)
        again, _, grads = vjp(fn, inputs, upstream, layout="strided")
    finally:
        for t, data in zip(tensors, originals):
            t.data = data
    pairs = [(f"output {k}", a.data, o.data) for k, (a, o) in enumerate(zip(again, outs))]
    pairs += [(f"the gradient of {names[i]}", grads[i], analytic[i]) for i in checked]
    failed = []
    for what, yours, reference in pairs:
        scale = max(1.0, _max(abs(reference)) if math.isfinite(_max(abs(reference))) else 1.0)
        passed, line = judge(f"layout: {what} with non-contiguous inputs and upstream gradients", yours, reference,
                             LAYOUT_RTOL * scale, 0.0)
        if not passed:
            failed.append((False, line + "; the kind of mistake: the op depends on memory layout (ravel(order='K'), "
                                         "raw buffers, writes through a reshape that copied): the same values in a "
                                         "strided array must give the same results"))
    return failed


def right_for_ones_verdict(fn: Callable, inputs: list, wrong: list, eps: float, atol: float, rtol: float) -> list:
    """[a failed verdict saying so] when the backward's gradients of the `wrong` inputs are right
    for an all-ones upstream gradient (L = the sum of the outputs), to gradcheck's tolerance; else []."""
    ones = [o.xp.ones_like(o.data) for o in _outputs(fn(*inputs))]
    _, _, grads = vjp(fn, inputs, ones)

    def total():
        with no_grad():
            return sum(float(o.data.sum()) for o in _outputs(fn(*inputs)))

    if not all(judge("", grads[i], numeric_gradient(total, inputs[i], eps), atol, rtol)[0] for i in wrong):
        return []
    return [(False, "the kind of mistake: your backward is right for an all-ones upstream gradient (the gradient of "
                    "sum()) but not for this random one: check how it uses the gradient it is given (dy): that it "
                    "multiplies by it, and over which axes it sums it")]


def in_place_verdict(fn: Callable, inputs: list, written: list, seed: int) -> tuple[bool, str]:
    """The failed verdict of a backward that wrote into the upstream gradient of outputs `written`,
    naming the ops that do (found by running each node's backward on gradients it may not change)."""
    with enable_grad():
        ops = writers_of_upstream(_outputs(fn(*inputs)), seed)
    who = f"the backward of {', '.join(ops)}" if ops else "a backward"
    outputs = ", ".join(str(k) for k in written)
    return False, (f"in-place write: {who} wrote into its upstream gradient (the gradient of output {outputs} "
                   "changed): a backward must not modify the gradients it is given, which the engine may pass to "
                   "other ops too; compute a new array (dy * s, not dy *= s)")


def kink_explainer(loss: Callable[[], float], tensor: Tensor, eps: float, atol: float,
                   rtol: float) -> Callable[[tuple], str | None]:
    """`judge`'s explain for one input: index -> `kink_note` there."""
    return lambda index: kink_note(loss, tensor, index, eps, atol, rtol)


def kink_note(loss: Callable[[], float], tensor: Tensor, index: tuple, eps: float = 1e-6, atol: float = 1e-5,
              rtol: float = 1e-3) -> str | None:
    """Where `loss` has a kink in `tensor` at `index` (the one-sided slopes (L(x+eps) - L(x)) / eps and
    (L(x) - L(x-eps)) / eps differ beyond tolerance, as ReLU's at 0), a note saying so: the central
    difference is their average, which no backward gives. None where they agree."""
    flat = tensor.data.reshape(-1)
    j = int(backend.get_array_module(tensor.data).ravel_multi_index(index, tensor.shape)) if tensor.shape else 0
    original = float(flat[j])
    base = loss()
    flat[j] = original + eps
    plus = loss()
    flat[j] = original - eps
    minus = loss()
    flat[j] = original
    return slopes_note(base, plus, minus, eps, atol, rtol)


def slopes_note(base: float, plus: float, minus: float, eps: float, atol: float, rtol: float) -> str | None:
    """The kink note from f(x), f(x + eps) and f(x - eps) (along an entry or a direction): the
    one-sided slopes, when they differ beyond tolerance; None when they agree."""
    left, right = (base - minus) / eps, (plus - base) / eps
    if not abs(right - left) > atol + rtol * max(abs(left), abs(right)):
        return None
    return (f"a kink there: the one-sided slopes differ (left {left:.6g}, right {right:.6g}) and the reference is "
            f"their average; move the input away from the kink (as ReLU's at 0), or check a one-sided slope")
