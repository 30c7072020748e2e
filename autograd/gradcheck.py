"""Gradient checking that can fail (the first read's last file): `gradcheck`.

The outputs are contracted with a random upstream gradient g, L = sum(fn(*inputs) * g), never a
plain sum (softmax rows and LayerNorm outputs have a zero gradient of sum(), which would hide a
wrong backward). `vjp` runs the function and backpropagates L once; `numeric_gradient` finds
every entry of every input's gradient by float64 central differences; `judge` compares the two.
Every input is judged, not only the first wrong one: a failure lists each input as exact, close
or wrong, with its largest difference and worst index, "yours" (the backward's) beside the
"reference" (finite differences).

`autograd.gradcheck` is this module, and calling it calls `gradcheck` (as one calls
`torch.autograd.gradcheck(...)`). The rest (a second read, autograd/gradcheck_extras.py,
re-exported here): one random direction over all inputs together, forward mode
(`check_forward_ad=True`), `check_create_graph`, `gradgradcheck`, `check_formula`.
"""
from __future__ import annotations

import math
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

from . import backend
from .modes import enable_grad, no_grad
from .tensor import Tensor

__all__ = ["GradcheckError", "check_create_graph", "check_formula", "gradcheck", "gradgradcheck", "judge",
           "kink_note", "layout_verdicts", "numeric_gradient", "random_generator", "strided", "vjp",
           "writers_of_upstream"]


class GradcheckError(AssertionError):
    """Raised by `gradcheck` and `check_formula`: one line per input (exact, close or wrong,
    the largest difference, the worst index with yours and the reference's values)."""


def _outputs(result):
    """The output Tensors of a function's result (a Tensor or a tuple; None entries dropped)."""
    items = result if isinstance(result, (tuple, list)) else [result]
    return [o for o in items if o is not None]


def random_generator(seed: int, stream: int = 0) -> Any:
    """The host Generator of gradcheck's random draws (upstream gradients: stream 0, directions:
    stream 1): independent of `default_rng(seed)`, from which the inputs are often drawn (an
    upstream gradient equal to the input would make LayerNorm's input gradient zero)."""
    return backend.module_for("cpu").random.default_rng([seed, stream, 0x67726164])


def vjp(fn: Callable, inputs: Sequence[Any], upstream: Sequence[Any] | None = None, *,
        seed: int = 0, written: list | None = None, layout: str = "contiguous") -> tuple[list, list, list]:
    """Run fn(*inputs) and backpropagate L = sum_k sum(out_k * g_k): (outputs, upstream, gradients).
    outputs: the output Tensors (None entries dropped). upstream: one array g_k per output;
    when None, standard normal ones drawn from `random_generator(seed)`, on the outputs' device
    in their dtype. gradients: for every input Tensor that requires grad, dL/d input (zeros
    where no gradient arrived), None for the other inputs. The inputs' .grad are reset first and
    hold the gradients afterwards. The backward gets a copy of each g_k: a backward that writes
    into its upstream gradient leaves the returned `upstream` as drawn, and `written` (a list,
    or None) gets the index k of each output whose copy it changed. layout: "contiguous" copies,
    or "strided" (non-contiguous: `strided`) ones."""
    for t in inputs:
        if getattr(t, "requires_grad", False):
            t.grad = None
    outs = _outputs(fn(*inputs))
    if upstream is None:
        rng = random_generator(seed)
        upstream = [rng.standard_normal(o.shape).astype(o.dtype) for o in outs]
    upstream = [backend.to_device(g, o.device) for o, g in zip(outs, upstream)]
    differentiable = [(k, o, g) for k, (o, g) in enumerate(zip(outs, upstream)) if o.requires_grad]
    # one backward per output: a summed loss would compute inf - inf = NaN beside an infinite output
    for n, (k, o, g) in enumerate(differentiable):
        given = strided(g) if layout == "strided" else g.copy()
        o.backward(given, retain_graph=n + 1 < len(differentiable))
        if written is not None and not _same(given, g):
            written.append(k)
    grads = [None if not getattr(t, "requires_grad", False) else t.xp.zeros_like(t.data) if t.grad is None else t.grad.data
             for t in inputs]
    return outs, upstream, grads


