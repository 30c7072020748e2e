"""Reverse-mode tape: `Function` (the torch-style base for hand-written ops) and the backward pass.

A `Function` subclass writes `forward(ctx, *arrays)` and `backward(ctx, *grads)` on raw
arrays of the active backend. `apply` unwraps Tensors, runs forward, and, when some input
requires grad, records the call as a node of the graph. `backward` walks the nodes in
reverse topological order (iteratively, so deep graphs never hit the recursion limit),
accumulates each gradient with `+`, and frees every node it has used.

Two hooks for code that must act during backward (data-parallel training starts each
gradient's all-reduce as soon as that gradient is final): a leaf's
`register_post_accumulate_grad_hook(fn)` runs `fn(leaf)` once its gradient for this pass is
complete, and `queue_callback(fn)` runs `fn()` when the pass now running ends (torch's).
(Code that acts at the start of every pass, not on one graph, registers in `autograd.hooks`.)
"""
from __future__ import annotations

import os
import threading
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import backend
from .modes import _state, no_grad  # the grad and anomaly modes of this thread

if TYPE_CHECKING:
    from .tensor import Tensor


def _check_finite(arrays, ctx, phase):
    for a in arrays:
        if a is not None and a.dtype.kind in "fc":
            xp = backend.get_array_module(a)
            if not bool(xp.isfinite(a).all()):
                raise FloatingPointError(
                    f"{op_name(type(ctx))} {phase} produced NaN or Inf; the op was created at\n"
                    f"{ctx.created_at}")


def op_name(op):
    """The full path of a Function class, e.g. 'npformer.functional.normalization.LayerNormFunction'."""
    return f"{op.__module__}.{op.__qualname__}"


# the packages whose frames are library code, not the user's line: autograd and npformer,
# found by their own directories (a checkout may itself be called "npformer")
_LIBRARY_DIRS = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), name) + os.sep
                      for name in ("autograd", "npformer"))


def _where_created():
    """The innermost stack frame outside the autograd and npformer packages: the user's line."""
    frames = [f for f in traceback.extract_stack()[:-3]
              if not os.path.abspath(f.filename).startswith(_LIBRARY_DIRS)]
    return "".join(traceback.format_list(frames[-1:])) or "(unknown)"


class Function:
    """Base class of every differentiable op. Subclasses define

        @staticmethod
        def forward(ctx, *inputs, **options) -> array or tuple of arrays
        @staticmethod
        def backward(ctx, *grad_outputs) -> one gradient (or None) per positional input

    and are called as `MyOp.apply(*inputs, **options)`. Non-Tensor inputs get no gradient.
    `ctx.needs_input_grad[i]` says whether input i needs one. What backward returns is checked
    like torch's engine does (count, shape, dtype, device; a gradient of a shape the input
    broadcasts to is summed back): a mistake raises an error naming the op and the input.
    """

    saved_tensors = ()
    inputs = None

    def save_for_backward(self, *arrays: Any) -> None:
        """Keep raw arrays (or anything) for backward, where `ctx.saved_tensors` gives them back
        as a tuple in the same order; call it from forward."""
        self.saved_tensors = arrays

    @classmethod
    def apply(cls, *args: Any, **options: Any) -> Tensor | tuple[Tensor, ...]:
        """Run the op: unwrap the Tensors among `args`, call `forward(ctx, *arrays, **options)`,
        wrap its array (or tuple of arrays) in Tensors and, when grad mode is on and an input
        requires grad, record the call for backward. Returns a Tensor, or a tuple of Tensors when
        forward returns a tuple. Raises TypeError / RuntimeError when the Tensor inputs differ in
        dtype or device, and TypeError when forward returns something that is not an array."""
        Tensor = _tensor_class()
        ctx = cls()
        tensors, raw = [], []
        for a in args:
            if isinstance(a, Tensor):
                tensors.append(a)
                raw.append(a.data)
            else:
                raw.append(a)
        if len(tensors) > 1:
            _check_same_device_and_dtype(cls, tensors)
        outputs = cls.forward(ctx, *raw, **options)
        single = not isinstance(outputs, tuple)
        outputs = (outputs,) if single else outputs
        if not all(map(backend.is_array, outputs)):
            xp = backend.get_array_module(*raw)
            outputs = tuple(o if backend.is_array(o) else _output_array(cls, i, o, xp) for i, o in enumerate(outputs))
        record = _state.grad_enabled and any(t.requires_grad for t in tensors)
        if _state.anomaly:
            ctx.created_at = _where_created()
            _check_finite(outputs, ctx, "forward")
        if not record:  # outside the graph (no_grad, inference): nothing to keep for backward
            return Tensor(outputs[0]) if single else tuple(Tensor(o) for o in outputs)
        results = tuple(Tensor(o, requires_grad=True) for o in outputs)
        ctx.inputs = tuple(a if isinstance(a, Tensor) else None for a in args)
        ctx.needs_input_grad = tuple(a is not None and a.requires_grad for a in ctx.inputs)
        ctx.output_meta = [(o.shape, o.dtype) for o in outputs]
        ctx.output_grads = [None] * len(outputs)
        ctx.retained = {}
        for i, r in enumerate(results):
            r.creator, r.output_index = ctx, i
        return results[0] if single else results


