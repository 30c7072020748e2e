"""The one place that chooses the array library.

Devices: ``"cpu"`` (numpy), ``"cuda"`` (cupy, optional) and ``"test"``: numpy memory
presented as a second device and held to CuPy's rules (`autograd.testdevice`), so device
propagation, mixed-device errors and the GPU code paths (fused kernels included) are tested on
machines without a GPU. Every op asks ``get_array_module(*arrays)`` for its ``xp``.
"""
from __future__ import annotations

import types
from typing import Any

import numpy

from . import testdevice
from .testdevice import TestDeviceArray, test_xp

try:  # optional GPU backend
    import cupy
except Exception:  # ImportError, or a CUDA driver that fails to load
    cupy = None

DEVICES = ("cpu", "cuda", "test")

# Names for type hints (documentation only; nothing checks them at run time):
Array = Any      # an array of some backend: numpy.ndarray, cupy.ndarray or the "test" device's TestDeviceArray
ArrayLike = Any  # what becomes an array: an Array, an autograd.Tensor, nested lists, a number
DType = Any      # a dtype or its name: numpy.float32, "float32"

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
    if isinstance(array, TestDeviceArray):
        return "test"
    if cupy is not None and isinstance(array, cupy.ndarray):
        return "cuda"
    return "cpu"


def module_for(device):
    """The array module (xp) of a device name."""
    _check_device(device)
    return {"cpu": numpy, "test": test_xp}.get(device) or cupy


def get_array_module(*arrays: Any) -> types.ModuleType:
    """numpy, cupy or the test-device module, chosen by the arrays (like cupy.get_array_module):
    the module of the first array that is not a numpy array, else numpy. Non-arrays are ignored."""
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
    return testdevice.from_host(None, host) if device == "test" else host


def as_numpy(array):
    """A plain numpy array holding the same values, wherever the array lives."""
    if cupy is not None and isinstance(array, cupy.ndarray):
        return cupy.asnumpy(array)
    if isinstance(array, TestDeviceArray):
        return testdevice.to_host(array)  # a copy, as from a GPU
    return numpy.asarray(array)


def copy_from_host(dst, host):
    """Write the host (numpy) array `host` into the existing device array `dst` of the same shape
    and dtype, in place: a host-to-device copy (numpy.copyto on the CPU)."""
    if cupy is not None and isinstance(dst, cupy.ndarray):
        dst.set(numpy.ascontiguousarray(host, dtype=dst.dtype))
    elif isinstance(dst, TestDeviceArray):
        testdevice.from_host(dst, host)
    else:
        numpy.copyto(dst, host)
