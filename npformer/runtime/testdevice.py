"""The "test" device: numpy memory presented as a second device and held to CuPy's rules, so
that device propagation, mixed-device errors and the GPU code paths are tested on machines
without a GPU. It registers itself with the backend switch (`autograd.backend.register_device`),
which then hands out `test_xp` as the array module of "test" arrays.

CuPy's rules kept here: a host numpy array beside device arrays in an op is an error; reductions
and integer indexing give 0-d arrays, not numpy scalars; out-of-bounds integer-array indices wrap
around (CuPy's documented "wrap" mode) instead of raising; transfers copy.

Transfers are counted (`transfers`): every device-to-host read (`as_numpy`, `bool(a)`, `int(a)`,
`float(a)`, `a.item()`, `a.tolist()`, printing) and every host-to-device copy, so tests can
assert that a training step never waits for the device.

Graph capture is emulated (`Capture`): while capturing, every operation on test arrays is
executed and recorded (an xp call, a ufunc, an indexing or array method that makes new data or
writes), host transfers and operations that synchronise a GPU raise (as inside a CUDA stream
capture), and at the end the memory that existed before the capture is restored: like a captured
CUDA graph, the capture itself changes nothing. `replay()` re-executes the record on the same
arrays, with the values they hold then, without running the Python code that made it.
"""
import collections
import threading
import types

import numpy

from autograd import backend

transfers = collections.Counter()  # "device_to_host" / "host_to_device" -> count, and per kind of read


class TransferDuringCapture(RuntimeError):
    """A host transfer or a synchronising operation inside a graph capture."""


class TestDeviceArray(numpy.ndarray):
    """numpy memory on the pretend device "test", held to CuPy's rules so that code passing
    here runs on a GPU: mixing it with a host numpy array in an op raises TypeError (as CuPy's
    "Unsupported type"), reductions and integer indexing give 0-d arrays where numpy gives
    scalars, integer-array indices wrap, and transfers copy (and are counted). Calling a numpy
    function on it directly (not through test_xp) raises TypeError too: ops take their array
    module from their inputs."""

    __test__ = False  # not a pytest class

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        outs = kwargs.get("out", ())
        outermost = not _in_xp_call()
        if outermost:
            _refuse_host_arrays(f"{ufunc.__name__}.{method}", inputs + outs)
        if method == "at":  # ufunc.at(a, indices, b) writes a; its indices wrap as in a[indices]
            _before_write(inputs[0])
            index = inputs[1]
            inputs = (inputs[0], _wrapped(inputs[0], index)) + inputs[2:]
        inputs = tuple(_host(x) for x in inputs)
        if outs:
            kwargs["out"] = tuple(_host(o) for o in outs)
            _before_write(*outs)
        result = getattr(ufunc, method)(*inputs, **kwargs)
        result = outs[0] if len(outs) == 1 else outs if outs else _to_test(result)
        if outermost and method == "at":
            target = inputs[0]
            _record(lambda: ufunc.at(target, _host(_wrapped(target, index)), *inputs[2:]), None)
        elif outermost:
            _record(lambda: getattr(ufunc, method)(*inputs, **kwargs), None if outs else result)
        return result

    def __array_function__(self, func, types, args, kwargs):
        if not _in_xp_call():
            raise TypeError(f"numpy.{func.__name__} was called on an array of device 'test': call it through "
                            "the array module of the data (xp = get_array_module(x)), or copy the data to the "
                            "host with as_numpy(x)")
        return super().__array_function__(func, types, args, kwargs)

    def __getitem__(self, index):
        _refuse_boolean_index("indexing with a boolean mask", index)
        result = _to_test(super().__getitem__(_wrapped(self, index)))
        if not _in_xp_call() and _new_memory(result, self):
            # a copy (integer-array indexing); the indices are wrapped again at each replay
            _record(lambda: numpy.ndarray.__getitem__(self, _wrapped(self, index)), result)
        return result

    def __setitem__(self, index, value):
        _refuse_host_arrays("__setitem__", (value,))
        _refuse_boolean_index("assignment through a boolean mask", index)
        _before_write(self)
        super().__setitem__(_wrapped(self, index), value)
        if not _in_xp_call():
            _record(lambda: numpy.ndarray.__setitem__(self, _wrapped(self, index), value), None)

    # reading values on the host: device-to-host transfers
    def __bool__(self):
        return numpy.ndarray.__bool__(_read(self, "bool"))

    def __int__(self):
        return numpy.ndarray.__int__(_read(self, "int"))

    def __float__(self):
        return numpy.ndarray.__float__(_read(self, "float"))

    def __complex__(self):
        return numpy.ndarray.__complex__(_read(self, "complex"))

    def __index__(self):
        return numpy.ndarray.__index__(_read(self, "index"))

    def item(self, *args):
        return numpy.ndarray.item(_read(self, "item"), *args)

    def tolist(self):
        return numpy.ndarray.tolist(_read(self, "tolist"))

    def tobytes(self, order="C"):
        return numpy.ndarray.tobytes(_read(self, "tobytes"), order)

    def __repr__(self):
        return numpy.ndarray.__repr__(_read(self, "repr"))

    def __str__(self):
        return numpy.ndarray.__str__(_read(self, "str"))

    def __format__(self, spec):
        return numpy.ndarray.__format__(_read(self, "format"), spec)

    # array methods that make new data without a ufunc, or write: recorded while capturing
    def astype(self, *args, **kwargs):
        return _method(self, "astype", args, kwargs)

    def copy(self, *args, **kwargs):
        return _method(self, "copy", args, kwargs)

    def reshape(self, *args, **kwargs):
        return _method(self, "reshape", args, kwargs)

    def ravel(self, *args, **kwargs):
        return _method(self, "ravel", args, kwargs)

    def flatten(self, *args, **kwargs):
        return _method(self, "flatten", args, kwargs)

    def argmax(self, *args, **kwargs):
        return _method(self, "argmax", args, kwargs)

    def argmin(self, *args, **kwargs):
        return _method(self, "argmin", args, kwargs)

    def argsort(self, *args, **kwargs):
        return _method(self, "argsort", args, kwargs)

    def take(self, *args, **kwargs):
        return _method(self, "take", args, kwargs)

    def repeat(self, *args, **kwargs):
        return _method(self, "repeat", args, kwargs)

    def dot(self, *args, **kwargs):
        return _method(self, "dot", args, kwargs)

    def fill(self, value):
        return _method(self, "fill", (value,), {}, writes=True)

    def put(self, *args, **kwargs):
        return _method(self, "put", args, kwargs, writes=True)

    def sort(self, *args, **kwargs):
        return _method(self, "sort", args, kwargs, writes=True)

    def nonzero(self):
        _refuse_during_capture("nonzero (the number of nonzero entries is read on the host)")
        return _to_test(numpy.ndarray.nonzero(self))


