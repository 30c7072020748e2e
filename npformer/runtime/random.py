"""Random numbers. Two kinds, both reseeded by `manual_seed` (like torch.manual_seed):

- `global_rng(device)`: a numpy/CuPy Generator per device, for the initialisers;
- `dropout_stream()`: one counter-based Philox4x32-10 stream (Salmon et al., "Parallel random
  numbers: as easy as 1, 2, 3", SC 2011) for every dropout mask. A mask's bits are a pure
  function of (seed, offset, element index), so the CPU, the test device and a CUDA kernel
  draw the same mask for the same seed and offset, a kernel can regenerate a mask in backward
  instead of storing it, and any block of a mask can be drawn on its own (threads, tiles).

Philox4x32-10: a counter c = (c0, c1, c2, c3) and a key k = (k0, k1) of 32-bit words; ten rounds of

    (hi0, lo0) = M0 * c0,  (hi1, lo1) = M1 * c2        (64-bit products split in halves)
    c = (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0)
    k = (k0 + W0, k1 + W1)                              (between rounds, mod 2^32)

give four random 32-bit words. npformer's streams use key = (seed mod 2^32, seed >> 32) and counter
(n mod 2^32, n >> 32, 0, 0) for the n-th block of 128 bits; each block gives eight 16-bit values
(word m gives value 2m from its low half and 2m + 1 from its high half). Value i of a stream at
`offset` is value (offset + i) of that sequence; a draw of n values advances the offset by n
rounded up to a multiple of 8, so every draw starts on a fresh counter.

Under graph capture (npformer.runtime.graphs, npformer.cuda.graphed) a replayed step must draw new values
each time, so `Philox.draw` then hands out offsets relative to a base that lives in device memory:
a (2,) uint64 array (seed, base) that kernels read (`PhiloxDraw.state`), rewritten before each
replay with the next unused offset, like torch's Philox state under CUDA graphs. Dropout sites
draw with `draw(n, device)` and pass its `state` on (to `bits16` or a kernel).
"""
import os
import threading
from typing import Any, NamedTuple

from autograd import backend
from autograd.checks import check_int

from . import graphs, lookahead, record, threads
from .kernels import kernel_table

_generators = {}
# held while a Philox stream's state or the global generators are read or changed: threads sharing a
# stream (two models trained side by side on the global one) reserve disjoint values, and threads
# using a global generator first use one object, as torch's generator (it has a mutex)
_streams_lock = threading.RLock()


def _new_lock_in_child():  # a forked child has none of the parent's threads: a lock one of them held stays held
    global _streams_lock
    _streams_lock = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_lock_in_child)

M0, M1 = 0xD2511F53, 0xCD9E8D57          # Philox4x32 multipliers
W0, W1 = 0x9E3779B9, 0xBB67AE85          # Weyl key increments (golden ratio, sqrt(3) - 1)
ROUNDS = 10
VALUES_PER_COUNTER = 8                   # 16-bit values per Philox call (128 bits)
_LOW32 = 0xFFFFFFFF
_REFERENCE_CHUNK = 1 << 20               # counters per chunk elsewhere (48 MB of temporaries)
# The CPU's counters per chunk (48 bytes of temporaries each): alone, 2^15 (1.5 MB, in a core's cache);
# on threads, 2^16 per chunk and at least that many per thread, so that each numpy call of a chunk is
# long enough for two threads not to wait on each other for the GIL (BENCHMARKS.md, "Thresholds")
_CHUNK = 1 << 15
_PARALLEL_CHUNK = 1 << 16


def default_rng(seed=None, device="cpu"):
    """A new random Generator whose arrays live on `device`."""
    xp = backend.module_for(device)
    return xp.random.default_rng(seed)


def manual_seed(seed: int) -> None:
    """Reseed every global generator: each device's Generator (the initialisers) and the dropout
    stream, like torch.manual_seed. seed: an integer >= 0 (TypeError / ValueError otherwise)."""
    seed = check_int(seed, "seed", "manual_seed", at_least=0)
    with _streams_lock:
        _generators.clear()
        _generators["seed"] = seed
        _dropout.seeded = False  # reseeded (in place) when next used


def _seed_words(index, words):
    """`words` 32-bit words seeding stream `index`, independent of the other streams, from
    manual_seed's seed (or from the operating system's entropy when none was set)."""
    seed = _generators.get("seed")
    sequence = backend.module_for("cpu").random.SeedSequence(None if seed is None else [seed, index])
    return [int(w) for w in sequence.generate_state(words)]


