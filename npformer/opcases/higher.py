"""A case's second derivatives and forward mode, the registry's columns beside the first
derivative: the first derivative taken with create_graph against the plain backward's
(`autograd.gradcheck.check_create_graph`), `autograd.gradgradcheck` and `autograd.gradcheck(check_forward_ad=True)` against
central finite differences, and the Hessian-vector product and the Jacobian-vector product
against PyTorch's (float64; torch's attention on its math backend, the one that has a double
backward and forward AD). Compared as `case.compare` compares, to the registry's tolerances.

An op that is differentiable once (no `differentiable_backward`) or has no `jvp` rule raises
the engine's error naming it: the column fails with that message, never a silent pass, where
the case requires it (`OpCase.require`); elsewhere the column is "not defined"
(`undefined_rules` finds such ops before the column runs).
"""
import warnings
from typing import Any, Callable, Sequence

import numpy as np

import autograd
from autograd import Tensor, backend
from autograd import forward_ad as fwAD
from autograd.gradcheck import _outputs, judge, numeric_gradient, vjp

from .case import TOLERANCE, Comparison, Instance, OpCase, compare, instantiate

FORWARD_MODE_CHECKS = ("forward mode", "the transpose identity")  # gradcheck's report: what forward mode judged


def gradgradcheck_case(case: OpCase, rng: np.random.Generator, device: str = "cpu",
                       report: list | None = None) -> bool:
    """`autograd.gradgradcheck` (float64, random grad_outputs) of the case over every input and
    parameter, by name; True or raises. report: see autograd.gradcheck. Whether the first
    derivative it differentiates is the backward's is create_graph_case's column, not this one."""
    instance = instantiate(case, rng, device)
    return autograd.gradgradcheck(instance, instance.tensors, report=report, names=instance.labels,
                                  check_first_derivative=False)


def create_graph_case(case: OpCase, rng: np.random.Generator, device: str = "cpu",
                      report: list | None = None) -> bool:
    """`autograd.gradcheck.check_create_graph` (float64) of the case over every input and
    parameter, by name: the first derivative taken with create_graph equals the plain
    backward's; True or raises. Where they differ and the create_graph form agrees with central
    differences, the plain backward is the wrong one (its own columns fail): True, the report
    then holding create_graph's gradient against the differences. report: see autograd.gradcheck."""
    instance = instantiate(case, rng, device)
    mark = len(report) if report is not None else 0
    try:
        return autograd.gradcheck.check_create_graph(instance, instance.tensors, report=report, names=instance.labels)
    except autograd.GradcheckError as disagreement:
        verdicts = _create_graph_against_finite_differences(instance)
        if not all(passed for passed, _, _ in verdicts):
            raise disagreement from None
        if report is not None:  # the cell shows create_graph's gradient against finite differences
            report[mark:] = [entry for _, _, entry in verdicts]
        return True


def _create_graph_against_finite_differences(instance: Instance) -> list:
    """[(passed, line, report entry)]: the first derivative taken with create_graph against central
    differences (gradcheck's tolerance), input by input: when it is right and the plain backward
    is not, the backward's columns fail, not create_graph's."""
    inputs, labels = instance.tensors, instance.labels
    _, upstream, _ = vjp(instance, inputs)
    with autograd.enable_grad():
        outs = _outputs(instance(*inputs))
        pairs = [(o, Tensor(g)) for o, g in zip(outs, upstream) if o.requires_grad]
        built = autograd.grad([o for o, _ in pairs], inputs, [g for _, g in pairs], create_graph=True,
                              allow_unused=True)

    def loss():
        with autograd.no_grad():
            return sum(float((o.data * g).sum()) for o, g in zip(_outputs(instance(*inputs)), upstream))

    verdicts = []
    for label, t, g in zip(labels, inputs, built):
        report = []
        numeric = numeric_gradient(loss, t)
        passed, line = judge(f"{label}: create_graph's gradient", t.xp.zeros_like(t.data) if g is None else g.data,
                             numeric, 1e-5, 1e-3, report)
        verdicts.append((passed, line, report[0]))
    return verdicts


def forward_mode_case(case: OpCase, rng: np.random.Generator, device: str = "cpu",
                      report: list | None = None) -> bool:
    """`autograd.gradcheck(check_forward_ad=True, check_backward_ad=False)` (float64) moving every
    input of the case (a module case's parameters stay constants): the jvp rules against central
    differences, and against the backward (the transpose identity) where the backward is right,
    so that a wrong backward fails its own column only; True or raises. report: see
    autograd.gradcheck (its forward-mode entries are those whose name starts with FORWARD_MODE_CHECKS)."""
    instance = instantiate(case, rng, device)
    count = len(instance.arrays)
    return autograd.gradcheck(instance, instance.tensors[:count], check_forward_ad=True, check_backward_ad=False,
                              report=report, names=instance.labels[:count])


def undefined_rules(case: OpCase, rng: np.random.Generator, device: str = "cpu") -> dict:
    """{"second-order": the ops of the case's graph without a `differentiable_backward`,
    "forward-mode": those without a `jvp` rule}: the Function classes' names, in the order a
    backward pass meets them, each once; the case's fn run once, with grad, to build the graph."""
    from autograd.function import backward_order, op_name

    instance = instantiate(case, rng, device)
    with autograd.enable_grad():
        outs = _outputs(instance(*instance.tensors))
    missing = {"second-order": [], "forward-mode": []}
    for node in backward_order([o.creator for o in outs if getattr(o, "creator", None) is not None]):
        for requirement, rule in (("second-order", "differentiable_backward"), ("forward-mode", "jvp")):
            name = op_name(type(node))
            if getattr(node, rule, None) is None and name not in missing[requirement]:
                missing[requirement].append(name)
    return missing


