"""Versions and views: a gradient is never computed from values changed since the forward pass
(a second read).

Every Tensor counts its in-place changes in `_version` (torch's version counter; `bump_version()`
adds one: optimizer steps, `load_state_dict`, `Module.to`, `nn.init`, gradient clipping call it).
A tensor that shares another's memory counts on that one, its `_base`: an output of a view op
(an op with `view = True`, e.g. `Reshape`, `GetItem`, `split_heads`, whose outputs `Function.apply`
finds to share its first input's memory: `backend.memory_owner`) and a `detach()`ed or `Tensor(t)`
alias (`make_dual`'s, `linearize`'s primals). Each node records its inputs' versions when it is
made (`ctx.versions`); before the node's backward or its differentiable backward (create_graph,
forward over reverse) the engine calls `check_versions(node)`, and `linearize`'s jvp_fn, before each
tangent step it takes again, `changed_inputs` with the versions it recorded. Each:

- raises torch's error, naming the op and the input, when an input changed since and the op kept
  it: any array (or Tensor) the op keeps on ctx shares the input's memory. That is anything the
  forward kept, in `save_for_backward` or in an attribute of its own (GELU's
  `ctx.activation_saved`): an op keeps on ctx only what its derivatives read;
- else returns the indices of the inputs that changed though the op did not keep them (an Add's: its
  gradient does not read them, as in torch). The call then runs with those inputs of `ctx.inputs`
  replaced by stand-ins (`reading_changed_inputs`) whose values raise the same error when read:
  a differentiable backward that builds its gradient from an input Tensor (cross-entropy's
  softmax formed again, linear's h) raises rather than mix new values with the old ones it kept.

The common case, no version moved, is one comparison per input.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

from . import backend
from .op_checks import op_name

# the engine's own attributes of a node (function.py, create_graph.py, forward_ad.py, hooks): not
# what the op kept from its forward. input_arrays holds every input's array, kept or not
_BOOKKEEPING = frozenset({"inputs", "input_arrays", "versions", "needs_input_grad", "output_meta", "output_grads",
                          "retained", "created_at", "output_tangents", "tangent_only_grads"})


def check_versions(node: Any) -> tuple[int, ...]:
    """() when no input of `node` changed in place since its forward (an optimizer step,
    load_state_dict, ...: its `_version` moved). Else raise RuntimeError (torch's words) when the
    op kept a changed input (its derivative would mix the new values with the old ones, a silently
    wrong result), or return the indices of the changed inputs it did not keep (see the module
    docstring)."""
    for t, version in zip(node.inputs, node.versions):  # the common case, cheaply: no version moved
        if t is not None and (t if t._base is None else t._base)._version != version:
            break
    else:
        return ()
    return changed_inputs(node, node.inputs, node.versions, node.input_arrays)


def changed_inputs(ctx: Any, inputs: Sequence[Any], versions: Sequence[int], arrays: Sequence[Any],
                   when: str = "backward") -> tuple[int, ...]:
    """check_versions of the op whose node (or ctx) is `ctx`, whose inputs were the Tensors (or
    None) `inputs` holding the arrays `arrays` at the `versions` when it ran: raises for a changed
    input the op kept, else the indices of the changed inputs. when: what is about to read the
    op's values ("backward", "jvp_fn of linearize"), for the message."""
    changed = []
    for i, (t, version) in enumerate(zip(inputs, versions)):
        if t is None or version is None:  # not a Tensor
            continue
        owner = t if t._base is None else t._base
        if owner._version == version:
            continue
        if _kept(ctx, t, arrays[i]):
            raise version_error(ctx, i, t, version, when)
        rebased = t.__dict__.get("rebased_at")  # custom_function: an in-place Function (mark_dirty) took over t
        if rebased is not None and version < rebased[0]:
            raise RuntimeError(f"{op_name(type(ctx))} used input {i} (a Tensor of shape {t.shape}) before the in-place "
                               f"Function {rebased[1]} changed it (ctx.mark_dirty): its gradient would go through "
                               "that Function's backward, which npformer cannot skip (torch's goes past it); use "
                               "the tensor after the in-place Function, or give the Function a copy (x + 0)")
        changed.append(i)
    return tuple(changed)


def version_error(ctx: Any, index: int, t: Any, version: int, when: str = "backward") -> RuntimeError:
    """Torch's error for input `index` of the op of `ctx`, the Tensor `t`, changed in place since
    the op ran at `version`."""
    owner = t if t._base is None else t._base
    view = "" if owner is t else f", a view of a {type(owner).__name__} of shape {owner.shape}"
    created = f"; the op was created at\n{ctx.created_at}" if hasattr(ctx, "created_at") else (
        " (autograd.detect_anomaly() names the line that created the op)")
    redo = ("call jvp_fn before the change, or linearize again" if when.startswith("jvp_fn") else
            "call backward first, or run the forward again")
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace operation: "
        f"[{type(t).__name__} of shape {t.shape}, {t.dtype}{view}] (input {index} of {op_name(type(ctx))}) "
        f"is at version {owner._version}; expected version {version} instead. Hint: an optimizer step, "
        f"load_state_dict or Module.to between a forward pass and its {when} changes what the forward "
        f"saved; {redo}{created}")


