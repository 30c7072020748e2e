"""Finite-difference gradient checking that can fail.

The output is contracted with a random upstream gradient g, L = sum(fn(*inputs) * g), never
a plain sum (softmax rows and LayerNorm outputs have a zero gradient of sum(), which would
hide a wrong backward). Every entry of every input that requires grad is checked with float64
central differences, then one random direction u over all inputs together (v^T J u).

Every input is judged, not only the first wrong one: a failure lists each input as exact,
close or wrong, with its largest difference and worst index, "yours" (the gradient being
checked) beside the "reference" (finite differences, or the op's backward).

`vjp` (outputs and input gradients for an upstream gradient) is the one place that runs a
function, backpropagates and collects the gradients; `check_formula` checks a gradient
written on paper against an op's backward and against central differences. With
`check_forward_ad=True`, gradcheck also checks forward mode: each jvp rule against central
differences and against the backward (the transpose identity). `gradgradcheck` checks second
derivatives: `gradcheck` of the map from (inputs, upstream gradients) to the gradient, built
with create_graph. `check_create_graph` checks that the first derivative taken with
`create_graph=True` (each op's `differentiable_backward`) equals the plain backward's: two
forms of one gradient that could otherwise drift apart unseen (gradgradcheck checks it first).

`autograd.gradcheck` is this module, and calling it calls `gradcheck` (as one calls
`torch.autograd.gradcheck(...)`): `autograd.gradcheck(fn, inputs)` and
`autograd.gradcheck.check_formula(...)` both work.
"""
from __future__ import annotations

import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

from . import backend
from .modes import enable_grad, no_grad
from .create_graph import grad
from .tensor import Tensor

__all__ = ["GradcheckError", "check_create_graph", "check_formula", "gradcheck", "gradgradcheck", "judge", "numeric_gradient",
           "random_generator", "vjp"]


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
        seed: int = 0) -> tuple[list, list, list]:
    """Run fn(*inputs) and backpropagate L = sum_k sum(out_k * g_k): (outputs, upstream, gradients).

    outputs: the output Tensors (None entries dropped). upstream: one array g_k per output;
    when None, standard normal ones drawn from `random_generator(seed)`, on the outputs' device
    in their dtype. gradients: for every input Tensor that requires grad, dL/d input (zeros
    where no gradient arrived), None for the other inputs. The inputs' .grad are reset first and
    hold the gradients afterwards.
    """
    for t in inputs:
        if getattr(t, "requires_grad", False):
            t.grad = None
    outs = _outputs(fn(*inputs))
    if upstream is None:
        rng = random_generator(seed)
        upstream = [rng.standard_normal(o.shape).astype(o.dtype) for o in outs]
    upstream = [backend.to_device(g, o.device) for o, g in zip(outs, upstream)]
    differentiable = [(o, g) for o, g in zip(outs, upstream) if o.requires_grad]
    # one backward per output: a summed loss would compute inf - inf = NaN beside an infinite output
    for k, (o, g) in enumerate(differentiable):
        o.backward(g, retain_graph=k + 1 < len(differentiable))
    grads = [None if not getattr(t, "requires_grad", False) else t.xp.zeros_like(t.data) if t.grad is None else t.grad.data
             for t in inputs]
    return outs, upstream, grads


