"""Elementwise activations (ReLU, GELU; with a bias: the epilogue of `linear`) and inverted dropout."""
import math

from autograd import Function, backend, random
from autograd.checks import check_real
from autograd.kernels import kernel_table
from autograd.threads import for_rows, row_blocks, run_blocks

from ._common import check_tensor, has_twin
from ._erf import INV_SQRT_2PI, SQRT_2, erf

TANH_C = math.sqrt(2.0 / math.pi)  # GELU tanh form: u = TANH_C * (x + 0.044715 x^3)
TANH_K = 0.044715
# bit generators whose random_raw gives 64 random bits and whose advance(n) skips n of them
RAW_64BIT_ADVANCE = ("PCG64", "PCG64DXSM")


ACTIVATIONS = ("relu", "gelu", "gelu_tanh")  # bias_activation kinds (gelu: the exact form)


@kernel_table
def bias_activation_forward(x, bias, kind):
    """y = act(x + bias) for x (..., N), bias (N,) or None, kind in ACTIVATIONS -> (y, saved):
    relu saves (keep,) with keep = not (h <= 0) (bool); gelu saves (h, aux) with h = x + bias (x
    itself without a bias) and aux = Phi(h) (exact) or tanh(u) (tanh form)."""
    xp = backend.get_array_module(x)
    h = x + bias if bias is not None else x
    if kind == "relu":
        keep = ~(h <= 0)                                    # NaN is kept: relu(NaN) = NaN, as torch's
        return xp.where(keep, h, 0), (keep,)                # relu(-inf) = 0
    if kind == "gelu_tanh":
        t = xp.tanh(TANH_C * (h + TANH_K * h * h * h))      # t = tanh(u)
        return 0.5 * h * (1.0 + t), (h, t)
    cdf = erf(h / SQRT_2)                                   # Phi(h) = (1 + erf(h / sqrt 2)) / 2
    cdf += 1.0
    cdf *= 0.5
    return h * cdf, (h, cdf)


@bias_activation_forward.register("cpu", supports=lambda x, bias, kind: kind == "relu")
def bias_activation_forward_cpu(x, bias, kind):
    """ReLU in flat blocks on the threads of `autograd.threads` (the bias added in place)."""
    xp = backend.get_array_module(x)
    keep = xp.empty(x.shape, dtype=bool)                    # (...) bool: 1 byte per entry saved
    y = xp.empty(x.shape, dtype=x.dtype)
    n = x.shape[-1] if bias is not None else 1                 # rows of the bias's length, or single entries
    xf, kf, yf = x.reshape(-1, n), keep.reshape(-1, n), y.reshape(-1, n)

    def block(start, stop):
        h = xf[start:stop]
        if bias is not None:
            h = xp.add(h, bias, out=yf[start:stop])
        xp.less_equal(h, 0, out=kf[start:stop])
        xp.logical_not(kf[start:stop], out=kf[start:stop])
        xp.maximum(h, 0, out=yf[start:stop])

    for_rows(block, xf.shape[0], x.size, x)
    return y, (keep,)


@kernel_table
def bias_activation_backward(dy, saved, kind):
    """dh = dy * act'(h), from what bias_activation_forward saved; the bias gradient is the sum of
    dh over the leading dimensions."""
    xp = backend.get_array_module(dy)
    if kind == "relu":
        (keep,) = saved
        # y = h where keep, else 0  ->  dh = dy where keep, else 0 (also for a NaN dy, as torch)
        return xp.where(keep, dy, 0)
    h, aux = saved
    if kind == "gelu_tanh":
        # u = TANH_C (h + k h^3)  ->  du/dh = TANH_C (1 + 3 k h^2)
        du = TANH_C * (1.0 + 3.0 * TANH_K * h * h)
        # y = 0.5 h (1 + tanh(u))  ->  dy/dh = 0.5 (1 + t) + 0.5 h (1 - t^2) du/dh
        return dy * (0.5 * (1.0 + aux) + 0.5 * h * (1.0 - aux * aux) * du)
    density = h * h                                         # phi(h) = exp(-h^2/2) / sqrt(2 pi)
    density *= -0.5
    xp.exp(density, out=density)
    density *= INV_SQRT_2PI
    # y = h Phi(h)  ->  dy/dh = Phi(h) + h phi(h)
    density *= h
    density += aux
    density *= dy
    return density


@bias_activation_backward.register("cpu", supports=lambda dy, saved, kind: kind == "relu")
def bias_activation_backward_cpu(dy, saved, kind):
    """ReLU's dh in flat blocks on the threads of `autograd.threads`: dy's bits ANDed with a mask of
    all ones (kept) or zeros (dropped), the exact `where(keep, dy, 0)` at the cost of a multiply
    (numpy's where and copyto(where=) are ~8x slower)."""
    xp = backend.get_array_module(dy)
    (keep,) = saved
    dh = xp.empty(dy.shape, dtype=dy.dtype)
    bits = f"int{8 * dy.itemsize}"                              # an integer of the float's width
    df, kf, hf = dy.reshape(-1).view(bits), keep.reshape(-1).view("int8"), dh.reshape(-1).view(bits)

    def block(start, stop):
        xp.bitwise_and(df[start:stop], xp.negative(kf[start:stop], dtype=bits), out=hf[start:stop])  # -1: all ones

    for_rows(block, dy.size, dy.size, dy)
    return dh


class ReLUFunction(Function):
    """y = max(x, 0), any shape (relu(NaN) = NaN).  dx = dy where not (x <= 0), else 0."""

    @staticmethod
    def forward(ctx, x):
        y, ctx.activation_saved = bias_activation_forward(x, None, "relu")
        return y

    @staticmethod
    def backward(ctx, dy):
        return bias_activation_backward(dy, ctx.activation_saved, "relu")


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
        ctx.kind = "gelu_tanh" if approximate == "tanh" else "gelu"
        y, ctx.activation_saved = bias_activation_forward(x, None, ctx.kind)
        return y

    @staticmethod
    def backward(ctx, dy):
        return bias_activation_backward(dy, ctx.activation_saved, ctx.kind)


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


@has_twin
def dropout(input, p=0.5, training=True, generator=None):
    """Inverted dropout like torch.nn.functional.dropout: zero each entry with probability p and
    scale the rest by 1/(1-p). p=0 or training=False returns `input` itself; p=1 returns zeros."""
    x = check_tensor("input", input, "dropout")
    p = check_real(p, "p", "dropout", at_least=0, at_most=1)
    if not training or p == 0.0:
        return input
    device = backend.device_of(x)
    if p == 1.0:
        keep = backend.module_for(device).zeros(x.shape, dtype=bool)
        return DropoutFunction.apply(input, keep=keep, scale=0.0)
    return DropoutFunction.apply(input, keep=dropout_mask(x.shape, p, device, generator), scale=1.0 / (1.0 - p))
