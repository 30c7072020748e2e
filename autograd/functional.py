"""Derivatives of whole functions, with torch.autograd.functional's signatures and results:
`vjp`, `jacobian`, `hvp`, `vhp` and `hessian`, built on `autograd.grad`.

Each takes `func` (Tensors in, a Tensor or a tuple of Tensors out) and `inputs` (a Tensor or a
tuple of Tensors, or arrays); a result has the structure of the inputs (a Tensor, or a tuple of
them). The inputs are copied into fresh leaves that require grad, so the caller's Tensors are
never changed. `create_graph=True` keeps the results in the graph (to differentiate them again);
`strict=True` raises when an output does not depend on an input, where the default returns zeros
(torch's rule).

    from autograd.functional import hvp
    f = lambda x: (x * x * x).sum()
    value, hv = hvp(f, x, v)        # H v = 6 x * v, without forming H
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .tensor import Tensor, grad, stack


def _as_tuple(value, what, fn_name):
    """(tuple of Tensors, whether the caller gave a tuple)."""
    if isinstance(value, tuple):
        items, is_tuple = value, True
    else:
        items, is_tuple = (value,), False
    if not all(isinstance(t, Tensor) for t in items):
        names = [type(t).__name__ for t in items]
        raise TypeError(f"{fn_name}: {what} must be a Tensor or a tuple of Tensors, got {names if is_tuple else names[0]}")
    return items, is_tuple


def _leaves(inputs, fn_name):
    """Fresh leaves requiring grad with the inputs' values (the inputs themselves stay untouched)."""
    items, is_tuple = _as_tuple(inputs, "inputs", fn_name)
    for i, t in enumerate(items):
        if t.dtype.kind != "f":
            raise TypeError(f"{fn_name}: inputs[{i}] must be floating to be differentiated, got {t.dtype}")
    return tuple(Tensor(t.data, requires_grad=True) for t in items), is_tuple


def _checked_vectors(v, like, what, fn_name):
    """`v` (a Tensor or tuple) matching the Tensors `like` in count and shape."""
    items, _ = _as_tuple(v, what, fn_name)
    if len(items) != len(like):
        raise ValueError(f"{fn_name}: {what} has {len(items)} entries, expected {len(like)} (one per "
                         f"{'output' if what == 'v' else 'input'})")
    for i, (a, b) in enumerate(zip(items, like)):
        if a.shape != b.shape:
            raise ValueError(f"{fn_name}: {what}[{i}] has shape {a.shape}, expected {b.shape}")
    return items


def _grads(outputs, inputs, grad_outputs, create_graph, strict, fn_name):
    """autograd.grad with zeros (or, strict, an error) for inputs the outputs do not depend on."""
    differentiable = [(o, g) for o, g in zip(outputs, grad_outputs) if o.requires_grad]
    if differentiable:
        found = grad([o for o, _ in differentiable], list(inputs), [g for _, g in differentiable],
                     retain_graph=True, create_graph=create_graph, allow_unused=True)
    else:
        found = (None,) * len(inputs)
    result = []
    for i, (g, x) in enumerate(zip(found, inputs)):
        if g is None:
            if strict:
                raise RuntimeError(f"{fn_name}: the output does not depend on inputs[{i}] (strict=True); "
                                   "with strict=False its derivative is zeros")
            g = Tensor(x.xp.zeros_like(x.data))
        result.append(g if create_graph else g.detach())
    return tuple(result)


def _scalar_output(outputs, fn_name):
    out, is_tuple = _as_tuple(outputs, "the output of func", fn_name)
    if is_tuple or out[0].size != 1:
        raise RuntimeError(f"{fn_name}: func must return a single Tensor with one element, got "
                           f"{'a tuple' if is_tuple else f'shape {out[0].shape}'}")
    return out[0]


def _result(items, is_tuple):
    return tuple(items) if is_tuple else items[0]


def vjp(func: Callable, inputs: Any, v: Any = None, create_graph: bool = False, strict: bool = False):
    """(func(inputs), v^T J): the vector-Jacobian product, v one Tensor per output (None for a
    one-element output: 1). torch.autograd.functional.vjp."""
    xs, inputs_tuple = _leaves(inputs, "vjp")
    outputs = func(*xs)
    outs, outputs_tuple = _as_tuple(outputs, "the output of func", "vjp")
    if v is None:
        if len(outs) != 1 or outs[0].size != 1:
            raise RuntimeError("vjp: v can be omitted only for a function with one one-element output")
        vs = (Tensor(outs[0].xp.ones_like(outs[0].data)),)
    else:
        vs = _checked_vectors(v, outs, "v", "vjp")
    grads = _grads(outs, xs, vs, create_graph, strict, "vjp")
    outs = outs if create_graph else tuple(o.detach() for o in outs)
    return _result(outs, outputs_tuple), _result(grads, inputs_tuple)