def global_rng(device="cpu"):
    """The global generator of a device, used by the initialisers."""
    rng = _generators.get(device)
    if rng is None:
        with _streams_lock:
            rng = _generators.get(device)
            if rng is None:  # one independent stream per device from the one seed
                (seed,) = _seed_words(backend.DEVICES.index(device), 1)
                rng = _generators[device] = default_rng(seed, device)
    return rng


def dropout_stream():
    """The global Philox stream of every dropout mask, on every device (one object for the whole
    run: manual_seed reseeds it in place, so a captured graph keeps drawing from it)."""
    stream = _generators.setdefault("dropout", _dropout)
    if not stream.seeded:
        with _streams_lock:
            if not stream.seeded:  # not seeded by another thread meanwhile (it may have drawn since)
                low, high = _seed_words(len(backend.DEVICES), 2)
                stream.manual_seed(low | high << 32)
    return stream


class PhiloxDraw(NamedTuple):
    """Where a draw of a Philox stream starts: value (offset + i) of the stream of `seed` is the
    i-th; with `state` (a device (2,) uint64 array, under graph capture) the seed is state[0] and
    the offset counts from state[1]."""
    seed: int
    offset: int
    state: Any = None


class Philox:
    """A counter-based random stream: `seed` (64-bit) and `offset` (how many 16-bit values were
    drawn, a multiple of 8). Like a torch.Generator for dropout: `take(n)` reserves n values and
    returns where they start; `bits16(n, device)` draws them. The state is two ints
    (`state_dict()`), the same for every device. Threads may share a stream: each reservation is
    atomic, so they get disjoint values."""

    def __init__(self, seed=0, offset=0):
        self.seed, self.offset = int(seed) % 2**64, _whole_counters(int(offset), "Philox")
        self.seeded = True

    def manual_seed(self, seed):
        with _streams_lock:
            self.seed, self.offset, self.seeded = int(seed) % 2**64, 0, True
        return self

    def take(self, n):
        """Reserve the next n values; returns their first offset. Refused inside a graph capture,
        where a host offset would be baked into the graph: draw(n, device) there."""
        if graphs.current() is not None:
            raise RuntimeError("Philox.take inside a graph capture: its offset would be the same at every replay; "
                               "draw with Philox.draw(n, device) and pass its state to the kernel")
        return self._reserve(n)

    def _reserve(self, n):
        if not self.seeded:  # the global dropout stream after manual_seed (a replay reserves without asking for it)
            dropout_stream()
        step = -(-int(n) // VALUES_PER_COUNTER) * VALUES_PER_COUNTER
        with _streams_lock:
            start = self.offset
            self.offset = start + step
        record.note_draw(self, n, start)  # a step being recorded: each replay reserves as many again
        return start

    def bits16(self, n, device="cpu"):
        """The next n 16-bit values (uint16, on `device`)."""
        return bits16(self.seed, self.take(n), n, device)

    def draw(self, n, device):
        """Reserve the next n values for a kernel on `device`: a PhiloxDraw. Outside graph capture,
        (seed, take(n)). While a step on `device` is being captured, the seed and a base offset live
        in a device array that is rewritten before each replay, and the draw's offset counts from
        that base, so each replay draws the values that the same step run eagerly would."""
        capture = graphs.current(device)
        if capture is None:
            return PhiloxDraw(self.seed, self._reserve(n))
        key = ("philox", id(self))
        if key not in capture.slots:
            record = {"base": self.offset, "per_step": 0}
            state = capture.slot(key, lambda: backend.module_for(device).empty(2, dtype="uint64"))
            capture.slots[key + ("record",)] = record

            def before_replay(replay):  # replay 0 performs the captured step: the values it reserved
                base = record["base"] if replay == 0 else self._reserve(record["per_step"])
                backend.copy_from_host(state, backend.module_for("cpu").array([self.seed, base], dtype="uint64"))
            capture.before_replay(before_replay)
        record = capture.slots[key + ("record",)]
        offset = self._reserve(n) - record["base"]
        record["per_step"] = self.offset - record["base"]
        return PhiloxDraw(self.seed, offset, capture.slots[key])

    def state_dict(self):
        with _streams_lock:
            return {"seed": self.seed, "offset": self.offset}

    def load_state_dict(self, state):
        """Continue from `state` ({"seed": int in [0, 2^64), "offset": int in [0, 2^64)}: the stream's
        values are counted in 64 bits); anything else is a TypeError or ValueError, and the stream
        is left as it was."""
        if not isinstance(state, dict) or set(state) != {"seed", "offset"}:
            raise ValueError(f"Philox state: expected {{'seed': ..., 'offset': ...}}, got {state!r:.80}")
        seed = check_int(state["seed"], "seed", "Philox state", at_least=0, at_most=2**64 - 1)
        offset = _whole_counters(check_int(state["offset"], "offset", "Philox state", at_least=0, at_most=2**64 - 1),
                                 "Philox state")
        with _streams_lock:
            self.seed, self.offset = seed, offset

    def __repr__(self):
        return f"Philox(seed={self.seed}, offset={self.offset})"


def _whole_counters(offset, owner):
    """offset, a multiple of 8 (draws reserve whole counters; a graph replay moves its counters by offset / 8)."""
    if offset % VALUES_PER_COUNTER:
        raise ValueError(f"{owner}: offset must be a multiple of {VALUES_PER_COUNTER} (whole Philox counters), "
                         f"got {offset}")
    return offset


_dropout = Philox()  # the dropout stream (dropout_stream()), seeded on first use
_dropout.seeded = False


def philox4x32(counter, key):
    """Philox4x32-10 of four 1-D arrays of 32-bit counter words (any integer dtype, values < 2^32)
    under a key of two ints -> the four output words, uint32 arrays."""
    xp = backend.get_array_module(*counter)
    c0, c1, c2, c3 = (xp.asarray(c).astype("uint64") for c in counter)       # owned copies
    work = [xp.empty_like(c0) for _ in range(4)]
    return _philox_rounds(c0, _low(c1), c2, _low(c3), key, work)


def _low(words):
    """The low 32-bit halves of a uint64 array, as a (strided) uint32 view (little-endian)."""
    return words.view("uint32")[0::2]


def _high(words):
    return words.view("uint32")[1::2]


def _philox_rounds(c0, c1, c2, c3, key, work, rounds=ROUNDS):
    """The ten rounds on 1-D arrays: c0 and c2 uint64 holding 32-bit values (overwritten: their
    high halves stay 0), c1 and c3 uint32 (read only), `work` four uint64 arrays of their length.
    Returns the output words as uint32 views of c0, c2 and `work`.

    Six passes per round instead of ten: the two 64-bit products go to buffers whose uint32
    views are hi and lo (no shifts, no masks), lo1 and lo0 are the next round's c1 and c3 as
    views (the two buffers of each product alternate between rounds), and c0 and c2 are written
    into the low halves of 64-bit arrays that the next products read as they are."""
    xp = backend.get_array_module(c0)
    low = xp.uint64(_LOW32)
    # the key: two ints, or two uint64 device arrays that broadcast (read on the device, under capture)
    k0, k1 = (k if backend.is_array(k) else xp.uint64(int(k) & _LOW32) for k in key)
    m0, m1 = xp.uint64(M0), xp.uint64(M1)
    p0, p0_next, p1, p1_next = work
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + xp.uint64(W0)) & low, (k1 + xp.uint64(W1)) & low
        xp.multiply(c0, m0, out=p0)                       # (hi0, lo0) = M0 * c0
        xp.multiply(c2, m1, out=p1)                       # (hi1, lo1) = M1 * c2
        xp.bitwise_xor(_high(p1), c1, out=_low(c0))       # c0 = hi1 ^ c1 ^ k0
        c0 ^= k0
        xp.bitwise_xor(_high(p0), c3, out=_low(c2))       # c2 = hi0 ^ c3 ^ k1
        c2 ^= k1
        c1, c3 = _low(p1), _low(p0)                       # c1 = lo1, c3 = lo0
        p0, p0_next, p1, p1_next = p0_next, p0, p1_next, p1
    return _low(c0), c1, _low(c2), c3