_calls = threading.local()  # .depth: calls through test_xp running in this thread; .capture: the Capture


def _in_xp_call():
    return getattr(_calls, "depth", 0) > 0


def _host(x):
    return x.view(numpy.ndarray) if isinstance(x, TestDeviceArray) else x


def _refuse_host_arrays(op, values):
    for v in values:
        if isinstance(v, (list, tuple)):
            _refuse_host_arrays(op, v)
        elif isinstance(v, numpy.ndarray) and not isinstance(v, TestDeviceArray):
            raise TypeError(f"{op}: got a host numpy array {v.shape} beside arrays of device 'test'; "
                            "move it with to_device(array, 'test') (CuPy, too, refuses numpy arrays)")


def _wrapped(array, index):
    """CuPy's rule for integer-array indices: out-of-bounds ones wrap around (index mod size)."""
    parts = index if isinstance(index, tuple) else (index,)
    if any(p is Ellipsis or p is None for p in parts) or len(parts) > array.ndim:
        return index

    def wrap(p, size):
        if not (isinstance(p, numpy.ndarray) and p.dtype.kind in "iu" and size and p.size):
            return p
        host = p.view(numpy.ndarray)
        if host.min() >= -size and host.max() < size:
            return p
        return (host.astype(numpy.int64) % size).view(type(p))
    wrapped = tuple(wrap(p, array.shape[axis]) for axis, p in enumerate(parts))
    return wrapped if isinstance(index, tuple) else wrapped[0]


def _refuse_boolean_index(what, index):
    parts = index if isinstance(index, tuple) else (index,)
    if any(isinstance(p, numpy.ndarray) and p.dtype == bool for p in parts):
        _refuse_during_capture(f"{what} (the number of selected entries is read on the host)")


