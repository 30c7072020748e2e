"""Hooks: the moments of the core's work at which code outside the core acts.

The core knows nothing of what runs beside it (threads, random streams, device checks: npformer's
runtime, `npformer.runtime`). Such code registers a function here, once, at its import, and the
core calls every function of a list, in the order they were registered, with no arguments:

- `backward_started`: `Tensor.backward()` has checked its arguments and is about to walk the
  tape. npformer's runtime ends the forward pass of its dropout lookahead there
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
"""
from collections.abc import Callable
from typing import Any

backward_started: list[Callable[[], Any]] = []  # called by Tensor.backward before the backward pass
host_read: list[Callable[[], Any]] = []         # called by Tensor.numpy() and Tensor.item() before reading
op_applied: list[Callable[..., Any]] = []       # called by Function.apply after each op (see above)
raw_computation: list[Callable[..., Any]] = []  # the last one computes autograd.raw_computation's fn (see above)


def run(hooks: list[Callable[[], Any]]) -> None:
    """Call every function of the list `hooks` (one of the argument-less lists above), in registration order."""
    for hook in hooks:
        hook()
