"""Elementwise activations (ReLU, GELU) and inverted dropout."""
import math

from autograd import Function, backend, random
from autograd.checks import check_real
from autograd.kernels import kernel_table
from autograd.threads import for_rows

from ._common import check_tensor, has_twin
from ._erf import INV_SQRT_2PI, SQRT_2, erf

TANH_C = math.sqrt(2.0 / math.pi)  # GELU tanh form: u = TANH_C * (x + 0.044715 x^3)
TANH_K = 0.044715


class ReLUFunction(Function):
    """y = max(x, 0), any shape (relu(-inf) = 0, NaN stays NaN).  dx = dy * [not x <= 0]: like
    torch, the gradient at a NaN input is the upstream gradient."""

    @staticmethod
    def forward(ctx, x):
        xp = backend.get_array_module(x)
        positive = xp.empty(x.shape, dtype=bool)            # (...) bool [not x <= 0]: 1 byte per entry saved
        y = xp.empty(x.shape, dtype=x.dtype)
        xf, pf, yf = x.reshape(-1), positive.reshape(-1), y.reshape(-1)

        def block(start, stop):
            xp.less_equal(xf[start:stop], 0, out=pf[start:stop])
            xp.logical_not(pf[start:stop], out=pf[start:stop])      # NaN is not <= 0: passes dy
            xp.maximum(xf[start:stop], 0, out=yf[start:stop])       # not x * [x > 0]: -inf * 0 is NaN

        for_rows(block, x.size, x.size, x)
        ctx.save_for_backward(positive)
        return y

    @staticmethod
    def backward(ctx, dy):
        (positive,) = ctx.saved_tensors
        # y = max(x, 0)  ->  dx = dy * [x > 0], taken as [not x <= 0] so a NaN passes dy (torch's)
        return elementwise_product(dy, positive)


@has_twin
def relu(input):
    """max(input, 0) elementwise, like torch.nn.functional.relu."""
    check_tensor("input", input, "relu")
    return ReLUFunction.apply(input)


class GELUFunction(Function):
    """y = x * Phi(x) (exact, Phi the normal CDF) or its tanh approximation; any shape.

    exact: dx = dy * (Phi(x) + x phi(x));  tanh: dx = dy * (0.5 (1 + t) + 0.5 x (1 - t^2) du/dx).
    """

    @staticmethod
    def forward(ctx, x, approximate):
        ctx.approximate = approximate
        xp = backend.get_array_module(x)
        if approximate == "tanh":
            t = xp.tanh(TANH_C * (x + TANH_K * x * x * x))   # t = tanh(u)
            ctx.save_for_backward(x, t)
            return 0.5 * x * (1.0 + t)
        cdf = erf(x / SQRT_2)                               # Phi(x) = (1 + erf(x / sqrt 2)) / 2
        cdf += 1.0
        cdf *= 0.5
        ctx.save_for_backward(x, cdf)
        return x * cdf

    @staticmethod
    def backward(ctx, dy):
        xp = backend.get_array_module(dy)
        if ctx.approximate == "tanh":
            x, t = ctx.saved_tensors
            # u = TANH_C (x + k x^3)  ->  du/dx = TANH_C (1 + 3 k x^2)
            du = TANH_C * (1.0 + 3.0 * TANH_K * x * x)
            # y = 0.5 x (1 + tanh(u))  ->  dy/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) du/dx
            return dy * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du)
        x, cdf = ctx.saved_tensors
        density = x * x                                     # phi(x) = exp(-x^2/2) / sqrt(2 pi)
        density *= -0.5
        xp.exp(density, out=density)
        density *= INV_SQRT_2PI
        # y = x Phi(x)  ->  dy/dx = Phi(x) + x phi(x)
        density *= x
        density += cdf
        density *= dy
        return density


@has_twin
def gelu(input, approximate="none"):
    """x * Phi(x), like torch.nn.functional.gelu; approximate="tanh" uses the tanh form."""
    check_tensor("input", input, "gelu")
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return GELUFunction.apply(input, approximate=approximate)


