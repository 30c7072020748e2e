"""Nested state <-> JSON plus arrays, and numpy generator states, read back without trusting them.

`pack` turns nested state into JSON-ready values, moving every array into a dict of arrays and
leaving a reference `{"__array__": key}`; tuples, non-string-keyed dicts and numpy Generators get
markers too (`__tuple__`, `__items__`, `__generator__`). `unpack` reverses it and checks every
node on the way: types, marker entries, references, nesting depth, generator states. Any
problem is a CheckpointError naming where in the metadata it is. Nothing read from the file
picks a function or class by name: bit generators come from the fixed BIT_GENERATORS dict.
"""
import numpy as np

from autograd import backend

from .archive import CheckpointError, plain_dtype

MAX_DEPTH = 64          # nesting levels of saved state (a trainer's history needs ~5)
MARKERS = ("__array__", "__tuple__", "__items__", "__generator__")
BIT_GENERATORS = {cls.__name__: cls for cls in (np.random.PCG64, np.random.PCG64DXSM, np.random.Philox,
                                                 np.random.SFC64, np.random.MT19937)}
# bounds of the generator state fields that index into the generator's buffers (numpy does not
# check them: MT19937's `pos` beyond 624 would read past its key); other ints are < 2**128
_STATE_INT_LIMITS = {"pos": 624, "buffer_pos": 4, "has_uint32": 1, "uinteger": 2**32 - 1}
_KEY_TYPES = (type(None), bool, int, float, str)