def gradcheck(fn: Callable[..., Tensor | Sequence[Tensor]], inputs: Sequence[Any], *, eps: float = 1e-6,
              atol: float = 1e-5, rtol: float = 1e-3, seed: int = 0, report: list | None = None,
              names: Sequence[str] | None = None, check_forward_ad: bool = False) -> bool:
    """Check `fn`'s hand-written backward against central differences (torch.autograd.gradcheck).

    fn: callable taking `inputs` and returning a Tensor or a tuple of Tensors; it must be
    deterministic (seed any dropout inside it). inputs: Tensors (or other arguments passed
    through); each Tensor with requires_grad=True must be float64 and is checked.
    names: what to call each input in messages ("q", "k", ...; default "input 0", ...).
    Pass when |yours - reference| <= atol + rtol * |reference| everywhere (yours: the
    backward's gradient; reference: the central differences). Returns True, or
    raises GradcheckError after judging every input (one line each: see `judge`).
    report: a list, or None; when given, one (what, max abs error, max |numeric|) tuple is
    appended per comparison (each input, then the random direction), so a caller can show how
    close a check came. check_forward_ad: also check forward mode (torch's name): for each input
    alone and for all together, J u by the ops' jvp rules against central differences along a
    random u, and the transpose identity <g, J u> = <J^T g, u> between the jvp rules and the
    backward (a wrong rule in either mode cannot hide behind the other). Raises ValueError when no
    input requires grad (raw arrays must be wrapped: `Tensor(a, requires_grad=True)`) and
    TypeError for a checked input that is not float64.
    """
    inputs = list(inputs)
    names = _names(names, len(inputs))
    checked = [i for i, t in enumerate(inputs) if getattr(t, "requires_grad", False)]
    if not checked:
        raise ValueError(_no_checked_input_message(inputs))
    for i in checked:
        if str(inputs[i].dtype) != "float64":
            raise TypeError(f"gradcheck: {names[i]} must be float64 for finite differences, got {inputs[i].dtype}")
    xp = inputs[checked[0]].xp
    outs, upstream, analytic = vjp(fn, inputs, seed=seed)

    def loss():
        with no_grad():
            return sum(float((o.data * g).sum()) for o, g in zip(_outputs(fn(*inputs)), upstream))

    verdicts = [judge(names[i], analytic[i], numeric_gradient(loss, inputs[i], eps), atol, rtol, report)
                for i in checked]

    # one random direction over all inputs together: v^T J u against the difference along u
    rng = random_generator(seed, stream=1)
    directions = {i: backend.to_device(rng.standard_normal(inputs[i].shape), inputs[i].device) for i in checked}
    expected = sum(float((analytic[i] * directions[i]).sum()) for i in checked)
    originals = {i: inputs[i].data.copy() for i in checked}
    values = []
    for sign in (1, -1):
        for i in checked:
            inputs[i].data[...] = originals[i] + sign * eps * directions[i]
        values.append(loss())
    for i in checked:
        inputs[i].data[...] = originals[i]
    numeric = (values[0] - values[1]) / (2 * eps)
    verdicts.append(judge("random direction over all inputs", xp.asarray([expected]), xp.asarray([numeric]),
                          atol, rtol, report))
    _raise_if_wrong("gradcheck: your backward (yours) against central finite differences (reference)", verdicts)
    if check_forward_ad:
        _raise_if_wrong("gradcheck: your jvp rules (yours) against central finite differences and the backward "
                        "(reference)", _forward_mode_verdicts(fn, inputs, names, checked, upstream, analytic, eps,
                                                               atol, rtol, seed, report))
    return True


def _forward_mode_verdicts(fn, inputs, names, checked, upstream, analytic, eps, atol, rtol, seed, report):
    """gradcheck's forward-mode part (see check_forward_ad): one verdict per output and direction,
    and the transpose identity."""
    from .forward_ad import dual_level, make_dual, unpack_dual

    rng = random_generator(seed, stream=3)
    directions = {i: backend.to_device(rng.standard_normal(inputs[i].shape), inputs[i].device) for i in checked}
    verdicts = []
    for chosen in [[i] for i in checked] + ([checked] if len(checked) > 1 else []):
        along = names[chosen[0]] if len(chosen) == 1 else "all inputs"
        with dual_level():
            duals = [make_dual(t, directions[i]) if i in chosen else t for i, t in enumerate(inputs)]
            outs = _outputs(fn(*duals))
            tangents = [unpack_dual(o).tangent for o in outs]
        tangents = [o.xp.zeros_like(o.data) if t is None else t for o, t in zip(outs, tangents)]
        originals = {i: inputs[i].data.copy() for i in chosen}
        values = []
        for sign in (1, -1):
            for i in chosen:
                inputs[i].data[...] = originals[i] + sign * eps * directions[i]
            with no_grad():
                values.append([o.data.copy() for o in _outputs(fn(*inputs))])
        for i in chosen:
            inputs[i].data[...] = originals[i]
        for k, (t, plus, minus) in enumerate(zip(tangents, *values)):
            verdicts.append(judge(f"forward mode, output {k} along {along}: J u", t, (plus - minus) / (2 * eps),
                                  atol, rtol, report))
        if len(chosen) == len(checked):  # <g, J u> = <J^T g, u>: the jvp rules against the backward
            xp = inputs[chosen[0]].xp
            forward = sum(float((g * t).sum()) for g, t in zip(upstream, tangents))
            reverse = sum(float((analytic[i] * directions[i]).sum()) for i in chosen)
            scale = sum(float(abs(g * t).sum()) for g, t in zip(upstream, tangents)) + 1.0
            verdicts.append(judge("the transpose identity <g, J u> = <J^T g, u>", xp.asarray([forward]),
                                  xp.asarray([reverse]), 1e-10 * scale, 0.0, report))
    return verdicts


