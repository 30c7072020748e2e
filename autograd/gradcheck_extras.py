"""The rest of gradient checking (a second read): forward mode, create_graph, second derivatives,
and formulas written on paper. `autograd.gradcheck` (autograd/gradcheck.py) re-exports them:
`autograd.gradcheck.check_formula`, `autograd.gradcheck.check_create_graph`, `autograd.gradgradcheck`.

`random_direction_verdict`: gradcheck's check of one random direction u over all inputs
together, v^T J u against the central difference along u. With `check_forward_ad=True`,
gradcheck also checks forward mode (`forward_mode_verdicts`): each
jvp rule against central differences and against the backward (the transpose identity).
`check_create_graph` checks that the first derivative taken with `create_graph=True` (each op's
`differentiable_backward`) equals the plain backward's: two forms of one gradient that could
otherwise drift apart unseen. `gradgradcheck` checks second derivatives: `gradcheck` of the map
from (inputs, upstream gradients) to the gradient, built with create_graph (after
check_create_graph). `check_formula` checks a gradient written on paper against an op's backward
and against central differences.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from . import backend
from .create_graph import grad
from .gradcheck import (GradcheckError, _checked, _outputs, gradcheck, judge, numeric_gradient, random_generator,
                        vjp)
from .function import Function
from .gradcheck_diagnosis import same, slopes_note, strided
from .modes import enable_grad, no_grad
from .tensor import Tensor


def _raise_if_wrong(what, verdicts):
    """Raise GradcheckError listing every verdict when any is wrong."""
    if not all(passed for passed, _ in verdicts):
        raise GradcheckError(f"{what}:\n" + "\n".join(f"  {line}" for _, line in verdicts))


def random_direction_verdict(loss, inputs, checked, analytic, eps, atol, rtol, seed, report):
    """gradcheck's verdict on one random direction u over all `checked` inputs together: the
    backward's gradients (`analytic`) along u, v^T J u, against the central difference of `loss`."""
    directions = _directions(inputs, checked, seed, stream=1)
    expected = sum(float((analytic[i] * directions[i]).sum()) for i in checked)
    plus, minus = _along(inputs, checked, directions, eps, loss)
    xp = inputs[checked[0]].xp
    return judge("random direction over all inputs", xp.asarray([expected]), xp.asarray([(plus - minus) / (2 * eps)]),
                 atol, rtol, report)


def _directions(inputs, checked, seed, stream):
    """{i: a standard normal direction of input i's shape, on its device} for the checked inputs."""
    rng = random_generator(seed, stream)
    return {i: backend.to_device(rng.standard_normal(inputs[i].shape), inputs[i].device) for i in checked}


def _along(inputs, chosen, directions, eps, evaluate):
    """(evaluate() with each chosen input moved by +eps along its direction, the same with -eps);
    the inputs' values restored."""
    originals = {i: inputs[i].data.copy() for i in chosen}
    values = []
    for sign in (1, -1):
        for i in chosen:
            inputs[i].data[...] = originals[i] + sign * eps * directions[i]
        values.append(evaluate())
    for i in chosen:
        inputs[i].data[...] = originals[i]
    return values


def vjp_where_it_runs(fn, inputs, seed):
    """gradcheck's vjp for forward mode alone (check_backward_ad=False): (outputs, upstream, the
    backward's gradients, or None where the backward raises: forward mode is judged without it)."""
    try:
        return vjp(fn, inputs, seed=seed)
    except Exception:  # noqa: BLE001  (a broken backward is the backward's check's business)
        outs = _outputs(fn(*inputs))
        rng = random_generator(seed)
        return outs, [backend.to_device(rng.standard_normal(o.shape).astype(o.dtype), o.device) for o in outs], None


