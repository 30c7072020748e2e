"""`OpCase`: one op (or module) on one set of inputs, and its checks: central finite
differences (by calling `autograd.gradcheck`), PyTorch where the case has a reference, and the
twin where it has one (for npformer's own ops the composite twin).

Every check contracts the outputs with a random upstream gradient (`autograd.gradcheck.vjp`).
Against torch and the twin, an array (an output or a gradient) passes when

    max |ours - reference| <= TOLERANCE * max(1, max |reference|)

because the rounding of a correct result grows with the magnitude of the array it belongs to
(sums of products of inputs and upstream gradients), not with one machine's BLAS.
"""
import dataclasses
import inspect
from collections.abc import Sequence
from typing import Any, Callable, Optional

import numpy as np

import autograd
from autograd import Tensor, backend
from autograd.gradcheck import vjp
from npformer import interop
from npformer.functional import composite
from npformer.runtime import random

# (reference, dtype) -> relative tolerance (see the module docstring)
TOLERANCE = {("torch", "float64"): 1e-10, ("torch", "float32"): 1e-5,
             ("twin", "float64"): 1e-12, ("twin", "float32"): 1e-5}


REQUIREMENTS = ("second-order", "forward-mode")   # OpCase.require, gradcheck --require: the higher columns

COMPOSITE = "composite"  # OpCase.twin: npformer's composite twin (npformer/functional/composite.py)


@dataclasses.dataclass(frozen=True)
class OpCase:
    """One op or module on one set of inputs: what `register` takes.

    name: unique; the row of `python -m npformer.gradcheck` and the test id ("F.softmax (dim=0)").
    inputs: rng -> list of float arrays, or a dict {name: array}; each becomes an input Tensor
        that is differentiated.
    fn: fn(*inputs) -> Tensor or tuple of Tensors (None entries ignored); with `module`,
        fn(module, *inputs).
    torch: torch(t, *leaves), the same computation written with PyTorch (t is the torch module),
        or None; with `module`, torch(t, torch_module, *leaves).
    family: None, or the name of a registered `Family` (its test file, its docs section).
    input_names: the inputs' names in messages and tables ("q", "k", "v"); by default the keys
        of a dict from `inputs`, else fn's parameter names, else "input 0", "input 1", ...
    twin: None; or a function with fn's signature computing the same thing another way (its
        outputs and gradients are compared with fn's); or COMPOSITE: fn run inside
        `composite.installed()`, where npformer.functional's ops are built from autograd primitives.
    module: rng -> an npformer module (built after `manual_seed(0)`) whose parameters
        are differentiated after the inputs. convert: the torch side gets
        `interop.to_torch(module)` (else None: the module has no parameters).
    finite_differences: run gradcheck (False where the function deliberately is not smooth,
        such as an embedding's frozen padding row).
    float32: also compare with torch in float32.
    require: which higher columns must be defined, among REQUIREMENTS ("second-order",
        "forward-mode"). An op without a `differentiable_backward` (or a `jvp`) shows "not defined"
        in a column that is not required, and passes: most ops are differentiated once. A required
        column fails for it, naming the op. npformer's own cases require both (`inputs.op_case`).
    """
    name: str
    inputs: Callable
    fn: Callable
    torch: Optional[Callable] = None
    _: dataclasses.KW_ONLY
    family: Optional[str] = None
    input_names: Optional[tuple] = None
    twin: Optional[object] = None
    module: Optional[Callable] = None
    convert: bool = True
    finite_differences: bool = True
    float32: bool = True
    require: tuple = ()


