"""torch's custom-Function API on `Function` (a second read): the methods of `ctx` beyond
`save_for_backward`, the `setup_context` style, and `once_differentiable`.

`Function` (autograd/function.py) inherits `FunctionMethods`. A ctx is the node `apply` records;
what forward (or setup_context) calls on it:

- `ctx.save_for_forward(*arrays)`: what the `jvp` rule reads as `ctx.saved_tensors` (backward still
  reads what `save_for_backward` kept).
- `ctx.mark_dirty(*arrays)`: forward changed these input arrays in place and returns them: the
  output is the input Tensor itself, its version counted (versions.py: an op that saved its old
  values raises in backward) and its history now this node's; a leaf that requires grad cannot be
  changed in place (RuntimeError, as torch's).
- `ctx.mark_non_differentiable(*arrays)`: these outputs (indices, masks) do not require grad; their
  gradients in backward are zeros.
- `ctx.set_materialize_grads(False)`: backward gets None, not zeros, for an output whose gradient
  never arrived (it did not reach the loss).
- `ctx.as_output(array, i)`: output i as a Tensor of the graph, for `differentiable_backward`
  (create_graph.as_output).

torch 2.x's style, `forward(*inputs)` without ctx plus `setup_context(ctx, inputs, output)`, works
as torch's: `Function.__init_subclass__` (here) turns such a forward into one taking ctx that calls
setup_context with forward's inputs (the arrays, as forward got them) and its output. A backward
decorated with `once_differentiable` makes the Function differentiable once even when it defines
`differentiable_backward`: a second derivative through it raises, naming it.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import backend
from .checks import check_bool

if TYPE_CHECKING:
    from .tensor import Tensor


def once_differentiable(backward: Callable) -> Callable:
    """Decorate a Function's `backward` (below @staticmethod) as torch's: the Function is
    differentiable once (its `differentiable_backward`, if any, is not used), so a second derivative
    through it raises a RuntimeError naming it (create_graph._OnceDifferentiable). Returns `backward`."""
    backward.once_differentiable = True
    return backward


class FunctionMethods:
    """What `Function` has beyond its core (autograd/function.py): see the module's docstring."""

    _marks = None  # {"dirty": [...], "non_differentiable": [...]} of arrays once forward marks one

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("backward")
        if own is not None and (getattr(own, "once_differentiable", False) or getattr(cls.backward, "once_differentiable", False)):
            cls.differentiable_backward = None  # create_graph.GraphPass: differentiable once
        if "setup_context" in cls.__dict__ and "forward" in cls.__dict__:
            cls.forward = staticmethod(_with_setup_context(cls.forward, cls.setup_context))

    def as_output(self, array: Any, index: int = 0) -> Tensor:
        """Output `index` of this node as a Tensor of the graph holding `array`, for
        `differentiable_backward` (create_graph.as_output)."""
        from .create_graph import as_output
        if not backend.is_array(array):  # a numpy scalar (saved from a 0-d op): its dtype, not Tensor()'s float32
            array = backend.get_array_module(array).asarray(array)
        return as_output(self, array, index)

    def save_for_forward(self, *arrays: Any) -> None:
        """Keep arrays for the `jvp` rule, which reads them as `ctx.saved_tensors` (torch's); call it
        from forward or setup_context."""
        self.saved_for_forward = arrays

    def mark_dirty(self, *arrays: Any) -> None:
        """Forward changed these input arrays in place and returns them as outputs (torch's mark_dirty):
        see the module's docstring."""
        self._mark("dirty", arrays)

    def mark_non_differentiable(self, *arrays: Any) -> None:
        """These output arrays do not require grad; backward gets zeros for them (torch's)."""
        self._mark("non_differentiable", arrays)

    def set_materialize_grads(self, value: bool) -> None:
        """False: backward (and differentiable_backward) get None, not zeros, for the gradient of an
        output that did not reach the loss (torch's; default True)."""
        if check_bool(value, "value", "set_materialize_grads"):
            for name in ("backward", "differentiable_backward"):
                self.__dict__.pop(name, None)
            return
        for name in ("backward", "differentiable_backward"):
            method = getattr(type(self), name, None)
            if method is not None:
                setattr(self, name, functools.partial(_unmaterialized, method))

    def _mark(self, kind, arrays):
        if self._marks is None:
            self._marks = {"dirty": [], "non_differentiable": []}
        self._marks[kind].extend(arrays)

    def floating_stand_ins(self, outputs: tuple) -> tuple:
        """forward's outputs with the integer and bool ones marked non-differentiable (indices, masks)
        replaced by floating zeros, which `apply` can make into Tensors that require grad:
        `marked_results` puts them back. Called by `Function.apply` only when forward marked one."""
        self._outputs = outputs
        marked = self._marks["non_differentiable"]
        xp = backend.get_array_module(*outputs)
        return tuple(xp.zeros(o.shape) if o.dtype.kind not in "fc" and any(o is m for m in marked) else o
                     for o in outputs)

    def marked_results(self, args: tuple, results: tuple) -> tuple:
        """`apply`'s results after forward marked some (mark_dirty, mark_non_differentiable): each
        dirty output is its input Tensor, changed in place, and each non-differentiable one is
        outside the graph (backward gets zeros of its dtype for it, as torch's)."""
        from .function import _tensor_class

        marks, outputs, self._marks = self._marks, self._outputs, None
        del self._outputs
        results = list(results)
        for array in marks["dirty"]:
            _take_dirty(self, args, results, outputs, array)
        for array in marks["non_differentiable"]:
            j = _index_of(array, outputs, "mark_non_differentiable", "an output of forward")
            results[j] = _tensor_class()(array)
            if self.inputs is not None:
                self.output_meta[j] = (array.shape, array.dtype)
        return tuple(results)