def forward_mode_verdicts(fn, inputs, names, checked, upstream, analytic, eps, atol, rtol, seed, report):
    """gradcheck's forward-mode part (check_forward_ad=True): for each input alone and for all
    together, J u by the ops' jvp rules against central differences along a random u, and the
    transpose identity <g, J u> = <J^T g, u> between the jvp rules and the backward (`analytic`,
    J^T g; None when it was not computed) where the backward is right along u: a wrong backward
    is the backward's failure, not forward mode's. One verdict per output and direction."""
    from .forward_ad import dual_level, make_dual, tangent_array

    directions = _directions(inputs, checked, seed, stream=3)
    verdicts = []
    for chosen in [[i] for i in checked] + ([checked] if len(checked) > 1 else []):
        along = names[chosen[0]] if len(chosen) == 1 else "all inputs"
        with dual_level():
            duals = [make_dual(t, directions[i]) if i in chosen else t for i, t in enumerate(inputs)]
            outs = _outputs(fn(*duals))
            tangents = [tangent_array(o) for o in outs]
        tangents = [o.xp.zeros_like(o.data) if t is None else t for o, t in zip(outs, tangents)]
        def outputs():
            with no_grad():
                return [o.data.copy() for o in _outputs(fn(*inputs))]

        values = _along(inputs, chosen, directions, eps, outputs)
        for k, (t, base, plus, minus) in enumerate(zip(tangents, outputs(), *values)):
            kink = lambda index, b=base, p=plus, m=minus: slopes_note(  # noqa: E731  (at a kink, say so)
                float(b[index]), float(p[index]), float(m[index]), eps, atol, rtol)
            verdicts.append(judge(f"forward mode, output {k} along {along}: J u", t, (plus - minus) / (2 * eps),
                                  atol, rtol, report, explain=kink))
        if len(chosen) == len(checked):  # <g, J u> = <J^T g, u>: the jvp rules against the backward
            verdicts.append(_transpose_verdict(upstream, tangents, analytic, directions, chosen, values, eps, atol,
                                               rtol, report))
    return verdicts


def _transpose_verdict(upstream, tangents, analytic, directions, chosen, values, eps, atol, rtol, report):
    """The transpose identity <g, J u> = <J^T g, u> between the jvp rules (tangents, J u) and the
    backward (analytic, J^T g), judged when the backward agrees with the central difference
    <g, (f(x + eps u) - f(x - eps u)) / 2 eps> along u (gradcheck's tolerance); otherwise a passed
    verdict saying why it was not judged."""
    what = "the transpose identity <g, J u> = <J^T g, u>"
    if analytic is None:
        return True, f"{what}: not judged (the backward did not run)"
    xp = backend.get_array_module(upstream[0]) if upstream else None
    reverse = sum(float((analytic[i] * directions[i]).sum()) for i in chosen)
    along = sum(float((g * (plus - minus)).sum()) / (2 * eps) for g, plus, minus in zip(upstream, *values))
    if not abs(reverse - along) <= atol + rtol * abs(along):
        return True, f"{what}: not judged (the backward disagrees with finite differences along u: its own check)"
    forward = sum(float((g * t).sum()) for g, t in zip(upstream, tangents))
    scale = sum(float(abs(g * t).sum()) for g, t in zip(upstream, tangents)) + 1.0
    return judge(what, xp.asarray([forward]), xp.asarray([reverse]), 1e-10 * scale, 0.0, report)


# -- torch's other options of gradcheck ---------------------------------------------------------------
TORCH_OPTIONS = {"fast_mode": False, "check_undefined_grad": True, "check_batched_grad": False, "nondet_tol": 0.0}
"""torch.autograd.gradcheck's options beyond gradcheck's own arguments, with torch's defaults:
fast_mode (accepted: gradcheck's check is already at least as strict as torch's fast mode, which
compares one random projection v^T J u, since gradcheck compares v^T J e_j for every entry j of
every input and a random direction besides), check_undefined_grad (the backward given zero
output gradients, or None where a Function asks for them, gives zeros or None and does not
raise), check_batched_grad (autograd.grad with is_grads_batched=True, a batch of upstream
gradients, gives each one's gradient: torch checks its vmap, npformer's loop) and nondet_tol
(the backward run again on the same input and upstream gradient gives the same gradients to
within it: torch's reentrant check)."""


