"""`Function`, the base of every op, and the backward pass (the first read, with tensor.py, gradcheck.py).

A `Function` subclass writes `forward(ctx, *arrays)` and `backward(ctx, *grads)` on raw arrays.
`apply` unwraps Tensors, runs forward and, when some input requires grad, records the call as a
node of the graph: its inputs, and a slot per output where gradients sum. `run_backward` walks the
nodes in reverse topological order (`backward_order`, iteratively: deep graphs never hit the
recursion limit): each node's backward turns its outputs' summed gradients into its inputs',
checked like torch's engine; a leaf's go into `.grad`, another tensor's into its creator's slot.
Second read: op_checks.py, versions.py, forward_ad.py, hooks.py, create_graph.py, modes.py.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from . import backend, hooks
from .custom_function import FunctionMethods, once_differentiable  # noqa: F401  (torch's place for it too)
from .forward_ad import propagate_tangents
from .hooks import queue_callback  # noqa: F401  (autograd.function.queue_callback, torch's place for it)
from .modes import _forward, _state, check_finite, enable_grad, no_grad, where_created
from .op_checks import op_name  # noqa: F401  (autograd.function.op_name too)
from .op_checks import check_same_device_and_dtype, checked_gradients, output_arrays
from .versions import check_versions, reading_changed_inputs

if TYPE_CHECKING:
    from .tensor import Tensor

class Function(FunctionMethods):
    """Base class of every differentiable op. Subclasses define

        @staticmethod
        def forward(ctx, *inputs, **options) -> array or tuple of arrays
        @staticmethod
        def backward(ctx, *grad_outputs) -> one gradient (or None) per positional input

    and are called as `MyOp.apply(*inputs, **options)`. Non-Tensor inputs get no gradient;
    `ctx.needs_input_grad[i]` says whether input i needs one. What backward returns is checked
    (op_checks.checked_gradients): a mistake raises an error naming the op and the input.
    Optional: `jvp(ctx, *tangents)`, the forward-mode rule (forward_ad.py); `differentiable_backward`
    for second derivatives (create_graph.py); `view = True`: its outputs may be views of its first input (versions.py).
    torch's ctx methods (mark_dirty, ...), setup_context and once_differentiable: custom_function.py.
    """

    saved_tensors = ()
    tangent_only_grads = frozenset()  # see create_graph.py
    inputs = None
    versions = ()  # the input Tensors' `_version` when the node was recorded (versions.py)
    grad_hooks = None  # {output index: [hook, ...]}: Tensor.register_hook on an output (hooks.py)
    view = False  # True for ops whose outputs may share their first input's memory (reshape, slicing, ...)

    def save_for_backward(self, *arrays: Any) -> None:
        """Keep arrays (or anything) for backward: `ctx.saved_tensors` (a tuple, same order); call it in forward."""
        self.saved_tensors = arrays

    @classmethod
    def apply(cls, *args: Any, **options: Any) -> Tensor | tuple[Tensor, ...]:
        """Run the op: unwrap the Tensors among `args`, call `forward(ctx, *arrays, **options)`,
        wrap its array (or tuple of arrays) in Tensors (a tuple of Tensors for a tuple) and, when
        grad mode is on and an input requires grad, record the call for backward (op_checks.py
        names the errors: inputs of several dtypes or devices, a forward output not an array)."""
        Tensor, ctx = _tensor_class(), cls()
        tensors, raw, inputs, needs = [], [], [], []  # one pass over the arguments (hot: no generators here)
        for a in args:
            if isinstance(a, Tensor):
                tensors.append(a)
                raw.append(a.data)
                inputs.append(a)
                needs.append(a.requires_grad)
            else:
                raw.append(a)
                inputs.append(None)
                needs.append(False)
        if len(tensors) > 1:
            check_same_device_and_dtype(cls, tensors)
        outputs = cls.forward(ctx, *raw, **options)
        single = not isinstance(outputs, tuple)
        outputs = (outputs,) if single else outputs
        if not all(map(backend.is_array, outputs)):  # a number becomes an array; anything else is an error
            outputs = output_arrays(cls, outputs, raw)
        record = _state.grad_enabled and any(needs)
        if _state.anomaly:  # autograd.detect_anomaly()
            ctx.created_at = where_created()
            check_finite(outputs, ctx, "forward")
        marked = ctx._marks is not None  # forward called ctx.mark_dirty / mark_non_differentiable (custom_function.py)
        if marked:
            outputs = ctx.floating_stand_ins(outputs)  # (marked_results puts back the integer ones)
        if not record:  # outside the graph (no_grad, inference): nothing to keep for backward
            results = tuple([Tensor(o) for o in outputs])
        else:
            results = tuple([Tensor(o, requires_grad=True) for o in outputs])
            ctx.inputs = tuple(inputs)
            ctx.needs_input_grad = tuple(needs)
            ctx.versions = tuple([0 if a is None else (a if a._base is None else a._base)._version for a in inputs])
            ctx.input_arrays = raw  # the arrays forward got: backward tells from them what it saved
            ctx.output_meta = [(o.shape, o.dtype) for o in outputs]
            ctx.output_grads = [None] * len(outputs)  # the slots where the outputs' gradients sum
            ctx.retained = {}
            for i, r in enumerate(results):
                r.creator, r.output_index = ctx, i
        if marked:
            results = ctx.marked_results(args, results)
        if cls.view and hasattr(args[0], "_version"):  # outputs sharing a Tensor input's memory: they count on it
            owner, base = backend.memory_owner(raw[0]), (args[0] if args[0]._base is None else args[0]._base)
            for r in [r for r, o in zip(results, outputs) if backend.memory_owner(o) is owner]:
                r._base = base  # (an in-place change of one is the other's)
        if _forward.stack:  # forward mode: the outputs' tangents, by the op's jvp rule
            propagate_tangents(cls, ctx, args, results)
        if hooks.op_applied:  # a step being recorded (npformer.runtime.record)
            for hook in hooks.op_applied:
                hook(cls, ctx, args, options, results)
        return results[0] if single else results


def raw_computation(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args): a computation on raw arrays that is no op (a mask from a step's inputs, a check of
    ids, a dropout mask's draw), which code watching a step's ops sees (hooks.raw_computation)."""
    return hooks.raw_computation[-1](fn, args) if hooks.raw_computation else fn(*args)


