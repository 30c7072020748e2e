"""The one place that chooses the array library.

Devices: ``"cpu"`` (numpy), ``"cuda"`` (cupy, optional) and ``"test"``: numpy memory
presented as a second device and held to CuPy's rules, so device propagation, mixed-device
errors and the GPU code paths (fused kernels included) are tested on machines without a GPU.
Every op asks ``get_array_module(*arrays)`` for its ``xp``.
"""
import threading
import types

import numpy

try:  # optional GPU backend
    import cupy
except Exception:  # ImportError, or a CUDA driver that fails to load
    cupy = None

DEVICES = ("cpu", "cuda", "test")


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


_kernels = {}


def elementwise_kernel(xp, in_params, out_params, operation, name):
    """xp.ElementwiseKernel(in_params, out_params, operation, name), built once per array module:
    on CuPy one fused CUDA kernel; on the test device the same text run by numpy."""
    key = (xp, in_params, out_params, operation)
    if key not in _kernels:
        _kernels[key] = xp.ElementwiseKernel(in_params, out_params, operation, name)
    return _kernels[key]


def _to_test(result):
    if isinstance(result, (numpy.ndarray, numpy.generic)) and not isinstance(result, TestDeviceArray):
        return numpy.asarray(result).view(TestDeviceArray)
    if isinstance(result, numpy.random.Generator):
        return _OnTestDevice(result, "numpy.random.Generator")
    if isinstance(result, tuple):
        return tuple(_to_test(r) for r in result)
    return result


test_xp = _OnTestDevice(numpy, "numpy")


def cuda_available():
    """True when cupy imports and sees at least one GPU."""
    if cupy is None:
        return False
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def available_devices():
    return ("cpu", "test") + (("cuda",) if cuda_available() else ())


def _check_device(device):
    if device not in DEVICES:
        raise ValueError(f"device: expected one of {DEVICES}, got {device!r}")
    if device == "cuda" and not cuda_available():
        raise RuntimeError(
            "device 'cuda' was asked for but "
            + ("CuPy is not installed" if cupy is None else "CuPy finds no GPU")
            + ": install CuPy matching your CUDA, e.g. `pip install -e .[cuda12]` "
            "(cupy-cuda12x) or `pip install -e .[cuda13]` (cupy-cuda13x)")


def device_of(array):
    """'cpu', 'cuda' or 'test' for an array; Python and numpy scalars count as 'cpu'."""
    if isinstance(array, TestDeviceArray):
        return "test"
    if cupy is not None and isinstance(array, cupy.ndarray):
        return "cuda"
    return "cpu"


def module_for(device):
    """The array module (xp) of a device name."""
    _check_device(device)
    return {"cpu": numpy, "test": test_xp}.get(device) or cupy


def get_array_module(*arrays):
    """numpy, cupy or the test-device module, chosen by the arrays (like cupy.get_array_module)."""
    for a in arrays:
        if isinstance(a, TestDeviceArray):
            return test_xp
        if cupy is not None and isinstance(a, cupy.ndarray):
            return cupy
    return numpy


def is_array(x):
    return isinstance(x, numpy.ndarray) or (cupy is not None and isinstance(x, cupy.ndarray))


def to_device(array, device):
    """Copy (or view) an array onto a device."""
    _check_device(device)
    if device_of(array) == device:
        return array
    host = as_numpy(array)
    if device == "cuda":
        return cupy.asarray(host)
    return numpy.array(host).view(TestDeviceArray) if device == "test" else host  # a copy, as on a GPU


def as_numpy(array):
    """A plain numpy array holding the same values, wherever the array lives."""
    if cupy is not None and isinstance(array, cupy.ndarray):
        return cupy.asnumpy(array)
    if isinstance(array, TestDeviceArray):
        return array.view(numpy.ndarray).copy()  # a copy, as from a GPU
    return numpy.asarray(array)


# -- random numbers: one generator per device, reseeded together ------------------------
_generators = {}


def default_rng(seed=None, device="cpu"):
    """A new random Generator whose arrays live on `device`."""
    xp = module_for(device)
    return xp.random.default_rng(seed)


def manual_seed(seed):
    """Reseed the global generator of every device (like torch.manual_seed)."""
    _generators.clear()
    _generators["seed"] = int(seed)


def global_rng(device="cpu"):
    """The global generator of a device, used by dropout and initialisers."""
    if device not in _generators:
        seed = _generators.get("seed")
        if seed is not None:  # one independent stream per device from the one seed
            seed = int(numpy.random.SeedSequence([seed, DEVICES.index(device)]).generate_state(1)[0])
        _generators[device] = default_rng(seed, device)
    return _generators[device]
