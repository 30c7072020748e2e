"""The one place that chooses the array library.

Devices: ``"cpu"`` (numpy), ``"cuda"`` (cupy, optional) and ``"test"``: numpy memory
presented as a second device, so device propagation and mixed-device errors are tested
on machines without a GPU. Every op asks ``get_array_module(*arrays)`` for its ``xp``.
"""
import types

import numpy

try:  # optional GPU backend
    import cupy
except Exception:  # ImportError, or a CUDA driver that fails to load
    cupy = None

DEVICES = ("cpu", "cuda", "test")


class TestDeviceArray(numpy.ndarray):
    """numpy array living on the pretend device "test"; numpy ops keep the subclass."""

    __test__ = False  # not a pytest class


class _OnTestDevice:
    """Proxy of numpy (or one of its functions, submodules, generators) whose results land on "test"."""

    def __init__(self, target):
        self._target = target

    def __getattr__(self, name):
        attr = getattr(self._target, name)
        if isinstance(attr, type) or not (callable(attr) or isinstance(attr, types.ModuleType)):
            return attr  # dtypes, classes and constants pass through
        return _OnTestDevice(attr)

    def __call__(self, *args, **kwargs):
        return _to_test(self._target(*args, **kwargs))

    def __repr__(self):
        return f"<test-device proxy of {self._target!r}>"


def _to_test(result):
    if isinstance(result, numpy.ndarray) and not isinstance(result, TestDeviceArray):
        return result.view(TestDeviceArray)
    if isinstance(result, numpy.random.Generator):
        return _OnTestDevice(result)
    if isinstance(result, tuple):
        return tuple(_to_test(r) for r in result)
    return result


test_xp = _OnTestDevice(numpy)


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
    return host.view(TestDeviceArray) if device == "test" else host


def as_numpy(array):
    """A plain numpy array holding the same values, wherever the array lives."""
    if cupy is not None and isinstance(array, cupy.ndarray):
        return cupy.asnumpy(array)
    array = numpy.asarray(array)
    return array.view(numpy.ndarray) if isinstance(array, TestDeviceArray) else array


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