def torch_options_checked(where: str, options: dict) -> dict:
    """TORCH_OPTIONS updated with `options` (gradcheck's **torch_options), each checked, or TypeError /
    ValueError naming the argument."""
    unknown = sorted(set(options) - set(TORCH_OPTIONS))
    if unknown:
        raise TypeError(f"{where}() got an unexpected keyword argument {unknown[0]!r}; torch's options it takes "
                        f"besides its own: {', '.join(TORCH_OPTIONS)}")
    merged = {**TORCH_OPTIONS, **options}
    for name in ("fast_mode", "check_undefined_grad", "check_batched_grad"):
        if not isinstance(merged[name], bool):
            raise TypeError(f"{where}: {name} must be a bool, got {type(merged[name]).__name__} {merged[name]!r}")
    tol = merged["nondet_tol"]
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not tol >= 0:
        raise ValueError(f"{where}: nondet_tol must be a number >= 0, got {tol!r}")
    return merged


def false_on_failure(check: Callable[..., bool], arguments: dict) -> bool:
    """check(**arguments) (a gradcheck or gradgradcheck, its **torch_options spread), or False
    where it raises GradcheckError: torch's raise_exception=False. Other errors propagate."""
    arguments = dict(arguments)
    arguments.update(arguments.pop("torch_options", {}))
    try:
        return check(**arguments)
    except GradcheckError:
        return False


def torch_option_verdicts(fn, inputs, names, checked, upstream, analytic, atol, rtol, seed, options):
    """The failed verdicts of torch's checks beyond the gradient's values (see TORCH_OPTIONS):
    reentrant (always, to nondet_tol), undefined output gradients, batched upstream gradients. [] when all pass."""
    tol = options["nondet_tol"]
    _, _, again = vjp(fn, inputs, upstream)
    failed = []
    for i in checked:
        if not same(again[i], analytic[i]):
            passed, line = judge(f"{names[i]}: the backward run again", again[i], analytic[i], tol, 0.0)
            if not passed:
                failed.append((False, line + f"; the kind of mistake: the backward is not reentrant (nondet_tol "
                                             f"{tol:g}): run again on the same input and upstream gradient, it gives "
                                             "other values (state kept between calls, or nondeterminism)"))
    if options["check_undefined_grad"]:
        failed += _undefined_grad_verdicts(fn, inputs, names, checked)
    if options["check_batched_grad"]:
        failed += _batched_grad_verdicts(fn, inputs, names, checked, atol, rtol, seed)
    return failed


