"""Recorded training steps on the CPU: a loss function's ops recorded once, then run again for
every batch of the same shapes without the Python around them (the CPU counterpart of
`npformer.cuda.graphed`, and of torch.cuda.make_graphed_callables: forward and backward are
recorded, the optimizer step stays outside).

    step = npformer.recorded(lambda src, tgt_in, tgt_out: F.cross_entropy(
        model(src, tgt_in).reshape(-1, vocab), tgt_out.reshape(-1)), model)
    for src, tgt_in, tgt_out in batches:
        optimizer.zero_grad()
        loss = step(src, tgt_in, tgt_out)     # forward and backward: the gradients are in .grad
        optim.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()                      # eager: its learning rate, its schedule
        scheduler.step()

The first `warmup` calls run eagerly (`fn(*inputs)` and `backward()`); the next records the
ops of the call (npformer.runtime.record) and the graph it builds; later calls like it copy
their inputs into the recorded ones and replay: every op's forward again, on the arrays of the
moment, then the recorded graph's backward. The numbers are those of the eager step, bit for
bit: each dropout draws the next values of its stream, the padding masks and ignored targets
are made from the new inputs, the ids are checked again.

A recording is replayed only by a call of the same signature, which covers what the step reads
beside its inputs' values: what its ops were chosen by and the Python values they were given:
- the inputs' shapes, dtypes and devices (the CPU only; not their memory order: the recorded
  copies are C-ordered, each batch is copied into them);
- the composite twins (`_twins`); (grad mode off, forward-mode AD, anomaly detection: eager);
- every attribute of every module of the model, whatever it holds: its parameters (which Tensors,
  their shapes, dtypes, requires_grad: a replay reads their values anew), other Tensors and arrays
  by identity (their values are read anew: an in-place change is seen, a new object records
  again), numbers, numpy scalars, strings, the items of lists, tuples, dicts and sets, the
  attributes of other objects (a config), functions;
- fn itself: its default arguments, its closure's values and, for a function written outside
  npformer, the globals its code names, followed into the functions and objects they hold (to a
  depth of 4); and what `state()` returns, for values fn reads otherwise (the attributes of a
  bound method's object: `Trainer(record_steps=True)` gives its loss function).
A call of another signature records again, up to `max_recordings` recordings (each keeps its
graph and the arrays it saved, as torch.compile keeps a graph per shape up to its cache size
limit), so that batches of a few shapes (an epoch's shorter last batch, a few sequence lengths)
all replay, and a setting changed between steps (a module's attribute, a value fn reads) records
anew; past the limit a call of a new signature runs eagerly. `eager_calls` and `replays` count what
it did. A parameter's tensor hook (`register_hook`) and post-accumulate-grad hook run at every
replay (the engine's own backward).

A replay does not run the Python of fn and of the modules' forward, so a step whose recording
shows Python that a replay would need falls back to eager steps, with one RuntimeWarning, from
then on (`eager_reason` says why): a value read on the host while recording (`item()`, `float()`,
`numpy()`, `tolist()` or `np.asarray` of a Tensor: a branch on the data; the warning names the
line); a change of the state the signature covers made by recording calls themselves, at the
`max_recordings`-th such call (a counter that fn increments, an attribute a forward sets at every
call; until then each is an eager step and a later call records again: a cache a forward builds
or grows changes it once); a module whose forward is replaced on the instance; a hook that fn
registers (on a tensor it makes, `Tensor.register_hook`, on a module or on a hook point, even one
it removes before it returns, as `run_with_hooks` does). A module hook on a module of the model
(`register_forward_hook`, ...: Python around forward), or a hook on one of its hook points
(`model.add_hook`: nn/hook_points.py), makes every call run eagerly while it is registered
(replays resume once it is removed): every hook sees every step, as in torch (docs/hooks.md).
Recording refuses (RuntimeError) a step whose ops read arrays computed outside them that a replay
could not remake: see npformer.runtime.record. Not seen, so not allowed in fn:
a branch on the values of the raw input arrays or of a Tensor's `.data` (numpy's own reads),
Python random numbers or the clock, state reached only deeper than the signature follows or
through objects it does not follow (declare those with `state`). Calls from several threads run
one at a time (each replay rewrites the recording's arrays); what a call returns is its own
(Tensors detached, arrays copied). The optimizer step runs after the call, eagerly: its state
(learning rate, schedule, moments) is read by it as in an eager step, and is no part of a
signature.
"""
from __future__ import annotations