# -- saving ------------------------------------------------------------------------------------
def pack(obj, path, arrays, depth=0):
    """JSON-ready copy of `obj`; every array goes into `arrays` under a key derived from `path`."""
    if depth > MAX_DEPTH:
        raise ValueError(f"checkpoint state at {path!r}: nested deeper than {MAX_DEPTH} levels")
    if backend.is_array(obj):
        if not plain_dtype(obj.dtype):
            raise TypeError(f"checkpoint state at {path!r}: cannot save an array of dtype {obj.dtype}; "
                            "checkpoints hold bool and numeric arrays")
        key = path
        while key in arrays:
            key += "_"
        arrays[key] = backend.as_numpy(obj)
        return {"__array__": key}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.random.Generator):
        return {"__generator__": pack(obj.bit_generator.state, f"{path}/state", arrays, depth + 1)}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and not any(m in obj for m in MARKERS):
            return {k: pack(v, f"{path}/{k}", arrays, depth + 1) for k, v in obj.items()}
        return {"__items__": [[_pack_key(k, path), pack(v, f"{path}/{k}", arrays, depth + 1)]
                              for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [pack(v, f"{path}/{i}", arrays, depth + 1) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [pack(v, f"{path}/{i}", arrays, depth + 1) for i, v in enumerate(obj)]
    if isinstance(obj, _KEY_TYPES):
        return obj
    raise TypeError(f"checkpoint state at {path!r}: cannot save a {type(obj).__name__}; "
                    "use arrays, numbers, strings, lists, tuples, dicts or numpy Generators")


def _pack_key(key, path):
    """A dict key: None, a bool, number or string, or a tuple of those."""
    if isinstance(key, np.generic):
        key = key.item()
    if isinstance(key, tuple):
        return {"__tuple__": [_pack_key(k, path) for k in key]}
    if isinstance(key, _KEY_TYPES):
        return key
    raise TypeError(f"checkpoint state at {path!r}: cannot save a dict key of type {type(key).__name__}; "
                    "keys are strings, numbers, None or tuples of those")


# -- loading -----------------------------------------------------------------------------------
def unpack(obj, archive, where, depth=0):
    """The value `pack` made `obj` from, arrays read from `archive`; `where` is the metadata path
    of `obj` (e.g. "model/w1"), named by every error."""
    if depth > MAX_DEPTH:
        raise CheckpointError(f"{archive.path}: metadata {where}: nested deeper than {MAX_DEPTH} levels")
    if isinstance(obj, list):
        return [unpack(v, archive, f"{where}/{i}", depth + 1) for i, v in enumerate(obj)]
    if not isinstance(obj, dict):
        return obj  # JSON leaves: None, bool, int, float, str
    marker = next((m for m in MARKERS if m in obj), None)
    if marker is None:
        return {k: unpack(v, archive, f"{where}/{k}", depth + 1) for k, v in obj.items()}
    if len(obj) != 1:
        raise CheckpointError(f"{archive.path}: metadata {where}: a {marker!r} entry must be alone, got the keys "
                              f"{sorted(obj)}")
    value = obj[marker]
    if marker == "__array__":
        return archive.array(value, where)
    if marker == "__generator__":
        state = unpack(value, archive, f"{where}/state", depth + 1)
        return np.random.Generator(bit_generator(state, f"{archive.path}: metadata {where}"))
    if not isinstance(value, list):
        raise CheckpointError(f"{archive.path}: metadata {where}: {marker!r} must hold a list, "
                              f"got {type(value).__name__}")
    if marker == "__tuple__":
        return tuple(unpack(v, archive, f"{where}/{i}", depth + 1) for i, v in enumerate(value))
    items = {}  # "__items__": [[key, value], ...]
    for i, pair in enumerate(value):
        if not isinstance(pair, list) or len(pair) != 2:
            raise CheckpointError(f"{archive.path}: metadata {where}/{i}: expected a [key, value] pair, got "
                                  f"{str(pair)[:80]}")
        key = unpack(pair[0], archive, f"{where}/{i}/key", depth + 1)
        try:
            hash(key)
        except TypeError:
            raise CheckpointError(f"{archive.path}: metadata {where}/{i}: a dict key must be a string, number, "
                                  f"None or a tuple of those, got a {type(key).__name__}") from None
        items[key] = unpack(pair[1], archive, f"{where}/{key}", depth + 1)
    return items


# -- numpy generators --------------------------------------------------------------------------
def bit_generator(state, where, like=None):
    """A new numpy bit generator set to `state` (a dict from `bit_generator.state`), after checking
    that it names an allowed bit generator (with `like`, a bit generator: that one's kind) and has
    exactly that generator's structure and bounds. Raises CheckpointError (a ValueError) prefixed
    by `where`."""
    if not isinstance(state, dict):
        raise CheckpointError(f"{where}: a generator state must be a dict, got {type(state).__name__}")
    name = state.get("bit_generator")
    cls = BIT_GENERATORS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise CheckpointError(f"{where}: bit_generator must be one of {sorted(BIT_GENERATORS)}, got {name!r}")
    if like is not None and cls is not type(like):
        raise CheckpointError(f"{where}: a {name} state for a {type(like).__name__} generator")
    generator = cls(0)
    _check_like(state, generator.state, where)
    try:
        generator.state = state
    except (ValueError, TypeError, OverflowError) as e:
        raise CheckpointError(f"{where}: invalid {name} state ({e})") from e
    return generator


def _check_like(value, template, where, field=None):
    """`value` must have the structure of `template` (a fresh generator's state): the same keys,
    ints where it has ints (within bounds), arrays of the same shape and dtype where it has arrays."""
    if isinstance(template, dict):
        if not isinstance(value, dict) or set(value) != set(template):
            got = sorted(value) if isinstance(value, dict) else type(value).__name__
            raise CheckpointError(f"{where}: expected a dict with the keys {sorted(template)}, got {got}")
        for key in template:
            _check_like(value[key], template[key], f"{where}/{key}", key)
    elif isinstance(template, np.ndarray):
        if not isinstance(value, np.ndarray) or value.shape != template.shape or value.dtype != template.dtype:
            got = f"{value.dtype} {value.shape}" if isinstance(value, np.ndarray) else type(value).__name__
            raise CheckpointError(f"{where}: expected a {template.dtype} array of shape {template.shape}, got {got}")
    elif isinstance(template, str):
        if value != template:
            raise CheckpointError(f"{where}: expected {template!r}, got {value!r}")
    else:
        limit = _STATE_INT_LIMITS.get(field, 2**128 - 1)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limit:
            raise CheckpointError(f"{where}: expected an int in [0, {limit}], got {str(value)[:80]}")