class _UndefinedGradient(Function):
    """The identity, whose backward gives no gradient (None): the op before it gets none for this
    output, as torch's UndefinedGrad (its backward gets zeros, or None with set_materialize_grads(False))."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return None


def _undefined_grad_verdicts(fn, inputs, names, checked):
    """check_undefined_grad: the backward of fn with every output's gradient undefined (zeros, or
    None where a Function set_materialize_grads(False)) must not raise and must give zeros or None."""
    what = "undefined output gradients (check_undefined_grad)"
    with enable_grad():
        outs = [o for o in _outputs(fn(*inputs)) if o.requires_grad]
        if not outs:
            return []
        try:
            found = grad([_UndefinedGradient.apply(o) for o in outs], [inputs[i] for i in checked],
                         [Tensor(o.xp.ones_like(o.data)) for o in outs], allow_unused=True)
        except Exception as error:  # noqa: BLE001  (what the backward raised is the verdict)
            return [(False, f"{what}: the backward raised {type(error).__name__}: {error}; a backward must accept "
                            "zero output gradients (None with ctx.set_materialize_grads(False)) and give zeros or None")]
    return [(False, f"{names[i]}: {what}: the backward gave a nonzero gradient (max |entry| "
                    f"{float(abs(g.data).max()):.3g}) from zero output gradients")
            for i, g in zip(checked, found) if g is not None and bool((g.data != 0).any())]


def _batched_grad_verdicts(fn, inputs, names, checked, atol, rtol, seed):
    """check_batched_grad: autograd.grad with a batch of two random upstream gradients per output
    (is_grads_batched=True) against each one's gradient computed alone."""
    rng = random_generator(seed, stream=6)
    with enable_grad():
        outs = [o for o in _outputs(fn(*inputs)) if o.requires_grad]
        batches = [backend.to_device(rng.standard_normal((2,) + o.shape).astype(o.dtype), o.device) for o in outs]
        batched = grad(outs, [inputs[i] for i in checked], [Tensor(b) for b in batches], is_grads_batched=True,
                       materialize_grads=True)
    failed = []
    for b in range(2):
        with enable_grad():
            outs = [o for o in _outputs(fn(*inputs)) if o.requires_grad]
            alone = grad(outs, [inputs[i] for i in checked], [Tensor(g[b]) for g in batches], materialize_grads=True)
        for i, one, many in zip(checked, alone, batched):
            passed, line = judge(f"{names[i]}: batched gradient {b} (check_batched_grad)", many.data[b], one.data,
                                 atol, rtol)
            if not passed:
                failed.append((False, line + "; the gradient of a batch of upstream gradients (is_grads_batched) "
                                             "differs from each one's alone"))
    return failed


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
    inputs, names, checked = _checked(inputs, names)
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
                  names: Sequence[str] | None = None, check_first_derivative: bool = True,
                  check_fwd_over_rev: bool = False, check_rev_over_rev: bool = True,
                  gen_non_contig_grad_outputs: bool = False, raise_exception: bool = True, **torch_options: Any) -> bool:
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

    torch's arguments: check_rev_over_rev (the double backward, above; default) and
    check_fwd_over_rev (forward mode through the first derivative: gradcheck's check_forward_ad
    of the map above, whose jvp rules are the gradient's ops' own), at least one of them;
    gen_non_contig_grad_outputs (the random grad_outputs are non-contiguous arrays);
    raise_exception=False (False instead of GradcheckError); fast_mode, check_undefined_grad,
    check_batched_grad, nondet_tol as gradcheck's (TORCH_OPTIONS), for the map above.
    """
    if not raise_exception:
        return false_on_failure(gradgradcheck, {**locals(), "raise_exception": True})
    torch_options = torch_options_checked("gradgradcheck", torch_options)
    for name, flag in (("check_fwd_over_rev", check_fwd_over_rev), ("check_rev_over_rev", check_rev_over_rev),
                       ("gen_non_contig_grad_outputs", gen_non_contig_grad_outputs)):
        if not isinstance(flag, bool):
            raise TypeError(f"gradgradcheck: {name} must be a bool, got {type(flag).__name__} {flag!r}")
    if not (check_fwd_over_rev or check_rev_over_rev):
        raise ValueError("gradgradcheck: check_fwd_over_rev=False and check_rev_over_rev=False leave nothing to check")
    if torch_options["check_undefined_grad"] and not check_rev_over_rev:  # torch's rule: it is a backward's check
        raise ValueError("gradgradcheck: check_undefined_grad=True (the default) checks the double backward, which "
                         "check_rev_over_rev=False skips: pass check_undefined_grad=False too, as torch needs")
    inputs, names, checked = _checked(inputs, names)
    if check_first_derivative:
        check_create_graph(fn, inputs, seed=seed, names=names)
    outs = [o for o in _outputs(fn(*inputs)) if o.requires_grad]
    if grad_outputs is None:
        rng = random_generator(seed, stream=2)
        grad_outputs = [backend.to_device(rng.standard_normal(o.shape), o.device) for o in outs]
        grad_outputs = [strided(g) for g in grad_outputs] if gen_non_contig_grad_outputs else grad_outputs
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
                     names=names + [f"grad_outputs[{k}]" for k in range(len(upstream))],
                     check_forward_ad=check_fwd_over_rev, check_backward_ad=check_rev_over_rev, **torch_options)


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
    inputs, names, _ = _checked([Tensor(backend.get_array_module(a).asarray(a, dtype="float64"), requires_grad=True,
                                        device=backend.device_of(a)) for a in arrays], names)
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
        verdicts.append(judge(f"{name} (reference: the op's backward)", formula, theirs, rtol * _magnitude(formula),
                              0.0))
        verdicts.append(judge(f"{name} (reference: finite differences)", formula, numeric_gradient(loss, t, eps),
                              1e-5, 1e-3))
    _raise_if_wrong("check_formula: your formula (yours) against the op's backward and finite differences", verdicts)
    return True
