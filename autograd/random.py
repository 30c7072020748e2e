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

Under graph capture (autograd.graphs, npformer.cuda.graphed) a replayed step must draw new values
each time, so `Philox.draw` then hands out offsets relative to a base that lives in device memory:
a (2,) uint64 array (seed, base) that kernels read (`PhiloxDraw.state`), rewritten before each
replay with the next unused offset, like torch's Philox state under CUDA graphs.
"""
from typing import Any, NamedTuple

from . import backend, graphs, threads
from .checks import check_int

_generators = {}

M0, M1 = 0xD2511F53, 0xCD9E8D57          # Philox4x32 multipliers
W0, W1 = 0x9E3779B9, 0xBB67AE85          # Weyl key increments (golden ratio, sqrt(3) - 1)
ROUNDS = 10
VALUES_PER_COUNTER = 8                   # 16-bit values per Philox call (128 bits)
_LOW32 = 0xFFFFFFFF
_CHUNK = 1 << 14                         # counters per chunk on the CPU (a few 100 KB of temporaries)


def default_rng(seed=None, device="cpu"):
    """A new random Generator whose arrays live on `device`."""
    xp = backend.module_for(device)
    return xp.random.default_rng(seed)


def manual_seed(seed):
    """Reseed every global generator: each device's Generator and the dropout stream."""
    seed = check_int(seed, "seed", "manual_seed", at_least=0)
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
    if device not in _generators:  # one independent stream per device from the one seed
        (seed,) = _seed_words(backend.DEVICES.index(device), 1)
        _generators[device] = default_rng(seed, device)
    return _generators[device]


def dropout_stream():
    """The global Philox stream of every dropout mask, on every device (one object for the whole
    run: manual_seed reseeds it in place, so a captured graph keeps drawing from it)."""
    stream = _generators.setdefault("dropout", _dropout)
    if not stream.seeded:
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
    (`state_dict()`), the same for every device."""

    def __init__(self, seed=0, offset=0):
        self.seed, self.offset = int(seed) % 2**64, int(offset)
        self.seeded = True

    def manual_seed(self, seed):
        self.seed, self.offset, self.seeded = int(seed) % 2**64, 0, True
        return self

    def take(self, n):
        """Reserve the next n values; returns their first offset."""
        start = self.offset
        self.offset += -(-int(n) // VALUES_PER_COUNTER) * VALUES_PER_COUNTER
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
            return PhiloxDraw(self.seed, self.take(n))
        key = ("philox", id(self))
        if key not in capture.slots:
            record = {"base": self.offset, "per_step": 0}
            state = capture.slot(key, lambda: backend.module_for(device).empty(2, dtype="uint64"))
            capture.slots[key + ("record",)] = record

            def before_replay(replay):  # replay 0 performs the captured step: the values it reserved
                base = record["base"] if replay == 0 else self.take(record["per_step"])
                backend.copy_from_host(state, backend.module_for("cpu").array([self.seed, base], dtype="uint64"))
            capture.before_replay(before_replay)
        record = capture.slots[key + ("record",)]
        offset = self.take(n) - record["base"]
        record["per_step"] = self.offset - record["base"]
        return PhiloxDraw(self.seed, offset, capture.slots[key])

    def state_dict(self):
        return {"seed": self.seed, "offset": self.offset}

    def load_state_dict(self, state):
        self.seed, self.offset = int(state["seed"]) % 2**64, int(state["offset"])

    def __repr__(self):
        return f"Philox(seed={self.seed}, offset={self.offset})"


_dropout = Philox()  # the dropout stream (dropout_stream()), seeded on first use
_dropout.seeded = False


def philox4x32(counter, key):
    """Philox4x32-10 of four arrays of 32-bit counter words (any integer dtype, values < 2^32)
    under a key of two ints (or two uint64 device arrays that broadcast, values < 2^32) -> four
    uint64 arrays holding the 32-bit output words."""
    xp = backend.get_array_module(*counter)
    c0, c1, c2, c3 = (xp.array(c, dtype="uint64") for c in counter)   # owned copies, updated in place
    k0, k1 = (k if backend.is_array(k) else xp.uint64(int(k) & _LOW32) for k in key)
    m0, m1, low, shift = xp.uint64(M0), xp.uint64(M1), xp.uint64(_LOW32), xp.uint64(32)
    p0, p1 = xp.empty_like(c0), xp.empty_like(c0)
    for r in range(ROUNDS):
        if r:
            k0, k1 = (k0 + xp.uint64(W0)) & low, (k1 + xp.uint64(W1)) & low
        xp.multiply(c0, m0, out=p0)           # (hi0, lo0) = M0 * c0
        xp.multiply(c2, m1, out=p1)           # (hi1, lo1) = M1 * c2
        xp.right_shift(p1, shift, out=c0)     # c0 = hi1 ^ c1 ^ k0
        c0 ^= c1
        c0 ^= k0
        xp.right_shift(p0, shift, out=c2)     # c2 = hi0 ^ c3 ^ k1
        c2 ^= c3
        c2 ^= k1
        xp.bitwise_and(p1, low, out=c1)       # c1 = lo1
        xp.bitwise_and(p0, low, out=c3)       # c3 = lo0
    return c0, c1, c2, c3


def bits16(seed, offset, n, device="cpu", state=None):
    """Values offset, ..., offset + n - 1 (uint16, shape (n,)) of the stream of `seed`; with
    `state` (a device (2,) uint64 array: seed, base), of the stream of state[0] from state[1] +
    offset (state[1] a multiple of 8), computed without reading state on the host.
    On the CPU, blocks of counters run on the threads of `autograd.threads`."""
    xp = backend.module_for(device)
    first = int(offset) // VALUES_PER_COUNTER
    skip = int(offset) - first * VALUES_PER_COUNTER
    count = -(-(skip + int(n)) // VALUES_PER_COUNTER)                   # counters covering the range
    words = xp.empty((count, 4), dtype="uint32")                        # 4 output words per counter
    if state is None:
        key, base = (seed & _LOW32, (seed >> 32) & _LOW32), None
    else:                                                               # (1,) arrays, read on the device
        low, shift = xp.uint64(_LOW32), xp.uint64(32)
        key, base = (state[0:1] & low, state[0:1] >> shift), state[1:2] >> xp.uint64(3)

    def block(start, stop):
        for lo in range(start, stop, _CHUNK):                           # chunks whose temporaries stay in cache
            hi = min(lo + _CHUNK, stop)
            index = xp.arange(first + lo, first + hi, dtype="uint64")
            if base is not None:
                index += base
            zero = xp.zeros(hi - lo, dtype="uint64")
            for m, w in enumerate(philox4x32((index & xp.uint64(_LOW32), index >> xp.uint64(32), zero, zero), key)):
                words[lo:hi, m] = w

    threads.for_rows(block, count, 4 * count, words)
    # value 2m of a counter is the low half of word m, value 2m + 1 its high half: on a
    # little-endian machine (x86, Arm, GPUs) that is the uint16 view of the words
    return words.view("uint16").reshape(-1)[skip:skip + int(n)]