def _kept(ctx, t, array):
    """Whether the op kept the input `t` from its forward: an array (or Tensor) it holds on ctx
    shares memory with `array`, what t held at forward time (the array itself, a reshaped or
    transposed view), and for a view, that array shares its base's memory (a reshape may have
    copied it instead)."""
    if not backend.is_array(array):
        return False
    xp = backend.get_array_module(array)
    if t._base is not None and not xp.may_share_memory(array, t._base.data):
        return False
    return any(type(s) is type(array) and xp.may_share_memory(s, array) for s in _kept_arrays(ctx))


def _kept_arrays(ctx):
    """Every array the op keeps on ctx: saved_tensors and its own attributes, inside tuples,
    lists and dicts, and the arrays of Tensors kept there."""
    from .tensor import Tensor  # (the tensor module imports function.py, which imports this one)

    found, stack = [], [value for name, value in vars(ctx).items() if name not in _BOOKKEEPING]
    while stack:
        value = stack.pop()
        if backend.is_array(value):
            found.append(value)
        elif isinstance(value, (tuple, list)):
            stack.extend(value)
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, Tensor):
            found.append(value.data)
    return found


def reading_inputs(ctx: Any, changed: Sequence[int], fn: Any, args: Sequence[Any]) -> Any:
    """fn(ctx, *args) (the op's backward, differentiable backward or jvp), with the inputs
    `changed` (check_versions) behind stand-ins whose values raise when read."""
    if not changed:
        return fn(ctx, *args)
    with reading_changed_inputs(ctx, changed, ctx.versions):
        return fn(ctx, *args)


@contextlib.contextmanager
def reading_changed_inputs(ctx: Any, changed: Sequence[int], versions: Sequence[int],
                           when: str = "backward") -> Iterator[None]:
    """Within the block, the inputs `changed` (indices into ctx.inputs, changed since the op ran at
    `versions`) are stand-ins whose values raise the version error when read (an op applied to
    one, `.data`, `.numpy()`); their shape, dtype, device and requires_grad read as the inputs'.
    ctx.inputs is given back on exit (the backward pass routes gradients by it)."""
    inputs = ctx.inputs
    if inputs is None:  # a node outside the graph (linearize without grad): its jvp cannot reach them
        yield
        return
    stand_ins = list(inputs)
    for i in changed:
        stand_ins[i] = _stand_in(inputs[i], version_error(ctx, i, inputs[i], versions[i], when))
    ctx.inputs = tuple(stand_ins)
    try:
        yield
    finally:
        ctx.inputs = inputs


_stand_in_class = None  # the Tensor subclass of the stand-ins, made on first use (_stand_in)


def _stand_in(t, error):
    """A Tensor standing in for the input `t` changed in place: its values raise `error`."""
    global _stand_in_class
    if _stand_in_class is None:
        from .tensor import Tensor  # (the tensor module imports function.py, which imports this one)

        class ChangedInput(Tensor):
            """An input changed in place since the forward (reading_changed_inputs): reading its
            values raises the version error; its shape, dtype and device are the input's."""
            data = property(lambda self: _raise(self._error))
            shape = property(lambda self: self._meta[0])
            dtype = property(lambda self: self._meta[1])
            device = property(lambda self: self._meta[2])
            ndim = property(lambda self: len(self._meta[0]))
            size = property(lambda self: math.prod(self._meta[0]))

        _stand_in_class = ChangedInput
    stand_in = object.__new__(_stand_in_class)
    stand_in.__dict__.update({k: v for k, v in vars(t).items() if k != "data"})
    stand_in._meta, stand_in._error = (t.shape, t.dtype, t.device), error
    return stand_in


def _raise(error):
    raise error