_Tensor = None  # autograd.tensor.Tensor once _tensor_class() has imported it


def _tensor_class():
    """autograd.tensor.Tensor, imported on first use (the tensor module imports this one)."""
    global _Tensor
    if _Tensor is None:
        from .tensor import Tensor
        _Tensor = Tensor
    return _Tensor


def _output_array(op, index, value, xp):
    """A forward output that is not an array: a number becomes one; anything else is the
    author's mistake, named."""
    from .tensor import Tensor

    if isinstance(value, Tensor):
        raise TypeError(f"{op_name(op)}.forward returned a Tensor as output {index}: forward works on raw "
                        "arrays and must return arrays (use `.data` of a Tensor); apply wraps them in Tensors")
    if isinstance(value, (int, float, complex)) or getattr(value, "shape", None) == ():  # numbers, numpy scalars
        return xp.asarray(value)
    raise TypeError(f"{op_name(op)}.forward returned {type(value).__name__} as output {index}: expected an "
                    "array, or a tuple of arrays for several outputs")


def _check_same_device_and_dtype(op, tensors):
    kind, dtype = type(tensors[0].data), tensors[0].data.dtype
    for t in tensors:  # the common case, cheaply: arrays of one type (so one device) and one dtype
        if type(t.data) is not kind or t.data.dtype != dtype:
            break
    else:
        return
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise RuntimeError(f"{op.__name__}: expected all tensors on one device, got {sorted(devices)}; "
                           "move them with .to(device)")
    floats = {t.dtype for t in tensors if t.dtype.kind == "f"}
    if len(floats) > 1:
        raise TypeError(f"{op.__name__}: expected one floating dtype, got {sorted(map(str, floats))}; "
                        "cast with .to(dtype=...) or .float()/.double() on modules")


def _topological_nodes(root):
    """Function nodes reachable from `root`, each after every node that consumes its output."""
    order, expanded, stack = [], set(), [(root, False)]
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


def _checked_gradients(node, grads):
    """The gradients a backward returned, checked against the node's inputs like torch's engine:
    one per positional input of forward (extra trailing Nones are dropped), each None or an
    array of its input's shape, dtype and device. A gradient of a shape the input broadcasts to
    is summed back to the input's shape (torch's rule); any other shape is an error."""
    inputs = node.inputs
    if len(grads) != len(inputs):
        if len(grads) > len(inputs) and all(g is None for g in grads[len(inputs):]):
            grads = grads[:len(inputs)]
        else:
            raise RuntimeError(f"function {op_name(type(node))} returned an incorrect number of gradients "
                               f"(expected {len(inputs)}, got {len(grads)}): backward returns one gradient "
                               "(or None) per positional input of forward")
    fixed = None
    for i, (t, g) in enumerate(zip(inputs, grads)):
        if g is None or t is None or not t.requires_grad:
            continue
        data = t.data
        if type(g) is not type(data) or g.shape != data.shape or g.dtype != data.dtype:  # cheap: the rare path
            fixed = fixed or list(grads)
            fixed[i] = _conforming_gradient(node, i, g, data)
    return grads if fixed is None else tuple(fixed)


def _conforming_gradient(node, index, grad, data):
    """`grad` for input `index` (whose array is `data`) made to conform, or a RuntimeError
    that names the Function, the index, what was expected and what came."""
    from .ops import unbroadcast
    from .tensor import Tensor

    where = f"Function {op_name(type(node))} returned an invalid gradient at index {index}"
    if isinstance(grad, Tensor):
        raise RuntimeError(f"{where} - got a Tensor: backward works on raw arrays and must return arrays "
                           "(use `.data` of a Tensor)")
    if not backend.is_array(grad):
        if getattr(grad, "shape", None) != () or not hasattr(grad, "dtype"):  # a numpy scalar is fine
            raise RuntimeError(f"{where} - got {type(grad).__name__}: expected an array of shape "
                               f"{data.shape} or None")
        grad = backend.get_array_module(data).asarray(grad)
    if backend.device_of(grad) != backend.device_of(data):
        raise RuntimeError(f"{where} - expected device '{backend.device_of(data)}' but got "
                           f"'{backend.device_of(grad)}'")
    if grad.dtype != data.dtype:
        raise RuntimeError(f"{where} - expected dtype {data.dtype} but got {grad.dtype}: return it in the "
                           f"input's dtype (e.g. `.astype(x.dtype)`)")
    if grad.shape != data.shape:
        if not _expands_to(data.shape, grad.shape):
            raise RuntimeError(f"{where} - got shape {grad.shape} but expected shape compatible with "
                               f"{data.shape} (the input's shape, or one it broadcasts to)")
        grad = unbroadcast(grad, data.shape).reshape(data.shape)  # summed over the broadcast axes, as torch
    return grad