def _same(a, b) -> bool:
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
        if not all(_same(a, b) for a, b in zip(given, grads)):
            names.append(op_name(type(node)))
    return names


def gradcheck(fn: Callable[..., Tensor | Sequence[Tensor]], inputs: Sequence[Any], *, eps: float = 1e-6,
              atol: float = 1e-5, rtol: float = 1e-3, seed: int = 0, report: list | None = None,
              names: Sequence[str] | None = None, check_forward_ad: bool = False,
              check_backward_ad: bool = True) -> bool:
    """Check `fn`'s hand-written backward against central differences (torch.autograd.gradcheck).

    fn: callable taking `inputs` and returning a Tensor or a tuple of Tensors; it must be
    deterministic (seed any dropout inside it). inputs: Tensors (or other arguments passed
    through); each Tensor with requires_grad=True must be float64 and is checked.
    names: what to call each input in messages ("q", "k", ...; default "input 0", ...).
    Pass when |yours - reference| <= atol + rtol * |reference| everywhere (yours: the
    backward's gradient; reference: the central differences). Returns True, or
    raises GradcheckError after judging every input (one line each: see `judge`). A wrong entry
    where the one-sided slopes differ (a kink, ReLU at 0) says so; a backward that writes into
    its upstream gradient fails as an in-place write, naming the op.
    report: a list, or None; when given, one (what, max abs error, max |numeric|) tuple is
    appended per comparison (each input, then the random direction), so a caller can show how
    close a check came. check_forward_ad: also check forward mode (torch's name; see
    gradcheck_extras.forward_mode_verdicts), judged on its own: a wrong backward does not fail
    it. check_backward_ad=False (torch's name) leaves the backward unjudged (forward mode alone).
    Raises ValueError when no input requires grad (raw arrays must be wrapped:
    `Tensor(a, requires_grad=True)`), TypeError for a checked one not float64."""
    inputs, names, checked = _checked(inputs, names)
    for i in checked:
        if str(inputs[i].dtype) != "float64":
            raise TypeError(f"gradcheck: {names[i]} must be float64 for finite differences, got {inputs[i].dtype}")
    if not (check_backward_ad or check_forward_ad):
        raise ValueError("gradcheck: check_backward_ad=False and check_forward_ad=False leave nothing to check")
    sections = []
    written = []
    try:
        outs, upstream, analytic = vjp(fn, inputs, seed=seed, written=written)
    except Exception:  # noqa: BLE001  (forward mode alone is judged without the backward)
        if check_backward_ad:
            raise
        outs, upstream, analytic = _outputs(fn(*inputs)), None, None
    if upstream is None:
        rng = random_generator(seed)
        upstream = [backend.to_device(rng.standard_normal(o.shape).astype(o.dtype), o.device) for o in outs]

    def loss():
        with no_grad():
            return sum(float((o.data * g).sum()) for o, g in zip(_outputs(fn(*inputs)), upstream))

    if check_backward_ad:
        verdicts = []
        for i in checked:
            numeric = numeric_gradient(loss, inputs[i], eps)
            verdicts.append(judge(names[i], analytic[i], numeric, atol, rtol, report,
                                  explain=lambda index, t=inputs[i]: kink_note(loss, t, index, eps, atol, rtol)))
        wrong = [i for i, (passed, _) in zip(checked, verdicts) if not passed]
        if wrong and _right_for_ones(fn, inputs, wrong, eps, atol, rtol):
            verdicts.append((False, "the kind of mistake: your backward is right for an all-ones upstream gradient "
                                    "(the gradient of sum()) but not for this random one: check how it uses the "
                                    "gradient it is given (dy): that it multiplies by it, and over which axes it "
                                    "sums it"))
        verdicts.append(gradcheck_extras.random_direction_verdict(loss, inputs, checked, analytic, eps, atol, rtol,
                                                                  seed, report))
        if written:
            verdicts.append(_in_place_verdict(fn, inputs, written, seed))
        verdicts += layout_verdicts(fn, inputs, names, checked, outs, upstream, analytic)
        sections.append(("your backward (yours) against central finite differences (reference)", verdicts))
    if check_forward_ad:
        sections.append(("your jvp rules (yours) against central finite differences and the backward (reference)",
                         gradcheck_extras.forward_mode_verdicts(fn, inputs, names, checked, upstream, analytic, eps,
                                                                atol, rtol, seed, report)))
    failed = [(what, verdicts) for what, verdicts in sections if not all(passed for passed, _ in verdicts)]
    if failed:
        raise GradcheckError("\n".join(f"gradcheck: {what}:\n" + "\n".join(f"  {line}" for _, line in verdicts)
                                       for what, verdicts in failed))
    return True


