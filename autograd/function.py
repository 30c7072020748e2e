"""Reverse-mode tape: `Function` (the torch-style base for hand-written ops), `no_grad`,
`detect_anomaly` and the backward pass.

A `Function` subclass writes `forward(ctx, *arrays)` and `backward(ctx, *grads)` on raw
arrays of the active backend. `apply` unwraps Tensors, runs forward, and, when some input
requires grad, records the call as a node of the graph. `backward` walks the nodes in
reverse topological order (iteratively, so deep graphs never hit the recursion limit),
accumulates each gradient with `+`, and frees every node it has used.

Two hooks for code that must act during backward (data-parallel training starts each
gradient's all-reduce as soon as that gradient is final): a leaf's
`register_post_accumulate_grad_hook(fn)` runs `fn(leaf)` once its gradient for this pass is
complete, and `queue_callback(fn)` runs `fn()` when the pass now running ends (torch's).
"""
import contextlib
import threading
import traceback

from . import backend

_state = {"grad_enabled": True, "anomaly": False}


def is_grad_enabled():
    return _state["grad_enabled"]


@contextlib.contextmanager
def _flag(name, value):
    old = _state[name]
    _state[name] = value
    try:
        yield
    finally:
        _state[name] = old


def no_grad():
    """Context manager: ops run without recording a graph (inference, optimizer steps)."""
    return _flag("grad_enabled", False)


def enable_grad():
    return _flag("grad_enabled", True)


def detect_anomaly():
    """Context manager: the first op whose forward or backward makes a NaN/Inf raises
    FloatingPointError naming the op and the line of user code that created it."""
    return _flag("anomaly", True)


def _check_finite(arrays, ctx, phase):
    for a in arrays:
        if a is not None and a.dtype.kind in "fc":
            xp = backend.get_array_module(a)
            if not bool(xp.isfinite(a).all()):
                raise FloatingPointError(
                    f"{type(ctx).__name__} {phase} produced NaN or Inf; the op was created at\n"
                    f"{ctx.created_at}")


def _where_created():
    """The innermost stack frame outside autograd and npformer: the user's line."""
    frames = [f for f in traceback.extract_stack()[:-3]
              if "/autograd/" not in f.filename and "/npformer/" not in f.filename]
    return "".join(traceback.format_list(frames[-1:])) or "(unknown)"


class Function:
    """Base class of every differentiable op. Subclasses define

        @staticmethod
        def forward(ctx, *inputs, **options) -> array or tuple of arrays
        @staticmethod
        def backward(ctx, *grad_outputs) -> one gradient (or None) per positional input

    and are called as `MyOp.apply(*inputs, **options)`. Non-Tensor inputs get no gradient.
    `ctx.needs_input_grad[i]` says whether input i needs one.
    """

    saved_tensors = ()
    inputs = None

    def save_for_backward(self, *arrays):
        self.saved_tensors = arrays

    @classmethod
    def apply(cls, *args, **options):
        from .tensor import Tensor  # the tensor module imports this one

        ctx = cls()
        tensors = [a for a in args if isinstance(a, Tensor)]
        _check_same_device_and_dtype(cls, tensors)
        raw = [a.data if isinstance(a, Tensor) else a for a in args]
        outputs = cls.forward(ctx, *raw, **options)
        single = not isinstance(outputs, tuple)
        outputs = (outputs,) if single else outputs
        xp = backend.get_array_module(*raw)
        outputs = tuple(o if backend.is_array(o) else xp.asarray(o) for o in outputs)
        record = _state["grad_enabled"] and any(t.requires_grad for t in tensors)
        if _state["anomaly"]:
            ctx.created_at = _where_created()
            _check_finite(outputs, ctx, "forward")
        results = tuple(Tensor(o, requires_grad=record) for o in outputs)
        if record:
            ctx.inputs = tuple(a if isinstance(a, Tensor) else None for a in args)
            ctx.needs_input_grad = tuple(a is not None and a.requires_grad for a in ctx.inputs)
            ctx.output_meta = [(o.shape, o.dtype) for o in outputs]
            ctx.output_grads = [None] * len(outputs)
            ctx.retained = {}
            for i, r in enumerate(results):
                r.creator, r.output_index = ctx, i
        return results[0] if single else results


def _check_same_device_and_dtype(op, tensors):
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
        expanded.add(id(node))
        stack.append((node, True))
        for t in node.inputs:
            if t is not None and t.creator is not None and id(t.creator) not in expanded:
                stack.append((t.creator, False))
    return order[::-1]


_backward = threading.local()  # .callbacks: those queued during the backward pass running in this thread


def queue_callback(fn):
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
    callbacks queued during the pass."""
    outer, _backward.callbacks = getattr(_backward, "callbacks", None), []
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


def _run_nodes(tensor, grad, retain_graph):
    if tensor.creator.inputs is None:
        raise RuntimeError("backward through a graph that was already freed: "
                           "call backward(retain_graph=True) the first time")
    tensor.creator.output_grads[tensor.output_index] = grad
    nodes = _topological_nodes(tensor.creator)
    hooked_last_uses, hooked_with_grad = _last_uses_of_hooked_leaves(nodes), set()
    for i, node in enumerate(nodes):
        xp = None
        grads = []
        for g, (shape, dtype) in zip(node.output_grads, node.output_meta):
            if g is None:  # an output that did not reach the loss
                xp = xp or backend.get_array_module(*[t.data for t in node.inputs if t is not None])
                g = xp.zeros(shape, dtype)
            grads.append(g)
        for i, t in node.retained.items():
            t.grad = grads[i]
        input_grads = node.backward(node, *grads)
        if not isinstance(input_grads, tuple):
            input_grads = (input_grads,)
        if _state["anomaly"]:
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