CREATE_GRAPH_RTOL = 1e-10  # the two forms of a gradient round differently, by a few ulps of the largest entry


def check_create_graph(fn: Callable[..., Tensor | Sequence[Tensor]], inputs: Sequence[Any], *, seed: int = 0,
                       report: list | None = None, names: Sequence[str] | None = None) -> bool:
    """Check that the first derivative taken with `create_graph=True` equals the plain backward's.

    Both are d/d input of L = sum_k sum(fn(*inputs)[k] * g_k) for one random upstream gradient
    g (gradcheck's): the plain one from each op's `backward` (raw arrays), the other from each
    op's `differentiable_backward` (the graph that second derivatives differentiate). A Function
    whose two forms disagree has second derivatives of a gradient it does not compute; finite
    differences of either form alone cannot see it. Pass when, for every input,
    |create_graph - plain| <= CREATE_GRAPH_RTOL * max(1, max |plain|). Returns True, or raises
    GradcheckError naming the input and the worst entry (see `judge`). names, report: as gradcheck's.
    """
    inputs = list(inputs)
    names = _names(names, len(inputs))
    checked = [i for i, t in enumerate(inputs) if getattr(t, "requires_grad", False)]
    if not checked:
        raise ValueError(_no_checked_input_message(inputs))
    _, upstream, plain = vjp(fn, inputs, seed=seed)
    with enable_grad():
        outs = _outputs(fn(*inputs))
        pairs = [(o, Tensor(g)) for o, g in zip(outs, upstream) if o.requires_grad]
        built = grad([o for o, _ in pairs], [inputs[i] for i in checked], [g for _, g in pairs],
                     create_graph=True, allow_unused=True)
    verdicts = []
    for i, g in zip(checked, built):
        reference = plain[i]
        yours = backend.get_array_module(reference).zeros_like(reference) if g is None else g.data
        verdicts.append(judge(f"{names[i]}: create_graph's gradient", yours, reference,
                              CREATE_GRAPH_RTOL * _magnitude(reference), 0.0, report))
    if not all(passed for passed, _ in verdicts):
        with enable_grad():
            verdicts += _disagreeing_ops(_outputs(fn(*inputs)), seed)
    _raise_if_wrong("check_create_graph: the gradient taken with create_graph=True (yours: differentiable_backward) "
                    "against the plain backward's (reference)", verdicts)
    return True


def _magnitude(array):
    """max(1, max |array|): the scale of a tolerance relative to an array's largest entry."""
    return max(1.0, float(abs(array).max())) if array.size else 1.0


def _disagreeing_ops(outs, seed):
    """One wrong verdict per op of the graph behind `outs` whose two forms of the gradient differ:
    each node's `backward` and `differentiable_backward` run on the same random gradients of its
    outputs, compared input by input (the op, its input and the worst entry named)."""
    from .function import backward_order, op_name

    rng = random_generator(seed, stream=4)
    verdicts = []
    for node in backward_order([o.creator for o in outs if o.creator is not None]):
        if getattr(node, "differentiable_backward", None) is None:
            continue  # differentiable once: create_graph runs its backward itself
        grads = [backend.to_device(rng.standard_normal(shape).astype(dtype), node.inputs[0].device
                                   if node.inputs[0] is not None else "cpu") for shape, dtype in node.output_meta]
        raw = node.backward(node, *[g.copy() for g in grads])
        raw = raw if isinstance(raw, tuple) else (raw,)
        built = node.differentiable_backward(node, *[Tensor(g) for g in grads])
        built = built if isinstance(built, tuple) else (built,)
        for k, (r, b) in enumerate(zip(raw, built)):
            if r is None or b is None or not node.needs_input_grad[k]:
                continue
            b = b.data if isinstance(b, Tensor) else b
            if b.shape != r.shape:
                continue  # a broadcast gradient: the engine sums it back; the totals were compared above
            passed, line = judge(f"op {op_name(type(node))}, its input {k}", b, r, CREATE_GRAPH_RTOL * _magnitude(r), 0.0)
            if not passed:
                verdicts.append((False, line))
    return verdicts


