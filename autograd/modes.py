"""Grad mode and anomaly mode: `no_grad`, `enable_grad`, `set_grad_enabled`, `is_grad_enabled`,
`detect_anomaly`, `is_anomaly_enabled`; and the dual levels of forward mode entered.

All are per thread, like torch's. `Function.apply` (autograd/function.py) reads them: with grad
mode off an op records no graph; with anomaly mode on every forward and backward output is
checked for NaN and Inf (`check_finite`) and each op keeps the user's line that created it;
inside a dual level (autograd/forward_ad.py) each op also computes its outputs' tangents.
"""
from __future__ import annotations

import functools
import inspect
import os
import threading
import traceback
from collections.abc import Callable

from .checks import check_bool


class _Modes(threading.local):
    """Grad mode and anomaly mode, per thread like torch's: each thread starts with gradients
    on and anomaly detection off, and a `no_grad()` in one thread never affects another.
    `saved`: the modes that the context managers entered in this thread will restore (a stack),
    so one context-manager object may be reused, nested and shared between threads."""
    grad_enabled = True
    anomaly = False

    def __init__(self):
        self.saved = []


_state = _Modes()


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


def is_grad_enabled() -> bool:
    """Whether ops in the calling thread record a graph now (False inside `no_grad()`); torch.is_grad_enabled."""
    return _state.grad_enabled


class _ModeSwitch:
    """A context manager and decorator that sets one mode of the calling thread (`name` to
    `value`) and restores the previous one on exit. Reusable and reentrant (the previous modes
    live on a per-thread stack, not on the object); as a decorator, the function runs in the mode."""

    name, value = "grad_enabled", False

    def __enter__(self):
        _state.saved.append(getattr(_state, self.name))
        setattr(_state, self.name, self.value)

    def __exit__(self, *exc_info):
        setattr(_state, self.name, _state.saved.pop())

    def __call__(self, fn: Callable) -> Callable:
        """Used as a decorator: `fn` wrapped to run in this mode (each call enters and leaves it;
        a generator function's body runs in it each time it resumes, as torch's)."""
        if inspect.isgeneratorfunction(fn):
            return self._in_mode_at_each_resume(fn)

        @functools.wraps(fn)
        def in_mode(*args, **kwargs):
            with self:
                return fn(*args, **kwargs)
        return in_mode

    def _in_mode_at_each_resume(self, fn):
        """The generator function `fn` with its body in this mode and the caller's mode back at
        every yield (torch's _wrap_generator): values, send(), throw() and close() pass through."""
        @functools.wraps(fn)
        def in_mode(*args, **kwargs):
            gen = fn(*args, **kwargs)
            resume, value = gen.send, None
            while True:
                try:
                    with self:
                        out = resume(value)
                except StopIteration as stop:
                    return stop.value
                try:
                    resume, value = gen.send, (yield out)
                except GeneratorExit:
                    with self:
                        gen.close()
                    raise
                except BaseException as error:  # thrown in by the caller: into fn's body, in the mode
                    resume, value = gen.throw, error
        return in_mode


class _DecoratorWithoutParentheses(_ModeSwitch):
    """`@no_grad` works as `@no_grad()` does (torch allows both)."""

    def __new__(cls, fn: Callable | None = None):
        switch = super().__new__(cls)
        return switch if fn is None else switch(fn)


class no_grad(_DecoratorWithoutParentheses):
    """Context manager and decorator: ops run without recording a graph (inference, optimizer
    steps), in the calling thread only; torch.no_grad. Nests; the previous mode returns on exit."""

    name, value = "grad_enabled", False


class enable_grad(_DecoratorWithoutParentheses):
    """Context manager and decorator: ops record a graph again inside a `no_grad()` block, in the
    calling thread only; torch.enable_grad."""

    name, value = "grad_enabled", True


class set_grad_enabled(_ModeSwitch):
    """Switch grad mode of the calling thread to `mode` now (torch.set_grad_enabled): called alone
    it stays switched; used as a context manager (`with set_grad_enabled(is_train):`) the previous
    mode returns on exit. TypeError unless mode is a bool."""

    def __init__(self, mode: bool):
        self.value = check_bool(mode, "mode", "set_grad_enabled")
        self.previous = _state.grad_enabled  # what the first `with` restores: the mode before the call
        _state.grad_enabled = self.value

    def __enter__(self):
        previous, self.previous = (_state.grad_enabled if self.previous is None else self.previous), None
        _state.saved.append(previous)
        _state.grad_enabled = self.value

    def __call__(self, fn: Callable) -> Callable:
        """Used as a decorator (`@set_grad_enabled(False)`), like torch's: the mode that the call
        switched returns at once, and `fn` runs in `mode` each time it is called."""
        if self.previous is not None:
            _state.grad_enabled, self.previous = self.previous, None
        return super().__call__(fn)


class detect_anomaly(_ModeSwitch):
    """Context manager and decorator (calling thread only): the first op whose forward or
    backward makes a NaN/Inf raises FloatingPointError naming the op and the line of user code
    that created it; torch.autograd.detect_anomaly. Slower (every output is checked): use it to debug."""

    name, value = "anomaly", True



def is_anomaly_enabled() -> bool:
    """Whether anomaly detection is on in the calling thread (inside `detect_anomaly()`); torch's."""
    return _state.anomaly


def check_finite(arrays, ctx, phase):
    """Anomaly mode: FloatingPointError naming the op (`ctx`, its node) and the line that created it
    when one of `arrays` (its forward's outputs or backward's gradients: `phase`) holds NaN or Inf."""
    from . import backend
    from .op_checks import op_name

    for a in arrays:
        if a is not None and a.dtype.kind in "fc":
            xp = backend.get_array_module(a)
            if not bool(xp.isfinite(a).all()):
                raise FloatingPointError(
                    f"{op_name(type(ctx))} {phase} produced NaN or Inf; the op was created at\n"
                    f"{ctx.created_at}")


# the packages whose frames are library code, not the user's line: autograd and npformer,
# found by their own directories (a checkout may itself be called "npformer")
_LIBRARY_DIRS = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), name) + os.sep
                      for name in ("autograd", "npformer"))


def where_created():
    """Anomaly mode: the innermost stack frame outside the autograd and npformer packages, the
    user's line that created an op (called by Function.apply)."""
    frames = [f for f in traceback.extract_stack()[:-3]
              if not os.path.abspath(f.filename).startswith(_LIBRARY_DIRS)]
    return "".join(traceback.format_list(frames[-1:])) or "(unknown)"
