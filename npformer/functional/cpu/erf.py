"""erf on the CPU (the "cpu" implementation of _erf.py's kernel table): float32 by one rational
function, float64 by each interval's formula on the entries in it only."""
from autograd import backend

from .._erf import BOUNDS, PP, QQ, erf, erf_far, erf_float32, erf_middle, erf_near, horner_inplace


@erf.register("cpu")
def erf_cpu(x):
    """float32: `erf_float32`. Otherwise the small-|x| formula in place over the whole array; each
    other interval's formula only on the entries in it (gathered with take, written back with
    put): a quarter of the reference's work."""
    xp = backend.get_array_module(x)
    if x.dtype == xp.float32:
        return erf_float32(x)
    flat_x = x.reshape(-1)                           # 1-D, so 0-d inputs stay arrays
    a = xp.abs(flat_x)
    out = xp.minimum(a, BOUNDS[0])                   # right on [0, 0.84375); clamped elsewhere
    z = out * out
    ratio = horner_inplace(PP, z)
    ratio /= horner_inplace(QQ, z)
    ratio *= out
    out += ratio                                     # a + a P(a^2) / Q(a^2)
    branches = ((BOUNDS[0], BOUNDS[1], erf_middle),
                (BOUNDS[1], BOUNDS[2], lambda t: erf_near(t, xp.exp)),
                (BOUNDS[2], BOUNDS[3], lambda t: erf_far(t, xp.exp)))
    for lo, hi, formula in branches:
        index = xp.flatnonzero((a >= lo) & (a < hi))
        if index.size:
            out.put(index, formula(a.take(index)))
    xp.copyto(out, 1.0, where=a >= BOUNDS[3])
    return xp.copysign(out, flat_x, out=out).reshape(x.shape)