import dis
import functools
import threading
import warnings
from collections.abc import Callable
from types import CodeType, FunctionType, MethodType, ModuleType
from typing import Any

import numpy

from autograd import Tensor, backend, forward_ad, is_anomaly_enabled, is_grad_enabled
from autograd.backend import memory_owner
from npformer.functional._common import _twins
from npformer.nn.hook_points import HookPoint
from npformer.nn.module import Module
from npformer.runtime import random, record

__all__ = ["recorded", "RecordedStep"]

_PLAIN = (bool, int, float, str, type(None))


class _Recording:
    """One recorded call: its ops (a record.Recorder), its inputs, which each replay rewrites, its
    loss and what fn returned after it (rewritten by each replay), and its graph's backward
    (record.Backward)."""

    def __init__(self, recorder, static, loss, extras):
        self.recorder, self.static, self.loss, self.extras = recorder, static, loss, extras
        self.backward = record.Backward(loss)

    def replay(self, inputs):
        for static, value in zip(self.static, inputs):
            numpy.copyto(_data(static), _data(value))
        self.recorder.replay()
        self.backward.run()
        return _returned(self.loss, self.extras)


class RecordedStep:
    """`fn(*inputs)` (a scalar loss Tensor) and its backward, recorded once per signature and
    replayed (see the module docstring). Made by `recorded`."""

    def __init__(self, fn: Callable[..., Tensor], model: Any, warmup: int = 1, max_recordings: int = 8,
                 state: Callable[[], Any] | None = None):
        if not callable(fn):
            raise TypeError(f"recorded: fn must be callable, got {type(fn).__name__}")
        if not callable(getattr(model, "modules", None)) or not callable(getattr(model, "parameters", None)):
            raise TypeError(f"recorded: model must be an npformer.nn.Module (the step's parameters and modes), "
                            f"got {type(model).__name__}")
        for name, value, least in (("warmup", warmup, 0), ("max_recordings", max_recordings, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"recorded: {name} must be an integer >= {least}, got {value!r}")
        if state is not None and not callable(state):
            raise TypeError(f"recorded: state must be None or a function () -> the Python values fn reads, "
                            f"got {type(state).__name__}")
        self.fn, self.model, self.warmup, self.max_recordings, self.state = fn, model, warmup, max_recordings, state
        self.calls = self.eager_calls = self.replays = 0
        # [(signature, _Recording)]: compared by equality, as a signature may hold what cannot be hashed
        # (a module's tuple of lists); at most max_recordings, each compared from its shapes on
        self.recordings = []
        self.modules = None     # the model's modules at the last recording (what _signature reads)
        self.eager_reason = None  # why every call now runs eagerly (a warning said it once), or None
        self._changed_calls = 0  # recording calls that changed the state they read (each an eager step)
        self._lock = threading.RLock()  # one call at a time: a replay rewrites the recording's arrays

    def __call__(self, *inputs: Any) -> Any:
        """Run the step on `inputs` (arrays or Tensors that do not require grad): the loss (a
        detached scalar Tensor), its gradients accumulated into the parameters' `.grad`. When fn
        returns a tuple (the loss first, then Tensors and arrays the step made), that tuple with
        the loss detached, Tensors detached and arrays copied (the next call leaves them as they are).
        Calls from several threads run one at a time."""
        with self._lock:
            self.calls += 1
            signature = self._signature(inputs) if self.eager_reason is None else None
            if self.calls <= self.warmup or signature is None:
                return self._eager(inputs)
            recording = next((r for recorded, r in self.recordings if recorded == signature), None)
            if recording is not None:
                self.replays += 1
                return recording.replay(inputs)
            if len(self.recordings) >= self.max_recordings or \
                    not all(type(p.data) is numpy.ndarray for p in self.model.parameters()):
                return self._eager(inputs)   # (a model on a GPU: npformer.cuda.graphed records there)
            return self._record(inputs)

    def _eager(self, inputs):
        self.eager_calls += 1
        loss, extras = _loss_and_extras(self.fn(*inputs))
        loss.backward()
        return _returned(loss, extras)

    def _record(self, inputs):
        self.modules = list(self.model.modules())   # as they are now (a module added changes the signature)
        held = []   # the arrays the signature holds by identity: a replay of it reads them anew
        signature = self._signature(inputs, held)
        if signature is None:
            return self._eager(inputs)
        # C order whatever the first batch's: a view the step takes of an input (a reshape) stays a view
        static = [Tensor(numpy.array(_data(v), order="C")) if isinstance(v, Tensor) else numpy.array(v, order="C")
                  for v in inputs]
        recorder = record.Recorder()
        with recorder:
            loss, extras = _loss_and_extras(self.fn(*static))
        if loss.creator is None:
            raise TypeError("recorded: fn must return a scalar loss Tensor that requires grad, got one that does not")
        self.eager_calls += 1  # the recording call is an eager step
        hooked = self._hooked(recorder)
        if hooked is not None:   # fn registers hooks at each call: Python that replays would not run
            self.eager_reason = hooked
            warnings.warn(f"recorded step: {hooked}, which a replay would not run: this step runs eagerly from "
                          "now on", RuntimeWarning, stacklevel=3)
            self.recordings.clear()
            loss.backward()
            return _returned(loss, extras)
        changed = None if recorder.host_read is not None else self._changed(signature, self._signature(inputs))
        if changed is not None:   # an eager step; a cache built by a forward changes once: a later call records
            self._changed_calls += 1
        if changed is not None and self._changed_calls < self.max_recordings:
            loss.backward()
            return _returned(loss, extras)
        if recorder.host_read is not None or changed is not None:
            self.eager_reason = f"it read a value on the host at {recorder.host_read}" if changed is None else \
                f"running it changed {changed}"
            warnings.warn(f"recorded step: {self.eager_reason}, which a replay would not do again: this step "
                          "runs eagerly from now on", RuntimeWarning, stacklevel=3)
            self.recordings.clear()
            loss.backward()
            return _returned(loss, extras)
        recorder.check(self._known(static, held), self.model.parameters(), extras or ())
        loss.backward(retain_graph=True)
        self.recordings.append((signature, _Recording(recorder, static, loss, extras)))
        return _returned(loss, extras)

    def _hooked(self, recorder):
        """Why the call just recorded cannot be replayed for its hooks (None: it can): it registered
        a tensor hook on a tensor it made, a module hook or a hook point's hook."""
        if recorder.hook_registered is not None:   # even one it removed again (run_with_hooks, run_with_cache)
            return f"it registered {recorder.hook_registered}"
        if recorder.tensor_hooked():
            return "it registered a hook on a tensor it made (Tensor.register_hook)"
        module = next((m for m in self.model.modules() if _has_hooks(vars(m))), None)
        return None if module is None else f"it registered a hook on a {type(module).__name__} (module hooks)"

    def _changed(self, before, after):
        """What differs between the signatures before and after the recorded call (None: nothing):
        Python state the step changes, which replays would not change."""
        if before == after:
            return None
        for module, a, b in zip(self.modules, before[2], after[2]):
            if a != b:
                names = [name for name, x in a if (name, x) not in b] + [name for name, y in b if (name, y) not in a]
                return f"the attribute {names[0]!r} of a {type(module).__name__}"
        return "a value fn reads (in its closure or globals, or its state())"

    def _known(self, static, held):
        """The ids of the arrays owning the memory a replay may read as it is: the inputs, the
        parameters, the arrays and Tensors the model's modules hold, and those the signature
        holds by identity (`held`; fn's closure and globals: a replay of it reads the same)."""
        known = [_data(s) for s in static] + held
        for module in self.modules:
            for value in vars(module).values():
                values = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) \
                    else (value,)
                known.extend(_data(v) for v in values if isinstance(v, Tensor) or backend.is_array(v))
        return {id(memory_owner(a)) for a in known}

    def _signature(self, inputs, found=None):
        """What the recorded ops were chosen by and the Python values they were given (see the
        module docstring), or None when a call cannot be recorded at all (inputs that are not CPU
        arrays or Tensors without grad, a module whose forward is replaced on the instance)."""
        if not is_grad_enabled() or forward_ad.current_level() is not None or is_anomaly_enabled():
            return None
        shapes = []
        for value in inputs:
            data = _data(value)
            if type(data) is not numpy.ndarray or (isinstance(value, Tensor) and value.requires_grad):
                return None
            shapes.append((isinstance(value, Tensor), data.shape, data.dtype))
        modules = self.modules if self.modules is not None else list(self.model.modules())
        states, memo = [], {}
        for module in modules:
            state = vars(module)
            if "forward" in state:   # a forward wrapped on the instance (a hook): Python a replay would not run
                self.eager_reason = f"a {type(module).__name__}'s forward is replaced on the instance"
                warnings.warn(f"recorded step: {self.eager_reason} (a hook that a replay would not run): this step "
                              "runs eagerly from now on", RuntimeWarning, stacklevel=4)
                self.recordings.clear()
                return None
            if _has_hooks(state):   # eager while a module hook or a hook point's hook is registered
                return None
            states.append(_module_state(state, found, memo))
        return (tuple(shapes), _twins.active, tuple(states), _frozen(self.fn, _DEPTH, found, memo),
                None if self.state is None else _frozen(self.state(), _DEPTH, found, memo))


