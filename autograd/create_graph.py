"""Gradients that are graphs (`create_graph=True`), and gradients returned for chosen tensors
(`autograd.grad`, `backward(inputs=...)`): the backward pass beyond first order into `.grad`
(a second read).

An op's `backward` works on raw arrays, so what it computes is outside any graph. An op whose
gradient can itself be differentiated (`backward(create_graph=True)`, `autograd.grad`) also defines

    @staticmethod
    def differentiable_backward(ctx, *grad_outputs) -> one Tensor (or None) per positional input

the same gradient built from differentiable ops on Tensors: the grad_outputs are Tensors,
`ctx.inputs` are the input Tensors, and `ctx.as_output(array, i)` turns an output array that
forward saved into output i of this node, in the graph. Built from ops that are themselves
differentiable, it can be differentiated again, to any order. An op without it is
differentiable once: a second derivative that reaches it raises an error naming it (torch's
`once_differentiable`, `_OnceDifferentiable` here), never a silent zero. In forward mode the
gradients are Tensors too, carrying tangents (forward over reverse).

`ctx.tangent_only_grads`, in differentiable_backward: the indices of the inputs whose gradient
only its tangent is read from (forward over reverse in `autograd.functional.hvp`, where a
parameter's gradient is wanted for its tangent H v alone: `tangent_only_gradients`). An op may
leave the values of such a gradient as zeros and skip computing them; its tangent must be exact.
Empty elsewhere.

`GraphPass` is `function.BackwardPass` with these Tensor gradients and with `targets`, the
tensors (leaves or not) whose gradients are wanted: the nodes that lead to none of them are not
run, and without accumulating, the gradients are returned (`grad`), `.grad` left alone.
"""
from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

from . import backend, hooks
from .backend import ArrayLike
from .checks import check_bool
from .forward_ad import carries_tangents
from .function import BackwardPass, Function, run_backward, tensor_gradients
from .modes import _forward, _state, check_finite
from .op_checks import checked_gradients, op_name
from .tensor import Tensor
from .tensor_methods import _checked_inputs, _upstream_gradient
from .versions import check_versions, reading_inputs


