"""Dropout masks drawn ahead: the next ones are drawn in the thread pool while the caller computes.

A training step draws its dropout masks in the same order, of the same sizes, every step; only
where they start in the stream moves on. Drawing a mask is work that depends on nothing the step
computes, so it can run beside the step's products: a matrix product holds no lock while it runs,
and a mask drawn in the pool during it costs the step nothing (BENCHMARKS.md has the figures).

The CPU's mask draws (npformer.runtime.random) report each request here: a key saying which mask
(seed, size, threshold, shape of the runs...) and where it starts. A forward pass is the
requests between two backward() calls; its requests, with their offsets relative to its first,
are the prediction for the next pass. When the next pass's first request has the recorded first's
key, the other recorded requests are drawn in the pool, in order, at the same relative offsets.
A request takes a mask drawn ahead only when its key and offset are exactly the predicted ones
(the mask is a function of them); at the first mismatch the predictions are dropped and every
request draws its own, as without lookahead. So the masks, and every result, are the same with
and without it; what it changes is which thread draws them and when.

Small masks are drawn together: a small Philox draw costs mostly its numpy calls, so the predicted masks of up to SMALL_MASK values that follow one another in a
stream share one draw of the counters spanning them (at most GROUP_VALUES values), made in the
caller by the first of them requested, the pass's first request included, with or without a pool
(in the pool it measured the same: the masks are needed soon after the pass starts, and a pool
thread waits for the GIL while the caller runs Python).

State is per thread (each thread's forward passes are its own, like grad mode). Without a pool
(npformer.set_num_threads(1)) only small masks are drawn before they are asked for, as above.
NPFORMER_LOOKAHEAD=0 turns it all off: every mask is drawn by its request. A process forked in the
middle of a pass (multiprocessing's "fork" start method) forgets the draws in flight: the parent's
pool threads are not in the child, so they would never finish; the child draws those masks itself.
A module call that raises (npformer.nn.Module) abandons the pass: the masks drawn ahead for the
rest of it are dropped.
"""
import os
import threading
from collections import deque

from . import threads

MAX_REQUESTS = 4096          # a pass with more mask requests (or with no backward ever) is not recorded
SMALL_MASK = 1 << 16         # values: a mask up to this size can share a draw with its neighbours
GROUP_VALUES = 1 << 19       # values of one shared draw, at most


class _Local(threading.local):
    state = None  # this thread's _Pass


_local = _Local()


class _Pass:
    """The requests of one forward pass [(key, offset from the first, draw, joint)], and the
    predictions queued [(key, offset, _Drawn, index among its masks)], oldest first."""

    def __init__(self):
        self.recorded = []           # the last complete pass
        self.current = []
        self.first = 0               # offset of the current pass's first request
        self.ahead = deque()


def _state():
    state = _local.state
    if state is None:
        state = _local.state = _Pass()
    return state


def enabled():
    """Whether masks are drawn ahead in the pool: npformer runs more than one thread and
    NPFORMER_LOOKAHEAD is "1" (the default), not "0" (anything else is a ValueError)."""
    return _on() and threads.get_num_threads() > 1


def _on():
    """NPFORMER_LOOKAHEAD: "1" (the default) predicts the passes' masks, "0" draws each as asked."""
    value = os.environ.get("NPFORMER_LOOKAHEAD", "1")
    if value not in ("0", "1"):
        raise ValueError(f"NPFORMER_LOOKAHEAD must be '0' or '1', got {value!r}")
    return value == "1"


def take(key, offset, draw, joint=None):
    """The mask `draw(offset)` of a request, when it was drawn ahead, else None (draw it yourself);
    records the request. key: hashable, equal for requests whose draw gives the same mask at the
    same offset; draw(offset) -> the mask, callable in any thread. joint (optional): what lets a
    small mask be drawn together with its neighbours in the pass, with `stream` (requests of one
    stream can share a draw), `n` (its values) and `draw_together([(offset, joint), ...])` -> their
    masks, one draw of the stream for all of them."""
    state = _state()
    mask = None
    if state.current and offset < state.first:   # the stream went back (reseeded, a state loaded) since the
        state.current = []                       # pass's first request: a pass without backward ended there
    if not state.current:                        # the first request of a pass: predict the others
        state.first = offset
        _drop(state)
        if state.recorded and state.recorded[0][0] == key and _on():
            mask = _predict(state, (key, 0, draw, joint), offset)
    elif state.ahead:
        k, at, drawn, index = state.ahead.popleft()
        if k == key and at == offset:
            mask = drawn.mask(index)
        else:
            drawn.cancel()
            _drop(state)
    if len(state.current) < MAX_REQUESTS:
        state.current.append((key, offset - state.first, draw, joint))
    return mask


def _predict(state, first, offset):
    """Queue the recorded pass's masks from `offset` (the first request's: `first`, (key, 0, draw,
    joint)) in state.ahead, grouped: runs of small masks of one stream share one draw, made by the
    group's first request; a big mask after the first is drawn in the pool, when there is one.
    Returns the first request's mask when it was drawn with its group, else None."""
    pool = enabled()
    for group in _groups([first] + state.recorded[1:]):
        k, relative, d, joint = group[0]
        if joint is None:
            drawn = _Drawn(lambda d=d, at=offset + relative: [d(at)], together=False)
            if pool and relative and not drawn.start():     # another thread set one thread meanwhile
                pool = False
        else:
            members = [(offset + r, j) for _, r, _, j in group]
            drawn = _Drawn(lambda j=joint, members=members: j.draw_together(members), together=True)
        state.ahead.extend((k, offset + r, drawn, i) for i, (k, r, _, _) in enumerate(group))
    _, _, drawn, index = state.ahead.popleft()    # the first request itself
    return drawn.mask(index) if drawn.together else None


def _groups(requests):
    """The requests in order, in groups of consecutive small masks of one stream (at most
    GROUP_VALUES values in all); any other request alone."""
    groups = []
    for request in requests:
        joint = request[3]
        small = joint is not None and joint.n <= SMALL_MASK
        last = groups[-1] if groups else None
        if (small and last is not None and last[0][3] is not None and last[0][3].stream == joint.stream
                and sum(r[3].n for r in last) + joint.n <= GROUP_VALUES):
            last.append(request)
        else:
            groups.append([request if small else request[:3] + (None,)])
    return groups


class _Drawn:
    """The masks of a group, drawn by one call: in the pool (start), or by the first request that
    needs them when the pool has not started the call (or it was not started)."""

    def __init__(self, draw, together):
        self.draw, self.together, self.task, self.masks = draw, together, None, None

    def start(self):
        self.task = threads.submit(self.draw)
        return self.task is not None

    def mask(self, index):
        if self.masks is None:
            ran_here = self.task is None or self.task.cancel()
            self.masks = self.draw() if ran_here else self.task.result()
        return self.masks[index]

    def cancel(self):
        if self.task is not None:
            self.task.cancel()


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
    state = _local.state
    if state is not None:
        state.current = []
        _drop(state)


def _forget_ahead():
    """In a forked child: the draws in flight ran in the parent's pool threads, which the child does
    not have (a draw running at the fork would never finish, and its future's lock may be held):
    forget them without touching them. The recorded pass stays: it still predicts."""
    state = _local.state
    if state is not None:
        state.ahead = deque()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_ahead)


def _drop(state):
    while state.ahead:
        state.ahead.popleft()[2].cancel()
