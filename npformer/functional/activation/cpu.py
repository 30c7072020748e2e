"""Activations and dropout on the CPU (the "cpu" implementations of this folder's kernel tables,
same signatures as the math.py references, xp first): ReLU in flat blocks on the threads of
`npformer.runtime.threads` (its backward a bitwise AND), GELU in blocks and cache-sized chunks (float32:
Phi by one rational function), dropout's elementwise products in flat blocks."""
from autograd.backend import overflow_ignored
from npformer.runtime import threads
from npformer.runtime.threads import for_rows

from . import (TANH_C, TANH_K, bias_activation_backward, bias_activation_forward,  # the tables
               elementwise_product, erf, gelu_backward_density, gelu_backward_jvp, gelu_double_backward, math)
from .erf import INV_SQRT_2PI, SQRT_2, normal_cdf_float32

# entries per pass of GELU's many-pass blocks (512 KiB of float32): erf's ~25 passes stay in the core's cache
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
def bias_activation_forward_cpu(xp, x, bias, kind):
    """ReLU, and GELU in cache-sized chunks, in flat blocks on the threads of `npformer.runtime.threads`
    (the bias added in place)."""
    if kind != "relu":
        return _gelu_forward_cpu(xp, x, bias, kind)
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


def _gelu_forward_cpu(xp, x, bias, kind):
    """The reference's GELU (exact or tanh form) on blocks of rows and cache-sized chunks, the bias
    added chunk by chunk: (y, (h, aux)). float32's exact form takes Phi from normal_cdf_float32."""
    xf = x.reshape(_bias_rows(x, bias))
    n = xf.shape[1]
    hf = xp.empty_like(xf) if bias is not None else xf         # h = x + bias, saved for the backward
    y, aux = xp.empty_like(xf), xp.empty_like(xf)              # aux: tanh(u), or Phi(h)

    def block(start, stop):
        hb, ab, yb = hf[start:stop], aux[start:stop], y[start:stop]
        if bias is not None:
            xp.add(xf[start:stop], bias, out=hb)
        if kind == "gelu_tanh":
            with overflow_ignored():  # h^3 is inf for |h| > 7e12 in float32: tanh(inf) = 1, the limit (math.tanh_of_cubic)
                xp.tanh(TANH_C * (hb + TANH_K * hb * hb * hb), out=ab)   # t = tanh(u)
            xp.add(ab, 1.0, out=yb)
            yb *= 0.5
            yb *= hb                                                # y = 0.5 h (1 + t): (1 + t) h overflows for h > max / 2
            return
        if hb.dtype == xp.float32:
            normal_cdf_float32(xp, hb, out=ab)                      # Phi(h)
        else:
            ab[...] = erf(xp, hb / SQRT_2)                              # Phi(h) = (1 + erf(h / sqrt 2)) / 2
            ab += 1.0
            ab *= 0.5
        xp.multiply(hb, ab, out=yb)                                 # y = h Phi(h)

    for_rows(in_cache_chunks(block, n), xf.shape[0], x.size, x)
    shape = x.shape
    return y.reshape(shape), (hf.reshape(shape), aux.reshape(shape))


@bias_activation_backward.register("cpu")
def bias_activation_backward_cpu(xp, dy, saved, kind):
    """ReLU's dh in flat blocks on the threads of `npformer.runtime.threads`: dy's bits ANDed with a mask of
    all ones (kept) or zeros (dropped), the exact `where(keep, dy, 0)` at the cost of a multiply
    (numpy's where and copyto(where=) are slower: BENCHMARKS.md). GELU's in blocks and cache-sized chunks."""
    if kind != "relu":
        return _gelu_backward_cpu(xp, dy, saved, kind)
    (keep,) = saved
    dh = xp.empty(dy.shape, dtype=dy.dtype)
    bits = f"int{8 * dy.itemsize}"                              # an integer of the float's width
    df, kf, hf = dy.reshape(-1).view(bits), keep.reshape(-1).view("int8"), dh.reshape(-1).view(bits)

    def block(start, stop):
        xp.bitwise_and(df[start:stop], xp.negative(kf[start:stop], dtype=bits), out=hf[start:stop])  # -1: all ones

    for_rows(block, dy.size, dy.size, dy)
    return dh