def _counter_words(counters, key, words, work):
    """words (n, 4) uint32 <- Philox4x32-10 of the counters (n,) uint64 (counter c is the words
    (c mod 2^32, c >> 32, 0, 0)); `work`: six uint64 arrays of length n."""
    xp = backend.get_array_module(counters)
    c0, c2 = work[4], work[5]
    xp.bitwise_and(counters, xp.uint64(_LOW32), out=c0)
    c1 = xp.right_shift(counters, xp.uint64(32)).astype("uint32")
    c2[...] = 0
    zero = xp.zeros(counters.shape[0], dtype="uint32")
    for m, w in enumerate(_philox_rounds(c0, c1, c2, zero, key, work[:4])):
        words[:, m] = w


def _fill_words(counters, key, words, start, stop, chunk):
    """words[start:stop] (uint32, 4 per counter) of counters[start:stop], `chunk` counters at a
    time (48 bytes of temporaries per counter)."""
    xp = backend.get_array_module(counters)
    work = [xp.empty(min(chunk, stop - start), dtype="uint64") for _ in range(6)]
    for lo in range(start, stop, chunk):
        hi = min(lo + chunk, stop)
        _counter_words(counters[lo:hi], key, words[lo:hi], [w[:hi - lo] for w in work])


@kernel_table
def philox_bits16(counters, key):
    """The eight 16-bit values of each counter: counters (n,) uint64 -> (8 n,) uint16, value 8 i + 2 m
    the low half of output word m of counter i and 8 i + 2 m + 1 its high half. In chunks of
    _REFERENCE_CHUNK counters, so the temporaries stay bounded."""
    words = backend.get_array_module(counters).empty((counters.shape[0], 4), dtype="uint32")
    _fill_words(counters, key, words, 0, counters.shape[0], _REFERENCE_CHUNK)
    # value 2m of a counter is the low half of word m, value 2m + 1 its high half: on a
    # little-endian machine (x86, Arm, GPUs) that is the uint16 view of the words
    return words.view("uint16").reshape(-1)


