"""Derivatives of whole functions, with torch.autograd.functional's signatures and results:
`vjp`, `jvp`, `jacobian`, `hvp`, `vhp` and `hessian`, built on `autograd.grad` (reverse mode)
and `autograd.forward_ad` (forward mode); and torch.func's `linearize`.

Each takes `func` (Tensors in, a Tensor or a tuple of Tensors out) and `inputs` (a Tensor or a
tuple of Tensors, or arrays); a result has the structure of the inputs (a Tensor, or a tuple of
them). The inputs enter func as fresh leaves with their values, so the caller's Tensors are never
changed; with `create_graph=True` an input that requires grad enters as a view of itself instead
(torch's view_as), and the results stay in the graph: they depend on the inputs as func's outputs
do, so a functional call inside another differentiates (a Jacobian of a Jacobian, a `jvp` of a
function calling `jvp(..., create_graph=True)`: torch's numbers). `strict=True` raises where an
output does not depend on an input (and, with create_graph, where a derivative does not), as
torch's; the default gives zeros there, and only there.

    from autograd.functional import hvp
    f = lambda x: (x * x * x).sum()
    value, hv = hvp(f, x, v)        # H v = 6 x * v, without forming H

`jvp` runs forward mode (one pass carrying tangents: J v for about two forwards, never a
backward); `hvp` is forward over reverse (the tangent of the gradient along v: one forward and one
backward, each carrying tangents), the cheaper way to H v (the JAX autodiff cookbook's choice);
`vhp` is reverse over reverse (the gradient of <g(x), v>), the same numbers for a symmetric H.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import forward_ad
from .create_graph import grad, tangent_only_gradients
from .forward_ad import output_tangent, run_jvp
from .modes import _forward, enable_grad
from .tensor import Tensor, stack
from .versions import changed_inputs, reading_changed_inputs


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


def _leaves(inputs, fn_name, requires_grad=True, create_graph=False):
    """What func gets: fresh leaves with the inputs' values (the inputs themselves stay untouched),
    requiring grad (reverse mode), or as the inputs do (forward mode records no graph unless
    asked); with create_graph, an input that requires grad as a view of itself, so that the
    results stay connected to it (torch's _grad_preprocess), and one that carries a tangent (an
    outer forward-mode pass: a jvp of a function calling this one) as a leaf carrying it too."""
    items, is_tuple = _as_tuple(inputs, "inputs", fn_name)
    for i, t in enumerate(items):
        if t.dtype.kind != "f":
            raise TypeError(f"{fn_name}: inputs[{i}] must be floating to be differentiated, got {t.dtype}")

    def entering(t):
        if create_graph and t.requires_grad:
            return t.view(t.shape)
        leaf = Tensor(t.data, requires_grad=requires_grad or t.requires_grad)
        tangent = forward_ad.tangent_array(t) if create_graph and forward_ad.current_level() is not None else None
        return leaf if tangent is None else forward_ad.make_dual(leaf, tangent)

    with enable_grad():
        return tuple(entering(t) for t in items), is_tuple


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


def _grads(outputs, inputs, grad_outputs, create_graph, strict, fn_name, strict_graph=True):
    """autograd.grad with zeros for inputs the outputs do not depend on; strict (torch's): an
    error for an output that does not require grad, an input none depends on and, with
    create_graph (and strict_graph), a derivative that does not depend on the inputs."""
    for k, o in enumerate(outputs):
        if strict and not o.requires_grad:
            raise RuntimeError(f"{fn_name}: output {k} of func does not require grad: with strict=True the outputs "
                               "must be computed from the inputs by differentiable ops (strict=False: zeros)")
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
        elif strict and strict_graph and create_graph and not g.requires_grad:
            raise RuntimeError(f"{fn_name}: the derivative with respect to inputs[{i}] does not depend on the inputs "
                               "(strict=True with create_graph=True, as torch's: a function linear in it)")
        result.append(g if create_graph or forward_ad.current_level() is not None else g.detach())  # keep tangents
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
    xs, inputs_tuple = _leaves(inputs, "vjp", create_graph=create_graph)
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
    strategy "reverse-mode": one VJP per output entry (jacrev, best for few outputs);
    "forward-mode": one JVP per input entry (jacfwd, best for few inputs). `vectorize` is
    accepted for torch's signature; the rows are computed one after another.
    torch.autograd.functional.jacobian."""
    if strategy not in ("reverse-mode", "forward-mode"):
        raise ValueError(f"jacobian: strategy must be 'reverse-mode' or 'forward-mode', got {strategy!r}")
    if strategy == "forward-mode":
        return _forward_jacobian(func, inputs, create_graph, strict)
    xs, inputs_tuple = _leaves(inputs, "jacobian", create_graph=create_graph)
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
    or nested tuples [input i][input j] for several inputs. The Jacobian of the gradient:
    outer_jacobian_strategy "reverse-mode" (reverse over reverse) or "forward-mode" (forward over
    reverse, one JVP of the gradient per input entry). `vectorize`: as in `jacobian`.
    torch.autograd.functional.hessian."""
    if outer_jacobian_strategy not in ("reverse-mode", "forward-mode"):
        raise ValueError(f"hessian: outer_jacobian_strategy must be 'reverse-mode' or 'forward-mode', got "
                         f"{outer_jacobian_strategy!r}")
    _, inputs_tuple = _as_tuple(inputs, "inputs", "hessian")
    forward = outer_jacobian_strategy == "forward-mode"

    def gradient(*xs):  # forward mode differentiates the gradient without recording it: no create_graph unless asked
        out = _scalar_output(func(*xs), "hessian")
        return _grads([out], xs, [Tensor(out.xp.ones_like(out.data))], not forward or create_graph, strict, "hessian",
                      strict_graph=not forward or create_graph)

    rows = jacobian(gradient, inputs if inputs_tuple else (inputs,), create_graph=create_graph, strict=strict,
                    strategy=outer_jacobian_strategy)
    return rows if inputs_tuple else rows[0][0]


def vhp(func: Callable, inputs: Any, v: Any = None, create_graph: bool = False, strict: bool = False):
    """(func(inputs), v^T H) for a function with one one-element output; H is symmetric, so this
    equals `hvp`'s H v. torch.autograd.functional.vhp."""
    return _second_order_product(func, inputs, v, create_graph, strict, "vhp")


def hvp(func: Callable, inputs: Any, v: Any = None, create_graph: bool = False, strict: bool = False):
    """(func(inputs), H v) for a function with one one-element output, without forming H:
    forward over reverse, the tangent along v of the gradient g(x) (one forward and one backward,
    each carrying tangents). With create_graph=True, reverse over reverse instead (the gradient of
    <g(x), v>), whose result stays in the graph. torch.autograd.functional.hvp."""
    if create_graph:
        return _second_order_product(func, inputs, v, create_graph, strict, "hvp")
    xs, vs, inputs_tuple = _inputs_and_vectors(inputs, v, "hvp")
    with forward_ad.dual_level():
        duals = [forward_ad.make_dual(x, u.data) for x, u in zip(xs, vs)]
        out = _scalar_output(func(*duals), "hvp")
        with tangent_only_gradients():  # the gradients' values are not read: the ops may skip them
            gs = _grads([out], duals, [Tensor(out.xp.ones_like(out.data))], False, strict, "hvp")
        products = tuple(_tangent_or_zeros(g) for g in gs)
        value = forward_ad.unpack_dual(out).primal.detach()
    return value, _result(products, inputs_tuple)


def jvp(func: Callable, inputs: Any, v: Any = None, create_graph: bool = False, strict: bool = False):
    """(func(inputs), J v): the Jacobian-vector product, v one Tensor per input (None for a single
    one-element input: 1). By forward mode, one pass carrying the tangent v, never a backward; an
    output that does not depend on the inputs gets a zero tangent. With create_graph=True or
    strict=True, torch's way instead (torch.autograd.functional.jvp): two backward passes, the
    double-backward trick J v = d/du <J^T u, v>, whose results stay in the graph with create_graph
    (a jvp inside another differentiates: torch's numbers) and which tells, for strict, which input
    an output does not depend on (an error, as torch's). The tangents of forward mode are outside any
    graph."""
    if create_graph or strict:
        return _jvp_by_double_backward(func, inputs, v, create_graph, strict)
    xs, vs, inputs_tuple = _inputs_and_vectors(inputs, v, "jvp", requires_grad=False)
    with forward_ad.dual_level():
        outputs = func(*[forward_ad.make_dual(x, u.data) for x, u in zip(xs, vs)])
        outs, outputs_tuple = _as_tuple(outputs, "the output of func", "jvp")
        unpacked = [forward_ad.unpack_dual(o) for o in outs]
    tangents = [Tensor(o.xp.zeros_like(o.data)) if tangent is None else tangent for o, (_, tangent) in zip(outs, unpacked)]
    return _result([p.detach() for p, _ in unpacked], outputs_tuple), _result(tangents, outputs_tuple)


def _jvp_by_double_backward(func, inputs, v, create_graph, strict):
    """jvp(create_graph=True or strict=True): J v as the derivative along v of u -> J^T u, u a dummy
    upstream gradient per output (torch's double-backward trick), both passes with create_graph."""
    xs, vs, inputs_tuple = _inputs_and_vectors(inputs, v, "jvp", create_graph=True)
    with enable_grad():
        outs, outputs_tuple = _as_tuple(func(*xs), "the output of func", "jvp")
        us = [Tensor(o.xp.zeros_like(o.data), requires_grad=True) for o in outs]
        transposed = _grads(outs, xs, us, True, strict, "jvp", strict_graph=False)   # J^T u, linear in u
        pairs = [(g, u) for g, u in zip(transposed, vs) if g.requires_grad]
        found = (grad([g for g, _ in pairs], us, [u for _, u in pairs], create_graph=create_graph,
                      allow_unused=True) if pairs else (None,) * len(us))
    tangents = []
    for k, (o, t) in enumerate(zip(outs, found)):
        if t is None and strict:
            raise RuntimeError(f"jvp: output {k} does not depend on the inputs along v (strict=True)")
        t = Tensor(o.xp.zeros_like(o.data)) if t is None else t
        tangents.append(t if create_graph else t.detach())
    outs = outs if create_graph else tuple(o.detach() for o in outs)
    return _result(outs, outputs_tuple), _result(tangents, outputs_tuple)


def linearize(func: Callable, *primals: Tensor):
    """(func(*primals), jvp_fn): jvp_fn(*tangents) is J u at the primals for tangents u (one per
    primal, each of its shape), the same as `jvp(func, primals, tangents)[1]`, without running
    func again. torch.func.linearize (JAX's jax.linearize).

    func runs once in forward mode with zero tangents, and every tangent step it takes (each op's
    `jvp(ctx, *tangents)` with the op's saved values) is recorded; jvp_fn takes those steps again
    along its tangents, and nothing else: no forward, no Tensor per step. The record keeps what
    the ops saved, as a graph does. For many products at one point, e.g. Hessian-vector products
    forward over reverse: `linearize(gradient_of_loss, *params)` gives H u for each u by tangent
    steps alone. A tangent that reaches func's ops other than through the primals (a dual tensor
    of func's own) is an error: jvp_fn could not give it a value along other tangents."""
    # the primals' values, sharing their version counters: jvp_fn raises after an in-place change of one
    xs = tuple(Tensor(p, requires_grad=p.requires_grad) for p in _as_tuple(primals, "primals", "linearize")[0])
    with forward_ad.dual_level() as level:
        _forward.records[level] = records = []
        try:
            duals = [forward_ad.make_dual(x, x.xp.zeros_like(x.data)) for x in xs]
            outputs = func(*duals)
        finally:
            del _forward.records[level]
        outs, outputs_tuple = _as_tuple(outputs, "the output of func", "linearize")
        values = [forward_ad.unpack_dual(o).primal.detach() for o in outs]
        known = {id(d) for d in duals} | {id(r) for _, _, _, results, _ in records for r in results}
        steps = {id(ctx) for _, ctx, _, _, _ in records}
        for op, _, inputs, _, _ in records:
            for a in inputs:
                if (isinstance(a, Tensor) and a._tangents and level in a._tangents and id(a) not in known
                        and id(a.creator) not in steps):
                    raise RuntimeError(f"linearize: a tangent reached {op.__name__} other than through the primals "
                                       "(a dual tensor made inside func); jvp_fn could not move it along its tangents")

    def jvp_fn(*tangents):
        us = _checked_vectors(tangents, xs, "tangents", "linearize")
        by_tensor = {id(d): u.data for d, u in zip(duals, us)}
        by_step = {}

        def tangent_of(a):
            if not isinstance(a, Tensor):
                return None
            t = by_tensor.get(id(a))
            if t is None and a.creator is not None and id(a.creator) in by_step:  # ctx.as_output's Tensors
                t = by_step[id(a.creator)][a.output_index]
            return t

        for op, ctx, inputs, results, seen in records:
            changed = _changed_since(ctx, inputs, seen)
            if changed:  # changed inputs the op did not keep (it raised for those it kept): reading one raises
                with reading_changed_inputs(ctx, changed, [version for _, version in seen], "jvp_fn of linearize"):
                    out = run_jvp(op, ctx, list(map(tangent_of, inputs)))
            else:
                out = run_jvp(op, ctx, list(map(tangent_of, inputs)))
            out = tuple(None if t is None else output_tangent(op, i, r, t)
                        for i, (r, t) in enumerate(zip(results, out if isinstance(out, tuple) else (out,))))
            by_step[id(ctx)] = out
            by_tensor.update((id(r), t) for r, t in zip(results, out) if t is not None)
        found = [tangent_of(o) for o in outs]
        return _result([Tensor(o.xp.zeros_like(o.data) if t is None else t) for o, t in zip(outs, found)],
                       outputs_tuple)

    return _result(values, outputs_tuple), jvp_fn


def _changed_since(ctx, inputs, seen):
    """versions.check_versions for a step linearize recorded: () when no input Tensor changed in
    place since; raises when the op kept one that did; else the indices of those that did."""
    for a, (_, version) in zip(inputs, seen):
        if version is not None and (a if a._base is None else a._base)._version != version:
            break
    else:
        return ()
    return changed_inputs(ctx, inputs, [version for _, version in seen], [array for array, _ in seen],
                          "jvp_fn of linearize")


def _forward_jacobian(func, inputs, create_graph, strict):
    """jacobian(strategy="forward-mode"): column by column, one JVP per input entry."""
    xs, inputs_tuple = _leaves(inputs, "jacobian", create_graph=create_graph)
    columns = []  # per input: the JVPs of its unit vectors, each a tuple over outputs
    for i, x in enumerate(xs):
        per_entry = []
        for j in range(x.size):
            e = [Tensor(t.xp.zeros_like(t.data)) for t in xs]
            e[i].data.reshape(-1)[j] = 1
            outs, tangents = jvp(func, tuple(xs), tuple(e), create_graph=create_graph, strict=strict)
            per_entry.append(tangents if isinstance(tangents, tuple) else (tangents,))
        columns.append(per_entry)
    outs = func(*xs)
    outs, outputs_tuple = _as_tuple(outs, "the output of func", "jacobian")
    rows = []
    for k, out in enumerate(outs):
        blocks = tuple(stack([entry[k] for entry in per_entry], axis=-1).reshape(out.shape + x.shape) if per_entry
                       else Tensor(out.xp.zeros(out.shape + x.shape, out.dtype)) for per_entry, x in zip(columns, xs))
        rows.append(_result(blocks, inputs_tuple))
    return _result(rows, outputs_tuple)


def _inputs_and_vectors(inputs, v, fn_name, requires_grad=True, create_graph=False):
    xs, inputs_tuple = _leaves(inputs, fn_name, requires_grad, create_graph)
    if v is None:
        if len(xs) != 1 or xs[0].size != 1:
            raise RuntimeError(f"{fn_name}: v can be omitted only for a single one-element input")
        return xs, (Tensor(xs[0].xp.ones_like(xs[0].data)),), inputs_tuple
    return xs, _checked_vectors(v, xs, "v", fn_name), inputs_tuple


def _tangent_or_zeros(g):
    tangent = forward_ad.unpack_dual(g).tangent
    return Tensor(g.xp.zeros_like(g.data) if tangent is None else tangent)


def _second_order_product(func, inputs, v, create_graph, strict, fn_name):
    xs, vs, inputs_tuple = _inputs_and_vectors(inputs, v, fn_name, create_graph=create_graph)
    out = _scalar_output(func(*xs), fn_name)
    gs = _grads([out], xs, [Tensor(out.xp.ones_like(out.data))], True, strict, fn_name)
    products = _grads([g for g in gs], xs, list(vs), create_graph, strict, fn_name)
    return (out if create_graph else out.detach()), _result(products, inputs_tuple)
