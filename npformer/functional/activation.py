"""Elementwise activations (ReLU, GELU) and inverted dropout."""
import math

from autograd import Function, backend, random
from autograd.threads import for_rows, row_blocks, run_blocks

from ._common import check_tensor, has_twin
from ._erf import INV_SQRT_2PI, SQRT_2, erf

TANH_C = math.sqrt(2.0 / math.pi)  # GELU tanh form: u = TANH_C * (x + 0.044715 x^3)
TANH_K = 0.044715
# bit generators whose random_raw gives 64 random bits and whose advance(n) skips n of them
RAW_64BIT_ADVANCE = ("PCG64", "PCG64DXSM")


class ReLUFunction(Function):
    """y = max(x, 0), any shape.  dx = dy * [x > 0]."""

    @staticmethod
    def forward(ctx, x):
        xp = backend.get_array_module(x)
        positive = xp.empty(x.shape, dtype=bool)            # (...) bool: 1 byte per entry saved
        y = xp.empty(x.shape, dtype=x.dtype)
        xf, pf, yf = x.reshape(-1), positive.reshape(-1), y.reshape(-1)

        def block(start, stop):
            xp.greater(xf[start:stop], 0, out=pf[start:stop])
            xp.multiply(xf[start:stop], pf[start:stop], out=yf[start:stop])

        for_rows(block, x.size, x.size, x)
        ctx.save_for_backward(positive)
        return y

    @staticmethod
    def backward(ctx, dy):
        (positive,) = ctx.saved_tensors
        # y = x * [x > 0]  ->  dx = dy * [x > 0]
        return elementwise_product(dy, positive)


@has_twin
def relu(input):
    """max(input, 0) elementwise, like torch.nn.functional.relu."""
    check_tensor("input", input, "relu")
    return ReLUFunction.apply(input)


CACHE_CHUNK = 1 << 17  # entries per pass of a many-pass elementwise kernel (512 KiB of float32)


def in_cache_chunks(kernel, like):
    """kernel(start, stop) run on consecutive chunks of at most CACHE_CHUNK entries when the
    array `like` is in host memory (on a GPU one launch per pass is what counts: unchanged)."""
    if backend.device_of(like) != "cpu":
        return kernel

    def chunked(start, stop):
        for lo in range(start, stop, CACHE_CHUNK):
            kernel(lo, min(lo + CACHE_CHUNK, stop))
    return chunked


class GELUFunction(Function):
    """y = x * Phi(x) (exact, Phi the normal CDF) or its tanh approximation; any shape.

    exact: dx = dy * (Phi(x) + x phi(x));  tanh: dx = dy * (0.5 (1 + t) + 0.5 x (1 - t^2) du/dx).
    Blocks of entries run on the threads of `autograd.threads`, each in chunks of CACHE_CHUNK
    entries: erf's ~25 array passes then stay in the core's cache (2-3x faster than whole-array
    passes), yet each call is long enough that two threads do not wait on each other for the GIL.
    """

    @staticmethod
    def forward(ctx, x, approximate):
        ctx.approximate = approximate
        xp = backend.get_array_module(x)
        xf = x.reshape(-1)
        y = xp.empty_like(xf)
        saved = xp.empty_like(xf)                           # t = tanh(u), or Phi(x)

        def block(start, stop):
            xb, sb, yb = xf[start:stop], saved[start:stop], y[start:stop]
            if approximate == "tanh":
                xp.tanh(TANH_C * (xb + TANH_K * xb * xb * xb), out=sb)   # t = tanh(u)
                xp.add(sb, 1.0, out=yb)
                yb *= xb
                yb *= 0.5                                   # y = 0.5 x (1 + t)
                return
            sb[...] = erf(xb / SQRT_2)                      # Phi(x) = (1 + erf(x / sqrt 2)) / 2
            sb += 1.0
            sb *= 0.5
            xp.multiply(xb, sb, out=yb)                     # y = x Phi(x)

        for_rows(in_cache_chunks(block, x), xf.size, xf.size, x)
        ctx.save_for_backward(xf, saved)
        ctx.shape = x.shape
        return y.reshape(x.shape)

    @staticmethod
    def backward(ctx, dy):
        xp = backend.get_array_module(dy)
        xf, saved = ctx.saved_tensors
        dyf = dy.reshape(-1)
        dx = xp.empty_like(dyf)

        def block(start, stop):
            x, s, g = xf[start:stop], saved[start:stop], dx[start:stop]
            if ctx.approximate == "tanh":
                t = s
                # u = TANH_C (x + k x^3)  ->  du/dx = TANH_C (1 + 3 k x^2)
                du = TANH_C * (1.0 + 3.0 * TANH_K * x * x)
                # y = 0.5 x (1 + tanh(u))  ->  dy/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) du/dx
                xp.multiply(dyf[start:stop], 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du, out=g)
                return
            cdf = s
            xp.multiply(x, x, out=g)                        # phi(x) = exp(-x^2/2) / sqrt(2 pi)
            g *= -0.5
            xp.exp(g, out=g)
            g *= INV_SQRT_2PI
            # y = x Phi(x)  ->  dy/dx = Phi(x) + x phi(x)
            g *= x
            g += cdf
            g *= dyf[start:stop]

        for_rows(in_cache_chunks(block, dy), dyf.size, dyf.size, dy)
        return dx.reshape(ctx.shape)