def grad(outputs: Tensor | Sequence[Tensor], inputs: Tensor | Sequence[Tensor],
         grad_outputs: ArrayLike | Sequence[ArrayLike | None] | None = None, retain_graph: bool | None = None,
         create_graph: bool = False, only_inputs: bool = True, allow_unused: bool | None = None,
         is_grads_batched: bool = False, materialize_grads: bool = False) -> tuple[Tensor | None, ...]:
    """The gradients of `outputs` with respect to `inputs`, returned rather than accumulated into
    `.grad` (torch.autograd.grad): sum_k grad_outputs[k] * d outputs[k] / d inputs[i] for each i.

    outputs: a Tensor or a sequence of them. inputs: the Tensors (leaves or not) to differentiate
    with respect to; only the part of the graph that leads to them is run. grad_outputs: one
    upstream gradient per output (a Tensor or array of its shape; None: 1 for a one-element
    output); with create_graph, Tensor grad_outputs that require grad are differentiated too.
    retain_graph: keep the graph (default: create_graph). create_graph: the gradients are Tensors
    of a new graph, so they can be differentiated again (Hessian-vector products, gradient
    penalties). allow_unused: an input that the outputs do not depend on gets None; without it,
    that is an error (as torch's). materialize_grads: such an input gets zeros instead (implies
    allow_unused; allow_unused=False beside it is a ValueError, as torch's). is_grads_batched: the
    first axis of every grad_outputs entry is a batch of upstream gradients; each gradient gets
    that axis in front (torch vectorizes it with vmap; here one pass per batch entry, the graph
    retained between them). only_inputs: accepted and ignored, as torch's (deprecated there; a
    FutureWarning when False). Returns a tuple with one entry per input.
    """
    if not only_inputs:
        warnings.warn("grad: only_inputs is deprecated and ignored (as in torch): the gradients of `inputs` alone "
                      "are computed; use backward() to accumulate into other tensors' .grad", FutureWarning,
                      stacklevel=2)
    materialize_grads = check_bool(materialize_grads, "materialize_grads", "grad")
    if materialize_grads and allow_unused is False:
        raise ValueError("grad: materialize_grads=True gives zeros for unused inputs, so it needs allow_unused "
                         "True or not passed, got allow_unused=False")
    allow_unused = materialize_grads or (allow_unused is not None and check_bool(allow_unused, "allow_unused", "grad"))
    if check_bool(is_grads_batched, "is_grads_batched", "grad"):
        return _batched_grad(outputs, inputs, grad_outputs, retain_graph, create_graph, allow_unused, materialize_grads)
    outputs = _checked_inputs(outputs, "grad", "outputs")
    inputs = _checked_inputs(inputs, "grad", "inputs")
    create_graph = check_bool(create_graph, "create_graph", "grad")
    retain_graph = create_graph if retain_graph is None else check_bool(retain_graph, "retain_graph", "grad")
    if grad_outputs is None or isinstance(grad_outputs, Tensor) or backend.is_array(grad_outputs):
        grad_outputs = [grad_outputs] * len(outputs) if grad_outputs is None else [grad_outputs]
    grad_outputs = list(grad_outputs)
    if len(grad_outputs) != len(outputs):
        raise ValueError(f"grad: grad_outputs has {len(grad_outputs)} entries, expected one per output "
                         f"({len(outputs)})")
    for i, t in enumerate(inputs):
        if not t.requires_grad:
            raise RuntimeError(f"grad: inputs[{i}] does not require grad: nothing can be differentiated with "
                               "respect to it (make it with requires_grad=True)")
    roots, upstream = [], []
    for k, (out, g) in enumerate(zip(outputs, grad_outputs)):
        if out.requires_grad:
            roots.append(out)
            upstream.append(_upstream_gradient(out, g, tensor_gradients(create_graph), f"grad(grad_outputs[{k}])"))
    if not roots:
        raise RuntimeError("grad: no output requires grad (no input had requires_grad=True, or they were made "
                           "under no_grad())")
    hooks.run(hooks.backward_started)
    found = run_backward(roots, upstream, retain_graph=retain_graph, create_graph=create_graph, inputs=inputs,
                         accumulate=False)
    result = []
    for i, t in enumerate(inputs):
        g = found.get(id(t))
        if g is None and not allow_unused:
            raise RuntimeError(f"grad: inputs[{i}] (shape {t.shape}) was not used to compute the outputs; pass "
                               "allow_unused=True to get None for it")
        if g is None and materialize_grads:
            g = Tensor(t.xp.zeros_like(t.data))
        result.append(g if g is None or isinstance(g, Tensor) else Tensor(g))
    return tuple(result)


def _batched_grad(outputs, inputs, grad_outputs, retain_graph, create_graph, allow_unused, materialize_grads):
    """grad(is_grads_batched=True): one grad per entry of the batch axis of every grad_outputs
    entry, the results stacked along a new first axis (None where an input is unused; zeros of the
    input's own shape with materialize_grads, as torch's)."""
    from .tensor_methods import stack

    outputs = _checked_inputs(outputs, "grad", "outputs")
    grad_outputs = [grad_outputs] if isinstance(grad_outputs, Tensor) or backend.is_array(grad_outputs) else \
        list(grad_outputs) if grad_outputs is not None else None
    if grad_outputs is None or len(grad_outputs) != len(outputs) or any(g is None for g in grad_outputs):
        raise ValueError("grad: is_grads_batched=True needs grad_outputs, one batched upstream gradient per output "
                         f"({len(outputs)}), got {grad_outputs!r}")
    batches = set()
    for k, (out, g) in enumerate(zip(outputs, grad_outputs)):
        if tuple(g.shape[1:]) != out.shape or len(g.shape) == 0:
            raise RuntimeError(f"grad: is_grads_batched=True reads the first axis of grad_outputs[{k}] as the batch: "
                               f"its other axes must be the output's shape {out.shape}, got shape {tuple(g.shape)}")
        batches.add(g.shape[0])
    if len(batches) != 1:
        raise RuntimeError(f"grad: is_grads_batched=True needs one batch size in every grad_outputs entry, got "
                           f"{sorted(batches)}")
    n = batches.pop()
    retain_graph = create_graph if retain_graph is None else retain_graph
    rows = [grad(outputs, inputs, [g[b] for g in grad_outputs], retain_graph=retain_graph or b + 1 < n,
                 create_graph=create_graph, allow_unused=allow_unused) for b in range(n)]
    columns = []
    for i, t in enumerate(_checked_inputs(inputs, "grad", "inputs")):
        found = [row[i] for row in rows]
        if any(g is None for g in found):
            columns.append(Tensor(t.xp.zeros_like(t.data)) if materialize_grads else None)
        else:
            columns.append(stack(found))  # (in the graph with create_graph; carrying tangents in forward mode)
    return tuple(columns)


