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

import contextlib
import os
import threading
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import backend, hooks
from .modes import _state, enable_grad, no_grad  # the grad and anomaly modes of this thread

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

    Higher order: `backward` works on raw arrays, so what it computes is outside any graph. An
    op whose gradient can itself be differentiated (`backward(create_graph=True)`,
    `autograd.grad`) also defines

        @staticmethod
        def differentiable_backward(ctx, *grad_outputs) -> one Tensor (or None) per positional input

    the same gradient built from differentiable ops on Tensors: the grad_outputs are Tensors,
    `ctx.inputs` are the input Tensors, and `ctx.as_output(array, i)` turns an output array that
    forward saved into output i of this node, in the graph. Built from ops that are themselves
    differentiable, it can be differentiated again, to any order. An op without it is
    differentiable once: a second derivative that reaches it raises an error naming it (torch's
    `once_differentiable`), never a silent zero.

    `ctx.tangent_only_grads`, in differentiable_backward: the indices of the inputs whose gradient
    only its tangent is read from (forward over reverse in `autograd.functional.hvp`, where a
    parameter's gradient is wanted for its tangent H v alone). An op may leave the values of such a
    gradient as zeros and skip computing them; its tangent must be exact. Empty elsewhere.
    """

    saved_tensors = ()
    tangent_only_grads = frozenset()
    inputs = None
    versions = ()  # the input Tensors' `_version` when the node was recorded (see _check_versions)
    view = False  # True for ops whose output may share its first input's memory (reshape, slicing, ...)

    def as_output(self, array: Any, index: int = 0) -> Tensor:
        """Output `index` of this node as a Tensor of the graph, holding `array` (the output's
        values, saved by forward): for `differentiable_backward`, whose gradients must lead back to
        the inputs through this node, as the op's real output does (torch's saved outputs)."""
        out = _tensor_class()(array, requires_grad=True)
        out.creator, out.output_index = self, index
        level, tangents = getattr(self, "output_tangents", (None, ()))
        if level in _forward.stack and tangents[index] is not None:  # the output's tangent too (forward mode)
            out._set_tangent(level, tangents[index])
        return out

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
        # one pass over the arguments (an apply runs for every op of every step: no generators here)
        tensors, raw, inputs, needs = [], [], [], []
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
            _check_same_device_and_dtype(cls, tensors)
        outputs = cls.forward(ctx, *raw, **options)
        single = not isinstance(outputs, tuple)
        outputs = (outputs,) if single else outputs
        if not all(map(backend.is_array, outputs)):
            xp = backend.get_array_module(*raw)
            outputs = tuple(o if backend.is_array(o) else _output_array(cls, i, o, xp) for i, o in enumerate(outputs))
        record = _state.grad_enabled and any(needs)
        if _state.anomaly:
            ctx.created_at = _where_created()
            _check_finite(outputs, ctx, "forward")
        if not record:  # outside the graph (no_grad, inference): nothing to keep for backward
            results = tuple([Tensor(o) for o in outputs])
        else:
            results = tuple([Tensor(o, requires_grad=True) for o in outputs])
            ctx.inputs = tuple(inputs)
            ctx.needs_input_grad = tuple(needs)
            ctx.versions = tuple([0 if a is None else (a if a._base is None else a._base)._version for a in inputs])
            ctx.input_arrays = raw  # the arrays forward got: backward tells from them what it saved
            ctx.output_meta = [(o.shape, o.dtype) for o in outputs]
            ctx.output_grads = [None] * len(outputs)
            ctx.retained = {}
            for i, r in enumerate(results):
                r.creator, r.output_index = ctx, i
        if cls.view and _memory_owner(outputs[0]) is _memory_owner(raw[0]):  # a view, not a copy: an in-place
            results[0]._base = args[0] if args[0]._base is None else args[0]._base  # change of one is the other's
        if _forward.stack:  # forward mode: the outputs' tangents, by the op's jvp rule
            _propagate_tangents(cls, ctx, args, results)
        if hooks.op_applied:  # a step being recorded (npformer.runtime.record)
            for hook in hooks.op_applied:
                hook(cls, ctx, args, options, results)
        return results[0] if single else results


def raw_computation(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args): a computation on raw arrays that is no op, made from what an op or a module got
    (a mask or a count from a step's inputs, a check of ids, a dropout keep mask's draw). Code that
    watches a step's ops sees it through `hooks.raw_computation` (npformer's recorded steps repeat
    it at each replay); without such code it is just fn(*args)."""
    if hooks.raw_computation:
        return hooks.raw_computation[-1](fn, args)
    return fn(*args)


