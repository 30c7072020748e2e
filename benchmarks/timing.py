"""Per-op timers for the profiling benchmarks (profile_step.py, generate.py --profile): wrappers
monkeypatched in the benchmark's own process only."""
import time

import autograd


def timed(table, name, fn):
    """`fn`, adding the seconds of every call to table[name] (a defaultdict(float) or Counter)."""
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            table[name] += time.perf_counter() - t0
    return wrapper


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def time_functions(table, phases=("forward", "backward")):
    """Wrap `phases` of every autograd.Function subclass defining them, as rows "Name.phase"."""
    for op in _subclasses(autograd.Function):
        for phase in phases:
            if phase in op.__dict__:
                setattr(op, phase, staticmethod(timed(table, f"{op.__name__}.{phase}", op.__dict__[phase].__func__)))
