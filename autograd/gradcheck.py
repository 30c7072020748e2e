"""Finite-difference gradient checking that can fail.

The output is contracted with a random upstream gradient g, L = sum(fn(*inputs) * g), never
a plain sum (softmax rows and LayerNorm outputs have a zero gradient of sum(), which would
hide a wrong backward). Every entry of every input that requires grad is checked with float64
central differences, then one random direction u over all inputs together (v^T J u).

`vjp` (outputs and input gradients for an upstream gradient) is the one place that runs a
function, backpropagates and collects the gradients; `check_formula` checks a gradient
written on paper against an op's backward and against central differences.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from . import backend
from .modes import no_grad
from .tensor import Tensor


class GradcheckError(AssertionError):
    """Raised by `gradcheck` with the input, worst index, analytic and numeric values."""


def _outputs(result):
    """The output Tensors of a function's result (a Tensor or a tuple; None entries dropped)."""
    items = result if isinstance(result, (tuple, list)) else [result]
    return [o for o in items if o is not None]


def random_generator(seed, stream=0):
    """The host Generator of gradcheck's random draws (upstream gradients: stream 0, directions:
    stream 1): independent of `default_rng(seed)`, from which the inputs are often drawn (an
    upstream gradient equal to the input would make LayerNorm's input gradient zero)."""
    return backend.module_for("cpu").random.default_rng([seed, stream, 0x67726164])


def vjp(fn, inputs, upstream=None, *, seed=0):
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
    grads = [None if not getattr(t, "requires_grad", False) else t.xp.zeros_like(t.data) if t.grad is None else t.grad
             for t in inputs]
    return outs, upstream, grads


def gradcheck(fn: Callable[..., Tensor | Sequence[Tensor]], inputs: Sequence[Any], *, eps: float = 1e-6,
              atol: float = 1e-5, rtol: float = 1e-3, seed: int = 0, report: list | None = None) -> bool:
    """Check `fn`'s hand-written backward against central differences (torch.autograd.gradcheck).

    fn: callable taking `inputs` and returning a Tensor or a tuple of Tensors; it must be
    deterministic (seed any dropout inside it). inputs: Tensors (or other arguments passed
    through); each Tensor with requires_grad=True must be float64 and is checked.
    Pass when |analytic - numeric| <= atol + rtol * |numeric| everywhere. Returns True, or
    raises GradcheckError. report: a list, or None; when given, one (what, max abs error,
    max |numeric|) tuple is appended per comparison (each input, then the random direction),
    so a caller can show how close a check came. Raises ValueError when no input requires grad
    (raw arrays must be wrapped: `Tensor(a, requires_grad=True)`) and TypeError for a checked
    input that is not float64.
    """
    inputs = list(inputs)
    checked = [i for i, t in enumerate(inputs) if getattr(t, "requires_grad", False)]
    if not checked:
        raise ValueError(_no_checked_input_message(inputs))
    for i in checked:
        if str(inputs[i].dtype) != "float64":
            raise TypeError(f"gradcheck: input {i} must be float64 for finite differences, got {inputs[i].dtype}")
    xp = inputs[checked[0]].xp
    outs, upstream, analytic = vjp(fn, inputs, seed=seed)

    def loss():
        with no_grad():
            return sum(float((o.data * g).sum()) for o, g in zip(_outputs(fn(*inputs)), upstream))

    for i in checked:
        numeric = numeric_gradient(loss, inputs[i], eps)
        _compare(f"input {i}", analytic[i].reshape(-1), numeric.reshape(-1), inputs[i].shape, atol, rtol, report)

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
    _compare("random direction over all inputs", xp.asarray([expected]), xp.asarray([numeric]), (1,), atol, rtol,
             report)
    return True


def _no_checked_input_message(inputs):
    """Why gradcheck has nothing to check, and what to do."""
    raw = [i for i, x in enumerate(inputs) if backend.is_array(x)]
    if raw:
        return (f"gradcheck: no input has requires_grad=True; input(s) {raw} are raw arrays, which get no "
                "gradient: wrap them: Tensor(x, requires_grad=True) (float64)")
    return ("gradcheck: no input has requires_grad=True; create the inputs to check with "
            "Tensor(x, requires_grad=True) (float64)")


def numeric_gradient(loss, tensor, eps=1e-6):
    """d loss / d tensor by central differences, one entry at a time: (L(x+eps) - L(x-eps)) / 2eps.

    loss: a function of no arguments returning a float; tensor: a float64 Tensor it reads.
    """
    xp = tensor.xp
    tensor.data = xp.ascontiguousarray(tensor.data)
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


def check_formula(fn, arrays, upstream, expected, *, rtol=1e-10, eps=1e-6):
    """Check gradients written on paper: `expected[i]` (an array, the formula's dL/d arrays[i]
    for L = sum(fn(*arrays) * upstream)) must equal the op's backward to rounding
    (rtol * the largest |expected|) and central differences to gradcheck's tolerance.

    fn: a function of float64 Tensors returning one Tensor; arrays, upstream: float64 arrays
    (host or device). Returns True, or raises GradcheckError naming the input and the worst entry.
    """
    inputs = [Tensor(backend.get_array_module(a).asarray(a, dtype="float64"), requires_grad=True,
                     device=backend.device_of(a)) for a in arrays]
    _, (g,), backward = vjp(fn, inputs, [upstream])
    for i, (t, formula) in enumerate(zip(inputs, expected)):
        formula = t.xp.asarray(formula, dtype="float64")
        scale = max(1.0, float(abs(formula).max())) if formula.size else 1.0
        _compare(f"input {i}: backward vs the formula", backward[i].reshape(-1), formula.reshape(-1), t.shape,
                 rtol * scale, 0.0)

        def loss():
            with no_grad():
                return float((fn(*inputs).data * g).sum())

        numeric = numeric_gradient(loss, t, eps)
        _compare(f"input {i}: the formula vs finite differences", formula.reshape(-1), numeric.reshape(-1), t.shape,
                 1e-5, 1e-3)
    return True


def _compare(name, analytic, numeric, shape, atol, rtol, report=None):
    xp = backend.get_array_module(numeric)
    err = xp.abs(analytic - numeric)
    if report is not None:
        report.append((name, float(err.max()) if err.size else 0.0,
                       float(xp.abs(numeric).max()) if numeric.size else 0.0))
    if not err.size:
        return
    excess = err / (atol + rtol * xp.abs(numeric))
    worst = int(xp.argmax(excess))
    if not bool(excess[worst] <= 1):
        index = tuple(int(k) for k in xp.unravel_index(worst, shape))
        raise GradcheckError(
            f"gradcheck failed for {name} at index {index}: analytic {float(analytic[worst]):.10g}, "
            f"numeric {float(numeric[worst]):.10g}, abs error {float(err[worst]):.3g}, "
            f"rel error {float(err[worst] / max(abs(float(numeric[worst])), 1e-300)):.3g} "
            f"(atol {atol}, rtol {rtol}); max abs error over the input {float(err.max()):.3g}")