class _ForwardLevels(threading.local):
    """The dual levels of forward mode entered in this thread (autograd.forward_ad), innermost
    last; {level: tensors carrying a tangent at it}, whose tangents go when the level exits; and
    {level: [(op, ctx, inputs, outputs), ...]}, the tangent steps taken at a level that
    autograd.functional.linearize records, to take them again along other tangents."""

    def __init__(self):
        self.stack = []
        self.duals = {}
        self.records = {}


_forward = _ForwardLevels()


def _propagate_tangents(op, ctx, args, results):
    """Give the outputs of `op` their tangents at the innermost level: `op.jvp(ctx, *tangents)`
    with one tangent (raw array or None) per positional input. Nothing happens when no input
    has one; an op without a jvp rule is an error naming it (never a silent zero tangent)."""
    Tensor = _tensor_class()
    level = _forward.stack[-1]
    tangents = [a._tangents.get(level) if isinstance(a, Tensor) and a._tangents else None for a in args]
    if all(t is None for t in tangents):
        return
    jvp = getattr(op, "jvp", None)
    if jvp is None:
        raise RuntimeError(f"{op_name(op)} has no forward-mode rule: give it a `jvp(ctx, *tangents)` staticmethod "
                           "returning the tangent of each output (see docs/backprop.md, \"Forward mode\")")
    out = jvp(ctx, *tangents)
    out = out if isinstance(out, tuple) else (out,)
    if len(out) != len(results):
        raise RuntimeError(f"{op_name(op)}.jvp returned {len(out)} tangents, expected one per output ({len(results)})")
    ctx.output_tangents = level, out  # for ctx.as_output: forward over reverse
    if level in _forward.records:
        _forward.records[level].append((op, ctx, args, results))
    for i, (r, t) in enumerate(zip(results, out)):
        if t is not None:
            r._set_tangent(level, _output_tangent(op, i, r, t))


def _output_tangent(op, index, result, t):
    """`t`, what op.jvp returned for output `index` (the Tensor `result`), as its tangent: a numpy
    scalar becomes an array; anything but an array of the output's shape and dtype is an error
    naming the op."""
    if not backend.is_array(t) and getattr(t, "shape", None) == () and hasattr(t, "dtype"):  # a numpy scalar
        t = result.xp.asarray(t)
    if not backend.is_array(t) or tuple(t.shape) != result.shape or t.dtype != result.dtype:
        got = f"shape {tuple(t.shape)}, dtype {t.dtype}" if backend.is_array(t) else type(t).__name__
        raise RuntimeError(f"{op_name(op)}.jvp returned an invalid tangent for output {index}: expected an array of "
                           f"shape {result.shape} and dtype {result.dtype}, got {got}")
    return t


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


def _topological_nodes(roots):
    """Function nodes reachable from the nodes `roots`, each after every node that consumes its output."""
    order, expanded, stack = [], set(), [(root, False) for root in roots]
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


def _check_versions(node):
    """Raise RuntimeError (torch's words) when an input that the op saved for backward was changed
    in place since the forward pass (an optimizer step, load_state_dict, ...: its `_version` moved):
    its backward would mix the new values with the old ones, a silently wrong gradient. An input
    that the op did not save may change (its backward does not read it), as in torch."""
    for i, (t, version) in enumerate(zip(node.inputs, node.versions)):
        if t is None:
            continue
        owner = t if t._base is None else t._base
        if owner._version != version and _saved(node, t, node.input_arrays[i]):
            view = "" if owner is t else f", a view of a {type(owner).__name__} of shape {owner.shape}"
            created = f"; the op was created at\n{node.created_at}" if hasattr(node, "created_at") else (
                " (autograd.detect_anomaly() names the line that created the op)")
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"[{type(t).__name__} of shape {t.shape}, {t.dtype}{view}] (input {i} of {op_name(type(node))}) "
                f"is at version {owner._version}; expected version {version} instead. Hint: an optimizer step, "
                "load_state_dict or Module.to between a forward pass and its backward changes what the forward "
                f"saved; call backward first, or run the forward again{created}")


def _memory_owner(array):
    """The array that owns `array`'s memory (numpy's and CuPy's views name it in `.base`)."""
    while getattr(array, "base", None) is not None:
        array = array.base
    return array


def _saved(node, t, array):
    """Whether the op saved the input `t` for backward: one of its saved arrays shares memory with
    `array`, what t held at forward time (the array itself, a reshaped or transposed view), and
    for a view, that array shares its base's memory (a reshape may have copied it instead)."""
    if not backend.is_array(array):
        return False
    xp = backend.get_array_module(array)
    if t._base is not None and not xp.may_share_memory(array, t._base.data):
        return False
    return any(type(s) is type(array) and xp.may_share_memory(s, array) for s in node.saved_tensors)


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


_tangent_only = threading.local()  # .next_pass: see _tangent_only_gradients