def _host_key(counters, key, *rest):
    """Whether the key is two ints (a device (seed, base) array under graph capture is not)."""
    return not any(backend.is_array(k) for k in key)


@philox_bits16.register("cpu", supports=_host_key)
def philox_bits16_cpu(counters, key):
    """Blocks of counters on the threads of `npformer.runtime.threads` (_run_counter_blocks), each in chunks
    whose temporaries stay in the cache, with the shortened first rounds of `_fresh_rounds`."""
    n = counters.shape[0]
    words = backend.get_array_module(counters).empty((n, 4), dtype="uint32")

    def block(start, stop, chunk):
        for _ in _words_in_chunks(counters, key, start, stop, chunk, words):
            pass

    _run_counter_blocks(block, n)
    return words.view("uint16").reshape(-1)


@kernel_table
def philox_at_least(counters, key, threshold):
    """(8 n,) bool: philox_bits16(counters, key) >= threshold, the keep test of a dropout mask."""
    return philox_bits16(counters, key) >= threshold


@philox_at_least.register("cpu", supports=_host_key)
def philox_at_least_cpu(counters, key, threshold):
    """philox_bits16_cpu's blocks and chunks, each chunk's 16-bit values compared while they are in
    the cache (no array of the values: 1 byte per value written instead of 2 written and read)."""
    xp = backend.get_array_module(counters)
    n = counters.shape[0]
    keep = xp.empty(VALUES_PER_COUNTER * n, dtype=bool)

    def block(start, stop, chunk):
        for lo, hi, words in _words_in_chunks(counters, key, start, stop, chunk):
            xp.greater_equal(words.view("uint16").reshape(-1), threshold, out=keep[8 * lo:8 * hi])

    _run_counter_blocks(block, n)
    return keep


def _run_counter_blocks(block, count):
    """block(start, stop, chunk) over blocks of `count` counters: one block in chunks of _CHUNK, or,
    when every thread of `npformer.runtime.threads` gets at least _PARALLEL_CHUNK counters, one block per
    thread in chunks of _PARALLEL_CHUNK."""
    blocks = threads.row_blocks(count, threads.MIN_PARALLEL_ENTRIES) if count >= 2 * _PARALLEL_CHUNK else [(0, count)]
    chunk = _CHUNK if len(blocks) == 1 else _PARALLEL_CHUNK
    threads.run_blocks(lambda start, stop: block(start, stop, chunk), blocks)