def jacobian(func: Callable, inputs: Any, create_graph: bool = False, strict: bool = False,
             vectorize: bool = False, strategy: str = "reverse-mode"):
    """The Jacobian d func / d inputs: for one output and one input, a Tensor of shape
    output.shape + input.shape; for tuples, nested tuples [output][input] (torch's layout).
    Reverse mode: one VJP per output entry (`vectorize` is accepted for torch's signature; the
    rows are computed one after another). torch.autograd.functional.jacobian."""
    if strategy != "reverse-mode":
        raise ValueError(f"jacobian: strategy must be 'reverse-mode', got {strategy!r}")
    xs, inputs_tuple = _leaves(inputs, "jacobian")
    outs, outputs_tuple = _as_tuple(func(*xs), "the output of func", "jacobian")
    rows = []
    for out in outs:
        xp = out.xp
        per_input = [[] for _ in xs]
        for j in range(out.size):
            e = xp.zeros(out.size, out.dtype)
            e[j] = 1
            grads = _grads([out], xs, [Tensor(e.reshape(out.shape))], create_graph, strict, "jacobian")
            for i, g in enumerate(grads):
                per_input[i].append(g)
        blocks = tuple(stack(gs).reshape(out.shape + x.shape) if gs else Tensor(xp.zeros(out.shape + x.shape, x.dtype))
                       for gs, x in zip(per_input, xs))
        rows.append(_result(blocks, inputs_tuple))
    return _result(rows, outputs_tuple)


def hessian(func: Callable, inputs: Any, create_graph: bool = False, strict: bool = False,
            vectorize: bool = False, outer_jacobian_strategy: str = "reverse-mode"):
    """The Hessian of a function with one one-element output: shape input.shape + input.shape,
    or nested tuples [input i][input j] for several inputs. The Jacobian of the gradient,
    reverse over reverse (`vectorize`: as in `jacobian`). torch.autograd.functional.hessian."""
    if outer_jacobian_strategy != "reverse-mode":
        raise ValueError(f"hessian: outer_jacobian_strategy must be 'reverse-mode', got {outer_jacobian_strategy!r}")
    _, inputs_tuple = _as_tuple(inputs, "inputs", "hessian")

    def gradient(*xs):
        out = _scalar_output(func(*xs), "hessian")
        return _grads([out], xs, [Tensor(out.xp.ones_like(out.data))], True, strict, "hessian")

    rows = jacobian(gradient, inputs if inputs_tuple else (inputs,), create_graph=create_graph, strict=strict)
    return rows if inputs_tuple else rows[0][0]


def vhp(func: Callable, inputs: Any, v: Any = None, create_graph: bool = False, strict: bool = False):
    """(func(inputs), v^T H) for a function with one one-element output; H is symmetric, so this
    equals `hvp`'s H v. torch.autograd.functional.vhp."""
    return _second_order_product(func, inputs, v, create_graph, strict, "vhp")


def hvp(func: Callable, inputs: Any, v: Any = None, create_graph: bool = False, strict: bool = False):
    """(func(inputs), H v) for a function with one one-element output, without forming H:
    the gradient g(x) with create_graph, then the gradient of <g(x), v> (reverse over reverse).
    torch.autograd.functional.hvp."""
    return _second_order_product(func, inputs, v, create_graph, strict, "hvp")


def _second_order_product(func, inputs, v, create_graph, strict, fn_name):
    xs, inputs_tuple = _leaves(inputs, fn_name)
    if v is None:
        if len(xs) != 1 or xs[0].size != 1:
            raise RuntimeError(f"{fn_name}: v can be omitted only for a single one-element input")
        vs = (Tensor(xs[0].xp.ones_like(xs[0].data)),)
    else:
        vs = _checked_vectors(v, xs, "v", fn_name)
    out = _scalar_output(func(*xs), fn_name)
    gs = _grads([out], xs, [Tensor(out.xp.ones_like(out.data))], True, strict, fn_name)
    products = _grads([g for g in gs], xs, list(vs), create_graph, strict, fn_name)
    return (out if create_graph else out.detach()), _result(products, inputs_tuple)
