"""Launchers of flash_attention.cu: the CUDA implementation of the memory-efficient attention's
kernel tables (`attention_blockwise_forward`, `attention_blockwise_backward` of tables.py, whose
references are blockwise.py's), registered for "cuda" wherever `flash_unsupported` finds
nothing against the call (head dims 32/64/128, float32/float64, no mask that needs a gradient, no
sliding window: the kernels have none, so the blockwise reference skips its blocks) and
at most one of the bool and float masks is given (the kernels read one mask). Forward mode has no
kernel here: after their forward, `attention_blockwise_jvp` (the blockwise reference, in CuPy)
gives J u from their O and L and regenerates their dropout mask, the same contract's.

Inputs with broadcast leading axes are made contiguous (BH, T, D) arrays; a mask keeps its own
shape: the kernels read it through one offset per (batch, head) and its strides along queries
and keys (0 on a broadcast axis). The array module comes from the data, so the launchers also
run on host arrays, with the kernels run by the CUDA emulator of the test suite.
"""
from math import prod

from ..activation import dropout_scale, dropout_threshold
from ..cuda import function
from . import flash_unsupported
from .blockwise import lead_shape
from .tables import attention_blockwise_backward, attention_blockwise_forward

# FlashTile<T> of flash_attention.cu: rows per block and dimensions per lane (threads = ROWS D / DIMS)
ROWS = {"float32": 64, "float64": 32}
DIMS = {"float32": 32, "float64": 16}
NO_MASK, BOOL_MASK, FLOAT_MASK = 0, 1, 2       # MaskKind


