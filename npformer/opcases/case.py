"""`OpCase`: one op (or module) on one set of inputs, and the three checks every case gets:
central finite differences (by calling `autograd.gradcheck`), PyTorch, and the composite twin.

Every check contracts the outputs with a random upstream gradient (`autograd.gradcheck.vjp`).
Against torch and the twin, an array (an output or a gradient) passes when

    max |ours - reference| <= TOLERANCE * max(1, max |reference|)

because the rounding of a correct result grows with the magnitude of the array it belongs to
(sums of products of inputs and upstream gradients), not with one machine's BLAS.
"""
import dataclasses
from typing import Callable, Optional

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


@dataclasses.dataclass(frozen=True)
class OpCase:
    """One op or module on one set of inputs.

    name: unique; the row of `python -m npformer.gradcheck` and the test id ("F.softmax (dim=0)").
    family: the op family (a key of `opcases.FAMILIES`): its test file, its row in docs/backprop.md.
    inputs: rng -> list of float arrays; each becomes an input Tensor that is differentiated.
    fn: fn(*inputs) -> Tensor or tuple of Tensors (None entries ignored), written with
        npformer.functional / npformer.nn, so that inside `composite.installed()` it runs the
        composite twin; with `module`, fn(module, *inputs).
    torch: torch(t, *leaves), the same computation written with PyTorch (t is the torch module),
        or None; with `module`, torch(t, torch_module, *leaves).
    module: rng -> an npformer module (built after `manual_seed(0)`) whose parameters
        are differentiated after the inputs. convert: the torch side gets
        `interop.to_torch(module)` (else None: the module has no parameters).
    twin: compare with the composite twin (False where the twin draws other random numbers).
    finite_differences: run gradcheck (False where the function deliberately is not smooth,
        such as an embedding's frozen padding row).
    float32: also compare with torch in float32.
    """
    name: str
    family: str
    inputs: Callable
    fn: Callable
    torch: Optional[Callable] = None
    module: Optional[Callable] = None
    convert: bool = True
    twin: bool = True
    finite_differences: bool = True
    float32: bool = True


@dataclasses.dataclass
class Instance:
    """An OpCase made concrete on a device and dtype: the input arrays (host), `tensors` (the
    input leaves, then the module's parameters) and their `labels`. Calling it runs the case."""
    case: OpCase
    arrays: list
    tensors: list
    labels: list
    module: object = None

    def __call__(self, *tensors):
        if self.module is None:
            return self.case.fn(*tensors)
        return self.case.fn(self.module, *tensors[:len(self.arrays)])

    def torch_function(self, torch):
        """(function of torch leaves, torch leaves aligned with `tensors`): the case in PyTorch."""
        leaves = [torch.tensor(a, requires_grad=True) for a in self.arrays]
        if self.module is None:
            return (lambda *ls: self.case.torch(torch, *ls)), leaves
        torch_module = interop.to_torch(self.module) if self.case.convert else None
        named = dict(torch_module.named_parameters()) if torch_module is not None else {}
        params = [named[label.split(" ", 1)[1]] for label in self.labels[len(self.arrays):]]
        return (lambda *ls: self.case.torch(torch, torch_module, *ls[:len(self.arrays)])), leaves + params


def instantiate(case, rng, device="cpu", dtype="float64"):
    """The case's inputs drawn from `rng` (and its module built) on `device` in `dtype`."""
    arrays = [np.asarray(a, dtype=dtype) for a in case.inputs(rng)]
    tensors = [Tensor(a, requires_grad=True, device=device) for a in arrays]
    labels = [f"input {i}" for i in range(len(arrays))]
    module = None
    if case.module is not None:
        random.manual_seed(0)
        module = case.module(rng).to(device=device, dtype=dtype)
        for name, p in module.named_parameters():
            tensors.append(p)
            labels.append(f"parameter {name}")
    return Instance(case, arrays, tensors, labels, module)


def torch_args(torch, kwargs, like):
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
    to the largest reference magnitude, and what failed (empty when everything passed)."""
    max_abs: float
    max_rel: float
    failures: list

    @property
    def passed(self):
        return not self.failures

    def __str__(self):
        return "; ".join(self.failures) or f"max abs {self.max_abs:.3g}, max rel {self.max_rel:.3g}"


def compare(ours, reference, labels, tolerance):
    """A Comparison of arrays `ours` against `reference` (pairs named by `labels`); equal
    infinities count as equal, NaN never does."""
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
            err = float(np.where(a == b, 0.0, np.abs(a - b)).max())
        magnitude = float(np.abs(b[np.isfinite(b)]).max(initial=0.0))
        max_abs, max_rel = max(max_abs, err), max(max_rel, err / magnitude if magnitude else err)
        if not err <= tolerance * max(1.0, magnitude):  # NaN fails too
            failures.append(f"{label}: max abs difference {err:.3g} > {tolerance} * max(1, max |reference| "
                            f"= {magnitude:.3g})")
    return Comparison(max_abs, max_rel, failures)


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


def gradcheck_case(case, rng, device="cpu", report=None):
    """`autograd.gradcheck` (float64) of the case over every input and parameter; True or raises
    autograd.GradcheckError. report: see autograd.gradcheck."""
    instance = instantiate(case, rng, device)
    return autograd.gradcheck(instance, instance.tensors, report=report)


def compare_with_torch(case, torch, rng, device="cpu", dtype="float64"):
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


def compare_with_twin(case, rng, device="cpu", dtype="float64"):
    """The case's outputs and gradients against those of its composite twin (the same inputs
    and upstream gradient, run inside `composite.installed()`)."""
    instance = instantiate(case, rng, device, dtype)
    outs, upstream, grads = vjp(instance, instance.tensors)
    ours, labels = _checked(instance, outs, grads, device, dtype)
    with composite.installed():
        twin_outs, _, twin_grads = vjp(instance, instance.tensors, upstream)
    twin, _ = _checked(instance, twin_outs, twin_grads, device, dtype)
    return compare(ours, twin, labels, TOLERANCE["twin", dtype])
