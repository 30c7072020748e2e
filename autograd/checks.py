"""Checks of the numbers and lists passed to public APIs, shared by every layer of npformer.

Any integral type counts as an integer and any real type as a real number (Python's, numpy
scalars such as np.int64(8) or np.float32(0.1), anything registered with `numbers`); bools are
not numbers (True would silently be 1), nor are strings. Each check returns the value as a
plain Python int or float (so configs stay JSON-serialisable and float32 arithmetic stays
float32), or raises an error naming the owner, the argument, what was expected and what came:

    TypeError:  "Linear: in_features must be an integer >= 1, got '3' of type str"
    ValueError: "Adam: lr must be a real number >= 0, got -0.001"
"""
import math
import numbers

from . import backend


def _bounds(at_least, above, at_most, below):
    """' in [0, 1)', ' >= 1', ... for the message; '' without bounds."""
    low = f"[{at_least}" if at_least is not None else f"({above}" if above is not None else None
    high = f"{at_most}]" if at_most is not None else f"{below})" if below is not None else None
    if low and high:
        return f" in {low}, {high}"
    if low:
        return f" {'>=' if at_least is not None else '>'} {low[1:]}"
    if high:
        return f" {'<=' if at_most is not None else '<'} {high[:-1]}"
    return ""


def _is_bool(value):
    return isinstance(value, bool) or type(value).__name__ in ("bool_", "bool")  # numpy's bool is no int


def is_integer(value) -> bool:
    """Whether `value` is an integer of any integral type (numpy's too), not a bool."""
    return isinstance(value, numbers.Integral) and not _is_bool(value)


def is_real(value) -> bool:
    """Whether `value` is a real number of any real type (numpy's too), not a bool."""
    return isinstance(value, numbers.Real) and not _is_bool(value)


def _refuse_type(value, name, owner, expected):
    actual = "(a bool, not a number)" if _is_bool(value) else f"of type {type(value).__name__}"
    raise TypeError(f"{owner}: {name} must be {expected}, got {value!r} {actual}")


def check_int(value, name: str, owner: str, *, at_least: int | None = None, at_most: int | None = None) -> int:
    """`value` as an int: TypeError unless it is an integer (any integral type, not a bool),
    ValueError outside [at_least, at_most] (either bound optional)."""
    if type(value) is int and (at_least is None or value >= at_least) and (at_most is None or value <= at_most):
        return value  # the common case, without building the message
    expected = "an integer" + _bounds(at_least, None, at_most, None)
    if not is_integer(value):
        _refuse_type(value, name, owner, expected)
    value = int(value)
    if (at_least is not None and value < at_least) or (at_most is not None and value > at_most):
        raise ValueError(f"{owner}: {name} must be {expected}, got {value}")
    return value


def check_real(value, name: str, owner: str, *, at_least: float | None = None, above: float | None = None,
               at_most: float | None = None, below: float | None = None, finite: bool = True) -> float:
    """`value` as a float: TypeError unless it is a real number (any real type, not a bool),
    ValueError for NaN, for +-inf when `finite`, and outside the bounds (at_least <= value,
    above < value, value <= at_most, value < below; each optional)."""
    if type(value) is float and (math.isfinite(value) or not finite and value == value) and (
            (at_least is None or value >= at_least) and (above is None or value > above)
            and (at_most is None or value <= at_most) and (below is None or value < below)):
        return value  # the common case, without building the message
    bounded = (at_least, above) != (None, None) and (at_most, below) != (None, None)
    expected = ("a finite real number" if finite and not bounded else "a real number") + _bounds(
        at_least, above, at_most, below)
    if not is_real(value):
        _refuse_type(value, name, owner, expected)
    value = float(value)
    inside = not math.isnan(value) and (math.isfinite(value) or not finite)
    inside = inside and (at_least is None or value >= at_least) and (above is None or value > above)
    inside = inside and (at_most is None or value <= at_most) and (below is None or value < below)
    if not inside:
        raise ValueError(f"{owner}: {name} must be {expected}, got {value}")
    return value


def check_optional_int(value, name: str, owner: str, **bounds) -> int | None:
    """None, or check_int(value, ...)."""
    return None if value is None else check_int(value, name, owner, **bounds)


def as_array(value, name: str, owner: str | None, xp):
    """`value` (an array, or a list/tuple of numbers or of equally long lists) as an `xp` array;
    ValueError naming the argument (and its owner unless None) for ragged nested lists
    (numpy's "inhomogeneous shape")."""
    try:
        return xp.asarray(value)
    except ValueError:
        if not isinstance(value, (list, tuple)):
            raise
        lengths = [len(row) if isinstance(row, (list, tuple)) else "a scalar" for row in value[:10]]
        more = ", ..." if len(value) > 10 else ""
        where = f"{owner}: {name}" if owner else name
        raise ValueError(f"{where} must be a rectangular array (every row of the same length), got a ragged "
                         f"{type(value).__name__} with rows of lengths {', '.join(map(str, lengths))}{more}") from None


def check_shape(value, name: str, owner: str) -> tuple:
    """An integer or a sequence of integers >= 1 (e.g. LayerNorm's normalized_shape) as a tuple of ints."""
    if is_integer(value):
        value = (value,)
    if not isinstance(value, (list, tuple)) or not value:
        _refuse_type(value, name, owner, "an integer >= 1 or a non-empty tuple of them")
    return tuple(check_int(n, name, owner, at_least=1) for n in value)


def check_bool(value, name: str, owner: str) -> bool:
    """`value` as a bool: TypeError unless it is True or False (numpy's bools too)."""
    if not _is_bool(value):
        raise TypeError(f"{owner}: {name} must be True or False, got {value!r} of type {type(value).__name__}")
    return bool(value)


def check_float_dtype(value, name: str, owner: str):
    """`value` (a dtype, a scalar type or a name such as "float32") as a floating numpy dtype, or
    TypeError naming the owner and argument (numpy would read None as float64: refused too)."""
    try:
        dtype = None if value is None else backend.module_for("cpu").dtype(value)
    except TypeError:
        dtype = None
    if dtype is None or dtype.kind != "f":
        raise TypeError(f"{owner}: {name} must be a floating dtype or its name (e.g. 'float32'), got {value!r}")
    return dtype