def _index_of(array, arrays, where, what):
    for j, a in enumerate(arrays):
        if a is array:
            return j
    raise ValueError(f"{where}: expected {what} (the very array), got {type(array).__name__} "
                     f"{getattr(array, 'shape', '')}")


def _take_dirty(ctx, args, results, outputs, array):
    """mark_dirty for one array: output j becomes the input Tensor i that holds it, its version
    counted and, when the node is recorded, its history this node's (ctx.inputs[i] stands for its old self)."""
    from .function import _tensor_class

    Tensor = _tensor_class()
    i = _index_of(array, [a.data if isinstance(a, Tensor) else a for a in args], "mark_dirty", "an input of forward")
    j = _index_of(array, outputs, "mark_dirty", "an input that forward also returns")
    x = args[i]
    if not isinstance(x, Tensor):
        return
    if x.requires_grad and x.creator is None and results[j].requires_grad:
        raise RuntimeError(f"{type(ctx).__name__}: mark_dirty on a leaf that requires grad: it cannot be changed in "
                           "place (its gradient would be of other values); change a copy, or use no_grad()")
    x.bump_version()
    recorded = ctx.inputs is not None and results[j].creator is ctx
    if recorded:
        old = Tensor.__new__(Tensor)
        old.__dict__.update(x.__dict__)  # the node's input: x before the change (its history, its version)
        ctx.inputs = tuple(old if t is x else t for t in ctx.inputs)
        ctx.versions = tuple((t if t._base is None else t._base)._version if t is old else v
                             for t, v in zip(ctx.inputs, ctx.versions))  # its own input, as it is now
        x.creator, x.output_index, x.requires_grad = ctx, j, True
        # ops that used x before now see its new history: versions.changed_inputs refuses their backward
        x.rebased_at = ((x if x._base is None else x._base)._version, type(ctx).__name__)
    results[j] = x


def _unmaterialized(method, node, *grads):
    """node's backward called with None where an output's gradient never arrived (set_materialize_grads(False))."""
    slots = node.output_grads or [None] * len(grads)
    return method(node, *[None if slot is None else g for slot, g in zip(slots, grads)])


def _with_setup_context(forward, setup_context):
    """forward(*inputs) and setup_context(ctx, inputs, output) as one forward(ctx, *inputs) (torch 2.x's style)."""
    forward = getattr(forward, "__func__", forward)
    setup_context = getattr(setup_context, "__func__", setup_context)

    @functools.wraps(forward)
    def forward_with_ctx(ctx, *inputs, **options):
        output = forward(*inputs, **options)
        setup_context(ctx, inputs, output)
        return output

    return forward_with_ctx
