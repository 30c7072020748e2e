"""Gradient checking that can fail (the first read's last file): `gradcheck`.

The outputs are contracted with a random upstream gradient g, L = sum(fn(*inputs) * g), never a
plain sum (softmax rows and LayerNorm outputs have a zero gradient of sum(), hiding a wrong
backward). `vjp` backpropagates L once; `numeric_gradient` finds every entry of every input's
gradient by float64 central differences; `judge` compares the two, for every input: exact, close
or wrong, the largest difference and worst index, "yours" (the backward's) beside the "reference".

`autograd.gradcheck` is this module, callable as `gradcheck` (torch.autograd.gradcheck(...)).
The rest (a second read, autograd/gradcheck_extras.py, re-exported here): a random direction
over all inputs, forward mode, torch's other options, `check_create_graph`, `gradgradcheck`,
`check_formula`; the kind of mistake a failure shows (autograd/gradcheck_diagnosis.py).
"""
from __future__ import annotations

import math
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

from . import backend
from .modes import no_grad
from .tensor import Tensor

__all__ = ["GradcheckError", "check_create_graph", "check_formula", "gradcheck", "gradgradcheck", "judge",
           "numeric_gradient", "random_generator", "vjp"]


class GradcheckError(AssertionError):
    """Raised by `gradcheck` and `check_formula`: one line per input (see `judge`)."""


def _outputs(result):
    """The output Tensors of a function's result (a Tensor or a tuple; None entries dropped)."""
    return [o for o in (result if isinstance(result, (tuple, list)) else [result]) if o is not None]


def random_generator(seed: int, stream: int = 0) -> Any:
    """gradcheck's host Generator (upstream gradients: stream 0, directions: 1), not default_rng(seed)'s."""
    return backend.module_for("cpu").random.default_rng([seed, stream, 0x67726164])


def vjp(fn: Callable, inputs: Sequence[Any], upstream: Sequence[Any] | None = None, *,
        seed: int = 0, written: list | None = None, layout: str = "contiguous") -> tuple[list, list, list]:
    """Run fn(*inputs) and backpropagate L = sum_k sum(out_k * g_k): (outputs, upstream, gradients).
    outputs: the output Tensors (None entries dropped). upstream: one array g_k per output; when
    None, standard normal ones from `random_generator(seed)`, on the outputs' device in their dtype.
    gradients: for every input Tensor that requires grad, dL/d input (zeros where no gradient
    arrived; also in .grad), None for the others. The backward gets a copy of each g_k (layout
    "contiguous" or "strided"); `written` (a list, or None) gets each k whose copy it changed."""
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
        given = gradcheck_diagnosis.strided(g) if layout == "strided" else g.copy()
        o.backward(given, retain_graph=n + 1 < len(differentiable))
        if written is not None and not gradcheck_diagnosis.same(given, g):
            written.append(k)
    grads = [None if not getattr(t, "requires_grad", False) else t.xp.zeros_like(t.data) if t.grad is None else t.grad.data
             for t in inputs]
    return outs, upstream, grads


def gradcheck(fn: Callable[..., Tensor | Sequence[Tensor]], inputs: Tensor | Sequence[Any], *, eps: float = 1e-6,
              atol: float = 1e-5, rtol: float = 1e-3, seed: int = 0, report: list | None = None,
              names: Sequence[str] | None = None, check_forward_ad: bool = False,
              check_backward_ad: bool = True, raise_exception: bool = True, **torch_options: Any) -> bool:
    """Check `fn`'s hand-written backward against central differences (torch.autograd.gradcheck).

    fn: callable taking `inputs` and returning a Tensor or a tuple of Tensors; deterministic
    (seed any dropout inside it). inputs: a Tensor, or Tensors (other arguments passed through);
    each Tensor with requires_grad=True must be float64 and is checked. names: what to call each
    input in messages ("q", "k", ...; default "input 0", ...).
    Pass when |yours - reference| <= atol + rtol * |reference| everywhere (yours: the backward's
    gradient; reference: the central differences). Returns True, or raises GradcheckError after
    judging every input (see `judge`), with the kind of mistake it sees (gradcheck_diagnosis);
    raise_exception=False: returns False instead. report: a list, or None; one (what, max abs
    error, max |numeric|) tuple per comparison. check_forward_ad: also check forward mode, on its
    own (gradcheck_extras.forward_mode_verdicts); check_backward_ad=False: forward mode alone.
    torch's fast_mode, check_undefined_grad, check_batched_grad, nondet_tol: gradcheck_extras.TORCH_OPTIONS.
    ValueError when no input requires grad, TypeError for a checked one not float64."""
    if not raise_exception:  # torch's: False where it would raise GradcheckError
        return gradcheck_extras.false_on_failure(gradcheck, {**locals(), "raise_exception": True})
    inputs, names, checked = _checked(inputs, names)
    options = gradcheck_extras.torch_options_checked("gradcheck", torch_options)
    for i in checked:
        if str(inputs[i].dtype) != "float64":
            raise TypeError(f"gradcheck: {names[i]} must be float64 for finite differences, got {inputs[i].dtype}")
    if not (check_backward_ad or check_forward_ad):
        raise ValueError("gradcheck: check_backward_ad=False and check_forward_ad=False leave nothing to check")
    sections, written = [], []
    outs, upstream, analytic = (vjp(fn, inputs, seed=seed, written=written) if check_backward_ad else
                                gradcheck_extras.vjp_where_it_runs(fn, inputs, seed))   # forward mode alone

    def loss():
        with no_grad():
            return sum(float((o.data * g).sum()) for o, g in zip(_outputs(fn(*inputs)), upstream))

    if check_backward_ad:
        verdicts = [judge(names[i], analytic[i], numeric_gradient(loss, inputs[i], eps), atol, rtol, report,
                          explain=gradcheck_diagnosis.kink_explainer(loss, inputs[i], eps, atol, rtol)) for i in checked]
        verdicts += gradcheck_diagnosis.backward_verdicts(loss, fn, inputs, names, checked, outs, upstream, analytic,
                                                          verdicts, written, eps, atol, rtol, seed, report, options)
        sections.append(("your backward (yours) against central finite differences (reference)", verdicts))
    if check_forward_ad:
        sections.append(("your jvp rules (yours) against central finite differences and the backward (reference)",
                         gradcheck_extras.forward_mode_verdicts(fn, inputs, names, checked, upstream, analytic, eps,
                                                                atol, rtol, seed, report)))
    failed = "\n".join(f"gradcheck: {what}:\n" + "\n".join(f"  {line}" for _, line in verdicts)
                       for what, verdicts in sections if not all(passed for passed, _ in verdicts))
    if failed:
        raise GradcheckError(failed)
    return True


