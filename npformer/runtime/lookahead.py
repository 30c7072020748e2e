"""Dropout masks drawn ahead: the next ones are drawn in the thread pool while the caller computes.

A training step draws its dropout masks in the same order, of the same sizes, every step; only
where they start in the stream moves on. Drawing a mask (Philox in numpy, ~4 ns per value) is
work that depends on nothing the step computes, so it can run beside the step's products: a
matrix product holds no lock while it runs, and a mask drawn in the pool during it costs the
step nothing (measured: 8M values drawn beside 48 ms of GEMMs finish with them; in sequence they
add 31 ms).

The CPU's mask draws (npformer.runtime.random) report each request here: a key saying which mask
(seed, size, threshold, shape of the runs...) and where it starts. A forward pass is the
requests between two backward() calls; its requests, with their offsets relative to its first,
are the prediction for the next pass. When the next pass's first request has the recorded first's
key, the other recorded requests are drawn in the pool, in order, at the same relative offsets.
A request takes a mask drawn ahead only when its key and offset are exactly the predicted ones
(the mask is a function of them); at the first mismatch the predictions are dropped and every
request draws its own, as without lookahead. So the masks, and every result, are the same with
and without it; what it changes is which thread draws them and when.

State is per thread (each thread's forward passes are its own, like grad mode). Without a pool
(npformer.set_num_threads(1)) nothing is drawn ahead. NPFORMER_LOOKAHEAD=0 turns it off. A process
forked in the middle of a pass (multiprocessing's "fork" start method) forgets the draws in flight:
the parent's pool threads are not in the child, so they would never finish; the child draws those
masks itself. A module call that raises (npformer.nn.Module) abandons the pass: the masks drawn
ahead for the rest of it are dropped.
"""
import os
import threading
from collections import deque

from . import threads

MAX_REQUESTS = 4096          # a pass with more mask requests (or with no backward ever) is not recorded

_local = threading.local()


class _Pass:
    """The requests of one forward pass [(key, offset from the first, draw)], and the predictions
    in flight [(key, offset, future)], oldest first."""

    def __init__(self):
        self.recorded = []           # the last complete pass
        self.current = []
        self.first = 0               # offset of the current pass's first request
        self.ahead = deque()


def _state():
    state = getattr(_local, "state", None)
    if state is None:
        state = _local.state = _Pass()
    return state


def enabled():
    """Whether masks are drawn ahead: npformer runs more than one thread and NPFORMER_LOOKAHEAD is
    "1" (the default), not "0" (anything else is a ValueError)."""
    value = os.environ.get("NPFORMER_LOOKAHEAD", "1")
    if value not in ("0", "1"):
        raise ValueError(f"NPFORMER_LOOKAHEAD must be '0' or '1', got {value!r}")
    return value == "1" and threads.get_num_threads() > 1


def take(key, offset, draw):
    """The mask `draw(offset)` of a request, when it was drawn ahead, else None (draw it yourself);
    records the request. key: hashable, equal for requests whose draw gives the same mask at the
    same offset; draw(offset) -> the mask, callable in any thread."""
    state = _state()
    mask = None
    if not state.current:                        # the first request of a pass: predict the others
        state.first = offset
        _drop(state)
        if state.recorded and state.recorded[0][0] == key and enabled():
            for k, relative, d in state.recorded[1:]:
                future = threads.submit(d, offset + relative)
                if future is None:               # another thread set one thread meanwhile: no pool
                    break
                state.ahead.append((k, offset + relative, future))
    elif state.ahead:
        k, at, future = state.ahead.popleft()
        if k == key and at == offset:
            mask = draw(offset) if future.cancel() else future.result()   # not started: draw it here
        else:
            future.cancel()
            _drop(state)
    if len(state.current) < MAX_REQUESTS:
        state.current.append((key, offset - state.first, draw))
    return mask


def end_pass():
    """A forward pass ended (backward() was called): its requests predict the next pass's. A pass
    with no request (a second backward) keeps the prediction."""
    state = _state()
    if state.current:
        state.recorded = state.current if len(state.current) < MAX_REQUESTS else []
        state.current = []
    _drop(state)


def abandon_pass():
    """A forward pass stopped by an exception: forget its requests and drop the masks drawn ahead
    for the rest of it (held, they would stay in memory until this thread's next mask request or
    backward(), for good if it only runs inference from then on). The last complete pass still
    predicts the next one."""
    state = getattr(_local, "state", None)
    if state is not None:
        state.current = []
        _drop(state)


def _forget_ahead():
    """In a forked child: the draws in flight ran in the parent's pool threads, which the child does
    not have (a draw running at the fork would never finish, and its future's lock may be held):
    forget them without touching them. The recorded pass stays: it still predicts."""
    state = getattr(_local, "state", None)
    if state is not None:
        state.ahead = deque()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_ahead)


def _drop(state):
    while state.ahead:
        state.ahead.popleft()[2].cancel()