@contextlib.contextmanager
def _tangent_only_gradients():
    """Within the block, the next backward pass started in this thread (that one only: a pass it
    starts itself is an ordinary one) delivers the gradients of the tensors it differentiates with
    respect to for their tangents alone: ops may leave their values as zeros (`ctx.tangent_only_grads`).
    For forward over reverse when only the gradients' tangents are read (autograd.functional.hvp)."""
    _tangent_only.next_pass = True
    try:
        yield
    finally:
        _tangent_only.next_pass = False


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


def run_backward(roots, grads, *, retain_graph=False, create_graph=False, inputs=None, accumulate=True):
    """Propagate each `grads[k]` (d loss / d roots[k]) back through the graph, then run the
    callbacks queued during the pass. Returns {id(t): gradient} for `inputs` when not accumulating.

    inputs: None (every leaf that requires grad) or the Tensors, leaves or not, whose gradients
    are wanted; nodes that lead to none of them are not run. accumulate: add into `.grad`
    (`Tensor.backward`), or return the gradients and leave `.grad` alone (`autograd.grad`).
    create_graph: the gradients are Tensors of a new graph, made by each op's
    `differentiable_backward`, so they can be differentiated again; the pass then runs with grad
    mode on, as torch's. Without it the pass, its hooks and its callbacks run with grad mode off
    (ops in a hook record no graph) on raw arrays, the fast first-order path. While
    autograd.functional.linearize records the level, the graph is retained: the tangent steps it
    takes again read what the ops saved.
    """
    retain_graph = retain_graph or bool(_forward.stack and _forward.stack[-1] in _forward.records)
    outer, _backward.callbacks = getattr(_backward, "callbacks", None), []
    with enable_grad() if create_graph else no_grad():
        try:
            found = _Pass(retain_graph, create_graph, inputs, accumulate).run(roots, grads)
            callbacks = _backward.callbacks
        finally:
            _backward.callbacks = outer
        for fn in callbacks:
            fn()
    return found


def _freed_graph_error():
    return RuntimeError("backward through a graph that was already freed: call backward(retain_graph=True) "
                        "the first time (an earlier backward through these ops freed what they saved)")


