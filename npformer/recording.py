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

A recording is made for what the ops were chosen by (the call's signature): the inputs' shapes,
dtypes and devices (the CPU only), the composite twins (grad mode off, forward-mode AD and
anomaly detection: always eager), the model's parameters (which Tensors, their shapes, dtypes,
requires_grad), and every plain setting of its modules (training/eval, an attention path, ...).
A call of another signature records again, up to `max_recordings` recordings (each keeps its
graph and the arrays it saved, as torch.compile keeps a graph per shape up to its cache size
limit), so that batches of a few shapes (an epoch's shorter last batch, a few sequence lengths)
all replay; past the limit a call of a new signature runs eagerly. `eager_calls` and `replays`
count what it did. Recording refuses (RuntimeError) a step whose ops read arrays computed outside
them that a replay could not remake: see npformer.runtime.record. As in a CUDA graph, the step
must not branch on its data, and `fn` must depend on nothing but its inputs and `model`.
"""
from __future__ import annotations

from collections.abc import Callable
from types import FunctionType
from typing import Any

import numpy

from autograd import Tensor, backend, forward_ad, is_anomaly_enabled, is_grad_enabled
from autograd.backend import memory_owner
from npformer.functional._common import _twins
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

    def __init__(self, fn: Callable[..., Tensor], model: Any, warmup: int = 1, max_recordings: int = 8):
        if not callable(fn):
            raise TypeError(f"recorded: fn must be callable, got {type(fn).__name__}")
        if not callable(getattr(model, "modules", None)) or not callable(getattr(model, "parameters", None)):
            raise TypeError(f"recorded: model must be an npformer.nn.Module (the step's parameters and modes), "
                            f"got {type(model).__name__}")
        for name, value, least in (("warmup", warmup, 0), ("max_recordings", max_recordings, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"recorded: {name} must be an integer >= {least}, got {value!r}")
        self.fn, self.model, self.warmup, self.max_recordings = fn, model, warmup, max_recordings
        self.calls = self.eager_calls = self.replays = 0
        # [(signature, _Recording)]: compared by equality, as a signature may hold what cannot be hashed
        # (a module's tuple of lists); at most max_recordings, each compared from its shapes on
        self.recordings = []
        self.modules = None     # the model's modules at the last recording (what _signature reads)

    def __call__(self, *inputs: Any) -> Any:
        """Run the step on `inputs` (arrays or Tensors that do not require grad): the loss (a
        detached scalar Tensor), its gradients accumulated into the parameters' `.grad`. When fn
        returns a tuple (the loss first, then Tensors and arrays the step made), that tuple with
        the loss detached; after a call's recording the same objects, which each replay of its
        signature rewrites."""
        self.calls += 1
        signature = self._signature(inputs)
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
        signature = self._signature(inputs)
        static = [Tensor(numpy.array(_data(v))) if isinstance(v, Tensor) else numpy.array(v) for v in inputs]
        recorder = record.Recorder()
        with recorder:
            loss, extras = _loss_and_extras(self.fn(*static))
        if loss.creator is None:
            raise TypeError("recorded: fn must return a scalar loss Tensor that requires grad, got one that does not")
        recorder.check(self._known(static), self.model.parameters(), extras or ())
        loss.backward(retain_graph=True)
        self.recordings.append((signature, _Recording(recorder, static, loss, extras)))
        self.eager_calls += 1  # the recording call is an eager step
        return _returned(loss, extras)

    def _known(self, static):
        """The ids of the arrays owning the memory a replay may read as it is: the inputs, the
        parameters, and the arrays and Tensors the model's modules hold."""
        known = [_data(s) for s in static]
        for module in self.modules:
            for value in vars(module).values():
                values = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) \
                    else (value,)
                known.extend(_data(v) for v in values if isinstance(v, Tensor) or backend.is_array(v))
        return {id(memory_owner(a)) for a in known}

    def _signature(self, inputs):
        """What the recorded ops were chosen by, or None when a call cannot be recorded at all
        (inputs that are not CPU arrays or Tensors without grad)."""
        if not is_grad_enabled() or forward_ad.current_level() is not None or is_anomaly_enabled():
            return None
        shapes = []
        for value in inputs:
            data = _data(value)
            if type(data) is not numpy.ndarray or (isinstance(value, Tensor) and value.requires_grad):
                return None
            shapes.append((isinstance(value, Tensor), data.shape, data.dtype))
        modules = self.modules if self.modules is not None else list(self.model.modules())
        return tuple(shapes), _twins.active, tuple([_settings(m) for m in modules])


def _loss_and_extras(returned):
    """(the loss, the rest of what fn returned or None), or TypeError."""
    loss, extras = (returned[0], returned[1:]) if isinstance(returned, tuple) and returned else (returned, None)
    if not isinstance(loss, Tensor) or loss.size != 1:
        shape = f" {loss.shape}" if isinstance(loss, Tensor) else ""
        raise TypeError(f"recorded: fn must return a scalar loss Tensor that requires grad (or a tuple that starts "
                        f"with one), got {type(loss).__name__}{shape}")
    return loss, extras


def _returned(loss, extras):
    return loss.detach() if extras is None else (loss.detach(),) + extras


def _data(value):
    return value.data if isinstance(value, Tensor) else value


def _settings(module):
    """What a module's forward may be chosen by: its plain values (training, sizes, paths), its
    functions, its parameters, buffers and children (which ones; a Tensor's requires_grad, shape,
    dtype and array type) and the plain values of its config objects."""
    found = []
    for value in vars(module).values():
        kind = type(value)
        if kind in _PLAIN or kind is tuple or kind is FunctionType:
            found.append(value)
        elif kind is dict:   # _parameters, _buffers, _modules, a config dict
            for key, item in value.items():
                if isinstance(item, Tensor):
                    data = item.data
                    found.append((key, id(item), item.requires_grad, data.shape, data.dtype, type(data)))
                else:
                    found.append((key, item if type(item) in _PLAIN else id(item)))
        elif hasattr(value, "__dict__") and not isinstance(value, (Tensor, random.Philox)) and not callable(value):
            found.append(tuple([v for v in vars(value).values() if type(v) in _PLAIN]))
    return tuple(found)


def recorded(fn: Callable[..., Tensor], model: Any, warmup: int = 1, max_recordings: int = 8) -> RecordedStep:
    """A callable that runs `fn(*inputs)` (the step's scalar loss) and its backward, recorded on
    the first call after `warmup` eager ones and replayed by later calls like it; a call of other
    shapes (or modes, parameters) records again, up to `max_recordings` recordings, then runs
    eagerly (see the module docstring). Raises TypeError for an fn that is not callable or a
    model that is not a Module, ValueError for a negative warmup or max_recordings below 1."""
    return RecordedStep(fn, model, warmup, max_recordings)