def _words_in_chunks(counters, key, start, stop, chunk, words=None):
    """For each chunk [lo, hi) of at most `chunk` counters of [start, stop): yields (lo, hi, w),
    w (hi - lo, 4) uint32 the Philox words of counters[lo:hi], written into words[lo:hi] when
    `words` is given, else into a buffer reused by the next chunk. The temporaries are kept per
    thread between draws: fresh ones would cost page faults at every draw."""
    buffers = _scratch.__dict__.pop("buffers", None)          # taken while in use: a nested draw makes its own
    if buffers is None or buffers[0].shape[0] < min(chunk, stop - start):
        xp = backend.get_array_module(counters)
        size = max(min(chunk, stop - start), 0 if buffers is None else buffers[0].shape[0])
        buffers = [xp.empty(size, dtype="uint64") for _ in range(6)] + [xp.empty((size, 4), dtype="uint32")]
    try:
        for lo in range(start, stop, chunk):
            hi = min(lo + chunk, stop)
            w = buffers[6][:hi - lo] if words is None else words[lo:hi]
            _counter_words_cpu(counters[lo:hi], key, w, [a[:hi - lo] for a in buffers[:6]])
            yield lo, hi, w
    finally:
        _scratch.buffers = buffers


_scratch = threading.local()                                  # .buffers: _words_in_chunks' temporaries


def _counter_words_cpu(counters, key, words, work):
    """_counter_words, with `_fresh_rounds` where the counters share their high word (every chunk
    but the one that straddles a multiple of 2^32 counters, 2^35 values into a stream)."""
    xp = backend.get_array_module(counters)
    high, c0 = work[4], work[5]
    xp.right_shift(counters, xp.uint64(32), out=high)
    shared = int(high.min())
    if shared != int(high.max()):
        return _counter_words(counters, key, words, work)
    xp.bitwise_and(counters, xp.uint64(_LOW32), out=c0)
    for m, w in enumerate(_fresh_rounds(c0, shared, key, work[:5])):
        words[:, m] = w


def _fresh_rounds(c0, high, key, work):
    """_philox_rounds of the counters (c0, high, 0, 0), the way every stream's counters start:
    c0 (n,) uint64 holding 32-bit values (overwritten), `high` one int, key two ints, `work` five
    uint64 arrays of length n. Returns the output words as uint32 views.

    The zero words make the first three rounds cheaper (3 + 5 + 6 array passes instead of 3 x 6,
    ~12% of the draw): round 1 multiplies c2 = 0, so its c0 is the number high ^ k0 and c1 = 0;
    round 2 then multiplies that number (one product for every counter) and xors c1 = 0; round 3
    xors c3, the low half of that product, also one number. Rounds 4-10 are _philox_rounds'."""
    xp = backend.get_array_module(c0)
    low, shift = xp.uint64(_LOW32), xp.uint64(32)
    k0, k1 = int(key[0]) & _LOW32, int(key[1]) & _LOW32
    p0, p0_next, p1, p1_next, c2 = work
    # round 1: (hi0, lo0) = M0 c0, M1 c2 = 0  ->  c = (high ^ k0, 0, hi0 ^ k1, lo0)
    xp.multiply(c0, xp.uint64(M0), out=p0)
    xp.right_shift(p0, shift, out=c2)
    c2 ^= xp.uint64(k1)
    c0_number = high ^ k0
    # round 2: (hi0, lo0) = M0 c0 is one number; (hi1, lo1) = M1 c2  ->  c = (hi1 ^ 0 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0)
    k0, k1 = (k0 + W0) & _LOW32, (k1 + W1) & _LOW32
    product = c0_number * M0
    xp.multiply(c2, xp.uint64(M1), out=p1)
    xp.right_shift(p1, shift, out=c0)
    c0 ^= xp.uint64(k0)
    xp.bitwise_and(p0, low, out=c2)                   # c3 of round 1: lo0 = the low half of p0
    c2 ^= xp.uint64((product >> 32) ^ k1)
    c3_number = product & _LOW32
    # round 3: c3 is one number  ->  c = (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0)
    k0, k1 = (k0 + W0) & _LOW32, (k1 + W1) & _LOW32
    xp.multiply(c0, xp.uint64(M0), out=p0_next)
    xp.multiply(c2, xp.uint64(M1), out=p1_next)
    xp.bitwise_xor(_high(p1_next), _low(p1), out=_low(c0))
    c0 ^= xp.uint64(k0)
    xp.right_shift(p0_next, shift, out=c2)
    c2 ^= xp.uint64(c3_number ^ k1)
    # rounds 4-10 as _philox_rounds, from round 4's key
    k0, k1 = (k0 + W0) & _LOW32, (k1 + W1) & _LOW32
    return _philox_rounds(c0, _low(p1_next), c2, _low(p0_next), (k0, k1), [p0, p0_next, p1, p1_next],
                          rounds=ROUNDS - 3)


