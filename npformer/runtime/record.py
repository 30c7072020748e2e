"""The recording of a step's ops on the CPU, and their replay (`npformer.recorded`).

An eager step spends much of a small model's time in Python around the arithmetic: modules'
calls, argument checks, `Function.apply` making Tensors and graph nodes. A recorded step runs
the loss function once under a `Recorder`, which keeps, in order:

- every op applied (the Function, its node, its arguments and options, its output Tensors),
  seen through the core's `autograd.hooks.op_applied`;
- every raw computation that a call site asked to be repeated (`recomputed(fn, *args)`): masks
  and targets made from the step's inputs outside any op, id checks;
- every draw of a Philox stream (`note_draw`, from Philox's reservations), and the op whose
  options took it.

`Recorder.replay()` then runs the same computations again: each op's `forward` on the arrays its
arguments hold now (the step's inputs rewritten in place, the parameters as the optimizer left
them), its outputs put into the same Tensors, its node's saved arrays and versions renewed, so
the graph recorded the first time is the graph of this step, and `Backward` runs the engine's
backward pass through it again, in the order worked out once. Each raw computation is repeated
and its result copied into the arrays the ops were given; each dropout takes the next values of
its stream with the seed of the moment, as the eager step would: the same numbers, bit for bit.

What a replay cannot see is refused while recording (`Recorder.check`): an array that an op
(as an input or option) or a recomputed call (as an argument) reads, or that the step returns,
which is none of the step's inputs, its parameters or state, an earlier op's output or a
recomputed result (an array the step computed some other way would be frozen, a strided view's
flattened copy included), and a draw that no op's options took. A value read on the host while
recording (`Tensor.item()`, `float()`, `numpy()`, `tolist()`, `np.asarray`: the core's `host_read`
hook) gives a Python number that a replay would not read again, as the branch taken on it: the
recorder keeps where the first such read happened (`Recorder.host_read`, the line of the code
outside npformer and autograd that made it) and `npformer.recorded` runs that step eagerly. A read
of the step's raw input arrays or of a Tensor's `.data` (numpy's own, not a Tensor's) is not seen.
Recording is per thread; ops applied inside `recomputed` belong to it and are not recorded.
"""
import os
import sys
import threading

from autograd import Tensor, backend, hooks
from autograd.backend import memory_owner
from autograd.function import backward_order, run_backward
from autograd.op_checks import op_name, output_arrays


class _Local(threading.local):
    recorder = None  # the Recorder of the step being recorded in this thread
    depth = 0        # > 0 inside a recomputed() call: its ops and draws are its own


_local = _Local()
_recording = [0]             # recorders active in any thread: the core's hook is registered while > 0
_recording_lock = threading.Lock()


def current():
    """The Recorder recording in this thread outside a recomputed() call, or None."""
    return _local.recorder if not _local.depth else None


def recomputed(fn, *args):
    """fn(*args), repeated by every replay of a step being recorded (see the module docstring):
    fn reads arrays whose contents the step's inputs decide and returns an array, a tuple of
    arrays or None, whose values each replay copies into the arrays returned the first time (so
    their shapes must not change). Outside a recording: fn(*args). Ops and modules reach it
    through the core's `autograd.raw_computation`, whose hook it is while a step is recorded."""
    recorder = current()
    if recorder is None:
        return fn(*args)
    _local.depth += 1
    try:
        result = fn(*args)
    finally:
        _local.depth -= 1
    recorder.events.append(_Raw(fn, args, result))
    return result


def _raw_computation(fn, args):
    return recomputed(fn, *args)


def note_draw(stream, n, offset):
    """A Philox stream reserved n values at `offset` (npformer.runtime.random): recorded when a step is."""
    recorder = current()
    if recorder is not None:
        recorder.events.append(_Draw(stream, n, offset))


def note_hook_registered(what):
    """A module hook or a hook point's hook was just registered (npformer.nn calls this; `what`
    says which): kept by the step being recorded in this thread, if any, as Python of the step
    (the hook) that a replay would not run (npformer.recorded then runs the step eagerly)."""
    recorder = current()
    if recorder is not None and recorder.hook_registered is None:
        recorder.hook_registered = what


def _op_applied(op, ctx, args, options, outputs):
    recorder = current()
    if recorder is not None:
        recorder.events.append(_Op(op, ctx, args, options, outputs))


_LIBRARY = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep
                 for m in (sys.modules["autograd"], sys.modules[__name__.split(".")[0]]))


