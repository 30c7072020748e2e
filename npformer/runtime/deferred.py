"""Checks of device data without a host round trip: the check's values stay on the device and are
read when the caller next reads a result (`Tensor.item()`, `.numpy()`, `float(tensor)`, ...).

Reading a value of a GPU array waits for the GPU and copies to the host; inside a training step
that stalls the pipeline, and under CUDA-graph capture it is an error. So a check of device data
(token ids in range, a mean with a nonzero divisor) computes what it needs on the device, e.g.
the minimum and maximum id, and `defer`s the verdict:

    deferred.defer(lambda lo, hi: IndexError(...) if lo < 0 or hi >= n else None, ids.min(), ids.max())

The first read of a result afterwards (`raise_pending()`, called by Tensor.item() and friends)
copies the values, asks each check, and raises the first error, as if the op had raised it.
Host data (numpy arrays, lists: ids that come from the data loader) is checked at once instead.
Pending checks are per thread; under graph capture (`npformer.runtime.graphs`) they belong to the
captured step and come back after each replay.
"""
import threading

from autograd import backend

from . import graphs

MAX_PENDING = 1024  # beyond this many unread checks (results never read), they are settled at once

_local = threading.local()  # .pending: [(verdict, values)]


def _pending():
    if not hasattr(_local, "pending"):
        _local.pending = []
    return _local.pending


def defer(verdict, *values):
    """Check device `values` (0-d arrays) later: `verdict(*host_values)` returns an exception to
    raise, or None. On the CPU (host values) the verdict is asked at once."""
    if all(backend.device_of(v) == "cpu" for v in values):
        error = verdict(*(v.item() if backend.is_array(v) else v for v in values))
        if error is not None:
            raise error
        return
    capture = graphs.current()
    if capture is not None:
        capture.checks.append((verdict, values))
        return
    pending = _pending()
    pending.append((verdict, values))
    if len(pending) > MAX_PENDING:
        raise_pending()


def add_pending(entries):
    """Make (verdict, values) entries pending in this thread (a graph replay's checks). An entry
    already pending is not added again: it reads the same device values, which hold the latest
    replay's, so the checks of replays never read stay as many as one replay's."""
    pending = _pending()
    known = set(map(id, pending))
    pending.extend(e for e in entries if id(e) not in known)


def raise_pending():
    """Read the values of every pending check of this thread and raise the first error."""
    pending = _pending()
    if not pending:
        return
    entries, pending[:] = list(pending), []
    for verdict, values in entries:
        error = verdict(*(backend.as_numpy(v).item() for v in values))
        if error is not None:
            raise error


def discard_pending():
    """Forget the pending checks of this thread (e.g. after an error was already raised)."""
    _pending().clear()