def _parameter_names(fn, count, skip):
    """The first `count` positional parameter names of fn after `skip` of them, or None where
    fn takes *args (a Function's apply) or has fewer."""
    try:
        parameters = list(inspect.signature(fn).parameters.values())[skip:]
    except (TypeError, ValueError):
        return None
    names = [p.name for p in parameters[:count] if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return names if len(names) == count else None


@dataclasses.dataclass
class Instance:
    """An OpCase made concrete on a device and dtype: the input arrays (host), `tensors` (the
    input leaves, then the module's parameters) and their `labels` (the inputs' names, then
    "parameter <name>"). Calling it runs the case."""
    case: OpCase
    arrays: list
    tensors: list
    labels: list
    module: object = None

    def __call__(self, *tensors: Tensor) -> Any:
        return self.call(self.case.fn, *tensors)

    def call(self, fn: Callable, *tensors: Tensor) -> Any:
        """fn (the case's fn, or its twin) on these tensors, with the module when there is one."""
        if self.module is None:
            return fn(*tensors)
        return fn(self.module, *tensors[:len(self.arrays)])

    def torch_function(self, torch: Any) -> tuple[Callable, list]:
        """(function of torch leaves, torch leaves aligned with `tensors`): the case in PyTorch."""
        leaves = [torch.tensor(a, requires_grad=True) for a in self.arrays]
        if self.module is None:
            return (lambda *ls: self.case.torch(torch, *ls)), leaves
        torch_module = interop.to_torch(self.module) if self.case.convert else None
        named = dict(torch_module.named_parameters()) if torch_module is not None else {}
        params = [named[label.split(" ", 1)[1]] for label in self.labels[len(self.arrays):]]
        return (lambda *ls: self.case.torch(torch, torch_module, *ls[:len(self.arrays)])), leaves + params


def instantiate(case: OpCase, rng: np.random.Generator, device: str = "cpu", dtype: str = "float64") -> Instance:
    """The case's inputs drawn from `rng` (and its module built) on `device` in `dtype`."""
    drawn = case.inputs(rng)
    arrays = [np.asarray(a, dtype=dtype) for a in (drawn.values() if isinstance(drawn, dict) else drawn)]
    labels = list(case.input_names or (drawn if isinstance(drawn, dict) else None)
                  or _parameter_names(case.fn, len(arrays), skip=case.module is not None)
                  or [f"input {i}" for i in range(len(arrays))])
    if len(labels) != len(arrays):
        raise ValueError(f"{case.name}: input_names: one name per input expected ({len(arrays)}), got {labels}")
    tensors = [Tensor(a, requires_grad=True, device=device) for a in arrays]
    module = None
    if case.module is not None:
        random.manual_seed(0)
        module = case.module(rng).to(device=device, dtype=dtype)
        for name, p in module.named_parameters():
            tensors.append(p)
            labels.append(f"parameter {name}")
    return Instance(case, arrays, tensors, labels, module)


def torch_args(torch: Any, kwargs: dict, like: Any) -> dict:
    """kwargs with numpy arrays as torch tensors (floating ones in the dtype of the torch tensor
    `like`), for a torch call."""
    def convert(value):
        if not isinstance(value, np.ndarray):
            return value
        return torch.tensor(value).to(like.dtype) if value.dtype.kind == "f" else torch.tensor(value)
    return {key: convert(value) for key, value in kwargs.items()}


@dataclasses.dataclass
class Comparison:
    """Outputs and gradients against a reference: the largest absolute difference, that relative
    to the largest reference magnitude, and what failed (empty when everything passed); notes:
    what was not judged, and why."""
    max_abs: float
    max_rel: float
    failures: list
    notes: list = dataclasses.field(default_factory=list)

    @property
    def passed(self) -> bool:
        """Whether every array was within tolerance."""
        return not self.failures

    def __str__(self):
        return "; ".join(self.failures) or f"max abs {self.max_abs:.3g}, max rel {self.max_rel:.3g}"


def compare(ours: Sequence[Any], reference: Sequence[Any], labels: Sequence[str], tolerance: float) -> Comparison:
    """A Comparison of arrays `ours` against `reference` (pairs named by `labels`); equal
    infinities count as equal, NaN never does: a NaN makes the largest difference NaN. A failure
    names the worst entry (its index, yours and the reference's values) and any NaN or inf of
    yours where the reference has none."""
    failures, max_abs, max_rel = [], 0.0, 0.0
    if len(ours) != len(reference):
        return Comparison(np.inf, np.inf, [f"{len(ours)} arrays, the reference has {len(reference)}"])
    for label, a, b in zip(labels, ours, reference):
        a, b = backend.as_numpy(a), np.asarray(b)
        if a.shape != b.shape:
            failures.append(f"{label}: shape {a.shape}, the reference's {b.shape}")
            continue
        if not a.size:
            continue
        with np.errstate(invalid="ignore"):
            diff = np.where(a == b, 0.0, np.abs(a - b))
        err = float(diff.max())   # NaN when any entry is NaN
        magnitude = float(np.abs(b[np.isfinite(b)]).max(initial=0.0))
        max_abs, max_rel = _nan_max(max_abs, err), _nan_max(max_rel, err / magnitude if magnitude else err)
        if not err <= tolerance * max(1.0, magnitude):  # NaN fails too
            worst = np.unravel_index(int(np.argmax(np.where(np.isnan(diff), np.inf, diff))), a.shape)
            index = tuple(int(k) for k in worst)
            line = (f"{label}: max abs difference {err:.3g} > {tolerance} * max(1, max |reference| = {magnitude:.3g}), "
                    f"worst at index {index}: yours {a[worst]:.10g}, reference {b[worst]:.10g}")
            bad = ~np.isfinite(a) & (a != b)
            if bad.any():
                kinds = " and ".join(k for k, m in (("NaN", np.isnan(a) & bad), ("inf", np.isinf(a) & bad)) if m.any())
                first = tuple(int(k) for k in np.unravel_index(int(np.argmax(bad)), a.shape))
                line += f"; yours has {kinds} at {int(bad.sum())} entries (the first at index {first})"
            failures.append(line)
    return Comparison(max_abs, max_rel, failures)


def _nan_max(a: float, b: float) -> float:
    """max(a, b), NaN when either is (Python's max keeps whichever came first)."""
    return a if a != a else b if b != b else max(a, b)


def _checked(instance, outs, grads, device, dtype):
    """Our outputs then gradients as arrays, and the labels; raises if one is on another device
    or in another dtype than the inputs (an op must keep both)."""
    arrays = [o.data for o in outs] + list(grads)
    labels = [f"output {i}" for i in range(len(outs))] + [f"gradient of {label}" for label in instance.labels]
    for label, array in zip(labels, arrays):
        if backend.device_of(array) != device or str(array.dtype) != dtype:
            raise AssertionError(f"{instance.case.name}: {label} is {array.dtype} on '{backend.device_of(array)}', "
                                 f"expected {dtype} on '{device}'")
    return arrays, labels


def gradcheck_case(case: OpCase, rng: np.random.Generator, device: str = "cpu", report: list | None = None) -> bool:
    """`autograd.gradcheck` (float64) of the case over every input and parameter, by name; True
    or raises autograd.GradcheckError. report: see autograd.gradcheck."""
    instance = instantiate(case, rng, device)
    return autograd.gradcheck(instance, instance.tensors, report=report, names=instance.labels)


def compare_with_torch(case: OpCase, torch: Any, rng: np.random.Generator, device: str = "cpu",
                       dtype: str = "float64") -> Comparison:
    """The case's outputs and gradients (one random upstream gradient) against PyTorch's."""
    instance = instantiate(case, rng, device, dtype)
    outs, upstream, grads = vjp(instance, instance.tensors)
    ours, labels = _checked(instance, outs, grads, device, dtype)
    fn, leaves = instance.torch_function(torch)
    result = fn(*leaves)
    theirs = [o for o in (result if isinstance(result, (tuple, list)) else [result]) if o is not None]
    loss = sum((o * torch.tensor(backend.as_numpy(g))).sum() for o, g in zip(theirs, upstream))
    if theirs:
        loss.backward()
    reference = [o.detach().numpy() for o in theirs] + [
        np.zeros(leaf.shape, dtype=dtype) if leaf.grad is None else leaf.grad.numpy() for leaf in leaves]
    return compare(ours, reference, labels, TOLERANCE["torch", dtype])


def compare_with_twin(case: OpCase, rng: np.random.Generator, device: str = "cpu",
                      dtype: str = "float64") -> Comparison:
    """The case's outputs and gradients against those of its twin (the same inputs and upstream
    gradient): `case.twin` itself, or for COMPOSITE the case run inside `composite.installed()`."""
    if case.twin is None:
        raise ValueError(f"{case.name}: the case has no twin")
    instance = instantiate(case, rng, device, dtype)
    outs, upstream, grads = vjp(instance, instance.tensors)
    ours, labels = _checked(instance, outs, grads, device, dtype)
    if case.twin == COMPOSITE:
        with composite.installed():
            twin_outs, _, twin_grads = vjp(instance, instance.tensors, upstream)
    else:
        twin_outs, _, twin_grads = vjp(lambda *ts: instance.call(case.twin, *ts), instance.tensors, upstream)
    twin, _ = _checked(instance, twin_outs, twin_grads, device, dtype)
    return compare(ours, twin, labels, TOLERANCE["twin", dtype])