def _host_read():
    """The core's host_read hook while recording: the first read of a step being recorded (outside
    a recomputed() call) is kept as "file:line (in function)" of the first frame outside npformer
    and autograd (the user's line; the library's own when none)."""
    recorder = current()
    if recorder is None or recorder.host_read is not None:
        return
    frame = where = sys._getframe(1)
    while frame is not None:
        if not os.path.abspath(frame.f_code.co_filename).startswith(_LIBRARY):
            where = frame
            break
        frame = frame.f_back
    code = where.f_code
    recorder.host_read = f"{code.co_filename}:{where.f_lineno} (in {code.co_name})"


def _check_arrays(named, owner, known, produced, params):
    """RuntimeError for the first of `named` [(name, value)] that a replay would read stale: an
    array (or a Tensor's, or one in a tuple) whose memory is none of `known`, unless the Tensor is
    an earlier op's output or a parameter (whose data a replay reads anew)."""
    for name, value in named:
        if isinstance(value, Tensor):
            if id(value) in produced or id(value) in params:
                continue
            value = value.data
        for array in _arrays(value):
            if id(memory_owner(array)) not in known:
                raise RuntimeError(
                    f"recorded step: {name} of {owner} is an array {array.shape} {array.dtype} computed outside the "
                    "recorded ops (not an input of the step, a parameter or buffer of the model, an op's output or "
                    "a recomputed result): a replay would reuse its first values. Make it with ops, compute it "
                    "inside autograd.raw_computation(fn, *arrays), or run this step eagerly")


def _arrays(value):
    """The arrays in an option or argument: itself, or those of a tuple or list."""
    if backend.is_array(value):
        return (value,)
    if isinstance(value, (tuple, list)):
        return tuple(v for v in value if backend.is_array(v))
    return ()


class _Op:
    """An op of the recorded step: `forward` run again on its arguments' arrays of the moment."""

    def __init__(self, op, ctx, args, options, outputs):
        self.op, self.ctx, self.args, self.options, self.outputs = op, ctx, args, options, outputs
        self.node = outputs[0].creator is ctx                 # in the graph: its saved state is renewed
        self.tensors = [i for i, a in enumerate(args) if isinstance(a, Tensor)]
        self.draws = []                                       # (option, draw) whose offset each replay moves

    def takes(self, draw):
        """The option of this op that holds `draw`'s (seed, offset), or None."""
        options = self.options
        if options.get("seed") == draw.seed and options.get("offset") == draw.offset:
            return "offset"
        dropout = options.get("dropout")   # (p, seed, offset, state): memory-efficient attention
        if isinstance(dropout, tuple) and len(dropout) == 4 and dropout[1:3] == (draw.seed, draw.offset):
            return "dropout"
        return None

    def run(self):
        raw = list(self.args)
        for i in self.tensors:
            raw[i] = raw[i].data
        options = self.options
        if self.draws:
            options = dict(options)
            for name, draw in self.draws:
                seed, offset = draw.now
                if name == "offset":
                    options["seed"], options["offset"] = seed, offset
                else:
                    p, _, _, state = options["dropout"]
                    options["dropout"] = (p, seed, offset, state)
        ctx = self.ctx
        outputs = self.op.forward(ctx, *raw, **options)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        if not all(map(backend.is_array, outputs)):  # numbers become arrays, as in apply
            outputs = output_arrays(self.op, outputs, raw)
        for t, o in zip(self.outputs, outputs):
            t.data = o
        if self.node:  # what backward reads: the arrays forward got, the versions it saw
            ctx.input_arrays = raw
            ctx.versions = tuple([0 if a is None else (a if a._base is None else a._base)._version
                                  for a in ctx.inputs])


class _Raw:
    """A recomputed() call: fn run again, its values copied into the first call's arrays."""

    def __init__(self, fn, args, result):
        self.fn, self.args, self.result = fn, args, result

    def run(self):
        _copy_into(self.result, self.fn(*self.args), self.fn)


def _copy_into(old, new, fn):
    if isinstance(old, tuple) and isinstance(new, tuple) and len(old) == len(new):
        for o, n in zip(old, new):
            _copy_into(o, n, fn)
    elif backend.is_array(old) and backend.is_array(new) and old.shape == new.shape and old.dtype == new.dtype:
        if new is not old:
            backend.get_array_module(old).copyto(old, new)
    elif not (old is None and new is None):
        raise RuntimeError(f"a recorded step's {getattr(fn, '__name__', fn)} gave {_describe(new)} where it gave "
                           f"{_describe(old)} when recorded: its shapes and dtypes must not change between replays")


def _describe(value):
    return f"an array {value.shape} {value.dtype}" if backend.is_array(value) else type(value).__name__