def hvp(fn: Callable, xs: Sequence[Any], upstream: Sequence[Any], directions: Sequence[Any],
        grad: Callable) -> tuple[list, list]:
    """(first derivatives, HVP) of fn at xs by `grad` (autograd.grad or torch.autograd.grad), as
    host float64 arrays: d/dx <fn(x), g> built with create_graph (g: one upstream gradient per
    output that is not None), then d/dx <that, u>; zeros where nothing depends on x."""
    outs = _outputs(fn(*xs))
    pairs = [(o, g) for o, g in zip(outs, upstream) if o.requires_grad]
    first = grad([o for o, _ in pairs], xs, [g for _, g in pairs], create_graph=True, allow_unused=True)
    pairs = [(f, u) for f, u in zip(first, directions) if f is not None and f.requires_grad]
    second = grad([f for f, _ in pairs], xs, [u for _, u in pairs], allow_unused=True) if pairs else [None] * len(xs)
    as_array = lambda t, x: np.zeros(x.shape) if t is None else np.array(t.detach().numpy())  # noqa: E731
    return [as_array(f, x) for f, x in zip(first, xs)], [as_array(s, x) for s, x in zip(second, xs)]


def compare_hvp(fn: Callable, xs: Sequence[Tensor], torch: Any, torch_fn: Callable, leaves: Sequence[Any],
                labels: Sequence[str], rng: np.random.Generator,
                tolerance: float = TOLERANCE["torch", "float64"]) -> Comparison:
    """fn's first derivative d/dx <f(x), g> and HVP d/dx <d/dx <f(x), g>, u> against torch_fn's
    on the torch leaves (the same values), for random upstream gradients g and directions u drawn
    from `rng`, over every x (named by `labels`). Where the first derivatives (taken with
    create_graph) differ, the HVP is not judged (a note says so): that is the create_graph
    column's failure, and a second derivative of a wrong first one is wrong for that reason alone."""
    with autograd.no_grad():
        outs = _outputs(fn(*xs))
    upstream = [rng.standard_normal(o.shape) for o in outs]
    directions = [rng.standard_normal(x.shape) for x in xs]
    on_device = lambda a, like: Tensor(backend.to_device(a, like.device))  # noqa: E731
    first, second = hvp(fn, xs, [on_device(g, o) for g, o in zip(upstream, outs)],
                        [on_device(u, x) for u, x in zip(directions, xs)], autograd.grad)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        first_t, second_t = hvp(torch_fn, leaves, [torch.tensor(g) for g in upstream],
                                [torch.tensor(u) for u in directions], torch.autograd.grad)
    firsts = compare(first, first_t, [f"d/d {label}" for label in labels], tolerance)
    if not firsts.passed:  # the create_graph column's failure (or the backward's): the HVP would repeat it
        return Comparison(0.0, 0.0, [], [f"the HVP is not judged: the first derivative it differentiates differs from "
                                         f"torch's ({'; '.join(firsts.failures)})"])
    return compare(first + second, first_t + second_t,
                   [f"d/d {label}" for label in labels] + [f"HVP at {label}" for label in labels], tolerance)


def compare_hvp_with_torch(case: OpCase, torch: Any, rng: np.random.Generator, device: str = "cpu") -> Comparison:
    """The case's first and second derivatives (`compare_hvp`) against torch's double backward,
    over every input and every parameter of a module case."""
    instance = instantiate(case, rng, device)
    torch_fn, leaves = instance.torch_function(torch)
    return compare_hvp(instance, instance.tensors, torch, torch_fn, leaves, instance.labels, rng)


def case_jvp(instance: Instance, directions: Sequence[Any]) -> tuple[list, list]:
    """(outputs, tangents): an instantiated case run on dual tensors of its input arrays (on its
    device) with `directions` as their tangents; a tangent is zeros for an output that got none."""
    with fwAD.dual_level():
        inputs = [fwAD.make_dual(Tensor(t.data), u) for t, u in zip(instance.tensors, directions)]
        outs = [fwAD.unpack_dual(o) for o in _outputs(instance(*inputs))]
    return [o.primal for o in outs], [o.primal.xp.zeros_like(o.primal.data) if o.tangent is None else o.tangent.data
                                      for o in outs]


def compare_jvp_with_torch(case: OpCase, torch: Any, rng: np.random.Generator, device: str = "cpu",
                           tangents: Callable | None = None) -> Comparison:
    """The case's forward mode against `torch.func.jvp` of its torch reference, in float64: a
    standard normal tangent for every input (`tangents`: None, or a function of those, a list of
    arrays, returning the ones to use); every output and its tangent compared. A module case
    moves its inputs only; its parameters stay constants."""
    instance = instantiate(case, rng, device)
    directions = [rng.standard_normal(a.shape) for a in instance.arrays]
    if tangents is not None:
        directions = tangents(directions)
    outs, ours = case_jvp(instance, [backend.to_device(u, device) for u in directions])
    torch_fn, _ = instance.torch_function(torch)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH), warnings.catch_warnings():
        # torch's first forward-mode call loads its decompositions with torch.jit.script, which warns
        # (DeprecationWarning) from inside torch: torch's business, not the case's
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch(\.|$)")
        theirs, theirs_tangents = torch.func.jvp(lambda *xs: tuple(_outputs(torch_fn(*xs))),
                                                 tuple(torch.tensor(a) for a in instance.arrays),
                                                 tuple(torch.tensor(u) for u in directions))
    labels = [f"output {i}" for i in range(len(outs))] + [f"tangent of output {i}" for i in range(len(outs))]
    return compare([o.data for o in outs] + ours, [t.detach().numpy() for t in (*theirs, *theirs_tangents)],
                   labels, TOLERANCE["torch", "float64"])