def _has_hooks(state):
    """Whether the module of attributes `state` has a hook that a replay would not run: a module hook
    (nn/module_hooks.py) or a hook on one of its hook points (nn/hook_points.py sets `hooks_active`)."""
    return bool(state.get("_module_hooks")) or state.get("hooks_active") is True


def _loss_and_extras(returned):
    """(the loss, the rest of what fn returned or None), or TypeError."""
    loss, extras = (returned[0], returned[1:]) if isinstance(returned, tuple) and returned else (returned, None)
    if not isinstance(loss, Tensor) or loss.size != 1:
        shape = f" {loss.shape}" if isinstance(loss, Tensor) else ""
        raise TypeError(f"recorded: fn must return a scalar loss Tensor that requires grad (or a tuple that starts "
                        f"with one), got {type(loss).__name__}{shape}")
    return loss, extras


def _returned(loss, extras):
    """The loss detached and what fn returned after it, as the caller keeps them: a Tensor detached
    (a replay gives its op's output a new array), an array copied (a replay rewrites a recomputed
    array in place), so that the next call (another thread's) leaves them as they are."""
    if extras is None:
        return loss.detach()
    return (loss.detach(),) + tuple([v.detach() if isinstance(v, Tensor) else v.copy() if backend.is_array(v) else v
                                     for v in extras])