_Tensor = None  # autograd.tensor.Tensor once _tensor_class() has imported it


def _tensor_class():
    """autograd.tensor.Tensor, imported on first use (the tensor module imports this one)."""
    global _Tensor
    if _Tensor is None:
        from .tensor import Tensor
        _Tensor = Tensor
    return _Tensor


# -- the backward pass -----------------------------------------------------------------------------
def backward_order(nodes: Sequence[Function]) -> list[Function]:
    """The nodes reachable from `nodes` (e.g. `[loss.creator]`) in the order a backward pass runs
    them: each after every node that consumes its outputs. `run_backward(..., order=...)` takes it
    to run the pass again on a graph kept with retain_graph=True without working it out anew."""
    order, expanded, stack = [], set(), [(node, False) for node in nodes]
    while stack:
        node, children_done = stack.pop()
        if children_done:
            order.append(node)
            continue
        if id(node) in expanded:
            continue
        if node.inputs is None:  # an earlier backward freed this part of the graph
            raise _freed_graph_error()
        expanded.add(id(node))
        stack.append((node, True))
        for t in node.inputs:
            if t is not None and t.creator is not None and id(t.creator) not in expanded:
                stack.append((t.creator, False))
    return order[::-1]


def run_backward(roots: Sequence[Tensor], grads: Sequence[Any], *, retain_graph: bool = False,
                 create_graph: bool = False, inputs: Sequence[Tensor] | None = None, accumulate: bool = True,
                 order: list[Function] | None = None) -> dict:
    """Propagate each `grads[k]` (d loss / d roots[k]: a raw array, or a Tensor when
    `tensor_gradients(create_graph)`) back through the graph, then run the callbacks queued during
    the pass (hooks.py); `Tensor.backward()` and `autograd.grad` call it. Without create_graph,
    inputs or accumulate=False (GraphPass, create_graph.py): a first-order BackwardPass into `.grad`
    on raw arrays, grad mode off (ops in a hook record no graph). order: `backward_order([t.creator
    for t in roots])` of a retained graph, run again (recorded steps). Returns {id(t): gradient}."""
    # autograd.functional.linearize records the level: its tangent steps read what the ops saved
    retain_graph = retain_graph or bool(_forward.stack and _forward.stack[-1] in _forward.records)
    tensors = tensor_gradients(create_graph)
    if tensors or inputs is not None or not accumulate:
        from .create_graph import GraphPass
        backward = GraphPass(retain_graph, create_graph, tensors, inputs, accumulate)
    else:
        backward = BackwardPass(retain_graph)
    with enable_grad() if create_graph else no_grad(), hooks.queued_callbacks():
        return backward.run(roots, grads, order)


def tensor_gradients(create_graph: bool) -> bool:
    """Whether a backward pass computes its gradients as Tensors (each op's differentiable_backward):
    with create_graph, and in forward mode, where they carry tangents (forward over reverse)."""
    return create_graph or bool(_forward.stack)