def _key(seed):
    return seed & _LOW32, (seed >> 32) & _LOW32


def bits16(seed, offset, n, device="cpu", state=None):
    """Values offset, ..., offset + n - 1 (uint16, shape (n,)) of the stream of `seed`, on `device`;
    with `state` (a device (2,) uint64 array: seed, base, as under graph capture) those of the
    stream of state[0] from state[1] + offset (state[1] a multiple of 8), without reading state
    on the host."""
    counters, key, skip = _covering_counters(seed, offset, n, device, state)
    return philox_bits16(counters, key)[skip:skip + int(n)]


def bits16_at_least(seed, offset, n, threshold, device="cpu", state=None):
    """bits16(seed, offset, n, device, state) >= threshold, (n,) bool (the keep test of a dropout
    mask), without the array of 16-bit values on the CPU (where it may have been drawn ahead:
    npformer.runtime.lookahead)."""
    if device != "cpu" or state is not None:
        counters, key, skip = _covering_counters(seed, offset, n, device, state)
        return philox_at_least(counters, key, threshold)[skip:skip + int(n)]
    ahead = _at_least_ahead(seed, offset, n, threshold)
    return _at_least_now(seed, offset, n, threshold) if ahead is None else ahead


def _at_least_ahead(seed, offset, n, threshold):
    """bits16_at_least's CPU mask when npformer.runtime.lookahead drew it ahead, else None; the request is
    recorded either way."""
    finish = lambda values, skip: values[skip:skip + n] >= threshold  # noqa: E731
    return lookahead.take(("at_least", int(seed), int(n), int(threshold)), int(offset),
                          lambda at: _at_least_now(seed, at, n, threshold), _Joint(int(seed), int(n), finish))


def _at_least_now(seed, offset, n, threshold):
    """bits16_at_least on the CPU, drawn in this call."""
    counters, key, skip = _covering_counters(seed, offset, n, "cpu", None)
    return philox_at_least(counters, key, threshold)[skip:skip + int(n)]


class _Joint(NamedTuple):
    """A CPU mask that npformer.runtime.lookahead may draw together with its neighbours of the same
    stream: n values, and finish(values, skip) -> the mask from the uint16 values of the counters
    that cover it (its value 0 being values[skip])."""
    stream: int
    n: int
    finish: Any

    @staticmethod
    def draw_together(requests):
        """The masks of requests [(offset, _Joint)] of one stream, from one draw of the counters
        that span them all (a small draw's cost is mostly its numpy calls, whatever its size)."""
        spans = [(_counter_span(offset, joint.n), joint) for offset, joint in requests]
        lo = min(first for (first, _, _), _ in spans)
        hi = max(first + count for (first, _, count), _ in spans)
        xp = backend.module_for("cpu")
        values = philox_bits16(xp.arange(lo, hi, dtype="uint64"), _key(requests[0][1].stream))
        return [joint.finish(values[8 * (first - lo):8 * (first - lo + count)], skip)
                for (first, skip, count), joint in spans]


def bits16_at_least_in_runs(seed, offset, n, threshold, starts, lengths):
    """(n,) bool on the CPU whose entries i in the runs [starts[r], starts[r] + lengths[r]) are
    bits16(seed, offset + i) >= threshold, drawing only the counters that cover the runs (an entry
    outside them is False, or its own test where a counter of a run covers it): a mask whose other
    entries do not matter (the probabilities above a causal diagonal) costs the values it needs.
    starts, lengths: (R,) integer arrays, lengths >= 1, the runs in increasing order, apart.
    It may have been drawn ahead (npformer.runtime.lookahead)."""
    xp = backend.module_for("cpu")
    starts, lengths = xp.asarray(starts, dtype="int64"), xp.asarray(lengths, dtype="int64")
    draw = lambda at: _at_least_in_runs_now(seed, at, n, threshold, starts, lengths)  # noqa: E731

    def finish(values, skip):                    # the same bits from the values of every covering counter
        keep = xp.zeros(values.shape[0], dtype=bool)
        needed = _counters_of_runs(skip, starts, lengths)
        keep.view("uint64")[needed] = (values >= threshold).view("uint64")[needed]
        return keep[skip:skip + int(n)]
    ahead = lookahead.take(("runs", int(seed), int(n), int(threshold), starts.tobytes(), lengths.tobytes()),
                           int(offset), draw, _Joint(int(seed), int(n), finish))
    return draw(int(offset)) if ahead is None else ahead