@has_twin
def gelu(input, approximate="none"):
    """x * Phi(x), like torch.nn.functional.gelu; approximate="tanh" uses the tanh form."""
    check_tensor("input", input, "gelu")
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return GELUFunction.apply(input, approximate=approximate)


class DropoutFunction(Function):
    """y = x * keep / (1 - p) with a fixed boolean mask `keep`; any shape.  dx = dy * keep / (1 - p)."""

    @staticmethod
    def forward(ctx, x, keep, scale):
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return elementwise_product(x, keep, scale)          # (...)

    @staticmethod
    def backward(ctx, dy):
        (keep,) = ctx.saved_tensors
        # y = x * keep * scale  ->  dx = dy * keep * scale
        return elementwise_product(dy, keep, ctx.scale)


def elementwise_product(a, b, scale=None):
    """a * b (* scale) into a new contiguous array, a and b of one shape, in flat blocks on
    the threads of `autograd.threads`."""
    xp = backend.get_array_module(a)
    out = xp.empty(a.shape, dtype=a.dtype)
    af, bf, of = a.reshape(-1), b.reshape(-1), out.reshape(-1)

    def block(start, stop):
        xp.multiply(af[start:stop], bf[start:stop], out=of[start:stop])
        if scale is not None:
            of[start:stop] *= scale

    for_rows(block, a.size, a.size, a)
    return out


def dropout_mask(shape, p, device, generator=None):
    """Boolean mask, True with probability 1 - p, drawn from `generator` (a Generator of the
    device) or the device's global generator.

    On the CPU: 16 random bits per entry compared to round(p * 2^16) (the drop probability is
    p rounded to a multiple of 2^-16, within 7.7e-6). With PCG64 (numpy's default) the bits
    are its raw 64-bit draws, four entries each, and a big mask is drawn by the threads of
    `autograd.threads` from copies advanced to their block, so the mask does not depend on the number
    of threads. On the GPU, where drawing is cheap: float32 uniforms compared to p.
    """
    rng = generator if generator is not None else random.global_rng(device)
    if device != "cpu":  # cuda, and "test" standing in for it
        return rng.random(shape, dtype="float32") >= p
    threshold = min(round(p * 2**16), 2**16 - 1)
    bits = rng.bit_generator                                # the numpy BitGenerator itself
    if type(bits).__name__ not in RAW_64BIT_ADVANCE:         # e.g. MT19937: 32-bit raw draws
        return rng.integers(0, 2**16, size=shape, dtype="uint16") >= threshold
    size = math.prod(shape)
    words = -(-size // 4)                                   # 64-bit draws, 4 entries each
    host = backend.module_for("cpu")
    keep = host.empty(4 * words, dtype=bool)
    blocks = row_blocks(words, size)
    start_state = bits.state

    def draw(start, stop):                                  # words [start, stop) of the stream
        source = bits
        if start:                                           # a copy advanced to this block
            source = type(bits)()
            source.state = start_state
            source.advance(start)
        raw = source.random_raw(stop - start)               # (stop - start,) uint64
        host.greater_equal(raw.view("uint16"), threshold, out=keep[4 * start: 4 * stop])

    run_blocks(draw, blocks)
    if len(blocks) > 1:
        bits.advance(words - blocks[0][1])                  # the stream continues after the mask
    return backend.to_device(keep[:size].reshape(shape), device)


def check_dropout_p(p, op):
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
        raise ValueError(f"{op}: dropout probability must be a number in [0, 1], got {p!r}")
    return float(p)


@has_twin
def dropout(input, p=0.5, training=True, generator=None):
    """Inverted dropout like torch.nn.functional.dropout: zero each entry with probability p and
    scale the rest by 1/(1-p). p=0 or training=False returns `input` itself; p=1 returns zeros."""
    x = check_tensor("input", input, "dropout")
    p = check_dropout_p(p, "dropout")
    if not training or p == 0.0:
        return input
    device = backend.device_of(x)
    if p == 1.0:
        keep = backend.module_for(device).zeros(x.shape, dtype=bool)
        return DropoutFunction.apply(input, keep=keep, scale=0.0)
    return DropoutFunction.apply(input, keep=dropout_mask(x.shape, p, device, generator), scale=1.0 / (1.0 - p))
