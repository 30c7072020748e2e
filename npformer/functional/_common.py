"""Helpers shared by the functional ops: unwrapping Tensors, argument checks, devices, and
the per-thread switch to the composite twins."""
import functools
import threading

from autograd import Tensor, backend, raw_computation
from autograd.checks import as_array, check_int
from npformer.runtime import deferred


class _Twins(threading.local):
    active = False  # this thread runs the composite twins (composite.installed())


_twins = _Twins()


def has_twin(op):
    """Decorate a public op that has a composite twin of the same name in
    npformer.functional.composite: inside `composite.installed()` the calls made by that
    thread go to the twin; other threads keep the fused op."""
    @functools.wraps(op)
    def dispatch(*args, **kwargs):
        if _twins.active:
            from . import composite  # composite imports the op modules: import it lazily
            return getattr(composite, op.__name__)(*args, **kwargs)
        return op(*args, **kwargs)
    return dispatch


def tensor_of(x):
    """`x` as a Tensor: itself, or a new leaf holding the array."""
    return x if isinstance(x, Tensor) else Tensor(x)


def data_of(x):
    """The raw array of a Tensor, or `x` itself."""
    return x.data if isinstance(x, Tensor) else x


def check_tensor(name, x, op, *, floating=True):
    """Raise TypeError unless `x` is a Tensor or an array (of a floating dtype when asked)."""
    raw = data_of(x)
    if not backend.is_array(raw):
        raise TypeError(f"{op}: {name} must be an autograd.Tensor or an array, got {type(x).__name__}")
    if floating and raw.dtype.kind != "f":
        raise TypeError(f"{op}: {name} must have a floating dtype, got {raw.dtype}")
    return raw


def check_one_dtype(op, *arrays):
    """TypeError unless the floating arrays (None aside) share one dtype, as torch requires: also
    where some are raw arrays, which Function.apply does not compare (it checks Tensors)."""
    first = arrays[0].dtype
    if any(a is not None and a.dtype != first for a in arrays):
        dtypes = sorted({str(a.dtype) for a in arrays if a is not None})
        raise TypeError(f"{op}: expected one floating dtype, got {dtypes}; cast with .astype(...) / .to(dtype=...) "
                        "or .float()/.double() on modules")


def on_device_of(array, like, name, op, check=None):
    """`array` (a raw array or a non-differentiable Tensor such as ids or a mask) on the device of
    the array `like`. Raw host arrays (and lists) are copied over; a Tensor on another device is an
    error. `check(array)`, when given, sees the array where it arrived: host data before its copy."""
    if isinstance(array, Tensor):
        if array.device != backend.device_of(like):
            raise RuntimeError(f"{op}: {name} is on device '{array.device}' but the inputs are on "
                               f"'{backend.device_of(like)}'; move it with .to(device)")
        array = array.data
    elif not backend.is_array(array):
        array = as_array(array, name, op, backend.module_for("cpu"))   # lists: on the host, checked before the copy
    if check is not None:
        check(array)
    return backend.to_device(array, backend.device_of(like))


def check_index_range(ids, high, error, skip=None):
    """Check 0 <= ids < high (ids equal to `skip` aside) without a host round trip: host ids now,
    device ids on the device, the verdict read with the next result (npformer.runtime.deferred).
    `error(lo, hi)` makes the exception from the smallest and largest id. It is a raw
    computation (autograd.raw_computation): a recorded step checks again at each replay."""
    raw_computation(_check_index_range, ids, high, error, skip)


def _check_index_range(ids, high, error, skip):
    if ids.size == 0:
        return
    xp = backend.get_array_module(ids)
    if skip is None:
        lo, hi = ids.min(), ids.max()
    else:  # skipped entries count as the largest id for the minimum and the smallest for the maximum
        kept = ids != skip
        info = xp.iinfo(ids.dtype)
        lo, hi = xp.where(kept, ids, info.max).min(), xp.where(kept, ids, info.min).max()
    deferred.defer(lambda lo, hi: error(lo, hi) if lo <= hi and (lo < 0 or hi >= high) else None, lo, hi)


def normalize_dim(dim, ndim, op, name="dim"):
    """`dim` in [0, ndim); like torch, a 0-d tensor takes dim 0 or -1 (as if it were 1-d)."""
    dim = check_int(dim, name, op)
    size = max(ndim, 1)
    if not -size <= dim < size:
        raise IndexError(f"{op}: {name} out of range: expected in [{-size}, {size - 1}], got {dim}")
    return dim % size


def broadcast_shapes(*shapes):
    """numpy.broadcast_shapes in plain Python (not every backend has it); ValueError if they clash."""
    if all(s == shapes[0] for s in shapes):  # the common case
        return tuple(shapes[0])
    ndim = max(len(s) for s in shapes)
    result = []
    for sizes in zip(*[(1,) * (ndim - len(s)) + tuple(s) for s in shapes]):
        stretched = {n for n in sizes if n != 1}
        if len(stretched) > 1:
            raise ValueError(f"shapes {shapes} do not broadcast")
        result.append(stretched.pop() if stretched else 1)
    return tuple(result)


def broadcasts_to(shape, target):
    """True when an array of `shape` broadcasts to exactly `target`."""
    try:
        return len(shape) <= len(target) and broadcast_shapes(shape, target) == tuple(target)
    except ValueError:
        return False


def added_into(total, term):
    """total + term, in place in total (an array its caller made, never one it was given); term
    itself when total is None."""
    if total is None:
        return term
    total += term
    return total