LAYOUT_RTOL = 1e-10  # the same values in another memory layout: BLAS may round differently, by a few ulps


def strided(array: Any) -> Any:
    """A non-contiguous array of `array`'s values in the other memory order: every other element
    of a buffer twice its size, its axes reversed (a transposed, strided view)."""
    view = backend.get_array_module(array).empty(array.shape[::-1] + (2,), dtype=array.dtype)[..., 0].transpose()
    view[...] = array
    return view


def layout_verdicts(fn, inputs, names, checked, outs, upstream, analytic) -> list:
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


def _right_for_ones(fn, inputs, wrong, eps, atol, rtol) -> bool:
    """Whether the backward's gradients of the `wrong` inputs are right for an all-ones upstream
    gradient (L = the sum of the outputs), to gradcheck's tolerance."""
    ones = [o.xp.ones_like(o.data) for o in _outputs(fn(*inputs))]
    _, _, grads = vjp(fn, inputs, ones)

    def total():
        with no_grad():
            return sum(float(o.data.sum()) for o in _outputs(fn(*inputs)))

    return all(judge("", grads[i], numeric_gradient(total, inputs[i], eps), atol, rtol)[0] for i in wrong)


def _in_place_verdict(fn, inputs, written, seed):
    """The failed verdict of a backward that wrote into the upstream gradient of outputs `written`,
    naming the ops that do (found by running each node's backward on gradients it may not change)."""
    with enable_grad():
        ops = writers_of_upstream(_outputs(fn(*inputs)), seed)
    who = f"the backward of {', '.join(ops)}" if ops else "a backward"
    outputs = ", ".join(str(k) for k in written)
    return False, (f"in-place write: {who} wrote into its upstream gradient (the gradient of output {outputs} "
                   "changed): a backward must not modify the gradients it is given, which the engine may pass to "
                   "other ops too; compute a new array (dy * s, not dy *= s)")


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
    left, right = (base - minus) / eps, (plus - base) / eps
    if not abs(right - left) > atol + rtol * max(abs(left), abs(right)):
        return None
    return (f"a kink there: the one-sided slopes differ (left {left:.6g}, right {right:.6g}) and the reference is "
            f"their average; move the input away from the kink (as ReLU's at 0), or check a one-sided slope")


def _checked(inputs, names):
    """(the inputs as a list, their names: `names` or "input 0", ...; the indices of those that
    require grad, the checked ones), or ValueError when none does or the names do not fit."""
    inputs = list(inputs)
    names = [f"input {i}" for i in range(len(inputs))] if names is None else list(names)
    if len(names) != len(inputs):
        raise ValueError(f"names: one name per input expected ({len(inputs)}), got {len(names)}: {names}")
    checked = [i for i, t in enumerate(inputs) if getattr(t, "requires_grad", False)]
    if not checked:
        raw = [i for i, x in enumerate(inputs) if backend.is_array(x)]
        hint = (f"input(s) {raw} are raw arrays, which get no gradient: wrap them:" if raw else
                "create the inputs to check with")
        raise ValueError(f"gradcheck: no input has requires_grad=True; {hint} Tensor(x, requires_grad=True) (float64)")
    return inputs, names, checked


def numeric_gradient(loss: Callable[[], float], tensor: Tensor, eps: float = 1e-6) -> Any:
    """d loss / d tensor by central differences, one entry at a time: (L(x+eps) - L(x-eps)) / 2eps.
    loss: a function of no arguments returning a float; tensor: a float64 Tensor it reads."""
    xp = tensor.xp
    tensor.data = xp.ascontiguousarray(tensor.data).reshape(tensor.shape)  # (ascontiguousarray makes 0-d 1-d)
    flat = tensor.data.reshape(-1)  # a view: perturbing it perturbs the tensor
    numeric = xp.zeros(flat.size)
    for j in range(flat.size):
        original = float(flat[j])
        flat[j] = original + eps
        plus = loss()
        flat[j] = original - eps
        minus = loss()
        flat[j] = original
        numeric[j] = (plus - minus) / (2 * eps)
    return numeric.reshape(tensor.shape)