def _new_memory(result, array):
    """While capturing: `result` is an array in memory of its own (a copy, not a view of `array`)."""
    return (_capture() is not None and isinstance(result, numpy.ndarray)
            and not numpy.may_share_memory(_host(result), _host(array)))


def _method(array, name, args, kwargs, writes=False):
    if writes:
        _before_write(array)
    method = getattr(numpy.ndarray, name)
    result = _to_test(method(array, *args, **kwargs))
    if not _in_xp_call() and (writes or _new_memory(result, array)):
        _record(lambda: method(array, *args, **kwargs), None if writes else result)
    return result


class _OnTestDevice:
    """Proxy of numpy (or one of its functions, submodules, generators) whose results land on
    "test". `names_used` records every name looked up through it, e.g. "numpy.random.default_rng",
    so that tests can check that each one exists in CuPy."""

    names_used = set()
    _HOST_TO_DEVICE = ("numpy.asarray", "numpy.array")  # copies host data onto the device
    _SYNCHRONISING = ("numpy.nonzero", "numpy.flatnonzero", "numpy.argwhere", "numpy.unique", "numpy.extract",
                      "numpy.compress")  # the size of the result is read on the host
    _WRITES_FIRST_ARGUMENT = ("numpy.copyto", "numpy.put", "numpy.place", "numpy.putmask")

    def __init__(self, target, name):
        self._target, self._name = target, name

    def __getattr__(self, name):
        full_name = f"{self._name}.{name}"
        self.names_used.add(full_name)
        attr = getattr(self._target, name)
        if isinstance(attr, type) or not (callable(attr) or isinstance(attr, types.ModuleType)):
            return attr  # dtypes, classes and constants pass through
        return _OnTestDevice(attr, full_name)

    def __call__(self, *args, **kwargs):
        host_data, target, at = False, self._target, self._name.endswith(".at")
        if at:  # ufunc.at(a, indices, b): indices may be host arrays, as in a[indices]
            _refuse_host_arrays(self._name, args[:1] + args[2:])
        elif self._name not in self._HOST_TO_DEVICE:
            _refuse_host_arrays(self._name, args + tuple(kwargs.values()))
        else:
            host_data = bool(args) and not isinstance(args[0], TestDeviceArray)

        def run():  # the indices of ufunc.at wrap as in a[indices], with the values they hold now
            if at and len(args) > 1 and isinstance(args[0], numpy.ndarray):
                return target(args[0], _wrapped(args[0], args[1]), *args[2:], **kwargs)
            return target(*args, **kwargs)
        outermost = not _in_xp_call()
        if outermost:
            if host_data:
                _refuse_during_capture(f"{self._name} of host data (a host-to-device copy)")
            if self._name in self._SYNCHRONISING:
                _refuse_during_capture(f"{self._name} (the size of its result is read on the host)")
            if self._name.startswith("numpy.random."):
                _refuse_during_capture(f"{self._name}: a generator's draws would repeat at every replay (its state "
                                       "is host memory); draw from a Philox stream, "
                                       "npformer.runtime.random.Philox.draw")
            has_out = kwargs.get("out") is not None
            written = [kwargs["out"]] if has_out else []
            if args and (self._name in self._WRITES_FIRST_ARGUMENT or at):
                written.append(args[0])
            _before_write(*written)
        _calls.depth = getattr(_calls, "depth", 0) + 1
        try:
            result = _to_test(run())
        finally:
            _calls.depth -= 1
        if outermost:
            if self._name.endswith((".empty", ".empty_like")):  # allocations run no kernel
                _allocated(result)
            else:
                produced = result if isinstance(result, (numpy.ndarray, tuple)) and not has_out else None
                _record(run, produced)
        return result

    def __repr__(self):
        return f"<test-device proxy of {self._name}>"


def _to_test(result):
    if isinstance(result, (numpy.ndarray, numpy.generic)) and not isinstance(result, TestDeviceArray):
        return numpy.asarray(result).view(TestDeviceArray)
    if isinstance(result, numpy.random.Generator):
        return _OnTestDevice(result, "numpy.random.Generator")
    if isinstance(result, tuple):
        return tuple(_to_test(r) for r in result)
    return result


test_xp = _OnTestDevice(numpy, "numpy")


