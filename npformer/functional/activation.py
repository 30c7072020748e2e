"""Elementwise activations (ReLU, GELU; with a bias: the epilogue of `linear`) and inverted dropout."""
from __future__ import annotations

import math

from autograd import Function, Tensor, backend, random
from autograd.backend import Array
from autograd.checks import check_bool, check_real
from autograd.kernels import kernel_table
from autograd.threads import for_rows

from ._common import check_tensor, has_twin
from ._erf import INV_SQRT_2PI, SQRT_2, erf, normal_cdf_float32


TANH_C = math.sqrt(2.0 / math.pi)  # GELU tanh form: u = TANH_C * (x + 0.044715 x^3)
TANH_K = 0.044715


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


# entries per pass of GELU's many-pass CPU blocks (512 KiB of float32): erf's ~25 array passes
# stay in the core's cache (2-3x faster than whole-array passes), and each numpy call is long
# enough that two threads do not wait on each other for the GIL
CACHE_CHUNK = 1 << 17


def in_cache_chunks(kernel, row_length=1):
    """kernel(start, stop) run on consecutive chunks of rows of `row_length` entries, at most
    CACHE_CHUNK entries (or one row) a chunk."""
    rows = max(CACHE_CHUNK // max(row_length, 1), 1)   # rows of 0 entries: one chunk

    def chunked(start, stop):
        for lo in range(start, stop, rows):
            kernel(lo, min(lo + rows, stop))
    return chunked


def _bias_rows(x, bias):
    """(rows, n): the 2-D shape of x as rows of the bias's length (n = x.shape[-1]) or, without a
    bias, of single entries (rows counted, not -1 in reshape: n may be 0)."""
    n = x.shape[-1] if bias is not None else 1
    return (x.size // n if n else 0, n)


@bias_activation_forward.register("cpu")
def bias_activation_forward_cpu(x, bias, kind):
    """ReLU, and GELU in cache-sized chunks, in flat blocks on the threads of `autograd.threads`
    (the bias added in place)."""
    if kind != "relu":
        return _gelu_forward_cpu(x, bias, kind)
    xp = backend.get_array_module(x)
    keep = xp.empty(x.shape, dtype=bool)                    # (...) bool: 1 byte per entry saved
    y = xp.empty(x.shape, dtype=x.dtype)
    rows = _bias_rows(x, bias)                               # (rows, n)
    xf, kf, yf = x.reshape(rows), keep.reshape(rows), y.reshape(rows)

    def block(start, stop):
        h = xf[start:stop]
        if bias is not None:
            h = xp.add(h, bias, out=yf[start:stop])
        xp.less_equal(h, 0, out=kf[start:stop])
        xp.logical_not(kf[start:stop], out=kf[start:stop])
        xp.maximum(h, 0, out=yf[start:stop])

    for_rows(block, xf.shape[0], x.size, x)
    return y, (keep,)


def _gelu_forward_cpu(x, bias, kind):
    """The reference's GELU (exact or tanh form) on blocks of rows and cache-sized chunks, the bias
    added chunk by chunk: (y, (h, aux)). float32's exact form takes Phi from normal_cdf_float32."""
    xp = backend.get_array_module(x)
    xf = x.reshape(_bias_rows(x, bias))
    n = xf.shape[1]
    hf = xp.empty_like(xf) if bias is not None else xf         # h = x + bias, saved for the backward
    y, aux = xp.empty_like(xf), xp.empty_like(xf)              # aux: tanh(u), or Phi(h)

    def block(start, stop):
        hb, ab, yb = hf[start:stop], aux[start:stop], y[start:stop]
        if bias is not None:
            xp.add(xf[start:stop], bias, out=hb)
        if kind == "gelu_tanh":
            xp.tanh(TANH_C * (hb + TANH_K * hb * hb * hb), out=ab)   # t = tanh(u)
            xp.add(ab, 1.0, out=yb)
            yb *= hb
            yb *= 0.5                                               # y = 0.5 h (1 + t)
            return
        if hb.dtype == xp.float32:
            normal_cdf_float32(hb, out=ab)                          # Phi(h)
        else:
            ab[...] = erf(hb / SQRT_2)                              # Phi(h) = (1 + erf(h / sqrt 2)) / 2
            ab += 1.0
            ab *= 0.5
        xp.multiply(hb, ab, out=yb)                                 # y = h Phi(h)

    for_rows(in_cache_chunks(block, n), xf.shape[0], x.size, x)
    shape = x.shape
    return y.reshape(shape), (hf.reshape(shape), aux.reshape(shape))


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


@bias_activation_backward.register("cpu")
def bias_activation_backward_cpu(dy, saved, kind):
    """ReLU's dh in flat blocks on the threads of `autograd.threads`: dy's bits ANDed with a mask of
    all ones (kept) or zeros (dropped), the exact `where(keep, dy, 0)` at the cost of a multiply
    (numpy's where and copyto(where=) are ~8x slower). GELU's in blocks and cache-sized chunks."""
    if kind != "relu":
        return _gelu_backward_cpu(dy, saved, kind)
    xp = backend.get_array_module(dy)
    (keep,) = saved
    dh = xp.empty(dy.shape, dtype=dy.dtype)
    bits = f"int{8 * dy.itemsize}"                              # an integer of the float's width
    df, kf, hf = dy.reshape(-1).view(bits), keep.reshape(-1).view("int8"), dh.reshape(-1).view(bits)

    def block(start, stop):
        xp.bitwise_and(df[start:stop], xp.negative(kf[start:stop], dtype=bits), out=hf[start:stop])  # -1: all ones

    for_rows(block, dy.size, dy.size, dy)
    return dh


def _gelu_backward_cpu(dy, saved, kind):
    """The reference's GELU backward on flat blocks and cache-sized chunks."""
    xp = backend.get_array_module(dy)
    h, aux = (a.reshape(-1) for a in saved)
    dyf = dy.reshape(-1)
    dh = xp.empty_like(dyf)

    @in_cache_chunks
    def block(start, stop):
        hb, ab, g = h[start:stop], aux[start:stop], dh[start:stop]
        if kind == "gelu_tanh":
            # u = TANH_C (h + k h^3)  ->  du/dh = TANH_C (1 + 3 k h^2)
            du = TANH_C * (1.0 + 3.0 * TANH_K * hb * hb)
            # y = 0.5 h (1 + tanh(u))  ->  dy/dh = 0.5 (1 + t) + 0.5 h (1 - t^2) du/dh
            xp.multiply(dyf[start:stop], 0.5 * (1.0 + ab) + 0.5 * hb * (1.0 - ab * ab) * du, out=g)
            return
        xp.multiply(hb, hb, out=g)                                  # phi(h) = exp(-h^2/2) / sqrt(2 pi)
        g *= -0.5
        xp.exp(g, out=g)
        g *= INV_SQRT_2PI
        # y = h Phi(h)  ->  dy/dh = Phi(h) + h phi(h)
        g *= hb
        g += ab
        g *= dyf[start:stop]

    for_rows(block, dyf.size, dyf.size, dy)
    return dh.reshape(dy.shape)


class ReLUFunction(Function):
    """y = max(x, 0), any shape (relu(NaN) = NaN).  dx = dy where not (x <= 0), else 0."""

    @staticmethod
    def forward(ctx, x):
        y, ctx.activation_saved = bias_activation_forward(x, None, "relu")
        return y

    @staticmethod
    def backward(ctx, dy):
        return bias_activation_backward(dy, ctx.activation_saved, "relu")

    @staticmethod
    def jvp(ctx, t):
        # y = max(x, 0)  ->  t_y = t_x * [not x <= 0]: elementwise, so the backward's kernel applies
        return bias_activation_backward(t, ctx.activation_saved, "relu")


@has_twin
def relu(input: Tensor | Array) -> Tensor:
    """max(input, 0) elementwise, any shape, like torch.nn.functional.relu (a NaN stays NaN).
    Raises TypeError unless `input` is a floating Tensor or array."""
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

    @staticmethod
    def jvp(ctx, t):
        # y = gelu(x)  ->  t_y = gelu'(x) * t_x: elementwise, so the backward's kernel applies
        return bias_activation_backward(t, ctx.activation_saved, ctx.kind)


@has_twin
def gelu(input: Tensor | Array, approximate: str = "none") -> Tensor:
    """x * Phi(x) elementwise (Phi: the standard normal CDF), like torch.nn.functional.gelu;
    approximate="tanh" uses the tanh form (GPT-2's). Raises ValueError for another `approximate`."""
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
    def forward(ctx, x, seed, offset, p, state=None):
        y, keep = dropout_forward(x, seed, offset, p, state)    # (...), (...) bool or None
        ctx.save_for_backward(keep)
        ctx.stream = (seed, offset, p, state)
        return y

    @staticmethod
    def backward(ctx, dy):
        (keep,) = ctx.saved_tensors
        # y = x * keep / (1 - p)  ->  dx = dy * keep / (1 - p)
        return dropout_backward(dy, keep, *ctx.stream)

    @staticmethod
    def jvp(ctx, t):
        (keep,) = ctx.saved_tensors
        # y = x * keep / (1 - p)  ->  t_y = t_x * keep / (1 - p), the forward's mask (kept, or drawn again)
        return dropout_backward(t, keep, *ctx.stream)


@kernel_table
def dropout_forward(x, seed, offset, p, state=None):
    """(y, keep): y = x * keep / (1 - p) with the mask of `keep_mask`, which is returned for
    the backward (implementations that regenerate it return None instead). state: None, or under
    graph capture the device (seed, base) of the draw (autograd.random.PhiloxDraw)."""
    keep = keep_mask(x.shape, p, seed, offset, backend.device_of(x), state)
    return elementwise_product(x, keep, dropout_scale(p)), keep


@dropout_forward.register("cpu", supports=lambda x, seed, offset, p, state=None: state is None and p < 1.0)
def dropout_forward_cpu(x, seed, offset, p, state=None):
    """The mask drawn and applied chunk by chunk while it is in the cache, in blocks on the threads
    (random.for_keep_chunks)."""
    return dropout_apply_cpu(x, seed, offset, p)


def dropout_apply_cpu(x, seed, offset, p, residual=None):
    """(x * keep / (1 - p) (+ residual), keep) on the CPU in cache-sized chunks: each chunk's mask
    is copied out for the backward and applied as the multiplier m = keep / (1 - p) (a chunk-sized
    buffer): x * m has the bits of (x * keep) / (1 - p), a kept entry being x / (1 - p) and a
    dropped one x * 0 either way."""
    xp = backend.get_array_module(x)
    xf = x.reshape(-1)
    rf = None if residual is None else residual.reshape(-1)
    y, keep = xp.empty_like(xf), xp.empty(x.size, dtype=bool)
    scale = dropout_scale(p)

    def apply(start, stop, piece):
        keep[start:stop] = piece
        out = y[start:stop]
        xp.multiply(piece, scale, out=out, dtype=out.dtype)        # m = keep / (1 - p)
        out *= xf[start:stop]
        if rf is not None:
            out += rf[start:stop]

    random.for_keep_chunks(seed, offset, x.size, dropout_threshold(p), apply)
    return y.reshape(x.shape), keep.reshape(x.shape)


@kernel_table
def dropout_backward(dy, keep, seed, offset, p, state=None):
    """dx = dy * keep / (1 - p) with the forward's mask `keep` (regenerated when None)."""
    if keep is None:
        keep = keep_mask(dy.shape, p, seed, offset, backend.device_of(dy), state)
    return elementwise_product(dy, keep, dropout_scale(p))


@dropout_backward.register("cpu", supports=lambda dy, keep, seed, offset, p, state=None: keep is not None)
def dropout_backward_cpu(dy, keep, seed, offset, p, state=None):
    """dy * m, m = keep / (1 - p) made chunk by chunk in the cache (the bits of (dy * keep) / (1 - p)),
    in flat blocks on the threads."""
    xp = backend.get_array_module(dy)
    df, kf = dy.reshape(-1), keep.reshape(-1)
    dx = xp.empty_like(df)
    scale = dropout_scale(p)

    @in_cache_chunks
    def block(start, stop):
        out = dx[start:stop]
        xp.multiply(kf[start:stop], scale, out=out, dtype=out.dtype)
        out *= df[start:stop]

    for_rows(block, df.size, df.size, dy)
    return dx.reshape(dy.shape)


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


def keep_mask(shape, p, seed, offset, device, state=None):
    """The boolean mask of a dropout over an array of `shape` whose values start at `offset` of
    the stream of `seed` (or, with `state`, of the device (seed, base): graph capture): entry i
    (C order) is kept iff bits16(seed, offset + i) >= threshold."""
    size = math.prod(shape)
    if p == 1.0:                                            # nothing passes a threshold of 2^16
        return backend.module_for(device).zeros(shape, dtype=bool)
    return random.bits16_at_least(seed, offset, size, dropout_threshold(p), device, state).reshape(shape)


def dropout_mask(shape, p, device, generator=None, op="dropout"):
    """Boolean mask of `shape`, True (keep) with probability 1 - p, on `device`: takes
    prod(shape) values from `generator` (an autograd.random.Philox; None: the global dropout
    stream), so every dropout site, on every device, draws the same mask for the same stream
    state. Kept entries are those whose 16 random bits are >= dropout_threshold(p)."""
    draw = dropout_stream(generator, op).draw(math.prod(shape), device)
    return keep_mask(shape, p, draw.seed, draw.offset, device, draw.state)


@has_twin
def dropout(input: Tensor | Array, p: float = 0.5, training: bool = True,
            generator: random.Philox | None = None) -> Tensor | Array:
    """Inverted dropout like torch.nn.functional.dropout: zero each entry with probability p and
    scale the rest by 1/(1-p). p=0 or training=False returns `input` itself; p=1 returns zeros.

    The mask comes from `generator`, an autograd.random.Philox (like a torch.Generator), or the
    global stream `autograd.random.dropout_stream()` (seeded by npformer.manual_seed): a dropout
    over n entries takes the next n values of the stream, and the mask is the same on every
    device and for any number of threads. Raises ValueError unless 0 <= p <= 1, TypeError for a
    `training` that is not a bool.
    """
    x = check_tensor("input", input, "dropout")
    p = check_real(p, "p", "dropout", at_least=0, at_most=1)
    if not check_bool(training, "training", "dropout") or p == 0.0:
        return input
    draw = dropout_stream(generator, "dropout").draw(x.size, backend.device_of(x))
    return DropoutFunction.apply(input, seed=draw.seed, offset=draw.offset, p=p, state=draw.state)