def judge(name: str, yours: Any, reference: Any, atol: float, rtol: float,
          report: list | None = None, explain: Callable[[tuple], str | None] | None = None) -> tuple[bool, str]:
    """(passed, line): one tensor's verdict, exact, close (|yours - reference| <= atol + rtol
    |reference| everywhere) or wrong, with the largest difference and the worst entry (the
    one furthest out of tolerance): its index, both values, and the relative error where the
    reference is not 0 there. A NaN or infinity of yours (or of the reference) where the other
    is not the same is wrong and counted, its entry named; equal infinities are equal.
    explain: None, or a function of the worst index returning a note for a wrong verdict (a
    kink there) or None. report: see `gradcheck`."""
    xp = backend.get_array_module(reference)
    with xp.errstate(invalid="ignore"):
        err = xp.where(yours == reference, 0.0, xp.abs(yours - reference))   # inf == inf: no inf - inf
    if report is not None:
        report.append((name, _max(err), _max(xp.abs(reference))))
    if not err.size:
        return True, f"{name}: exact (empty)"
    bound = atol + rtol * xp.abs(reference)
    with xp.errstate(invalid="ignore"):
        excess = err / xp.maximum(bound, xp.finfo(bound.dtype).tiny)   # a zero tolerance divides by no zero
    worst = int(xp.argmax(xp.where(xp.isnan(excess), xp.inf, excess)))
    index = tuple(int(k) for k in xp.unravel_index(worst, reference.shape))
    passed = bool((excess <= 1).all())
    mine, theirs, diff = float(yours.reshape(-1)[worst]), float(reference.reshape(-1)[worst]), _max(err)
    verdict = "exact" if diff == 0 else "close" if passed else "wrong"
    line = f"{name}: {verdict}, max diff {diff:.3g}"
    for what, values in (("yours", yours), ("the reference", reference)):
        finite = xp.isfinite(values) | (yours == reference)
        if not bool(finite.all()):
            first = tuple(int(k) for k in xp.unravel_index(int(xp.argmin(finite)), reference.shape))
            kinds = " and ".join(kind for kind, bad in (("NaN", xp.isnan(values)), ("inf", xp.isinf(values)))
                                 if bool(bad.any()))
            line += f", {what} has {kinds} at {int((~finite).sum())} entries (the first at index {first})"
    if verdict == "close":
        line += f", worst at index {index}"
    if verdict == "wrong":
        relative = ("not finite" if not (math.isfinite(mine) and math.isfinite(theirs)) else
                    f"rel {abs(mine - theirs) / abs(theirs):.3g}" if theirs else "the reference is 0 there")
        line += f", worst at index {index}: yours {mine:.10g}, reference {theirs:.10g} ({relative})"
        note = explain(index) if explain is not None else None
        if note:
            line += f"; {note}"
    if not passed:
        tolerance = f"atol {atol:.3g}" + (f" + rtol {rtol:.3g} * |reference|" if rtol else "")
        line += f"; {int((~(excess <= 1)).sum())} of {err.size} entries beyond {tolerance}"
    return passed, line


def _max(array) -> float:
    """The largest entry as a float, NaN when one is NaN (Python's max would depend on the order); 0 when empty."""
    return float(array.max()) if array.size else 0.0


def _raise_if_wrong(what, verdicts):
    """Raise GradcheckError listing every verdict when any is wrong."""
    if not all(passed for passed, _ in verdicts):
        raise GradcheckError(f"{what}:\n" + "\n".join(f"  {line}" for _, line in verdicts))


class _CallableModule(types.ModuleType):
    """This module, callable as `gradcheck` (torch users call `autograd.gradcheck(...)`)."""

    def __call__(self, *args, **kwargs):
        return gradcheck(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

from . import gradcheck_extras  # noqa: E402  (the second read)
from .gradcheck_extras import check_create_graph, check_formula, gradgradcheck  # noqa: E402