class _Draw:
    """Values reserved from a Philox stream: each replay reserves as many, at the stream's offset then."""

    def __init__(self, stream, n, offset):
        self.stream, self.n, self.seed, self.offset = stream, n, stream.seed, offset
        self.now = (self.seed, offset)
        self.taken = False

    def run(self):
        offset = self.stream._reserve(self.n)          # first: it reseeds a stream that manual_seed reset
        self.now = (self.stream.seed, offset)


class Recorder:
    """The ops, recomputed calls and draws of one step (see the module docstring)."""

    def __init__(self):
        self.events = []
        self.host_read = None   # where the step first read a value on the host ("file:line (in function)"), or None
        self.hook_registered = None  # the first module or hook-point hook the step registered (a phrase), or None

    def __enter__(self):
        if _local.recorder is not None:
            raise RuntimeError("a step is already being recorded in this thread")
        _local.recorder = self
        with _recording_lock:
            _recording[0] += 1
            if _recording[0] == 1:
                hooks.op_applied.append(_op_applied)
                hooks.raw_computation.append(_raw_computation)
                hooks.host_read.append(_host_read)
        return self

    def __exit__(self, *exc):
        _local.recorder = None
        with _recording_lock:
            _recording[0] -= 1
            if _recording[0] == 0:
                hooks.op_applied.remove(_op_applied)
                hooks.raw_computation.remove(_raw_computation)
                hooks.host_read.remove(_host_read)
        return False

    def tensor_hooked(self):
        """Whether a tensor the step made got a hook (`Tensor.register_hook`, kept on its op's node):
        Python of the step (registering it, and the hook itself) that a replay would not run again."""
        return any(isinstance(e, _Op) and e.node and e.ctx.grad_hooks for e in self.events)

    def check(self, known, parameters, outputs=()):
        """Refuse (RuntimeError) a recording that a replay would get wrong: an op input or option
        array that is not an earlier op's output, a recomputed result, a Tensor of `parameters`, or
        memory whose owner's id is in `known` (the step's inputs, the model's parameters and
        state); a draw that no later op's options took; among `outputs` (what the step returns
        beside its loss), a Tensor no op made, an array not made by an op or a recomputed call, or
        anything else (a number would be the first call's at every replay). Then link each draw
        to its op."""
        known, produced = set(known), set()
        params = {id(p) for p in parameters}
        pending = []
        for event in self.events:
            if isinstance(event, _Draw):
                pending.append(event)
            elif isinstance(event, _Raw):
                _check_arrays([(f"argument {i}", a) for i, a in enumerate(event.args)],
                              f"the recomputed {getattr(event.fn, '__name__', event.fn)}", known, produced, params)
                known.update(id(memory_owner(a)) for a in _arrays(event.result))
            else:
                self._check_op(event, known, produced, params)
                for draw in pending:
                    name = event.takes(draw)
                    if name is not None and not draw.taken:
                        draw.taken = True
                        event.draws.append((name, draw))
                pending = [d for d in pending if not d.taken]
                produced.update(id(t) for t in event.outputs)
                known.update(id(memory_owner(t.data)) for t in event.outputs)
        if pending:
            raise RuntimeError(f"recorded step: {pending[0].n} random values were drawn outside an op's options "
                               "(each replay would reuse the same mask); draw them inside autograd.raw_computation(...)")
        for i, value in enumerate(outputs, 1):
            if isinstance(value, Tensor) and id(value) in produced:
                continue
            if backend.is_array(value) and id(memory_owner(value)) in known:
                continue
            raise RuntimeError(f"recorded step: output {i} ({_describe(value)}) is not an op's output or a "
                               "recomputed array: a replay would return its first value")

    @staticmethod
    def _check_op(event, known, produced, params):
        _check_arrays([(f"argument {i}", a) for i, a in enumerate(event.args)] +
                      [(f"option {k!r}", v) for k, v in event.options.items()], op_name(event.op), known, produced,
                      params)

    def replay(self):
        """Run the recorded step again (see the module docstring)."""
        for event in self.events:
            event.run()


class Backward:
    """The backward pass of a recorded graph, retained (`run()` for each replay): the engine's own
    pass (autograd.function.run_backward, first order, into `.grad`, hooks and retained gradients
    included), given the order of its nodes worked out once (`autograd.function.backward_order`)."""

    def __init__(self, loss):
        self.loss, self.order = loss, backward_order([loss.creator])

    @classmethod
    def of(cls, loss):
        return cls(loss)

    def run(self):
        loss = self.loss
        hooks.run(hooks.backward_started)
        run_backward([loss], [loss.xp.ones_like(loss.data)], retain_graph=True, order=self.order)
