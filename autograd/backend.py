"""The one place that chooses the array library.

Devices: ``"cpu"`` (numpy), ``"cuda"`` (cupy, optional) and those added by `register_device`:
npformer's runtime adds ``"test"``, numpy memory presented as a second device and held to CuPy's
rules (`npformer.runtime.testdevice`), so device propagation, mixed-device errors and the GPU code
paths (fused kernels included) are tested on machines without a GPU. Every op asks
``get_array_module(*arrays)`` for its ``xp``.
"""
from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy

try:  # optional GPU backend
    import cupy
except Exception:  # ImportError, or a CUDA driver that fails to load
    cupy = None

DEVICES = ("cpu", "cuda")  # and then each device of register_device, in the order registered

# Names for type hints (documentation only; nothing checks them at run time):
Array = Any      # an array of some backend: numpy.ndarray, cupy.ndarray or a registered device's (the "test" device's)
ArrayLike = Any  # what becomes an array: an Array, an autograd.Tensor, nested lists, a number
DType = Any      # a dtype or its name: numpy.float32, "float32"


class _Device(NamedTuple):
    """A device added by `register_device`."""
    array_type: type
    xp: Any                                  # its array module
    to_host: Callable[[Any], Any]            # array -> a numpy copy
    from_host: Callable[[Any, Any], Any]     # (array or None, numpy array) -> that array, or a new one


_registered: dict[str, _Device] = {}  # name -> device, in the order registered
_registered_types: tuple[type, ...] = ()  # their array types, for one isinstance on the hot path


def register_device(name: str, array_type: type, xp: Any, to_host: Callable[[Any], Any],
                    from_host: Callable[[Any, Any], Any]) -> None:
    """Add the device `name` beside "cpu" and "cuda": its arrays are the instances of
    `array_type`, `xp` is their array module, `to_host(array)` returns a numpy copy of one, and
    `from_host(dst, host)` copies the numpy array `host` into `dst` in place (returning it) or, when
    dst is None, into a new array of the device. npformer's "test" device registers itself so."""
    global DEVICES, _registered_types
    if name in ("cpu", "cuda"):
        raise ValueError(f"register_device: name must not be 'cpu' or 'cuda' (built in), got {name!r}")
    _registered[name] = _Device(array_type, xp, to_host, from_host)
    DEVICES = ("cpu", "cuda") + tuple(_registered)
    _registered_types = tuple(d.array_type for d in _registered.values())


def _registered_device(array):
    """The name and _Device of the registered device holding `array`, or None."""
    for name, device in _registered.items():
        if isinstance(array, device.array_type):
            return name, device
    return None


def cuda_available():
    """True when cupy imports and sees at least one GPU."""
    if cupy is None:
        return False
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


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
    if isinstance(array, _registered_types):
        return _registered_device(array)[0]
    if cupy is not None and isinstance(array, cupy.ndarray):
        return "cuda"
    return "cpu"


def module_for(device):
    """The array module (xp) of a device name."""
    _check_device(device)
    return numpy if device == "cpu" else cupy if device == "cuda" else _registered[device].xp


def get_array_module(*arrays: Any) -> types.ModuleType:
    """numpy, cupy or the test-device module, chosen by the arrays (like cupy.get_array_module):
    the module of the first array that is not a numpy array, else numpy. Non-arrays are ignored."""
    for a in arrays:
        if isinstance(a, _registered_types):
            return _registered_device(a)[1].xp
        if cupy is not None and isinstance(a, cupy.ndarray):
            return cupy
    return numpy


def is_array(x):
    return (isinstance(x, numpy.ndarray) or (cupy is not None and isinstance(x, cupy.ndarray))
            or isinstance(x, _registered_types))


def overflow_ignored() -> Any:
    """A context manager within which numpy warns of no overflow (CuPy warns of none anyway): for
    math that overflows on purpose, e.g. to an infinity whose tanh is the limit wanted."""
    return numpy.errstate(over="ignore")


def invalid_ignored() -> Any:
    """A context manager within which numpy warns of no invalid operation (inf - inf, 0 / 0; CuPy
    warns of none anyway): for comparisons that judge NaN and inf where they land."""
    return numpy.errstate(invalid="ignore")


def memory_owner(array: Any) -> Any:
    """The array that owns `array`'s memory (numpy's and CuPy's views name it in `.base`): two
    arrays with one owner may share memory (a view and its base, two views of one array)."""
    while getattr(array, "base", None) is not None:
        array = array.base
    return array


def to_device(array, device):
    """Copy (or view) an array onto a device."""
    _check_device(device)
    if device_of(array) == device:
        return array
    host = as_numpy(array)
    if device == "cuda":
        return cupy.asarray(host)
    return _registered[device].from_host(None, host) if device in _registered else host


def as_numpy(array):
    """A plain numpy array holding the same values, wherever the array lives."""
    if cupy is not None and isinstance(array, cupy.ndarray):
        return cupy.asnumpy(array)
    if isinstance(array, _registered_types):
        return _registered_device(array)[1].to_host(array)  # a copy, as from a GPU
    return numpy.asarray(array)


def copy_from_host(dst, host):
    """Write the host (numpy) array `host` into the existing device array `dst` of the same shape
    and dtype, in place: a host-to-device copy (numpy.copyto on the CPU)."""
    if cupy is not None and isinstance(dst, cupy.ndarray):
        dst.set(numpy.ascontiguousarray(host, dtype=dst.dtype))
    elif isinstance(dst, _registered_types):
        _registered_device(dst)[1].from_host(dst, host)
    else:
        numpy.copyto(dst, host)