def launch_shape(dtype, head_dim, heads, rows):
    """(blocks, threads) of a kernel that gives each block ROWS[dtype] of the `rows` rows (of Tq or
    Tk) of one of `heads` (batch, head) pairs, each row to head_dim / DIMS[dtype] threads."""
    per_block = ROWS[str(dtype)]
    return heads * -(-rows // per_block), per_block * (head_dim // DIMS[str(dtype)])


def _rows(xp, a, lead):
    """`a` (..., T, D) as a contiguous (BH, T, D) array over the broadcast leading shape."""
    return xp.ascontiguousarray(xp.broadcast_to(a, lead + a.shape[-2:])).reshape((-1,) + a.shape[-2:])


def mask_arguments(xp, blocked, additive, lead, dtype):
    """(kind, hidden, added, base, stride_q, stride_k): the kernels' mask parameters. base[b] is
    the offset of (batch, head) b in the contiguous mask; arrays that are not used are 1-entry
    placeholders (never a None: CuPy would pass an invalid pointer)."""
    mask = blocked if blocked is not None else additive
    hidden, added = xp.zeros(1, dtype=bool), xp.zeros(1, dtype=dtype)
    if mask is None:
        return (xp.int32(NO_MASK), hidden, added, xp.zeros(1, dtype="int64"), xp.int64(0), xp.int64(0))
    mask = xp.ascontiguousarray(mask)                                   # (mask lead..., Mq, Mk)
    mq, mk = mask.shape[-2:]
    per_head = xp.arange(prod(mask.shape[:-2]), dtype="int64") * (mq * mk)
    per_head = per_head.reshape((1,) * (len(lead) - mask.ndim + 2) + mask.shape[:-2])
    base = xp.ascontiguousarray(xp.broadcast_to(per_head, lead)).reshape(-1)   # (BH,)
    if blocked is not None:
        kind, hidden = BOOL_MASK, mask
    else:
        kind, added = FLOAT_MASK, mask
    return (xp.int32(kind), hidden, added, base, xp.int64(mk if mq != 1 else 0), xp.int64(1 if mk != 1 else 0))


def _common_arguments(xp, dtype, tq, tk, causal, scale, dropout):
    """tq, tk, causal, scale, state, seed, offset, threshold, dropout scale: as the kernels take
    them (state: the device (seed, base) of a draw under graph capture, else a null pointer)."""
    p, seed, offset, state = dropout if dropout is not None else (0.0, 0, 0, None)
    threshold = dropout_threshold(p) if dropout is not None else 0
    cast = xp.dtype(dtype).type
    return (xp.int32(tq), xp.int32(tk), xp.int32(bool(causal)), cast(scale), 0 if state is None else state,
            xp.uint64(seed), xp.uint64(offset), xp.uint32(threshold), cast(dropout_scale(p)))


def _forward_supported(xp, q, k, v, blocked, additive, causal, scale, block_size, dropout, mask_grad, window=None):
    return (blocked is None or additive is None) and flash_unsupported(q, k, v, additive, mask_grad, window) is None


def _backward_supported(xp, q, k, v, out, lse, dout, blocked, additive, causal, scale, block_size, dropout, need_mask,
                        window=None):
    return (blocked is None or additive is None) and flash_unsupported(q, k, v, additive, need_mask, window) is None


@attention_blockwise_forward.register("cuda", supports=_forward_supported)
def attention_flash_forward(xp, q, k, v, blocked, additive, causal, scale, block_size, dropout, mask_grad, window=None):
    """(O, L) of flash_attention_forward: one block per 64 (float) or 32 (double) query rows."""
    lead, (tq, d), tk = lead_shape(q, k, v), q.shape[-2:], k.shape[-2]
    qr, kr, vr = (_rows(xp, a, lead) for a in (q, k, v))
    heads = qr.shape[0]
    out = xp.empty((heads, tq, d), dtype=q.dtype)
    lse = xp.empty((heads, tq), dtype=q.dtype)
    blocks, threads = launch_shape(q.dtype, d, heads, tq)
    function("flash_attention", "flash_attention_forward", q.dtype, str(d))(
        (blocks,), (threads,),
        (qr, kr, vr, out, lse, *mask_arguments(xp, blocked, additive, lead, q.dtype),
         *_common_arguments(xp, q.dtype, tq, tk, causal, scale, dropout)))
    return out.reshape(lead + (tq, d)), lse.reshape(lead + (tq,))


@attention_blockwise_backward.register("cuda", supports=_backward_supported)
def attention_flash_backward(xp, q, k, v, out, lse, dout, blocked, additive, causal, scale, block_size, dropout,
                             need_mask, window=None):
    """(dQ, dK, dV, None): flash_attention_backward_dq (which also writes D = rowsum(dO O)) over
    blocks of query rows, then flash_attention_backward_dkdv over blocks of key rows."""
    lead, (tq, d), tk = lead_shape(q, k, v), q.shape[-2:], k.shape[-2]
    qr, kr, vr = (_rows(xp, a, lead) for a in (q, k, v))
    heads = qr.shape[0]
    outr, doutr = (xp.ascontiguousarray(a).reshape(heads, tq, d) for a in (out, dout))
    lser = xp.ascontiguousarray(lse).reshape(heads, tq)
    delta = xp.empty((heads, tq), dtype=q.dtype)
    dq = xp.empty((heads, tq, d), dtype=q.dtype)
    dk, dv = xp.empty((heads, tk, d), dtype=q.dtype), xp.empty((heads, tk, d), dtype=q.dtype)
    mask = mask_arguments(xp, blocked, additive, lead, q.dtype)
    common = _common_arguments(xp, q.dtype, tq, tk, causal, scale, dropout)
    blocks, threads = launch_shape(q.dtype, d, heads, tq)
    function("flash_attention", "flash_attention_backward_dq", q.dtype, str(d))(
        (blocks,), (threads,), (qr, kr, vr, outr, doutr, lser, delta, dq, *mask, *common))
    blocks, threads = launch_shape(q.dtype, d, heads, tk)
    function("flash_attention", "flash_attention_backward_dkdv", q.dtype, str(d))(
        (blocks,), (threads,), (qr, kr, vr, doutr, lser, delta, dk, dv, *mask, *common))
    return dq.reshape(lead + (tq, d)), dk.reshape(lead + (tk, d)), dv.reshape(lead + (tk, d)), None