def as_output(node: Function, array: Any, index: int = 0) -> Tensor:
    """`ctx.as_output`: output `index` of `node` as a Tensor of the graph, holding `array` (the
    output's values, saved by forward): for `differentiable_backward`, whose gradients must lead
    back to the inputs through this node, as the op's real output does (torch's saved outputs)."""
    out = Tensor(array, requires_grad=True)
    out.creator, out.output_index = node, index
    level, tangents = getattr(node, "output_tangents", (None, ()))
    if level in _forward.stack and tangents[index] is not None:  # the output's tangent too (forward mode)
        out._set_tangent(level, tangents[index])
    return out


_tangent_only = threading.local()  # .next_pass: see tangent_only_gradients


@contextlib.contextmanager
def tangent_only_gradients() -> Iterator[None]:
    """Within the block, the next backward pass started in this thread (that one only: a pass it
    starts itself is an ordinary one) delivers the gradients of the tensors it differentiates with
    respect to for their tangents alone: ops may leave their values as zeros (`ctx.tangent_only_grads`).
    For forward over reverse when only the gradients' tangents are read (autograd.functional.hvp)."""
    _tangent_only.next_pass = True
    try:
        yield
    finally:
        _tangent_only.next_pass = False


class GraphPass(BackwardPass):
    """A backward pass whose gradients are Tensors (`tensors`: create_graph, or forward mode)
    and/or go to chosen tensors (`inputs`), into `.grad` or (`accumulate=False`) into `found`."""

    def __init__(self, retain_graph, create_graph, tensors, inputs, accumulate):
        super().__init__(retain_graph)
        self.create_graph, self.tensors, self.accumulate = create_graph, tensors, accumulate
        self.targets = None if inputs is None else {id(t): t for t in inputs}
        # tangent_only_gradients: the wanted tensors' gradients are read for their tangents alone
        self.tangent_only = getattr(_tangent_only, "next_pass", False) and tensors and inputs is not None
        _tangent_only.next_pass, self.needed_ids = False, None
        self.wanted_outputs = {} if self.targets is None else {
            (id(t.creator), t.output_index): t for t in self.targets.values() if t.creator is not None}
        self.captured = set()  # (id(node), j) of wanted outputs given their gradient before their hooks (hooks.py)

    def needed(self, nodes):
        """The ids of the nodes whose backward leads to a wanted tensor."""
        needed = self.needed_ids = set()
        for node in reversed(nodes):  # inputs' creators first
            if any(t is not None and (id(t) in self.targets or t.creator is not None and id(t.creator) in needed)
                   for t in node.inputs):
                needed.add(id(node))
        return needed

    def ends_at(self, t):
        """Whether the gradient of `t` goes nowhere but to the caller: `t` is wanted and it is a leaf,
        or the pass runs none of its creator's backward."""
        return t is not None and id(t) in self.targets and (t.creator is None or id(t.creator) not in self.needed_ids)

    def deliver(self, t, grad, held=False):
        """`grad` (one contribution) of the leaf or wanted tensor `t`: into `.grad` or `found`, or
        held if `t` is a leaf with hooks (hooks.py)."""
        if not held and (t._grad_hooks or t._post_accumulate_grad_hooks):
            return hooks.hold(self.held, t, grad)
        if not self.accumulate:
            current = self.found.get(id(t))
            self.found[id(t)] = grad if current is None else current + grad
        else:
            t._accumulate_grad(grad, self.tensors)

    def deliver_outputs(self, node, grads):
        for j, ref in node.retained.items():  # accumulate, as a leaf's
            t = ref()
            if t is not None and self.accumulate and (self.targets is None or id(t) in self.targets):
                t._accumulate_grad(grads[j], self.tensors)
        for j in range(len(grads)) if self.wanted_outputs else ():  # autograd.grad of non-leaf tensors
            t = self.wanted_outputs.get((id(node), j))
            if (t is not None and not (self.accumulate and t.creator.retained.get(j))
                    and (id(node), j) not in self.captured):
                self.deliver(t, grads[j])

    def input_grads(self, node, grads):
        """The node's backward, checked: raw arrays, or Tensors (of a new graph with create_graph,
        carrying tangents in forward mode)."""
        if not self.tensors:
            return super().input_grads(node, grads)
        changed = check_versions(node)  # inputs changed in place that the op did not keep: reading them raises
        differentiable = getattr(node, "differentiable_backward", None)
        if differentiable is not None:
            if self.tangent_only:  # for this pass only (the graph may be retained for another)
                node.tangent_only_grads = frozenset(i for i, t in enumerate(node.inputs) if self.ends_at(t))
            try:
                input_grads = reading_inputs(node, changed, differentiable, grads)
            finally:
                node.__dict__.pop("tangent_only_grads", None)
            input_grads = input_grads if isinstance(input_grads, tuple) else (input_grads,)
        else:  # differentiable once: the raw gradients, behind a node that refuses to be differentiated
            if not self.create_graph and carries_tangents(grads, node.inputs):
                raise RuntimeError(f"{op_name(type(node))} has no differentiable_backward, so forward mode cannot "
                                   "run through its gradient (forward over reverse); give it one")
            raw = reading_inputs(node, changed, node.backward, [g.data for g in grads])
            raw = raw if isinstance(raw, tuple) else (raw,)
            input_grads = (_OnceDifferentiable.wrap(node, grads, raw) if self.create_graph else
                           tuple(None if r is None else Tensor(r) for r in raw))
        input_grads = checked_tensor_gradients(node, input_grads)
        if _state.anomaly:
            check_finite([g.data if g is not None else None for g in input_grads], node, "backward")
        return input_grads