def _at_least_in_runs_now(seed, offset, n, threshold, starts, lengths):
    """bits16_at_least_in_runs, drawn in this call."""
    xp = backend.module_for("cpu")
    first, skip, count = _counter_span(offset, n)
    needed = _counters_of_runs(skip, starts, lengths)
    keep = xp.zeros(count * VALUES_PER_COUNTER, dtype=bool)
    drawn = philox_at_least(needed.astype("uint64") + xp.uint64(first), _key(int(seed)), threshold)
    keep.view("uint64")[needed] = drawn.view("uint64")                            # 8 values per counter
    return keep[skip:skip + int(n)]


def _counters_of_runs(skip, starts, lengths):
    """The counters (from the first covering the mask, its value 0 being value `skip` of it) that
    cover the runs [starts[r], starts[r] + lengths[r]) of a mask, each once, increasing."""
    xp = backend.module_for("cpu")
    starts = starts + skip                                                       # from value 8 first
    hi = (starts + lengths - 1) // VALUES_PER_COUNTER                            # last counter of each run
    # run r needs counters [lo, hi] but those up to an earlier run's last one: [max(lo, that + 1), hi]
    drawn_before = xp.maximum.accumulate(xp.concatenate([xp.full(1, -1, dtype="int64"), hi[:-1]]))
    lo = xp.maximum(starts // VALUES_PER_COUNTER, drawn_before + 1)
    per_run = xp.maximum(hi - lo + 1, 0)
    ends = xp.cumsum(per_run)
    return xp.repeat(lo - (ends - per_run), per_run) + xp.arange(int(ends[-1]) if ends.size else 0)


def _covering_counters(seed, offset, n, device, state):
    """(counters, key, skip): the counters covering values offset, ..., offset + n - 1 of the stream
    (on `device`, moved by the base of `state` when given), the key, and where value `offset` is
    among the counters' values."""
    xp = backend.module_for(device)
    first, skip, count = _counter_span(offset, n)
    counters, key = _from_state(xp.arange(first, first + count, dtype="uint64"), _key(int(seed)), state)
    return counters, key, skip


def _counter_span(offset, n):
    """(first, skip, count): values offset, ..., offset + n - 1 of a stream lie in the `count`
    counters from `first`, value `offset` being value `skip` of counter `first`."""
    first, skip = divmod(int(offset), VALUES_PER_COUNTER)
    return first, skip, -(-(skip + int(n)) // VALUES_PER_COUNTER)


def _from_state(counters, key, state):
    """(counters, key), or under graph capture (state: the device (seed, base), (1,) arrays read on
    the device, base a multiple of 8) the counters moved by base / 8 and the key of state[0]."""
    if state is None:
        return counters, key
    xp = backend.get_array_module(counters)
    counters += state[1:2] >> xp.uint64(3)
    return counters, (state[0:1] & xp.uint64(_LOW32), state[0:1] >> xp.uint64(32))


def bits16_runs(seed: int, starts, width: int, state=None):
    """Values starts[r], ..., starts[r] + width - 1 of the stream of `seed` for every r: starts
    (R,) uint64 -> (R, width) uint16, on the device of `starts`. Draws whole counters around
    each run (at most one more than width / 8 per run) and picks the run out of them, so that a
    tile of a bigger mask is drawn alone, from the flat indices of its entries. With `state` (the
    device (seed, base) of a draw under graph capture) the stream is state[0]'s, from state[1]."""
    xp = backend.get_array_module(starts)
    per_run = -(-(int(width) + VALUES_PER_COUNTER - 1) // VALUES_PER_COUNTER)   # covers any skip < 8
    first = starts // xp.uint64(VALUES_PER_COUNTER)                              # (R,)
    counters, key = _from_state(first[:, None] + xp.arange(per_run, dtype="uint64"), _key(int(seed)), state)
    values = philox_bits16(counters.reshape(-1), key).reshape(starts.shape[0], -1)
    skip = (starts - first * xp.uint64(VALUES_PER_COUNTER)).astype("int64")     # (R,) in [0, 8)
    return xp.take_along_axis(values, skip[:, None] + xp.arange(int(width)), axis=1)