def _data(value):
    return value.data if isinstance(value, Tensor) else value


_DEPTH = 4   # how deep _frozen follows containers, objects and functions from fn, state() and a module


# a module's hooks and hook points: what a call with none registered (_has_hooks) leaves out of its signature
# (a hook removed leaves an empty list; the hook points are identity modules then)
_HOOK_ATTRIBUTES = frozenset({"_module_hooks", "hook_point_attributes", "hooks_active"})


def _module_state(state, found=None, memo=None):
    """A module's attributes (`vars`) as a signature compares them: ((name, frozen value), ...). Its
    parameters by identity, requires_grad, shape, dtype and array type (a replay reads their
    arrays anew); its children by identity (each is a module of the model, frozen itself)."""
    frozen = []
    for name, value in state.items():
        kind = type(value)
        if kind in _PLAIN:
            frozen.append((name, value))
        elif (kind is dict or kind is set) and not value:   # (most modules' buffers, many's parameters)
            frozen.append((name, kind))
        elif name in _HOOK_ATTRIBUTES or kind is HookPoint:   # none has a hook (else no signature)
            continue
        elif name == "_parameters":
            frozen.append((name, tuple([(key, id(p), p.requires_grad, p.data.shape, p.data.dtype, type(p.data))
                                        if isinstance(p, Tensor) else (key, p) for key, p in value.items()])))
        elif name == "_modules":
            frozen.append((name, tuple([(key, id(m)) for key, m in value.items()])))
        elif name == "_buffers":
            frozen.append((name, tuple([(key, id(t), id(t.data), t.requires_grad) if isinstance(t, Tensor) else
                                        (key, _frozen(t, _DEPTH, found, memo)) for key, t in value.items()])))
            if found is not None:
                found.extend(t.data for t in value.values() if isinstance(t, Tensor))
        elif kind is set:
            frozen.append((name, frozenset(value)))
        else:
            frozen.append((name, _frozen(value, _DEPTH, found, memo)))
    return tuple(frozen)


_LIBRARY_PACKAGES = ("npformer", "autograd", "numpy")
_ARRAY, _OBJECT = "array", "object"   # tags of what a signature holds by identity (its id)


