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

**Moments of one backward pass** (torch's; data-parallel training starts each gradient's
all-reduce as soon as that gradient is final): a leaf's `register_post_accumulate_grad_hook(fn)`
runs `fn(leaf)` once its gradient for the pass is complete (after the last node of the pass that
adds to it: `last_uses_of_hooked_leaves`), and `queue_callback(fn)`, called from such a hook, runs
`fn()` when the pass now running ends.
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
    """What `register_post_accumulate_grad_hook` returns: `remove()` unregisters the hook."""

    def __init__(self, hooks, hook):
        self.hooks, self.hook = hooks, hook

    def remove(self) -> None:
        if self.hook in self.hooks:
            self.hooks.remove(self.hook)


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


def last_uses_of_hooked_leaves(nodes: list) -> dict[int, list]:
    """{index of a node in `nodes` (a backward pass's order): [leaves with post-accumulate-grad hooks
    whose last use in this pass is that node]}: after that node, nothing else adds to those leaves'
    gradients. Empty, cheaply, when no leaf has a hook."""
    last = {}
    for i, node in enumerate(nodes):
        for t in node.inputs:
            if t is not None and t.creator is None and t._post_accumulate_grad_hooks:
                last[id(t)] = (i, t)
    by_node = {}
    for i, t in last.values():
        by_node.setdefault(i, []).append(t)
    return by_node


def run_post_accumulate_grad_hooks(leaves: list, delivered: set) -> None:
    """Run the post-accumulate-grad hooks of each of `leaves` whose id is in `delivered` (it got a
    gradient in this pass, now final)."""
    for leaf in leaves:
        if id(leaf) in delivered:
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
