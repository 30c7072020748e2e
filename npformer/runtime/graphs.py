"""The graph capture in progress in this thread, if any: what code running inside a captured step
(a CUDA graph, `npformer.cuda.graphed`) needs to know.

A captured step is recorded once and replayed many times without running its Python code again,
so host values baked in at capture would repeat at every replay. Code whose host state advances
from step to step keeps that state in device memory while capturing and asks to have it updated
before each replay (`Capture.before_replay`): the dropout stream's (seed, offset)
(npformer.runtime.random.Philox.draw), and numbers the host computes for each step, such as Adam's step
sizes and learning rates (npformer.optim), with one call: `replayed(device, values, next_values)`.
Deferred device checks made while capturing (npformer.runtime.deferred) belong to the capture and are
made pending again after each replay. Capture is per thread, like a CUDA stream capture.
"""
import contextlib
import threading

from autograd import backend


class _Local(threading.local):
    capture = None  # the Capture in progress in this thread


_local = _Local()
SCALARS_PER_BLOCK = 1024    # replayed() numbers share float64 device blocks: one copy per block and replay


class Capture:
    """The state of one captured step on `device` ("cuda", or "test": the emulation)."""

    def __init__(self, device):
        self.device = device
        self.checks = []         # (verdict, values) deferred while capturing
        self.hooks = []          # hook(replay_index), run before each replay
        self.slots = {}          # key -> device array made while capturing (see slot())
        self.scalar_blocks = []  # _ScalarBlock, for replayed()

    def before_replay(self, hook):
        """Run `hook(replay_index)` on the host before every replay (index 0: the first one, which
        performs the captured step itself)."""
        self.hooks.append(hook)

    def slot(self, key, make):
        """The device array for `key` in this capture, made by `make()` on first use."""
        if key not in self.slots:
            self.slots[key] = make()
        return self.slots[key]

    def replayed_scalars(self, values, next_values):
        """A float64 device array holding `values` at the first replay and `next_values()` at each
        later one (see replayed)."""
        if not 0 < len(values) <= SCALARS_PER_BLOCK:
            raise ValueError(f"replayed: expected 1 to {SCALARS_PER_BLOCK} numbers, got {len(values)}")
        if not self.scalar_blocks or self.scalar_blocks[-1].used + len(values) > SCALARS_PER_BLOCK:
            self.scalar_blocks.append(_ScalarBlock(self.device))
            self.before_replay(self.scalar_blocks[-1].rewrite)
        return self.scalar_blocks[-1].take(values, next_values)


class _ScalarBlock:
    """SCALARS_PER_BLOCK float64 on the device, shared by the replayed() numbers of one capture,
    rewritten from the host with one copy before each replay."""

    def __init__(self, device):
        self.array = backend.module_for(device).empty(SCALARS_PER_BLOCK)
        self.used = 0
        self.entries = []        # (start, the captured step's values, next_values)

    def take(self, values, next_values):
        start, self.used = self.used, self.used + len(values)
        self.entries.append((start, tuple(values), next_values))
        return self.array[start:self.used]

    def rewrite(self, replay):
        host = backend.module_for("cpu").zeros(SCALARS_PER_BLOCK)
        for start, captured, next_values in self.entries:   # in the order of the step, as it ran
            values = captured if replay == 0 else next_values()
            host[start:start + len(values)] = values
        backend.copy_from_host(self.array, host)


def current(device=None):
    """The capture in progress in this thread (on `device`, when given), or None."""
    capture = _local.capture
    if capture is None or (device is not None and capture.device != device):
        return None
    return capture


def replayed(device, values, next_values):
    """Numbers the host computes for each step (floats), as a step captured on `device` reads them:
    outside a capture, None (the caller uses `values` themselves); while capturing, a float64
    device array (len(values),) that holds `values` when the graph first runs (the captured step)
    and `next_values()` (called on the host just before) at each later replay, e.g. Adam's step
    size from the step count and the lr of the step that replay performs."""
    capture = current(device)
    return None if capture is None else capture.replayed_scalars(values, next_values)


@contextlib.contextmanager
def capturing(capture):
    """Within the block, `current()` is `capture` in this thread."""
    if _local.capture is not None:
        raise RuntimeError("a graph capture is already in progress in this thread")
    _local.capture = capture
    try:
        yield capture
    finally:
        _local.capture = None