def _checked(inputs, names):
    """(inputs as a list, their names (default "input 0", ...), indices of those requiring grad), or ValueError."""
    inputs = [inputs] if isinstance(inputs, Tensor) else list(inputs)  # a bare Tensor: torch's one input
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
    |reference| everywhere) or wrong, with the largest difference and the worst entry (the one
    furthest out of tolerance): its index, both values, and the relative error where the reference
    is not 0 there; NaN and inf counted (equal infinities are equal). explain: None, or a function
    of the worst index returning a note for a wrong verdict, or None. report: see `gradcheck`."""
    xp = backend.get_array_module(reference)
    with backend.invalid_ignored():  # (CuPy has no errstate)
        err = xp.where(yours == reference, 0.0, xp.abs(yours - reference))   # inf == inf: no inf - inf
    if report is not None:
        report.append((name, _max(err), _max(xp.abs(reference))))
    if not err.size:
        return True, f"{name}: exact (empty)"
    bound = atol + rtol * xp.abs(reference)
    with backend.invalid_ignored():  # (CuPy has no errstate)
        excess = err / xp.maximum(bound, xp.finfo(bound.dtype).tiny)   # a zero tolerance divides by no zero
    worst = int(xp.argmax(xp.where(xp.isnan(excess), xp.inf, excess)))
    index = tuple(int(k) for k in xp.unravel_index(worst, reference.shape))
    passed = bool((excess <= 1).all())
    mine, theirs, diff = float(yours.reshape(-1)[worst]), float(reference.reshape(-1)[worst]), _max(err)
    verdict = "exact" if diff == 0 else "close" if passed else "wrong"
    line = f"{name}: {verdict}, max diff {diff:.3g}" + gradcheck_diagnosis.nonfinite_note(yours, reference)
    if verdict == "close":
        line += f", worst at index {index}"
    if verdict == "wrong":
        relative = ("not finite" if not (math.isfinite(mine) and math.isfinite(theirs)) else
                    f"rel {abs(mine - theirs) / abs(theirs):.3g}" if theirs else "the reference is 0 there")
        line += f", worst at index {index}: yours {mine:.10g}, reference {theirs:.10g} ({relative})"
        note = explain(index) if explain is not None else None
        line += f"; {note}" if note else ""
    if not passed:
        tolerance = f"atol {atol:.3g}" + (f" + rtol {rtol:.3g} * |reference|" if rtol else "")
        line += f"; {int((~(excess <= 1)).sum())} of {err.size} entries beyond {tolerance}"
    return passed, line


def _max(array) -> float:  # the largest entry, NaN when one is NaN (not Python's max, order-dependent); 0 when empty
    return float(array.max()) if array.size else 0.0


class _CallableModule(types.ModuleType):
    """This module, callable as `gradcheck` (torch users call `autograd.gradcheck(...)`)."""

    def __call__(self, *args, **kwargs):
        return gradcheck(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

from . import gradcheck_diagnosis, gradcheck_extras  # noqa: E402  (the second read)
from .gradcheck_extras import check_create_graph, check_formula, gradgradcheck  # noqa: E402
