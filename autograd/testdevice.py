"""The "test" device: numpy memory presented as a second device and held to CuPy's rules, so
that device propagation, mixed-device errors and the GPU code paths (fused kernels included)
are tested on machines without a GPU. `autograd.backend` hands out `test_xp` as the array
module of "test" arrays."""
import threading
import types

import numpy


class TestDeviceArray(numpy.ndarray):
    """numpy memory on the pretend device "test", held to CuPy's rules so that code passing
    here runs on a GPU: mixing it with a host numpy array in an op raises TypeError (as CuPy's
    "Unsupported type"), reductions give 0-d arrays where numpy gives scalars, and transfers
    copy. Calling a numpy function on it directly (not through test_xp) raises TypeError too:
    ops take their array module from their inputs."""

    __test__ = False  # not a pytest class

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        outs = kwargs.get("out", ())
        if not _in_xp_call():
            _refuse_host_arrays(f"{ufunc.__name__}.{method}", inputs + outs)
        inputs = tuple(_host(x) for x in inputs)
        if outs:
            kwargs["out"] = tuple(_host(o) for o in outs)
        result = getattr(ufunc, method)(*inputs, **kwargs)
        if outs:
            return outs[0] if len(outs) == 1 else outs
        return _to_test(result)

    def __array_function__(self, func, types, args, kwargs):
        if not _in_xp_call():
            raise TypeError(f"numpy.{func.__name__} was called on an array of device 'test': call it through "
                            "the array module of the data (xp = get_array_module(x)), or copy the data to the "
                            "host with as_numpy(x)")
        return super().__array_function__(func, types, args, kwargs)

    def __setitem__(self, index, value):
        _refuse_host_arrays("__setitem__", (value,))
        super().__setitem__(index, value)


_calls = threading.local()  # .depth: calls through test_xp running in this thread


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


class _OnTestDevice:
    """Proxy of numpy (or one of its functions, submodules, generators) whose results land on
    "test". `names_used` records every name looked up through it, e.g. "numpy.random.default_rng",
    so that tests can check that each one exists in CuPy."""

    names_used = set()
    _HOST_TO_DEVICE = ("numpy.asarray", "numpy.array")  # copies host data onto the device

    def __init__(self, target, name):
        self._target, self._name = target, name

    def __getattr__(self, name):
        full_name = f"{self._name}.{name}"
        self.names_used.add(full_name)
        if full_name == "numpy.ElementwiseKernel":
            return _HostElementwiseKernel
        attr = getattr(self._target, name)
        if isinstance(attr, type) or not (callable(attr) or isinstance(attr, types.ModuleType)):
            return attr  # dtypes, classes and constants pass through
        return _OnTestDevice(attr, full_name)

    def __call__(self, *args, **kwargs):
        if self._name.endswith(".at"):  # ufunc.at(a, indices, b): indices may be host arrays, as in a[indices]
            _refuse_host_arrays(self._name, args[:1] + args[2:])
        elif self._name not in self._HOST_TO_DEVICE:
            _refuse_host_arrays(self._name, args + tuple(kwargs.values()))
        _calls.depth = getattr(_calls, "depth", 0) + 1
        try:
            return _to_test(self._target(*args, **kwargs))
        finally:
            _calls.depth -= 1

    def __repr__(self):
        return f"<test-device proxy of {self._name}>"


class _HostElementwiseKernel:
    """cupy.ElementwiseKernel(in_params, out_params, operation, name) for the test device: the
    same C body, run by numpy over whole arrays, so that a fused kernel's math is tested on
    every machine. Bodies must keep to the part of C that is also Python: `name = expression;`
    statements over the parameters, with arithmetic and sqrt/exp/log/tanh (and no float
    literals, which C would take as double). Parameters are "T name" (T: the dtype of the first
    array passed for a T) or "float32 name"; arrays are not "raw". Outputs may be read."""

    FUNCTIONS = {f: getattr(numpy, f) for f in ("sqrt", "exp", "log", "tanh")}

    def __init__(self, in_params, out_params, operation, name="kernel", **options):
        self.params = [tuple(p.split()) for p in f"{in_params}, {out_params}".split(",")]
        self.n_in = in_params.count(",") + 1
        self.code = compile(operation, name, "exec")

    def __call__(self, *args):
        types = {}
        for (ptype, _), a in zip(self.params, args):
            if isinstance(a, numpy.ndarray):
                types.setdefault(ptype, a.dtype)
        values = {name: (a if isinstance(a, numpy.ndarray) else numpy.dtype(types.get(ptype, ptype)).type(a))
                  for (ptype, name), a in zip(self.params, args)}
        exec(self.code, {"__builtins__": {}, **self.FUNCTIONS}, values)
        outs = args[self.n_in:]
        for (_, name), out in zip(self.params[self.n_in:], outs):
            out[...] = values[name]
        return outs[0] if len(outs) == 1 else outs


def _to_test(result):
    if isinstance(result, (numpy.ndarray, numpy.generic)) and not isinstance(result, TestDeviceArray):
        return numpy.asarray(result).view(TestDeviceArray)
    if isinstance(result, numpy.random.Generator):
        return _OnTestDevice(result, "numpy.random.Generator")
    if isinstance(result, tuple):
        return tuple(_to_test(r) for r in result)
    return result


test_xp = _OnTestDevice(numpy, "numpy")