def _frozen(value, depth, found=None, memo=None):
    """`value` as a signature compares it: plain values and numpy scalars (their bytes) as they
    are; lists, tuples, dicts and sets by their items; a Tensor or array by identity (and a
    Tensor's array's) and requires_grad (a replay reads its values anew); a function by identity,
    its default arguments, the values its closure holds and, outside npformer, autograd and numpy,
    the globals its code names; another object by identity and its attributes. Modules, classes,
    random streams and whatever lies deeper than `depth` by identity alone. Identities are ids: an
    id is reused only once its object is gone, and a recording holds what its ops read.
    found: a list to which the arrays held by identity are appended (what a replay reads anew);
    memo: {id: frozen} of the objects frozen so far in this signature (a config many modules share
    is frozen once, and compared by identity first)."""
    kind = type(value)
    if kind in _PLAIN:
        return value
    if kind is Tensor or isinstance(value, Tensor):
        data = value.data
        if found is not None:
            found.append(data)
        return _ARRAY, id(value), id(data), value.requires_grad
    if kind is numpy.ndarray or backend.is_array(value):
        if found is not None:
            found.append(value)
        return _ARRAY, id(value)
    if isinstance(value, numpy.generic):
        return kind, value.tobytes()
    if depth <= 0:
        return _OBJECT, id(value)
    depth -= 1
    if kind is tuple or kind is list:   # (plain items inline: the common case, cheaper than a call each)
        return kind, tuple([v if type(v) in _PLAIN else _frozen(v, depth, found, memo) for v in value])
    if kind is dict:
        return kind, tuple([(k, v if type(v) in _PLAIN else _frozen(v, depth, found, memo))
                            for k, v in value.items()])
    if kind is set or kind is frozenset:
        return kind, frozenset(value)
    if kind is FunctionType:
        return value, _function_state(value, depth, found, memo)
    if kind is MethodType:
        return value.__func__, id(value.__self__), _function_state(value.__func__, depth, found, memo)
    if kind is functools.partial:
        return _frozen(value.func, depth, found, memo), _frozen(value.args, depth, found, memo), \
            _frozen(value.keywords, depth, found, memo)
    if isinstance(value, (Module, ModuleType, type, random.Philox, RecordedStep)):
        return _OBJECT, id(value)
    attributes = getattr(value, "__dict__", None)
    if type(attributes) is dict:
        if memo is None:
            return _OBJECT, id(value), _frozen(attributes, depth, found)
        frozen = memo.get(id(value))
        if frozen is None:
            frozen = memo[id(value)] = _OBJECT, id(value), _frozen(attributes, depth, found, memo)
        return frozen
    return _OBJECT, id(value)


_EMPTY = object()   # an empty closure cell
_global_names_of = {}  # code object -> the names its code (and the code it defines) reads as globals


def _function_state(fn, depth, found=None, memo=None):
    """What a function reads beside its arguments: its default arguments' values, its closure
    cells' and, for a function defined outside npformer, autograd and numpy, the globals its code
    names."""
    cells = (_frozen(fn.__defaults__, depth, found, memo), _frozen(fn.__kwdefaults__, depth, found, memo),
             tuple([_frozen(_cell(c), depth, found, memo) for c in fn.__closure__ or ()]))
    if (getattr(fn, "__module__", None) or "").split(".")[0] in _LIBRARY_PACKAGES:
        return cells
    code = fn.__code__
    names = _global_names_of.get(code)
    if names is None:
        names = _global_names_of[code] = _code_names(code)
    scope = fn.__globals__
    return cells, tuple([(name, _frozen(scope[name], depth, found, memo)) for name in names if name in scope])


def _cell(cell):
    try:
        return cell.cell_contents
    except ValueError:
        return _EMPTY


def _code_names(code):
    """The global names a code object and the code objects it defines (lambdas, inner functions)
    load (not the attribute names beside them in co_names: `optimizer.step` is no global `step`)."""
    names = [i.argval for i in dis.get_instructions(code) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")]
    for const in code.co_consts:
        if isinstance(const, CodeType):
            names.extend(_code_names(const))
    return tuple(dict.fromkeys(names))


def recorded(fn: Callable[..., Tensor], model: Any, warmup: int = 1, max_recordings: int = 8,
             state: Callable[[], Any] | None = None) -> RecordedStep:
    """A callable that runs `fn(*inputs)` (the step's scalar loss) and its backward, recorded on
    the first call after `warmup` eager ones and replayed by later calls like it; a call of other
    shapes (or modes, parameters) records again, up to `max_recordings` recordings, then runs
    eagerly (see the module docstring). Raises TypeError for an fn that is not callable or a
    model that is not a Module, ValueError for a negative warmup or max_recordings below 1. state:
    a function returning the Python values fn reads beyond what the signature follows from fn
    (e.g. the attributes of a bound method's object), put in the signature."""
    return RecordedStep(fn, model, warmup, max_recordings, state)
