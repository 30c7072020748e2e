"""Checks of public arguments: a clear error naming the argument, what was expected and what came.

Any integral or real number type counts (numpy scalars too); bools are not numbers."""
import math
import numbers


def integer(name: str, value, minimum: int | None = None) -> int:
    """`value` as an int; TypeError unless it is an integral number, ValueError below minimum."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an integer, got {value!r} ({type(value).__name__})")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {value!r}")
    return int(value)


def real(name: str, value, minimum: float | None = None, maximum: float | None = None) -> float:
    """`value` as a finite float; TypeError unless it is a real number, ValueError for NaN,
    infinities or values outside [minimum, maximum]."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a real number, got {value!r} ({type(value).__name__})")
    value = float(value)
    low = -math.inf if minimum is None else minimum
    high = math.inf if maximum is None else maximum
    if not (math.isfinite(value) and low <= value <= high):
        bounds = " and ".join(b for b in (f">= {minimum}" if minimum is not None else "",
                                          f"<= {maximum}" if maximum is not None else "") if b)
        raise ValueError(f"{name}: expected a finite number{' ' + bounds if bounds else ''}, got {value!r}")
    return value


def flag(name: str, value) -> bool:
    """TypeError unless `value` is a bool (numpy's too)."""
    if not isinstance(value, bool) and type(value).__name__ != "bool_":
        raise TypeError(f"{name}: expected True or False, got {value!r} ({type(value).__name__})")
    return bool(value)
