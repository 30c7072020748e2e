"""Forward mode: dual tensors, torch.autograd.forward_ad's API.

Reverse mode answers "how does the loss depend on every input"; forward mode answers "how does
every output move when the input moves along u". A *dual* tensor carries, beside its values x, a
tangent u (the dual number x + u eps, eps^2 = 0). Every op then also computes its output's
tangent J u by its hand-written rule `Function.jvp(ctx, *tangents)`, in the same pass as its
forward: one pass gives f(x) and J u, for about the cost of two forwards, and nothing is stored
for later.

    from autograd import forward_ad as fwAD
    with fwAD.dual_level():
        x = fwAD.make_dual(primal, tangent)
        y = f(x)
        value, jvp = fwAD.unpack_dual(y)      # f(primal), J tangent

Levels are per thread (the grad mode is too); tangents belong to the innermost level and are
dropped when it exits. Tangents are kept as raw arrays (unpack_dual wraps them in Tensors):
forward mode is first order here, and forward over reverse (an HVP: the tangent of a gradient)
works because the gradient's ops, run by their `differentiable_backward`, carry tangents like
any other op.

In the engine (a second read of the core): `Function.apply` calls `propagate_tangents` when a
level is active (`modes._forward`, the levels of this thread), which runs the op's `jvp` rule.
"""
from __future__ import annotations

import itertools
import weakref
from typing import TYPE_CHECKING, Any, NamedTuple

from . import backend
from .modes import _forward
from .op_checks import op_name

if TYPE_CHECKING:
    from .tensor import Tensor

_level_ids = itertools.count(1)  # unique across threads: a tensor's tangents never mix two levels


def current_level() -> int | None:
    """The innermost dual level of the calling thread, or None outside `dual_level()`."""
    return _forward.stack[-1] if _forward.stack else None


class dual_level:
    """Context manager: a level of dual tensors in the calling thread (torch's): `enter_dual_level`
    on entry (its value is the level), `exit_dual_level` on exit. Levels nest here (torch allows
    one); the innermost one is active."""

    def __enter__(self):
        self.level = enter_dual_level()
        return self.level

    def __exit__(self, *exc_info):
        exit_dual_level(level=self.level)


def enter_dual_level() -> int:
    """Open a new dual level in the calling thread and make it the active one; returns it (an int).
    The tangents made at it belong to it until `exit_dual_level`. torch's enter_dual_level."""
    level = next(_level_ids)
    _forward.stack.append(level)
    _forward.duals[level] = weakref.WeakSet()
    return level


def exit_dual_level(*, level: int | None = None) -> None:
    """Close the innermost dual level of the calling thread (`level`, when given, must be it, as in
    torch), dropping every tangent made at it. RuntimeError when no level is open or `level` is
    not the innermost one. torch's exit_dual_level."""
    if not _forward.stack:
        raise RuntimeError("exit_dual_level: no dual level is open in this thread (enter_dual_level() opens one)")
    if level is not None and level != _forward.stack[-1]:
        raise RuntimeError(f"exit_dual_level: level {level} is not the innermost open level ({_forward.stack[-1]}): "
                           "levels close in the reverse order of opening, as in torch")
    level = _forward.stack.pop()
    for t in _forward.duals.pop(level):
        t._set_tangent(level, None)


def _level(level, where):
    level = current_level() if level is None else level
    if level is None or level not in _forward.stack:
        raise RuntimeError(f"{where}: no dual level is active in this thread; use `with forward_ad.dual_level():`")
    return level


def make_dual(tensor: Tensor, tangent: Any, *, level: int | None = None) -> Tensor:
    """A new Tensor with `tensor`'s values (shared) and graph, carrying `tangent` (an array or
    Tensor of the same shape, dtype and device) at the innermost dual level. torch's make_dual."""
    from .tensor import Tensor

    level = _level(level, "make_dual")
    if not isinstance(tensor, Tensor):
        raise TypeError(f"make_dual: tensor must be a Tensor, got {type(tensor).__name__}")
    if tensor.dtype.kind != "f":
        raise TypeError(f"make_dual: tensor must be floating to carry a tangent, got {tensor.dtype}")
    array = tangent.data if isinstance(tangent, Tensor) else tangent
    if not backend.is_array(array):
        raise TypeError(f"make_dual: tangent must be an array or a Tensor, got {type(tangent).__name__}")
    if tuple(array.shape) != tensor.shape or array.dtype != tensor.dtype or backend.device_of(array) != tensor.device:
        raise ValueError(f"make_dual: tangent must have shape {tensor.shape}, dtype {tensor.dtype} on "
                         f"'{tensor.device}', got shape {tuple(array.shape)}, dtype {array.dtype} on "
                         f"'{backend.device_of(array)}'")
    dual = tensor.view(tensor.shape) if tensor.requires_grad else Tensor(tensor)  # sharing its version counter
    dual._set_tangent(level, array)
    return dual