class BackwardPass:
    """One backward pass at first order into `.grad` of every leaf that requires grad (`loss.backward()`).
    create_graph.GraphPass extends it: Tensor gradients, or only some tensors' gradients."""

    tensors = False  # the gradients are raw arrays (GraphPass: Tensors, with create_graph or tangents)
    targets = None   # every leaf that requires grad gets its gradient (GraphPass: {id(t): t} of those wanted)

    def __init__(self, retain_graph):
        self.retain_graph = retain_graph
        self.found = {}  # GraphPass without accumulating: {id(t): gradient}
        self.held = {}  # the gradients of leaves with hooks, until complete (hooks.hold, hooks.release)

    def run(self, roots, grads, order=None):
        creators = []
        for t, g in zip(roots, grads):
            if t.creator is None:
                if self.targets is None or id(t) in self.targets:
                    self.deliver(t, g)
            elif t.creator.inputs is None:  # an earlier backward freed this graph
                raise _freed_graph_error()
            else:
                _accumulate(t.creator.output_grads, t.output_index, g)
                creators.append(t.creator)
        if creators:
            nodes = backward_order(creators) if order is None else order
            try:
                for _ in self.run_nodes(nodes):  # a generator, paused after each node by autograd.backward_steps
                    pass
            except BaseException:  # a pass stopped midway: its partial sums must not stay in the graph
                for node in nodes:  # (they held memory, and the next backward through it would add to them)
                    if node.inputs is not None:
                        node.output_grads = [None] * len(node.output_meta)
                raise
        hooks.release(self)  # leaves with hooks that were roots and no node reached
        return self.found

    def run_nodes(self, nodes):
        last_uses = hooks.last_uses_of_hooked_leaves(nodes)  # {} unless a leaf has a hook
        needed = None if self.targets is None else self.needed(nodes)  # GraphPass: the nodes leading to targets
        targets, tensors, input_grads, deliver = self.targets, self.tensors, self.input_grads, self.deliver
        for i, node in enumerate(nodes):
            if node.grad_hooks:  # Tensor.register_hook on an output
                hooks.run_output_hooks(self, node, needed)
            grads = output_gradients(node, tensors)
            if node.retained or targets is not None:  # retain_grad(); autograd.grad of a non-leaf
                self.deliver_outputs(node, grads)
            if needed is None or id(node) in needed:
                for t, g in zip(node.inputs, input_grads(node, grads)):
                    if t is None or g is None or not t.requires_grad:
                        continue
                    if t.creator is not None:
                        _accumulate(t.creator.output_grads, t.output_index, g)
                    elif targets is None or id(t) in targets:
                        deliver(t, g)
            if i in last_uses:  # leaves whose gradients are now complete
                hooks.release(self, last_uses[i])
            if self.retain_graph:
                node.output_grads = [None] * len(node.output_meta)
            else:  # free the graph: everything the op saved, and the links to its inputs
                node.__dict__.clear()
                node.inputs = None
            yield

    def deliver(self, t, grad, held=False):
        """One contribution to the gradient of the leaf `t`: into `.grad`, or held if `t` has hooks (hooks.py)."""
        if not held and (t._grad_hooks or t._post_accumulate_grad_hooks):
            return hooks.hold(self.held, t, grad)
        t._accumulate_grad(grad)

    def deliver_outputs(self, node, grads):
        """The gradients of the node's outputs that `retain_grad()` keeps, into their `.grad`."""
        for j, ref in node.retained.items():  # accumulate, as a leaf's
            t = ref()
            if t is not None:
                t._accumulate_grad(grads[j], self.tensors)

    def input_grads(self, node, grads):
        """The node's backward, on raw arrays, its gradients checked (op_checks.checked_gradients)."""
        changed = check_versions(node)
        if changed:  # inputs changed in place that the op did not keep: reading them raises
            with reading_changed_inputs(node, changed, node.versions):
                input_grads = node.backward(node, *grads)
        else:
            input_grads = node.backward(node, *grads)
        input_grads = checked_gradients(node, input_grads if isinstance(input_grads, tuple) else (input_grads,))
        if _state.anomaly:
            check_finite(input_grads, node, "backward")
        return input_grads


def output_gradients(node: Function, tensors: bool) -> list:
    """The summed gradients of the node's outputs, raw arrays or (`tensors`) Tensors; zeros where none came."""
    grads = []
    for g, (shape, dtype) in zip(node.output_grads, node.output_meta):
        if g is None:
            xp = backend.get_array_module(*[t.data for t in node.inputs if t is not None])
            g = _tensor_class()(xp.zeros(shape, dtype)) if tensors else xp.zeros(shape, dtype)
        grads.append(g)
    return grads


def _accumulate(slot_owner, index, grad):
    current = slot_owner[index]
    slot_owner[index] = grad if current is None else current + grad


def _freed_graph_error():
    return RuntimeError("backward through a graph that was already freed: call backward(retain_graph=True) "
                        "the first time (an earlier backward through these ops freed what they saved)")