class _Pass:
    """One backward pass: where gradients go (`.grad`, or `found` for autograd.grad), and whether
    they are raw arrays (first order) or Tensors of a new graph (create_graph)."""

    def __init__(self, retain_graph, create_graph, inputs, accumulate):
        self.retain_graph, self.create_graph, self.accumulate = retain_graph, create_graph, accumulate
        self.tensors = tensor_gradients(create_graph)
        self.targets = None if inputs is None else {id(t): t for t in inputs}
        self.found = {}
        # _tangent_only_gradients: the wanted tensors' gradients are read for their tangents alone
        self.tangent_only = getattr(_tangent_only, "next_pass", False) and self.tensors and inputs is not None
        _tangent_only.next_pass, self.needed_ids = False, None

    def wanted(self, t):
        return t.requires_grad if self.targets is None else id(t) in self.targets

    def ends_at(self, t):
        """Whether the gradient of `t` goes nowhere but to the caller: `t` is wanted and it is a leaf,
        or the pass runs none of its creator's backward."""
        return t is not None and id(t) in self.targets and (t.creator is None or id(t.creator) not in self.needed_ids)

    def deliver(self, t, grad):
        """`grad` (one contribution) of the leaf or wanted tensor `t`: into `.grad` or `found`."""
        if not self.accumulate:
            current = self.found.get(id(t))
            self.found[id(t)] = grad if current is None else current + grad
        else:
            t._accumulate_grad(grad, self.tensors)

    def run(self, roots, grads):
        creators = []
        for t, g in zip(roots, grads):
            if t.creator is None:
                if self.wanted(t):
                    self.deliver(t, g)
                    if self.accumulate:
                        t._run_post_accumulate_grad_hooks()
            elif t.creator.inputs is None:  # an earlier backward freed this graph
                raise _freed_graph_error()
            else:
                _accumulate(t.creator.output_grads, t.output_index, g)
                creators.append(t.creator)
        if creators:
            nodes = _topological_nodes(creators)
            try:
                self.run_nodes(nodes)
            except BaseException:  # a pass stopped midway: its partial sums must not stay in the graph
                for node in nodes:  # (they held memory, and the next backward through it would add to them)
                    if node.inputs is not None:
                        node.output_grads = [None] * len(node.output_meta)
                raise
        return self.found

    def needed(self, nodes):
        """The ids of the nodes whose backward leads to a wanted tensor (every node without `inputs`)."""
        if self.targets is None:
            return None
        needed = set()
        for node in reversed(nodes):  # inputs' creators first
            if any(t is not None and (id(t) in self.targets or t.creator is not None and id(t.creator) in needed)
                   for t in node.inputs):
                needed.add(id(node))
        return needed

    def run_nodes(self, nodes):
        hooked_last_uses, hooked_with_grad = _last_uses_of_hooked_leaves(nodes), set()
        needed = self.needed_ids = self.needed(nodes)
        wanted_outputs = {} if self.targets is None else {
            (id(t.creator), t.output_index): t for t in self.targets.values() if t.creator is not None}
        for i, node in enumerate(nodes):
            grads = output_gradients(node, self.tensors)
            for j, ref in node.retained.items():  # accumulate, as a leaf's
                t = ref()
                if t is not None and self.accumulate and (self.targets is None or id(t) in self.targets):
                    t._accumulate_grad(grads[j], self.tensors)
            for j in range(len(grads)) if wanted_outputs else ():  # autograd.grad of non-leaf tensors
                t = wanted_outputs.get((id(node), j))
                if t is not None and not (self.accumulate and t.creator.retained.get(j)):
                    self.deliver(t, grads[j])
            if needed is None or id(node) in needed:
                for t, g in zip(node.inputs, self.input_grads(node, grads)):
                    if t is None or g is None or not t.requires_grad:
                        continue
                    if t.creator is None:
                        if self.wanted(t):
                            self.deliver(t, g)
                            if t._post_accumulate_grad_hooks and self.accumulate:
                                hooked_with_grad.add(id(t))
                    else:
                        _accumulate(t.creator.output_grads, t.output_index, g)
            for leaf in hooked_last_uses.get(i, ()):  # gradients that are now final
                if id(leaf) in hooked_with_grad:
                    leaf._run_post_accumulate_grad_hooks()
            if self.retain_graph:
                node.output_grads = [None] * len(node.output_meta)
            else:  # free the graph: everything the op saved, and the links to its inputs
                node.__dict__.clear()
                node.inputs = None

    def input_grads(self, node, grads):
        """The node's backward, checked: raw arrays, or Tensors (of a new graph with create_graph,
        carrying tangents in forward mode)."""
        _check_versions(node)
        if not self.tensors:
            input_grads = node.backward(node, *grads)
            input_grads = _checked_gradients(node, input_grads if isinstance(input_grads, tuple) else (input_grads,))
            if _state.anomaly:
                _check_finite(input_grads, node, "backward")
            return input_grads
        differentiable = getattr(node, "differentiable_backward", None)
        if differentiable is not None:
            if self.tangent_only:  # for this pass only (the graph may be retained for another)
                node.tangent_only_grads = frozenset(i for i, t in enumerate(node.inputs) if self.ends_at(t))
            try:
                input_grads = differentiable(node, *grads)
            finally:
                node.__dict__.pop("tangent_only_grads", None)
            input_grads = input_grads if isinstance(input_grads, tuple) else (input_grads,)
        else:  # differentiable once: the raw gradients, behind a node that refuses to be differentiated
            if not self.create_graph and _carries_tangents(grads, node.inputs):
                raise RuntimeError(f"{op_name(type(node))} has no differentiable_backward, so forward mode cannot "
                                   "run through its gradient (forward over reverse); give it one")
            raw = node.backward(node, *[g.data for g in grads])
            raw = raw if isinstance(raw, tuple) else (raw,)
            input_grads = (_OnceDifferentiable.wrap(node, grads, raw) if self.create_graph else
                           tuple(None if r is None else _tensor_class()(r) for r in raw))
        input_grads = _checked_tensor_gradients(node, input_grads)
        if _state.anomaly:
            _check_finite([g.data if g is not None else None for g in input_grads], node, "backward")
        return input_grads


def output_gradients(node, tensors):
    """The gradients of the node's outputs, raw arrays or (`tensors`) Tensors; zeros for an output
    that did not reach the loss."""
    grads = []
    for g, (shape, dtype) in zip(node.output_grads, node.output_meta):
        if g is None:
            xp = backend.get_array_module(*[t.data for t in node.inputs if t is not None])
            g = xp.zeros(shape, dtype)
            if tensors:
                g = _tensor_class()(g)
        grads.append(g)
    return grads


def tensor_gradients(create_graph):
    """Whether a backward pass computes its gradients as Tensors (each op's differentiable_backward):
    with create_graph, and in forward mode, where they carry tangents (forward over reverse)."""
    return create_graph or bool(_forward.stack)


def _carries_tangents(*groups):
    level = _forward.stack[-1]
    return any(t is not None and t._tangents and level in t._tangents for group in groups for t in group)


def _checked_tensor_gradients(node, grads):
    """`_checked_gradients` for a differentiable backward: Tensors (or None), one per input, each
    of its input's shape (or one it broadcasts to, summed back in the graph), dtype and device."""
    Tensor = _tensor_class()
    checked = _checked_gradients(node, tuple(g.data if isinstance(g, Tensor) else g for g in grads))
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