def checked_tensor_gradients(node: Function, grads: tuple) -> tuple:
    """`op_checks.checked_gradients` for a differentiable backward: Tensors (or None), one per input,
    each of its input's shape (or one it broadcasts to, summed back in the graph), dtype and device."""
    checked = checked_gradients(node, tuple(g.data if isinstance(g, Tensor) else g for g in grads))
    result = []
    for i, (g, data) in enumerate(zip(grads, checked)):
        if g is not None and not isinstance(g, Tensor):
            raise RuntimeError(f"Function {op_name(type(node))}.differentiable_backward returned "
                               f"{type(g).__name__} at index {i}: it works on Tensors and must return Tensors "
                               "(or None), built from differentiable ops")
        if data is not None and data.shape != g.shape:
            g = g.sum_to(data.shape)
        result.append(g)
    return tuple(result)


class _OnceDifferentiable(Function):
    """Stands behind the gradients of an op without `differentiable_backward` when create_graph
    is on: its forward is the identity on the op's raw gradients, and differentiating through it
    raises, naming the op (torch's once_differentiable)."""

    @classmethod
    def wrap(cls, node, grads, raw):
        anchors = [g for g in grads if g.requires_grad] + [t for t in node.inputs if t is not None and t.requires_grad]
        return tuple(None if r is None else cls.apply(r, *anchors, op=op_name(type(node))) for r in raw)

    @staticmethod
    def forward(ctx, gradient, *anchors, op):
        ctx.op = op
        return gradient

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(f"{ctx.op} is differentiable once: its backward works on raw arrays, so its gradient "
                           "cannot be differentiated again (a second derivative through it would be a silent zero). "
                           "Give the Function a `differentiable_backward` built from differentiable ops "
                           "(see docs/backprop.md, \"Double backward\")")