def gradgradcheck(fn: Callable[..., Tensor | Sequence[Tensor]], inputs: Sequence[Any],
                  grad_outputs: Sequence[Any] | None = None, *, eps: float = 1e-6, atol: float = 1e-5,
                  rtol: float = 1e-3, seed: int = 0, report: list | None = None,
                  names: Sequence[str] | None = None, check_first_derivative: bool = True) -> bool:
    """Check second derivatives (torch.autograd.gradgradcheck): `gradcheck` of the map

        (inputs, grad_outputs) -> sum_k grad_outputs[k]^T d fn(inputs)[k] / d inputs

    whose value is the first derivative built with `create_graph=True`, so that its own backward
    is the op's double backward. That first derivative is first checked against the plain
    backward's (`check_create_graph`): second derivatives of a gradient the ops do not compute
    would be checked in vain (check_first_derivative=False leaves that to the caller). grad_outputs: one float64 array or Tensor per output of fn that
    requires grad; None: random ones drawn from `random_generator(seed, stream=2)`. They require
    grad, so the derivative with respect to the upstream gradient is checked too. names: the
    inputs' names; the upstream gradients are "grad_outputs[k]". Returns True, or raises
    GradcheckError (or the error of an op that is differentiable only once, naming it).
    """
    inputs = list(inputs)
    names = _names(names, len(inputs))
    checked = [i for i, t in enumerate(inputs) if getattr(t, "requires_grad", False)]
    if not checked:
        raise ValueError(_no_checked_input_message(inputs))
    if check_first_derivative:
        check_create_graph(fn, inputs, seed=seed, names=names)
    outs = [o for o in _outputs(fn(*inputs)) if o.requires_grad]
    if grad_outputs is None:
        rng = random_generator(seed, stream=2)
        grad_outputs = [backend.to_device(rng.standard_normal(o.shape), o.device) for o in outs]
    if len(grad_outputs) != len(outs):
        raise ValueError(f"gradgradcheck: grad_outputs has {len(grad_outputs)} entries, expected one per output "
                         f"that requires grad ({len(outs)})")
    upstream = [Tensor(g.data if isinstance(g, Tensor) else g, requires_grad=True) for g in grad_outputs]
    n = len(inputs)

    def first_derivative(*args):  # with grad mode on, also where gradcheck evaluates it under no_grad
        xs, gs = list(args[:n]), list(args[n:])
        with enable_grad():
            outs = [o for o in _outputs(fn(*xs)) if o.requires_grad]
            return grad(outs, [xs[i] for i in checked], gs, create_graph=True, allow_unused=True)

    return gradcheck(first_derivative, inputs + upstream, eps=eps, atol=atol, rtol=rtol, seed=seed, report=report,
                     names=names + [f"grad_outputs[{k}]" for k in range(len(upstream))])


def _names(names, count):
    """The inputs' names: `names`, or "input 0", "input 1", ..."""
    if names is None:
        return [f"input {i}" for i in range(count)]
    if len(names) != count:
        raise ValueError(f"names: one name per input expected ({count}), got {len(names)}: {list(names)}")
    return list(names)


def _no_checked_input_message(inputs):
    """Why gradcheck has nothing to check, and what to do."""
    raw = [i for i, x in enumerate(inputs) if backend.is_array(x)]
    if raw:
        return (f"gradcheck: no input has requires_grad=True; input(s) {raw} are raw arrays, which get no "
                "gradient: wrap them: Tensor(x, requires_grad=True) (float64)")
    return ("gradcheck: no input has requires_grad=True; create the inputs to check with "
            "Tensor(x, requires_grad=True) (float64)")


def numeric_gradient(loss: Callable[[], float], tensor: Tensor, eps: float = 1e-6) -> Any:
    """d loss / d tensor by central differences, one entry at a time: (L(x+eps) - L(x-eps)) / 2eps.

    loss: a function of no arguments returning a float; tensor: a float64 Tensor it reads.
    """
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


