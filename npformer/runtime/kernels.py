"""Kernel tables: one fused computation, several implementations, chosen by device.

Each fused computation keeps one *reference*: plain whole-array code written with the array
module of its inputs (`xp`), which runs on every device and which every faster implementation
is tested against. Faster implementations plug in beside it, per device: "cpu" (row blocks on
the threads of `npformer.runtime.threads`), "cuda" (hand-written CUDA kernels). The "test" device runs
the references, so the math of every op is checked on machines without a GPU.

    @kernel_table
    def softmax_forward(x, axis, out=None):        # the reference, used where nothing else is
        ...

    @softmax_forward.register("cuda", supports=lambda x, axis, out=None: x.dtype.kind == "f")
    def softmax_forward_cuda(x, axis, out=None):   # a faster implementation, with the same signature
        ...

Calling `softmax_forward(x, 1)` runs the implementation registered for the device of the first
array argument when its `supports(...)` accepts the arguments, else the reference. Inside
`reference_only()` (per thread, like the grad mode) every table runs its reference.
"""
import contextlib
import threading

from autograd import backend

_mode = threading.local()  # .reference_only: this thread runs the references
TABLES = []                # every KernelTable made, in the order of definition


class KernelTable:
    """A reference implementation plus faster ones per device (see the module docstring)."""

    def __init__(self, reference):
        self.reference = reference
        self.__name__ = reference.__name__
        self.__doc__ = reference.__doc__
        self.__wrapped__ = reference
        self.implementations = {}  # device -> (function, supports or None)
        TABLES.append(self)

    def register(self, device, supports=None):
        """Decorator: `fn` implements this table on `device` for the arguments that
        `supports(*args, **kwargs)` accepts (all, when None)."""
        if device not in backend.DEVICES:
            raise ValueError(f"register: device must be one of {backend.DEVICES}, got {device!r}")

        def add(fn):
            self.implementations[device] = (fn, supports)
            return fn
        return add

    def select(self, *args, **kwargs):
        """The function that a call with these arguments runs."""
        if self.implementations and not getattr(_mode, "reference_only", False):
            for array in args:  # the first array argument decides
                if backend.is_array(array):
                    entry = self.implementations.get(backend.device_of(array))
                    if entry is not None and (entry[1] is None or entry[1](*args, **kwargs)):
                        return entry[0]
                    break
        return self.reference

    def __call__(self, *args, **kwargs):
        return self.select(*args, **kwargs)(*args, **kwargs)

    def __repr__(self):
        return f"<kernel table {self.__name__}: reference + {sorted(self.implementations) or 'nothing'}>"


def kernel_table(reference):
    """Decorator: make `reference` the reference implementation of a new KernelTable."""
    return KernelTable(reference)


@contextlib.contextmanager
def reference_only():
    """Within the block, in the calling thread, every kernel table runs its reference."""
    old = getattr(_mode, "reference_only", False)
    _mode.reference_only = True
    try:
        yield
    finally:
        _mode.reference_only = old