# -- transfers ----------------------------------------------------------------------------------------
def _read(array, how):
    """A device-to-host read of `array` (counted; refused while capturing); its host view."""
    if not _in_xp_call():
        _refuse_during_capture(f"reading a value on the host ({how}): the current stream is capturing, so "
                               "device-to-host transfers are disallowed")
        transfers["device_to_host"] += 1
        transfers[f"device_to_host:{how}"] += 1
    return array.view(numpy.ndarray)


def to_host(array):
    """A host copy of a test array: a device-to-host transfer."""
    return _read(array, "as_numpy").copy()


def from_host(dst, host):
    """A host-to-device copy of `host`: into the test array `dst` in place, or a new test array
    (dst None). Counted; refused while capturing."""
    _refuse_during_capture("a host-to-device copy")
    transfers["host_to_device"] += 1
    if dst is None:
        return numpy.array(host).view(TestDeviceArray)
    numpy.copyto(dst.view(numpy.ndarray), host)
    return dst


backend.register_device("test", TestDeviceArray, test_xp, to_host, from_host)


# -- graph capture ---------------------------------------------------------------------------------
class Capture:
    """The emulated capture of a step on the test device (see the module docstring):

        capture = Capture()
        with capture:            # the step runs, is recorded, and leaves no trace in older memory
            outputs = step()
        capture.replay()         # the step again, on the arrays' current values
    """

    def __init__(self):
        self.ops = []          # (fn, result): fn() recomputes; its value is copied into result
        self._saved = {}       # id(root) -> (root, copy): memory from before the capture, written in it
        self._made = {}        # id(root) -> root: memory the capture made (no need to restore)
        self._errors = None

    def __enter__(self):
        if getattr(_calls, "capture", None) is not None:
            raise RuntimeError("a test-device capture is already in progress in this thread")
        _calls.capture = self
        # memory that the replays fill in first (e.g. the dropout stream's device state) holds
        # garbage while capturing, as a GPU's would: its arithmetic may overflow, harmlessly
        self._errors = numpy.errstate(all="ignore")
        self._errors.__enter__()
        return self

    def __exit__(self, *exc):
        _calls.capture = None
        self._errors.__exit__(*exc)
        for root, saved in self._saved.values():   # the capture ran nothing: older memory as it was
            numpy.copyto(root.view(numpy.ndarray), saved)
        self._saved.clear()
        return False

    def replay(self):
        """Re-execute the recorded step on the arrays' current values."""
        _calls.depth = getattr(_calls, "depth", 0) + 1   # numpy calls below act for test_xp
        try:
            for fn, result in self.ops:
                value = fn()
                for old, new in _pairs(result, value):
                    if old.shape != numpy.shape(new):
                        raise RuntimeError(f"replay: an operation of the captured step now gives shape "
                                           f"{numpy.shape(new)} instead of {old.shape}")
                    numpy.copyto(old.view(numpy.ndarray), _host(new))
        finally:
            _calls.depth -= 1


def _pairs(result, value):
    if isinstance(result, tuple):
        return [p for r, v in zip(result, value) for p in _pairs(r, v)]
    if isinstance(result, numpy.ndarray) and result is not value:
        return [(result, value)]
    return []


def _capture():
    return getattr(_calls, "capture", None)


def _refuse_during_capture(what):
    if _capture() is not None:
        raise TransferDuringCapture(f"{what} inside a graph capture of device 'test' (as inside a CUDA "
                                    "stream capture, where it would fail or make the graph wrong)")


def _root(array):
    """The array that owns the memory of `array` (its base of bases)."""
    while isinstance(array.base, numpy.ndarray):
        array = array.base
    return array


def _allocated(result):
    capture = _capture()
    if capture is not None and isinstance(result, numpy.ndarray):
        root = _root(result)
        capture._made[id(root)] = root


def _record(fn, result):
    capture = _capture()
    if capture is None:
        return
    capture.ops.append((fn, result))
    for r in (result if isinstance(result, tuple) else (result,)):
        _allocated(r)


def _before_write(*arrays):
    """Keep a copy of memory from before the capture that the capture is about to write."""
    capture = _capture()
    if capture is None:
        return
    for a in arrays:
        for array in (a if isinstance(a, tuple) else (a,)):
            if isinstance(array, numpy.ndarray):
                root = _root(array)
                if id(root) not in capture._made and id(root) not in capture._saved:
                    capture._saved[id(root)] = (root, root.view(numpy.ndarray).copy())
