"""Versions and views: a gradient is never computed from values changed since the forward pass
(a second read).

Every Tensor counts its in-place changes in `_version` (torch's version counter; `bump_version()`
adds one: optimizer steps, `load_state_dict`, `Module.to`, `nn.init`, gradient clipping call it).
A tensor that shares another's memory counts on that one, its `_base`: the output of a view op
(an op with `view = True`, e.g. `Reshape`, `GetItem`, whose output `Function.apply` finds to share
its input's memory: `backend.memory_owner`) and a `detach()`ed or `Tensor(t)` alias. Each node
records its inputs' versions when it is made (`ctx.versions`); the backward pass calls
`check_versions(node)` before the node's backward, which raises when an input the op saved for
backward has moved on since. An input the op did not save may change (its backward does not read
it), as in torch.
"""
from __future__ import annotations

from typing import Any

from . import backend
from .op_checks import op_name


def check_versions(node: Any) -> None:
    """Raise RuntimeError (torch's words) when an input that the op saved for backward was changed
    in place since the forward pass (an optimizer step, load_state_dict, ...: its `_version` moved):
    its backward would mix the new values with the old ones, a silently wrong gradient."""
    for t, version in zip(node.inputs, node.versions):  # the common case, cheaply: no version moved
        if t is not None and (t if t._base is None else t._base)._version != version:
            break
    else:
        return
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