class UnpackedDualTensor(NamedTuple):
    """What `unpack_dual` returns: the primal Tensor and its tangent (a Tensor sharing the tangent's
    array, outside the graph, or None)."""
    primal: Tensor
    tangent: Tensor | None


def unpack_dual(tensor: Tensor, *, level: int | None = None) -> UnpackedDualTensor:
    """(primal, tangent): the values as a Tensor without tangent (sharing the graph), and the
    tangent at the innermost level as a Tensor (None when there is none), as torch's unpack_dual.
    `tangent_array` gives the raw array."""
    from .tensor import Tensor

    if not isinstance(tensor, Tensor):
        raise TypeError(f"unpack_dual: tensor must be a Tensor, got {type(tensor).__name__}")
    level = current_level() if level is None else level
    tangent = tensor._tangents.get(level) if level is not None and tensor._tangents else None
    primal = tensor if tangent is None else (tensor.view(tensor.shape) if tensor.requires_grad else Tensor(tensor.data))
    if primal is not tensor:
        primal._set_tangent(level, None)
    return UnpackedDualTensor(primal, None if tangent is None else Tensor(tangent))


def tangent_array(tensor: Tensor, level: int | None = None) -> Any:
    """The tangent of `tensor` at `level` (default: the innermost) as the raw array it is kept as,
    or None: what the engine reads (`unpack_dual(tensor).tangent` wraps it in a Tensor)."""
    level = current_level() if level is None else level
    return tensor._tangents.get(level) if level is not None and tensor._tangents else None


# -- in the engine ---------------------------------------------------------------------------------
def propagate_tangents(op: type, ctx: Any, args: tuple, results: tuple) -> None:
    """Give the outputs of `op` their tangents at the innermost level: `op.jvp(ctx, *tangents)`
    with one tangent (raw array or None) per positional input. Nothing happens when no input
    has one; an op without a jvp rule is an error naming it (never a silent zero tangent)."""
    from .tensor import Tensor

    level = _forward.stack[-1]
    tangents = [a._tangents.get(level) if isinstance(a, Tensor) and a._tangents else None for a in args]
    if all(t is None for t in tangents):
        return
    jvp = getattr(op, "jvp", None)
    if jvp is None:
        raise RuntimeError(f"{op_name(op)} has no forward-mode rule: give it a `jvp(ctx, *tangents)` staticmethod "
                           "returning the tangent of each output (see docs/backprop.md, \"Forward mode\")")
    out = run_jvp(op, ctx, tangents)
    out = out if isinstance(out, tuple) else (out,)
    if len(out) != len(results):
        raise RuntimeError(f"{op_name(op)}.jvp returned {len(out)} tangents, expected one per output ({len(results)})")
    ctx.output_tangents = level, out  # for ctx.as_output: forward over reverse
    if level in _forward.records:  # linearize: the step, and what its inputs held (versions.py)
        seen = [(None, None) if not isinstance(a, Tensor) else
                (a.data, (a if a._base is None else a._base)._version) for a in args]
        _forward.records[level].append((op, ctx, args, results, seen))
    for i, (r, t) in enumerate(zip(results, out)):
        if t is not None:
            r._set_tangent(level, output_tangent(op, i, r, t))


def run_jvp(op: type, ctx: Any, tangents: Any) -> Any:
    """op.jvp(ctx, *tangents), reading as `ctx.saved_tensors` what forward gave `ctx.save_for_forward`
    (torch's), where it did; backward's saved tensors are back afterwards."""
    forward_saved = ctx.__dict__.get("saved_for_forward")
    if forward_saved is None:
        return op.jvp(ctx, *tangents)
    backward_saved = ctx.__dict__.get("saved_tensors")
    ctx.saved_tensors = forward_saved
    try:
        return op.jvp(ctx, *tangents)
    finally:
        if backward_saved is None:
            del ctx.saved_tensors
        else:
            ctx.saved_tensors = backward_saved


def output_tangent(op: type, index: int, result: Tensor, t: Any) -> Any:
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


def carries_tangents(*groups: Any) -> bool:
    """Whether a Tensor of `groups` (iterables of Tensors or None) has a tangent at the innermost level."""
    level = _forward.stack[-1]
    return any(t is not None and t._tangents and level in t._tangents for group in groups for t in group)


def set_tangent(tensor: Tensor, level: int, tangent: Any) -> None:
    """`tensor` carries `tangent` (an array, or None for none) at the dual `level` (Tensor._set_tangent)."""
    if tangent is None:
        if tensor._tangents:
            tensor._tangents.pop(level, None)
        return
    if tensor._tangents is None:
        tensor._tangents = {}
    tensor._tangents[level] = tangent
    _forward.duals[level].add(tensor)