def _gelu_backward_cpu(xp, dy, saved, kind):
    """The reference's GELU backward on flat blocks and cache-sized chunks."""
    h, aux = (a.reshape(-1) for a in saved)
    dyf = dy.reshape(-1)
    dh = xp.empty_like(dyf)

    @in_cache_chunks
    def block(start, stop):
        hb, ab, g = h[start:stop], aux[start:stop], dh[start:stop]
        if kind == "gelu_tanh":
            # y = 0.5 h (1 + tanh(u))  ->  dy/dh = 0.5 (1 + t) + 0.5 h (1 - t^2) du/dh, du/dh = c (1 + 3 k h^2)
            xp.multiply(dyf[start:stop], math.tanh_gelu_slope(xp, hb, ab), out=g)
            return
        _exact_gelu_backward_chunk(xp, dyf[start:stop], hb, ab, g, g, True)   # phi(h) not kept: in dh's array

    for_rows(block, dyf.size, dyf.size, dy)
    return dh.reshape(dy.shape)


def _exact_gelu_backward_chunk(xp, dy, h, cdf, density, dh, form):
    """The exact GELU's dh = dy (Phi(h) + h phi(h)) of one chunk into `dh`, phi(h) first formed into
    `density` when `form` (`density` may be dh's own array: phi(h) then not kept)."""
    if form:
        xp.multiply(h, h, out=density)                              # phi(h) = exp(-h^2/2) / sqrt(2 pi)
        density *= -0.5
        xp.exp(density, out=density)
        density *= INV_SQRT_2PI
    # y = h Phi(h)  ->  dy/dh = Phi(h) + h phi(h)
    xp.multiply(density, h, out=dh)
    dh += cdf
    dh *= dy


@gelu_backward_density.register("cpu", splits_reference=True)
def gelu_backward_density_cpu(xp, dy, h, cdf, density=None):
    """The reference on flat blocks of entries in cache-sized chunks: phi(h) (when formed here) and
    dh of a chunk while it is in the cache."""
    dyf, hf, cf = dy.reshape(-1), h.reshape(-1), cdf.reshape(-1)
    dh = xp.empty_like(hf)
    form = density is None
    phi = xp.empty_like(hf) if form else density.reshape(-1)

    @in_cache_chunks
    def block(start, stop):
        _exact_gelu_backward_chunk(xp, dyf[start:stop], hf[start:stop], cf[start:stop], phi[start:stop],
                                   dh[start:stop], form)

    for_rows(block, hf.size, hf.size, h)
    return dh.reshape(h.shape), phi.reshape(h.shape)


@elementwise_product.register("cpu", splits_reference=True, supports=lambda xp, a, b, scale=None:
                              a.size >= threads.MIN_PARALLEL_ENTRIES)
def elementwise_product_cpu(xp, a, b, scale=None):
    """The reference in flat blocks (into a new contiguous array)."""
    out = xp.empty(a.shape, dtype=a.dtype)
    af, bf, of = a.reshape(-1), b.reshape(-1), out.reshape(-1)

    def block(start, stop):
        xp.multiply(af[start:stop], bf[start:stop], out=of[start:stop])
        if scale is not None:
            of[start:stop] *= scale

    for_rows(block, a.size, a.size, a)
    return out


def _flat(a):
    return None if a is None else a.reshape(-1)


@gelu_double_backward.register("cpu", splits_reference=True)
def gelu_double_backward_cpu(xp, g, dy, h, aux, kind, need_dy, need_h):
    """The reference on flat blocks of entries (elementwise), each in cache-sized chunks."""
    g_, dy_, h_, aux_ = (a.reshape(-1) for a in (g, dy, h, aux))
    dtype = xp.result_type(g, dy, h, aux)
    ddy = xp.empty(h.size, dtype=dtype) if need_dy else None
    dh = xp.empty(h.size, dtype=dtype) if need_h else None

    @in_cache_chunks
    def block(start, stop):
        part = slice(start, stop)
        ddy_part, dh_part = math.gelu_double_backward(xp, g_[part], dy_[part], h_[part], aux_[part], kind,
                                                      need_dy, need_h)
        if need_dy:
            ddy[part] = ddy_part
        if need_h:
            dh[part] = dh_part

    for_rows(block, h.size, h.size, h)
    return tuple(None if a is None else a.reshape(h.shape) for a in (ddy, dh))


@gelu_backward_jvp.register("cpu", splits_reference=True)
def gelu_backward_jvp_cpu(xp, dy, h, aux, t_dy, t_h, kind, density=None):
    """The reference on flat blocks of entries (elementwise), each in cache-sized chunks: its dozen
    passes over a chunk while it is in the cache."""
    flat = [_flat(a) for a in (dy, h, aux, t_dy, t_h, density)]
    t_dh = xp.empty(h.size, dtype=h.dtype)

    @in_cache_chunks
    def block(start, stop):
        dy_, h_, aux_, t_dy_, t_h_, density_ = (None if a is None else a[start:stop] for a in flat)
        t_dh[start:stop] = math.gelu_backward_jvp(xp, dy_, h_, aux_, t_dy_, t_h_, kind, density_)

    for_rows(block, h.size, h.size, h)
    return t_dh.reshape(h.shape)
