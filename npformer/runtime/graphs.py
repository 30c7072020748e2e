"""The graph capture in progress in this thread, if any: what code running inside a captured step
(a CUDA graph, `npformer.cuda.graphed`) needs to know.

A captured step is recorded once and replayed many times without running its Python code again,
so host values baked in at capture would repeat at every replay. Code whose host state advances
from step to step keeps that state in device memory while capturing and asks to have it updated
before each replay (`Capture.before_replay`): the dropout stream's (seed, offset)
(npformer.runtime.random.Philox.draw) and Adam's step sizes (npformer.optim). Deferred device checks made
while capturing (npformer.runtime.deferred) belong to the capture and are made pending again after each
replay. Capture is per thread, like a CUDA stream capture.
"""
import contextlib
import threading

_local = threading.local()  # .capture


class Capture:
    """The state of one captured step on `device` ("cuda", or "test": the emulation)."""

    def __init__(self, device):
        self.device = device
        self.checks = []         # (verdict, values) deferred while capturing
        self.hooks = []          # hook(replay_index), run before each replay
        self.slots = {}          # key -> device array made while capturing (see slot())

    def before_replay(self, hook):
        """Run `hook(replay_index)` on the host before every replay (index 0: the first one, which
        performs the captured step itself)."""
        self.hooks.append(hook)

    def slot(self, key, make):
        """The device array for `key` in this capture, made by `make()` on first use."""
        if key not in self.slots:
            self.slots[key] = make()
        return self.slots[key]


def current(device=None):
    """The capture in progress in this thread (on `device`, when given), or None."""
    capture = getattr(_local, "capture", None)
    if capture is None or (device is not None and capture.device != device):
        return None
    return capture


@contextlib.contextmanager
def capturing(capture):
    """Within the block, `current()` is `capture` in this thread."""
    if getattr(_local, "capture", None) is not None:
        raise RuntimeError("a graph capture is already in progress in this thread")
    _local.capture = capture
    try:
        yield capture
    finally:
        _local.capture = None