def check_formula(fn: Callable[..., Tensor], arrays: Sequence[Any], upstream: Any, expected: Sequence[Any], *,
                  rtol: float = 1e-10, eps: float = 1e-6, names: Sequence[str] | None = None) -> bool:
    """Check gradients written on paper: `expected[i]` (yours: an array, the formula's dL/d
    arrays[i] for L = sum(fn(*arrays) * upstream)) must equal the op's backward to rounding
    (rtol * the largest |expected|) and central differences to gradcheck's tolerance.

    fn: a function of float64 Tensors returning one Tensor; arrays, upstream: float64 arrays
    (host or device); names: what to call each input ("q", "k", ...). Every input is judged
    against both references; returns True, or raises GradcheckError with one line per input
    and reference (see `judge`).
    """
    names = _names(names, len(arrays))
    inputs = [Tensor(backend.get_array_module(a).asarray(a, dtype="float64"), requires_grad=True,
                     device=backend.device_of(a)) for a in arrays]
    _, (g,), backward = vjp(fn, inputs, [upstream])

    def loss():
        with no_grad():
            return float((fn(*inputs).data * g).sum())

    verdicts = []
    for name, t, formula, theirs in zip(names, inputs, expected, backward):
        formula = t.xp.asarray(formula, dtype="float64")
        if formula.shape != t.shape:
            verdicts.append((False, f"{name}: wrong: your formula has shape {formula.shape}, the input {t.shape}"))
            continue
        scale = max(1.0, float(abs(formula).max())) if formula.size else 1.0
        verdicts.append(judge(f"{name} (reference: the op's backward)", formula, theirs, rtol * scale, 0.0))
        verdicts.append(judge(f"{name} (reference: finite differences)", formula, numeric_gradient(loss, t, eps),
                              1e-5, 1e-3))
    _raise_if_wrong("check_formula: your formula (yours) against the op's backward and finite differences", verdicts)
    return True


def judge(name: str, yours: Any, reference: Any, atol: float, rtol: float,
          report: list | None = None) -> tuple[bool, str]:
    """(passed, line): one tensor's verdict, exact, close (|yours - reference| <= atol + rtol
    |reference| everywhere) or wrong, with the largest difference and the worst entry (the
    one furthest out of tolerance): its index, both values, and the relative error where the
    reference is not 0 there. report: see `gradcheck`."""
    xp = backend.get_array_module(reference)
    err = xp.abs(yours - reference)
    if report is not None:
        report.append((name, float(err.max()) if err.size else 0.0,
                       float(xp.abs(reference).max()) if reference.size else 0.0))
    if not err.size:
        return True, f"{name}: exact (empty)"
    bound = atol + rtol * xp.abs(reference)
    excess = err / xp.maximum(bound, xp.finfo(bound.dtype).tiny)   # a zero tolerance divides by no zero
    worst = int(xp.argmax(xp.where(xp.isnan(excess), xp.inf, excess)))
    index = tuple(int(k) for k in xp.unravel_index(worst, reference.shape))
    passed = bool((excess <= 1).all())
    mine, theirs, diff = float(yours.reshape(-1)[worst]), float(reference.reshape(-1)[worst]), float(err.max())
    verdict = "exact" if diff == 0 else "close" if passed else "wrong"
    line = f"{name}: {verdict}, max diff {diff:.3g}"
    if verdict == "close":
        line += f", worst at index {index}"
    if verdict == "wrong":
        relative = f"rel {abs(mine - theirs) / abs(theirs):.3g}" if theirs else "the reference is 0 there"
        line += f", worst at index {index}: yours {mine:.10g}, reference {theirs:.10g} ({relative})"
    if not passed:
        tolerance = f"atol {atol:.3g}" + (f" + rtol {rtol:.3g} * |reference|" if rtol else "")
        line += f"; {int((~(excess <= 1)).sum())} of {err.size} entries beyond {tolerance}"
    return passed, line


def _raise_if_wrong(what, verdicts):
    """Raise GradcheckError listing every verdict when any is wrong."""
    if not all(passed for passed, _ in verdicts):
        raise GradcheckError(f"{what}:\n" + "\n".join(f"  {line}" for _, line in verdicts))


class _CallableModule(types.ModuleType):
    """This module, callable as `gradcheck`: `autograd.gradcheck` must be both the module
    (`autograd.gradcheck.check_formula`) and the function torch users call."""

    def __call__(self, *args, **kwargs):
        return gradcheck(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