class DropoutFunction(Function):
    """y = x * keep / (1 - p), any shape, keep_i = bits16(seed, offset + i) >= threshold over the
    flat (C-order) index i of x.  dx = dy * keep / (1 - p).

    What backward needs comes from the kernel table: on the CPU the mask (1 byte per entry,
    cheaper than drawing it again), on a GPU nothing (the kernel regenerates it)."""

    @staticmethod
    def forward(ctx, x, seed, offset, p):
        y, keep = dropout_forward(x, seed, offset, p)       # (...), (...) bool or None
        ctx.save_for_backward(keep)
        ctx.stream = (seed, offset, p)
        return y

    @staticmethod
    def backward(ctx, dy):
        (keep,) = ctx.saved_tensors
        # y = x * keep / (1 - p)  ->  dx = dy * keep / (1 - p)
        return dropout_backward(dy, keep, *ctx.stream)


@kernel_table
def dropout_forward(x, seed, offset, p):
    """(y, keep): y = x * keep / (1 - p) with the mask of `keep_mask`, which is returned for
    the backward (implementations that regenerate it return None instead)."""
    keep = keep_mask(x.shape, p, seed, offset, backend.device_of(x))
    return elementwise_product(x, keep, dropout_scale(p)), keep


@kernel_table
def dropout_backward(dy, keep, seed, offset, p):
    """dx = dy * keep / (1 - p) with the forward's mask `keep` (regenerated when None)."""
    if keep is None:
        keep = keep_mask(dy.shape, p, seed, offset, backend.device_of(dy))
    return elementwise_product(dy, keep, dropout_scale(p))


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


def dropout_threshold(p):
    """Dropout's keep test: an entry is kept iff its 16 random bits are >= this threshold,
    min(round(p 2^16), 2^16 - 1), so the drop probability is p rounded to a multiple of 2^-16
    (within 7.7e-6); p = 1 gives 2^16, which keeps nothing."""
    return 2**16 if p == 1.0 else min(round(p * 2**16), 2**16 - 1)


def dropout_scale(p):
    """1 / (1 - p), the scale of the kept entries (0 for p = 1: everything is dropped)."""
    return 1.0 / (1.0 - p) if p < 1.0 else 0.0


def dropout_stream(generator, op):
    """The random.Philox stream a dropout draws from: `generator`, or the global
    random.dropout_stream() when None."""
    if generator is None:
        return random.dropout_stream()
    if not isinstance(generator, random.Philox):
        raise TypeError(f"{op}: generator must be an autograd.random.Philox (a dropout stream, like a "
                        f"torch.Generator) or None for the global one, got {type(generator).__name__}")
    return generator


def keep_mask(shape, p, seed, offset, device):
    """The boolean mask of a dropout over an array of `shape` whose values start at `offset` of
    the stream of `seed`: entry i (C order) is kept iff bits16(seed, offset + i) >= threshold."""
    size = math.prod(shape)
    if p == 1.0:                                            # nothing passes a threshold of 2^16
        return backend.module_for(device).zeros(shape, dtype=bool)
    return (random.bits16(seed, offset, size, device) >= dropout_threshold(p)).reshape(shape)


def dropout_mask(shape, p, device, generator=None, op="dropout"):
    """Boolean mask of `shape`, True (keep) with probability 1 - p, on `device`: takes
    prod(shape) values from `generator` (an autograd.random.Philox; None: the global dropout
    stream), so every dropout site, on every device, draws the same mask for the same stream
    state. Kept entries are those whose 16 random bits are >= dropout_threshold(p)."""
    stream = dropout_stream(generator, op)
    return keep_mask(shape, p, stream.seed, stream.take(math.prod(shape)), device)


@has_twin
def dropout(input, p=0.5, training=True, generator=None):
    """Inverted dropout like torch.nn.functional.dropout: zero each entry with probability p and
    scale the rest by 1/(1-p). p=0 or training=False returns `input` itself; p=1 returns zeros.

    The mask comes from `generator`, an autograd.random.Philox (like a torch.Generator), or the
    global stream `autograd.random.dropout_stream()` (seeded by npformer.manual_seed): a dropout
    over n entries takes the next n values of the stream, and the mask is the same on every
    device and for any number of threads."""
    x = check_tensor("input", input, "dropout")
    p = check_real(p, "p", "dropout", at_least=0, at_most=1)
    if not training or p == 0.0:
        return input
    stream = dropout_stream(generator, "dropout")
    return DropoutFunction.apply(input, seed=stream.seed, offset=stream.take(x.size), p=p)