def _expands_to(shape, target):
    """Whether an array of `shape` broadcasts to `target` (torch's is_expandable_to)."""
    if len(shape) > len(target):
        return False
    return all(n == m or n == 1 for n, m in zip(shape[::-1], target[::-1]))


_backward = threading.local()  # .callbacks: those queued during the backward pass running in this thread


def queue_callback(fn: Callable[[], Any]) -> None:
    """Run `fn()` once, when the backward pass running in this thread has finished (every
    gradient accumulated and every post-accumulate-grad hook run); like torch's
    `Variable._execution_engine.queue_callback`. Only valid inside a backward pass (from a hook)."""
    callbacks = getattr(_backward, "callbacks", None)
    if callbacks is None:
        raise RuntimeError("queue_callback: no backward pass is running in this thread; call it from a hook")
    callbacks.append(fn)


def _last_uses_of_hooked_leaves(nodes):
    """{index of a node in `nodes`: [leaves with post-accumulate-grad hooks whose last use in
    this pass is that node]}: after that node, nothing else adds to those leaves' gradients."""
    last = {}
    for i, node in enumerate(nodes):
        for t in node.inputs:
            if t is not None and t.creator is None and t._post_accumulate_grad_hooks:
                last[id(t)] = (i, t)
    by_node = {}
    for i, t in last.values():
        by_node.setdefault(i, []).append(t)
    return by_node


def _accumulate(slot_owner, index, grad):
    current = slot_owner[index]
    slot_owner[index] = grad if current is None else current + grad


def run_backward(tensor, grad, retain_graph=False):
    """Propagate `grad` (d loss / d tensor) to every leaf that requires grad, then run the
    callbacks queued during the pass. Like torch's engine without create_graph, the pass, its
    hooks and its callbacks run with grad mode off (ops in a hook record no graph)."""
    outer, _backward.callbacks = getattr(_backward, "callbacks", None), []
    with no_grad():
        try:
            if tensor.creator is None:
                tensor._accumulate_leaf(grad)
                tensor._run_post_accumulate_grad_hooks()
            else:
                _run_nodes(tensor, grad, retain_graph)
            callbacks = _backward.callbacks
        finally:
            _backward.callbacks = outer
        for fn in callbacks:
            fn()


def _freed_graph_error():
    return RuntimeError("backward through a graph that was already freed: call backward(retain_graph=True) "
                        "the first time (an earlier backward through these ops freed what they saved)")


def _run_nodes(tensor, grad, retain_graph):
    nodes = _topological_nodes(tensor.creator)
    tensor.creator.output_grads[tensor.output_index] = grad
    try:
        _run_sorted_nodes(nodes, retain_graph)
    except BaseException:  # a pass stopped midway: its partial sums must not stay in the graph
        for node in nodes:  # (they held memory, and the next backward through it would add to them)
            if node.inputs is not None:
                node.output_grads = [None] * len(node.output_meta)
        raise


def _run_sorted_nodes(nodes, retain_graph):
    hooked_last_uses, hooked_with_grad = _last_uses_of_hooked_leaves(nodes), set()
    for i, node in enumerate(nodes):
        xp = None
        grads = []
        for g, (shape, dtype) in zip(node.output_grads, node.output_meta):
            if g is None:  # an output that did not reach the loss
                xp = xp or backend.get_array_module(*[t.data for t in node.inputs if t is not None])
                g = xp.zeros(shape, dtype)
            grads.append(g)
        for j, ref in node.retained.items():  # accumulate, as a leaf's (grads[j] may be shared: own a copy)
            t = ref()
            if t is not None:
                t.grad = grads[j].copy() if t.grad is None else t.grad + grads[j]
        input_grads = node.backward(node, *grads)
        if not isinstance(input_grads, tuple):
            input_grads = (input_grads,)
        input_grads = _checked_gradients(node, input_grads)
        if _state.anomaly:
            _check_finite(input_grads, node, "backward")
        for t, g in zip(node.inputs, input_grads):
            if t is None or g is None or not t.requires_grad:
                continue
            if t.creator is None:
                t._accumulate_leaf(g)
                if t._post_accumulate_grad_hooks:
                    hooked_with_grad.add(id(t))
            else:
                _accumulate(t.creator.output_grads, t.output_index, g)
        for leaf in hooked_last_uses.get(i, ()):  # gradients that are now final
            if id(leaf) in hooked_with_grad:
                leaf._run_post_accumulate_grad_hooks()
        if retain_graph:
            node.output_grads = [None] * len(node.output_meta)
        else:  # free the graph: everything the op saved, and the links to its inputs
            node.__dict__.clear()
            node.inputs = None
