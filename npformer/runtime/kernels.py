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
`softmax_forward.choose(x, 1)` says which one a call runs and why, without running it.

An implementation registered with `splits_reference=True` runs the reference itself on blocks
of the work (rows on threads): the same math, faster. `runs_reference(fn)` is True for it and
for the reference, so a caller can ask whether a call runs the reference's math or another
kernel (the attention path choice asks whether the flash kernels run).
"""
import contextlib
import threading

from autograd import backend


class _Mode(threading.local):
    reference_only = False  # this thread runs the references (a class default: read without a miss)


_mode = _Mode()
TABLES = []  # every KernelTable made, in the order of definition


class KernelTable:
    """A reference implementation plus faster ones per device (see the module docstring)."""

    def __init__(self, reference):
        self.reference = reference
        self.__name__ = reference.__name__
        self.__doc__ = reference.__doc__
        self.__wrapped__ = reference
        self.implementations = {}  # device -> (function, supports or None)
        self.reference_splits = set()  # the implementations registered with splits_reference=True
        TABLES.append(self)

    def register(self, device, supports=None, splits_reference=False):
        """Decorator: `fn` implements this table on `device` for the arguments that
        `supports(*args, **kwargs)` accepts (all, when None); splits_reference=True says that
        `fn` runs the reference on blocks of the work (see runs_reference)."""
        if device not in backend.DEVICES:
            raise ValueError(f"register: device must be one of {backend.DEVICES}, got {device!r}")

        def add(fn):
            self.implementations[device] = (fn, supports)
            if splits_reference:
                self.reference_splits.add(fn)
            return fn
        return add

    def choose(self, *args, **kwargs):
        """(implementation, reason): the function that a call with these arguments runs and why,
        e.g. "cuda: supports(...) accepted" or "reference: no cpu implementation"."""
        if is_reference_only():
            return self.reference, "reference: inside reference_only()"
        if not self.implementations:
            return self.reference, "reference: nothing else is registered"
        for array in args:  # the first array argument decides
            if backend.is_array(array):
                break
        else:
            return self.reference, "reference: no array argument"
        device = backend.device_of(array)
        entry = self.implementations.get(device)
        if entry is None:
            return self.reference, _reasons(device)[0]
        fn, supports = entry
        if supports is None:
            return fn, _reasons(device)[1]
        if supports(*args, **kwargs):
            return fn, _reasons(device)[2]
        return self.reference, _reasons(device)[3]

    def select(self, *args, **kwargs):
        """The function that a call with these arguments runs (choose's implementation)."""
        return self.choose(*args, **kwargs)[0]

    def runs_reference(self, implementation):
        """True for the reference and for implementations registered with splits_reference=True
        (the reference's math on blocks); False for other kernels (e.g. CUDA's)."""
        return implementation is self.reference or implementation in self.reference_splits

    def __call__(self, *args, **kwargs):
        return self.choose(*args, **kwargs)[0](*args, **kwargs)

    def __repr__(self):
        return f"<kernel table {self.__name__}: reference + {sorted(self.implementations) or 'nothing'}>"


_REASONS = {}  # device -> the reasons `choose` gives, made once (it runs on every call of every table)


def _reasons(device):
    if device not in _REASONS:
        _REASONS[device] = (f"reference: no {device} implementation", f"{device}: takes every argument",
                            f"{device}: supports(...) accepted", f"reference: {device}'s supports(...) refused")
    return _REASONS[device]


def kernel_table(reference):
    """Decorator: make `reference` the reference implementation of a new KernelTable."""
    return KernelTable(reference)


def is_reference_only():
    """True inside reference_only() in the calling thread (like autograd.is_grad_enabled)."""
    return _mode.reference_only


@contextlib.contextmanager
def reference_only():
    """Within the block, in the calling thread, every kernel table runs its reference."""
    old = _mode.reference_only
    _mode.reference_only = True
    try:
        yield
    finally:
        _mode.reference_only = old
