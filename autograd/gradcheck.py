"""Finite-difference gradient checking that can fail.

The output is contracted with a random upstream gradient g, L = sum(fn(*inputs) * g), never
a plain sum (softmax rows and LayerNorm outputs have a zero gradient of sum(), which would
hide a wrong backward). Every entry of every input that requires grad is checked with float64
central differences, then one random direction u over all inputs together (v^T J u).
"""
from . import backend, random
from .function import no_grad


class GradcheckError(AssertionError):
    """Raised by `gradcheck` with the input, worst index, analytic and numeric values."""


def _outputs(fn, inputs):
    out = fn(*inputs)
    return list(out) if isinstance(out, (tuple, list)) else [out]


def gradcheck(fn, inputs, *, eps=1e-6, atol=1e-5, rtol=1e-3, seed=0):
    """Check `fn`'s hand-written backward against central differences.

    fn: callable taking `inputs` and returning a Tensor or a tuple of Tensors; it must be
    deterministic (seed any dropout inside it). inputs: Tensors (or other arguments passed
    through); each Tensor with requires_grad=True must be float64 and is checked.
    Pass when |analytic - numeric| <= atol + rtol * |numeric| everywhere. Returns True, or
    raises GradcheckError.
    """
    inputs = list(inputs)
    checked = [i for i, t in enumerate(inputs) if getattr(t, "requires_grad", False)]
    if not checked:
        raise ValueError(_no_checked_input_message(inputs))
    for i in checked:
        if str(inputs[i].dtype) != "float64":
            raise TypeError(f"gradcheck: input {i} must be float64 for finite differences, got {inputs[i].dtype}")
    xp = inputs[checked[0]].xp
    rng = random.default_rng(seed, inputs[checked[0]].device)

    for i in checked:
        inputs[i].grad = None
    outs = _outputs(fn, inputs)
    upstream = [rng.standard_normal(o.shape) for o in outs]
    for o, g in zip(outs, upstream):
        if o.requires_grad:
            o.backward(g.astype(o.dtype), retain_graph=True)
    analytic = {i: inputs[i].grad if inputs[i].grad is not None else xp.zeros_like(inputs[i].data)
                for i in checked}

    def loss():
        with no_grad():
            return sum(float((o.data * g).sum()) for o, g in zip(_outputs(fn, inputs), upstream))

    for i in checked:
        numeric = numeric_gradient(loss, inputs[i], eps)
        _compare(f"input {i}", analytic[i].reshape(-1), numeric.reshape(-1), inputs[i].shape, atol, rtol)

    # one random direction over all inputs together: v^T J u against the difference along u
    directions = {i: rng.standard_normal(inputs[i].shape) for i in checked}
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
    _compare("random direction over all inputs", xp.asarray([expected]), xp.asarray([numeric]), (1,), atol, rtol)
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


def _compare(name, analytic, numeric, shape, atol, rtol):
    xp = backend.get_array_module(numeric)
    err = xp.abs(analytic - numeric)
    excess = err / (atol + rtol * xp.abs(numeric))
    worst = int(xp.argmax(excess))
    if not bool(excess[worst] <= 1):
        index = tuple(int(k) for k in xp.unravel_index(worst, shape))
        raise GradcheckError(
            f"gradcheck failed for {name} at index {index}: analytic {float(analytic[worst]):.10g}, "
            f"numeric {float(numeric[worst]):.10g}, abs error {float(err[worst]):.3g}, "
            f"rel error {float(err[worst] / max(abs(float(numeric[worst])), 1e-300)):.3g} "
            f"(atol {atol}, rtol {rtol}); max abs error over the input {float(err.max()):.3g}")
