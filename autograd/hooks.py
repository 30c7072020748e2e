"""Hooks: where code outside the core acts during the core's work (a second read).

Two kinds. **Moments of the process**: code beside the core (threads, random streams, device
checks: npformer's runtime, `npformer.runtime`) registers a function in one of the lists below,
once, at its import, and the core calls every function of that list, in registration order:

- `backward_started`: `Tensor.backward()` (or `autograd.grad`) has checked its arguments and is
  about to walk the tape. npformer's runtime ends the forward pass of its dropout lookahead there
  (`npformer.runtime.lookahead.end_pass`).
- `host_read`: `Tensor.numpy()` or `Tensor.item()` (and so `tolist()`, `float()`, `int()`) is
  about to read values on the host. npformer's runtime reports its deferred device checks there
  (`npformer.runtime.deferred.raise_pending`).
- `op_applied`: `Function.apply` has run an op; each function of the list is called with
  `(op, ctx, args, options, outputs)` (the Function class, its node, what apply got, the output
  Tensors). npformer's runtime records a step's ops there while it records one
  (`npformer.runtime.record`); the list is empty otherwise, so apply pays one check.
- `raw_computation`: `autograd.raw_computation(fn, *args)` is about to compute `fn(*args)`, a
  computation on raw arrays that is no op (a mask or a count made from a step's inputs, a check of
  ids, a dropout keep mask's draw). The last function of the list is called as `hook(fn, args)`
  and returns the result in its place; npformer's runtime keeps such computations of a step being
  recorded, to repeat them at each replay (`npformer.runtime.record`). Empty otherwise: the core
  calls `fn(*args)`.

Registration is per process: append to the list (`hooks.host_read.append(fn)`). What a hook acts
on is its owner's to keep, per thread where it is per thread (the core calls hooks in the thread
that backpropagates or reads).

**Moments of one backward pass** (torch's): a tensor's `register_hook(fn)` runs `fn(grad)` on
its gradient in each backward pass, and what fn returns (a Tensor of the gradient's shape, dtype
and device), if not None, replaces it: for a tensor made by an op, on the summed gradient of that
output before its node's backward runs (the hooks live on the node, `node.grad_hooks`, as torch's
tensor pre-hooks on grad_fn: `run_output_hooks`); for a leaf, on its whole gradient of the pass
before it goes into `.grad` (torch's pre-hook of AccumulateGrad). Several run in registration
order, each on the previous one's result; `retain_grad()` keeps the value after all of them, and
`autograd.grad` returns it (as torch). A leaf's `register_post_accumulate_grad_hook(fn)` runs
`fn(leaf)` once its gradient for the pass is in `.grad` (data-parallel training starts each
gradient's all-reduce as soon as it is final). A leaf with hooks of either kind has the
contributions of a pass held and summed (`hold`) until the last node of the pass that adds to it
(`last_uses_of_hooked_leaves`), then released (`release`: its tensor hooks, `.grad`, its
post-accumulate-grad hooks). `queue_callback(fn)`, called from a hook, runs `fn()` when the pass
now running ends. A hook sees a Tensor: in a first-order pass a Tensor outside any graph (grad
mode is off); with create_graph, a Tensor of the gradient's graph, so that what the hook computes
is differentiated too; in forward mode, one that carries its tangent.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

backward_started: list[Callable[[], Any]] = []  # called by Tensor.backward before the backward pass
host_read: list[Callable[[], Any]] = []         # called by Tensor.numpy() and Tensor.item() before reading
op_applied: list[Callable[..., Any]] = []       # called by Function.apply after each op (see above)
raw_computation: list[Callable[..., Any]] = []  # the last one computes autograd.raw_computation's fn (see above)


def run(hooks: list[Callable[[], Any]]) -> None:
    """Call every function of the list `hooks` (one of the argument-less lists above), in registration order."""
    for hook in hooks:
        hook()


# -- moments of one backward pass ------------------------------------------------------------------
class HookHandle:
    """What `register_hook`, `register_post_accumulate_grad_hook` (and npformer's module hooks)
    return: `remove()` unregisters the hook (once; again, it does nothing)."""

    def __init__(self, hooks, hook):
        self.hooks, self.hook = hooks, hook

    def remove(self) -> None:
        for i, entry in enumerate(self.hooks):  # this handle's entry (the same function may be registered twice)
            if entry is self.hook:
                del self.hooks[i]
                return


def register_post_accumulate_grad_hook(leaf: Any, hook: Callable[[Any], Any]) -> HookHandle:
    """`Tensor.register_post_accumulate_grad_hook`: `hook` kept in the leaf's list."""
    if leaf.creator is not None:
        raise RuntimeError("register_post_accumulate_grad_hook: only leaves (parameters) have one; "
                           "this tensor was made by an op")
    if not callable(hook):
        raise TypeError(f"hook: expected a callable, got {type(hook).__name__}")
    if not leaf._post_accumulate_grad_hooks:
        leaf._post_accumulate_grad_hooks = []
    leaf._post_accumulate_grad_hooks.append(hook)
    return HookHandle(leaf._post_accumulate_grad_hooks, hook)


def register_hook(t: Any, hook: Callable[[Any], Any]) -> HookHandle:
    """`Tensor.register_hook`: `hook` kept in the leaf's list, or in its creator's for that output."""
    if not callable(hook):
        raise TypeError(f"register_hook: hook must be a callable hook(grad) -> Tensor or None, got "
                        f"{type(hook).__name__}")
    if not t.requires_grad:
        raise RuntimeError("register_hook: cannot register a hook on a tensor that does not require grad "
                           "(it gets no gradient; as torch)")
    if t.creator is None:
        if not t._grad_hooks:
            t._grad_hooks = []
        fns = t._grad_hooks
    else:
        if t.creator.grad_hooks is None:
            t.creator.grad_hooks = {}
        fns = t.creator.grad_hooks.setdefault(t.output_index, [])
    fns.append(hook)
    return HookHandle(fns, hook)


def run_grad_hooks(fns: list, grad: Any, shape: tuple, dtype: Any, tensors: bool) -> Any:
    """The gradient after the tensor hooks `fns`, in order, each given the last one's result (a
    Tensor; None for an output of a node that got no gradient, as torch): `grad` itself when each
    returns None. `grad` and the result are raw arrays, or Tensors when `tensors`."""
    from .tensor import Tensor  # (the tensor module imports function.py, which imports this one)
    g = grad if tensors or grad is None else Tensor(grad)
    for fn in list(fns):  # (a hook may remove itself)
        new = fn(g)
        if new is None:
            continue
        name = getattr(fn, "__qualname__", type(fn).__name__)
        if not isinstance(new, Tensor):
            raise TypeError(f"tensor hook {name} returned {type(new).__name__}: a hook returns a Tensor (the "
                            "gradient to use in place of the one it got) or None")
        if new.shape != shape or new.dtype != dtype or (g is not None and new.device != g.device):
            raise RuntimeError(f"tensor hook {name} returned a gradient of shape {new.shape}, dtype {new.dtype} "
                               f"on '{new.device}': expected shape {shape}, dtype {dtype}"
                               + ("" if g is None else f" on '{g.device}'") + " (the tensor's)")
        g = new
    return g if tensors or g is None else g.data


def run_output_hooks(backward: Any, node: Any, needed: set | None) -> None:
    """The tensor hooks of `node`'s outputs on their summed gradients, in place in `node.output_grads`,
    when the pass runs the node (`needed`: GraphPass's nodes that lead to a wanted tensor) or
    returns one of its outputs' gradients (`autograd.grad` of a non-leaf). As torch's engine,
    `autograd.grad` returns the gradient of a non-leaf whose node it runs as it was before the
    hooks (`captured`), and that of one whose node it does not run, after them."""
    wanted, runs = getattr(backward, "wanted_outputs", None), needed is None or id(node) in needed
    if not runs and not any((id(node), j) in wanted for j in node.grad_hooks):
        return
    if runs and wanted and not backward.accumulate:
        for j, grad in enumerate(node.output_grads):
            t = wanted.get((id(node), j))
            if t is not None and grad is not None and j in node.grad_hooks:
                backward.deliver(t, grad)
                backward.captured.add((id(node), j))
    for j, fns in node.grad_hooks.items():
        shape, dtype = node.output_meta[j]
        node.output_grads[j] = run_grad_hooks(fns, node.output_grads[j], shape, dtype, backward.tensors)


def last_uses_of_hooked_leaves(nodes: list) -> dict[int, list]:
    """{index of a node in `nodes` (a backward pass's order): [leaves with hooks (tensor or
    post-accumulate-grad) whose last use in this pass is that node]}: after that node, nothing else
    adds to those leaves' gradients. Empty, cheaply, when no leaf has a hook."""
    last = {}
    for i, node in enumerate(nodes):
        for t in node.inputs:
            if t is not None and t.creator is None and (t._post_accumulate_grad_hooks or t._grad_hooks):
                last[id(t)] = (i, t)
    by_node = {}
    for i, t in last.values():
        by_node.setdefault(i, []).append(t)
    return by_node


def hold(held: dict, leaf: Any, grad: Any) -> None:
    """Add one contribution to the gradient of `leaf` (a leaf with hooks) held in `held` ({id: [leaf,
    the sum so far]}, a pass's `held`) until `release`."""
    entry = held.get(id(leaf))
    if entry is None:
        held[id(leaf)] = [leaf, grad]
    else:
        entry[1] = entry[1] + grad


def release(backward: Any, leaves: list | None = None) -> None:
    """For each of `leaves` (None: all) whose gradient `backward` (the pass) holds, now complete:
    its tensor hooks on it, then into `.grad` (or what the pass returns: `backward.deliver(...,
    held=True)`), then its post-accumulate-grad hooks when it went into `.grad`."""
    if leaves is None:
        if not backward.held:
            return
        leaves = [leaf for leaf, _ in list(backward.held.values())]
    for leaf in leaves:
        entry = backward.held.pop(id(leaf), None)
        if entry is None:  # no gradient for it in this pass
            continue
        grad = entry[1]
        if leaf._grad_hooks:
            grad = run_grad_hooks(leaf._grad_hooks, grad, leaf.shape, leaf.dtype, backward.tensors)
        backward.deliver(leaf, grad, held=True)
        if getattr(backward, "accumulate", True):  # (GraphPass's accumulate=False: returned, not in .grad)
            for hook in list(leaf._post_accumulate_grad_hooks):
                hook(leaf)


_backward = threading.local()  # .callbacks: those queued during the backward pass running in this thread


def queue_callback(fn: Callable[[], Any]) -> None:
    """Run `fn()` once, when the backward pass running in this thread has finished (every
    gradient accumulated and every post-accumulate-grad hook run); like torch's
    `Variable._execution_engine.queue_callback`. Only valid inside a backward pass (from a hook)."""
    callbacks = getattr(_backward, "callbacks", None)
    if callbacks is None:
        raise RuntimeError("queue_callback: no backward pass is running in this thread; call it from a hook")
    callbacks.append(fn)


@contextlib.contextmanager
def queued_callbacks() -> Iterator[None]:
    """Around one backward pass (`function.run_backward`): the callbacks queued inside run once it
    has ended without an error (a pass inside a callback or hook queues its own)."""
    outer, _backward.callbacks = getattr(_backward, "callbacks", None), []
    try:
        yield
        callbacks = _backward.callbacks
    finally:
        _backward.callbacks = outer
    for fn in callbacks:
        fn()
