"""Scaled dot-product attention, three paths with hand-written backward passes:

- naive: keeps the (Tq, Tk) probabilities (`AttentionFunction`);
- memory-efficient: the FlashAttention scheme (online softmax over key blocks, P recomputed in
  backward from one logsumexp per query row), never a (Tq, Tk) matrix
  (`MemoryEfficientAttentionFunction`). Its blockwise forward and backward are kernel tables:
  the reference below (blocks of numpy/CuPy calls, every device) and, on "cuda", the
  flash-attention kernels of npformer/functional/cuda/flash_attention.cu where they apply;
- flash: that CUDA implementation, chosen by default on a GPU where it applies.

Every path is differentiable twice and more (create_graph, forward over reverse): the naive backward
is the op `AttentionBackward`, whose backward (the double backward) and jvp work from the saved P; the
memory-efficient (and flash) backward is the op `MemoryEfficientAttentionBackward`, whose backward is
the blockwise double backward, again without a (Tq, Tk) matrix. Both write their third derivative
with differentiable ops (`graph_attention_double_backward`).

Every dropout mask over the probabilities is the one of the dropout contract (activation.py):
entry i of the flat (..., Tq, Tk) index is kept iff bits16(seed, offset + i) >= threshold, so
all paths, on every device, drop the same entries for the same generator state."""
from __future__ import annotations

import math

from autograd import Function, Tensor, backend, is_grad_enabled, raw_computation, unbroadcast, where
from autograd.backend import Array
from autograd.checks import check_bool, check_int, check_real
from autograd.forward_ad import unpack_dual
from npformer.runtime import kernels, random
from npformer.runtime.kernels import kernel_table

from ._common import broadcast_shapes, broadcasts_to, check_tensor, has_twin, on_device_of
from .activation import dropout_scale, dropout_stream, dropout_threshold, keep_mask
from .softmax import row_dot, softmax_backward, softmax_forward, stable_row_max

BACKENDS = ("naive", "memory_efficient", "flash")
FLASH_HEAD_DIMS = (32, 64, 128)       # head dims the flash kernels are compiled for
FLASH_DTYPES = ("float32", "float64")
_FLASH_DTYPE_CHARS = tuple(backend.module_for("cpu").dtype(name).char for name in FLASH_DTYPES)  # "f", "d"


def causal_blocked(xp, q_start, q_stop, k_start, k_stop):
    """(q rows, k cols) bool, True where key j > query i (top-left aligned, like torch's is_causal)."""
    return xp.arange(k_start, k_stop)[None, :] > xp.arange(q_start, q_stop)[:, None]


def mask_block(mask, q_start, q_stop, k_start, k_stop):
    """The (..., q rows, k cols) block of a mask broadcastable to (..., Tq, Tk)."""
    rows = slice(q_start, q_stop) if mask.shape[-2] != 1 else slice(None)
    cols = slice(k_start, k_stop) if mask.shape[-1] != 1 else slice(None)
    return mask[..., rows, cols]


@kernel_table
def matmul_transposed(a, b, out=None):
    """a (..., m, k) @ b (..., n, k)^T -> (..., m, n) (written into `out` when given): Q K^T, dO V^T."""
    return backend.get_array_module(a).matmul(a, b.swapaxes(-1, -2), out=out)


def hidden_bias(xp, blocked, causal, q_start, q_stop, k_start, k_stop, dtype):
    """-inf where `blocked` (a bool mask broadcastable to (..., Tq, Tk)) or causal hides key j from
    query i, 0 elsewhere, for one (..., q rows, k cols) block, over the masks' own broadcast shape
    (or None when nothing is hidden): the bool masks added to the scores as one bias, as torch's
    math attention adds them."""
    hidden = None if blocked is None else mask_block(blocked, q_start, q_stop, k_start, k_stop)
    if causal:
        above = causal_blocked(xp, q_start, q_stop, k_start, k_stop)          # (q rows, k cols)
        hidden = above if hidden is None else hidden | above
    if hidden is None:
        return None
    bias = xp.zeros(hidden.shape, dtype=dtype)
    xp.copyto(bias, -math.inf, where=hidden)
    return bias


def masked_scores(q_scaled, k, blocked, additive, causal, q_start, k_start, out=None):
    """S = (s q) K^T + additive, -inf where blocked or causally hidden, for one block
    (written into `out` when given)."""
    xp = backend.get_array_module(q_scaled)
    q_stop, k_stop = q_start + q_scaled.shape[-2], k_start + k.shape[-2]
    scores = matmul_transposed(q_scaled, k, out=out)                        # (..., bq, bk)
    if additive is not None:
        scores += mask_block(additive, q_start, q_stop, k_start, k_stop)
    # -inf where hidden: one add of a bias of the masks' size (2-3x faster than copyto's where= over S)
    bias = hidden_bias(xp, blocked, causal, q_start, q_stop, k_start, k_stop, scores.dtype)
    if bias is not None:
        scores += bias
    return scores


def _at_least_2d(mask):
    """A mask broadcastable to (..., Tq, Tk) with its last two axes present (size 1 if missing)."""
    return None if mask is None else mask.reshape((1,) * max(0, 2 - mask.ndim) + tuple(mask.shape))


@kernel_table
def attention_forward(q, k, v, mask, blocked, causal, scale, keep, dropout_scale, probs, out, weights):
    """The naive path's forward: q (..., Tq, hd), k (..., Tk, hd), v (..., Tk, hdv), a float mask
    and a bool `blocked` (True = hidden), each broadcastable to (..., Tq, Tk) or None, keep the
    dropout mask or None. Writes P into probs (..., Tq, Tk), O into out (..., Tq, hdv) and, with
    dropout, Pd into weights (None: a temporary)."""
    xp = backend.get_array_module(q)
    # S = s Q K^T + mask, -inf where blocked or causally hidden
    scores = masked_scores(q * scale, k, blocked, mask, causal, 0, 0, out=probs)   # (..., Tq, Tk)
    # P = softmax(S), in place
    softmax_forward(xp, scores, -1, out=scores)
    dropped = scores
    if keep is not None:                                                       # Pd = P * keep / (1 - p)
        dropped = xp.multiply(scores, keep, out=weights)
        dropped *= dropout_scale
    # O = Pd V
    xp.matmul(dropped, v, out=out)


@kernel_table
def attention_backward(q, k, v, probs, keep, dout, dweights, scale, dropout_scale, dq, dk, dv, dmask):
    """The naive path's backward from what attention_forward saved (P in probs, the mask keep or
    None) and dout (..., Tq, hdv) plus dweights (..., Tq, Tk) reaching the returned weights, or
    None. Writes dQ into dq, dK into dk, dV into dv (each (..., T, hd) over the broadcast leading
    shape) and dS into dmask (..., Tq, Tk), those that are not None."""
    xp = backend.get_array_module(dout)
    dropped = probs
    if keep is not None:
        dropped = probs * keep
        dropped *= dropout_scale
    # O = Pd V  ->  dV = Pd^T dO
    if dv is not None:
        xp.matmul(dropped.swapaxes(-1, -2), dout, out=dv)
    if dq is None and dk is None and dmask is None:
        return
    # O = Pd V  ->  dPd = dO V^T (plus the gradient reaching the returned weights Pd)
    dprobs = matmul_transposed(dout, v)                                       # (..., Tq, Tk)
    if dweights is not None:
        dprobs += dweights
    # Pd = P * keep / (1 - p)  ->  dP = dPd * keep / (1 - p)
    if keep is not None:
        dprobs *= keep
        dprobs *= dropout_scale
    # P = softmax(S)  ->  dS = P (dP - rowsum(dP P)); masked entries have P = 0, so dS = 0
    dscores = softmax_backward(xp, probs, dprobs, -1, out=dprobs)                 # (..., Tq, Tk)
    # S = s Q K^T + mask  ->  d(mask) = dS
    if dmask is not None:
        dmask[...] = dscores
    # S = s Q K^T  ->  dQ = s dS K
    if dq is not None:
        xp.matmul(dscores, k, out=dq)
        dq *= scale
    # S = s Q K^T  ->  dK = s dS^T Q
    if dk is not None:
        xp.matmul(dscores.swapaxes(-1, -2), q, out=dk)
        dk *= scale


@kernel_table
def attention_double_backward(q, k, v, probs, keep, dout, dweights, scale, dropout_scale, gq, gk, gv, gmask,
                              dq, dk, dv, dmask, ddout, ddweights):
    """The naive path's double backward on whole (..., Tq, Tk) matrices, from what attention_forward
    saved (P in probs, the mask keep or None): the gradients of L = <gq, dQ> + <gk, dK> + <gv, dV> +
    <gmask, dMask>, where (dQ, dK, dV, dMask) is attention_backward of (q, k, v, mask, dout, dweights).
    gq, gk, gv (shapes of q, k, v) and gmask (broadcastable to (..., Tq, Tk), at least 2-D) reach dQ,
    dK, dV and dMask; each may be None, but gv or one of the others is given. Writes the gradients of
    q, k, v into dq, dk, dv, of the mask into dmask (..., Tq, Tk), of dout into ddout and of dweights
    into ddweights (each over the broadcast leading shape), those that are not None; dv and ddweights
    need one of gq, gk, gmask (without them both gradients are 0).

    With Z = keep / (1 - p) (1 without dropout), dP = (dO V^T + dweights) Z, D = rowsum(dP P),
    dS = P (dP - D), W = s (gq K^T + Q gk^T) + gmask (what reaches dS), r = rowsum(W P) and
    Y = dO gv^T (what reaches Pd):  Pbar = (W - r) dP - W D + Y Z,  Sbar = P (Pbar - rowsum(Pbar P)),
    C = P (W - r) Z;  then dq = s (Sbar K + dS gk), dk = s (Sbar^T Q + dS^T gq), dv = C^T dO,
    d dO = C V + Pd gv, dmask = Sbar, d dweights = C (docs/backprop.md derives them)."""
    xp = backend.get_array_module(dout)
    z, dprobs, delta = _first_order_dp(v, probs, keep, dout, dweights, dropout_scale)
    # W = s (gq K^T + Q gk^T) + gmask: the gradient reaching dS through dQ = s dS K, dK = s dS^T Q, dMask = dS
    w = None
    if gq is not None:
        w = matmul_transposed(gq, k)
    if gk is not None:
        product = matmul_transposed(q, gk)                                   # (gq K^T's shape)
        w = product if w is None else xp.add(w, product, out=w)
    if w is not None:
        w *= scale
    if gmask is not None:
        w = _plus(w, gmask)                                                  # (out of place: never into gmask)
    p_bar = w_centered = None
    if w is not None:
        w_centered = w - row_dot(w, probs)                                   # (..., Tq, Tk) W - r, r = rowsum(W P)
        # P enters dS = P (dP - D) and D = rowsum(dP P):  Pbar = W (dP - D) - r dP = (W - r) dP - W D
        p_bar = w_centered * dprobs
        p_bar -= w * delta
    if gv is not None:
        # dV = Pd^T dO  ->  Y = dO gv^T reaches Pd = P Z:  Pbar += Y Z
        y = matmul_transposed(dout, gv)                                      # (..., Tq, Tk)
        if z is not None:
            y *= z
        p_bar = y if p_bar is None else xp.add(p_bar, y, out=p_bar)
    # P = softmax(S)  ->  Sbar = P (Pbar - rowsum(Pbar P)), in place
    s_bar = xp.subtract(p_bar, row_dot(p_bar, probs), out=p_bar)
    s_bar *= probs
    # dS = P (dP - D), in dP's place: dQ = s dS K and dK = s dS^T Q multiply it by gk and gq
    ds = None
    if (dq is not None and gk is not None) or (dk is not None and gq is not None):
        ds = xp.subtract(dprobs, delta, out=dprobs)
        ds *= probs
    # S = s Q K^T + mask  ->  dq = s (Sbar K + dS gk), dk = s (Sbar^T Q + dS^T gq), dmask = Sbar
    _through_scores(s_bar, ds, q, k, gq, gk, scale, dq, dk, dmask)
    # dP = (dO V^T + dweights) Z enters dS and D:  C = P (W - r) Z reaches dO V^T and dweights
    c = None
    if w_centered is not None:
        c = w_centered
        c *= probs
        if z is not None:
            c *= z
    # dO V^T  ->  dv = C^T dO;  dweights  ->  d dweights = C
    if dv is not None:
        xp.matmul(c.swapaxes(-1, -2), dout, out=dv)
    if ddweights is not None:
        ddweights[...] = c
    # dO V^T  ->  d dO = C V;  dV = Pd^T dO  ->  d dO += Pd gv
    if ddout is not None:
        if c is not None:
            xp.matmul(c, v, out=ddout)
        if gv is not None:
            dropped = probs if z is None else probs * z
            if c is None:
                xp.matmul(dropped, gv, out=ddout)
            else:
                ddout += xp.matmul(dropped, gv)


@kernel_table
def attention_backward_jvp(q, k, v, probs, keep, dout, dweights, scale, dropout_scale, tq, tk, tv, tmask, tdout,
                           tdweights, dq_tangent, dk_tangent, dv_tangent, dmask_tangent):
    """The tangents of attention_backward's (dQ, dK, dV, dMask) along the tangents tq, tk, tv, tmask
    (broadcastable to (..., Tq, Tk), at least 2-D), tdout and tdweights of (q, k, v, mask, dout,
    dweights) (None where that input does not move, at least one given), on whole (..., Tq, Tk)
    matrices from the saved P and keep. Writes them into dq_tangent, dk_tangent, dv_tangent and
    dmask_tangent (each over the broadcast leading shape), those that are not None; dv_tangent needs
    one of tq, tk, tmask, tdout (without them it is 0).

    Every first-order step along its tangents (forward over reverse): t_S = s (t_Q K^T + Q t_K^T) +
    t_mask, t_P = P (t_S - rowsum(P t_S)), t_dP = (t_dO V^T + dO t_V^T + t_dweights) Z,
    t_dS = t_P (dP - D) + P (t_dP - t_D) with t_D = rowsum(t_dP P + dP t_P), then
    t_dQ = s (t_dS K + dS t_K), t_dK = s (t_dS^T Q + dS^T t_Q), t_dV = t_Pd^T dO + Pd^T t_dO, t_dMask = t_dS."""
    xp = backend.get_array_module(dout)
    z, dprobs, delta = _first_order_dp(v, probs, keep, dout, dweights, dropout_scale)
    tprobs = tdropped = None
    if tq is not None or tk is not None or tmask is not None:
        # S = s Q K^T + mask  ->  t_S = s (t_Q K^T + Q t_K^T) + t_mask
        tscores = _score_tangent(q * scale, k, None if tq is None else tq * scale, tk, tmask)
        # P = softmax(S)  ->  t_P = P (t_S - rowsum(P t_S))  (out of place: t_S may be t_mask)
        tprobs = tscores - row_dot(probs, tscores)                           # (..., Tq, Tk)
        tprobs *= probs
        # Pd = P Z  ->  t_Pd = t_P Z
        tdropped = tprobs if z is None else tprobs * z
    # dPd = dO V^T + dweights  ->  t_dPd = t_dO V^T + dO t_V^T + t_dweights;  dP = dPd Z  ->  t_dP = t_dPd Z
    tdprobs = None
    if tdout is not None:
        tdprobs = matmul_transposed(tdout, v)
    if tv is not None:
        product = matmul_transposed(dout, tv)                                # (..., Tq, Tk)
        tdprobs = product if tdprobs is None else xp.add(tdprobs, product, out=tdprobs)
    if tdweights is not None:
        tdprobs = _plus(tdprobs, tdweights)                                  # (out of place: never into t_dweights)
    if tdprobs is not None and z is not None:
        tdprobs = tdprobs * z
    # dV = Pd^T dO  ->  t_dV = t_Pd^T dO + Pd^T t_dO
    if dv_tangent is not None:
        if tdropped is not None:
            xp.matmul(tdropped.swapaxes(-1, -2), dout, out=dv_tangent)
        if tdout is not None:
            dropped = probs if z is None else probs * z                      # Pd = P Z
            if tdropped is None:
                xp.matmul(dropped.swapaxes(-1, -2), tdout, out=dv_tangent)
            else:
                dv_tangent += xp.matmul(dropped.swapaxes(-1, -2), tdout)
    # dS = P (dP - D), D = rowsum(dP P)  ->  t_dS = t_P (dP - D) + P (t_dP - t_D), t_D = rowsum(t_dP P + dP t_P)
    centered = dprobs - delta                                                # (..., Tq, Tk) dP - D
    tds = tdelta = None
    if tprobs is not None:
        tds = tprobs * centered
        tdelta = row_dot(dprobs, tprobs)
    if tdprobs is not None:
        moved = probs * tdprobs                                              # P t_dP
        tds = moved if tds is None else xp.add(tds, moved, out=tds)
        tdelta = _plus(tdelta, row_dot(tdprobs, probs))
    tds -= probs * tdelta
    ds = centered                                                            # dS = P (dP - D), in place
    ds *= probs
    # dQ = s dS K, dK = s dS^T Q, dMask = dS  ->  t_dQ = s (t_dS K + dS t_K), t_dK = s (t_dS^T Q + dS^T t_Q),
    # t_dMask = t_dS
    _through_scores(tds, ds, q, k, tq, tk, scale, dq_tangent, dk_tangent, dmask_tangent)


def _first_order_dp(v, probs, keep, dout, dweights, dropout_scale):
    """(Z, dP, D) as the first-order backward forms them from the saved P: Z = keep / (1 - p) (None
    without dropout), dP = (dO V^T + dweights) Z (..., Tq, Tk), D = rowsum(dP P) (..., Tq, 1)."""
    xp = backend.get_array_module(dout)
    z = None if keep is None else keep * probs.dtype.type(dropout_scale)    # (..., Tq, Tk) Z = keep / (1 - p)
    # O = Pd V  ->  dPd = dO V^T (+ dweights);  Pd = P Z  ->  dP = dPd Z
    dprobs = matmul_transposed(dout, v)                                      # (..., Tq, Tk)
    if dweights is not None:
        dprobs += dweights
    if z is not None:
        dprobs *= z
    return z, dprobs, row_dot(dprobs, probs)                                 # D = rowsum(dP P)


def _through_scores(a, ds, q, k, bq, bk, scale, dq, dk, dmask):
    """The last step of the double backward (a = Sbar, bq, bk = the incoming gq, gk) and of the
    gradients' tangent (a = t_dS, bq, bk = t_Q, t_K), through S = s Q K^T + mask with dS the
    first-order score gradient: writes dq = s (a K + dS bk), dk = s (a^T Q + dS^T bq) and dmask = a
    into those outputs that are not None (a term whose bq or bk is None left out)."""
    xp = backend.get_array_module(a)
    if dq is not None:
        xp.matmul(a, k, out=dq)
        if bk is not None:
            dq += xp.matmul(ds, bk)
        dq *= scale
    if dk is not None:
        xp.matmul(a.swapaxes(-1, -2), q, out=dk)
        if bq is not None:
            dk += xp.matmul(ds.swapaxes(-1, -2), bq)
        dk *= scale
    if dmask is not None:
        dmask[...] = a


def _plus(total, term):
    """total + term out of place, or term when total is None: the sum of the terms that exist
    (arrays or Tensors)."""
    return term if total is None else total + term


class AttentionFunction(Function):
    """q (..., Tq, hd), k (..., Tk, hd), v (..., Tk, hdv) [, additive mask] -> out (..., Tq, hdv)
    [, P (..., Tq, Tk)].

    S = s Q K^T + mask, P = softmax(S) (dropout: Pd = P * keep / (1 - p)), O = Pd V;
    dV = Pd^T dO, dPd = dO V^T (+ dP from the returned weights), dS = P (dP - rowsum(dP P)),
    dQ = s dS K, dK = s dS^T Q, and d(additive mask) = dS summed over its broadcast axes.
    The kernel tables attention_forward / attention_backward run it (cpu: blocks of a batch axis
    on the threads of `npformer.runtime.threads`, see npformer/functional/cpu/attention.py).
    """

    @staticmethod
    def forward(ctx, q, k, v, additive, blocked, causal, scale, keep, dropout_scale, return_weights):
        xp = backend.get_array_module(q)
        lead = _lead_shape(q, k, v)
        probs = xp.empty(lead + (q.shape[-2], k.shape[-2]), dtype=q.dtype)   # (..., Tq, Tk)
        out = xp.empty(lead + (q.shape[-2], v.shape[-1]), dtype=q.dtype)     # (..., Tq, hdv)
        weights = xp.empty_like(probs) if keep is not None and return_weights else None
        attention_forward(q, k, v, _at_least_2d(additive), blocked, causal, scale, keep, dropout_scale,
                          probs, out, weights)
        ctx.save_for_backward(q, k, v, probs, keep)
        ctx.scale, ctx.dropout_scale, ctx.return_weights = scale, dropout_scale, return_weights
        ctx.masks = (additive, blocked, causal)                               # for differentiable_backward
        ctx.mask_shape = None if additive is None else additive.shape
        return (out, probs if weights is None else weights) if return_weights else out

    @staticmethod
    def backward(ctx, dout, dweights=None):
        q, k, v, probs, keep = ctx.saved_tensors
        return naive_attention_gradients(q, k, v, probs, keep, dout, dweights, ctx.scale, ctx.dropout_scale,
                                         ctx.mask_shape, ctx.needs_input_grad[:4])

    @staticmethod
    def differentiable_backward(ctx, dout, dweights=None):
        """The backward as the op `AttentionBackward`, one node of the graph: its forward is the
        kernel above (threads on the CPU), its backward the double backward and its jvp the tangent
        of the gradients, each by hand from the saved P."""
        q, k, v, probs, keep = ctx.saved_tensors
        additive, blocked, causal = ctx.masks
        operands = [t if t is not None else raw for t, raw in zip(ctx.inputs, (q, k, v, additive))]
        need = ctx.needs_input_grad[:4]
        grads = AttentionBackward.apply(*operands, dout, dweights, probs=probs, keep=keep, blocked=blocked,
                                        causal=causal, scale=ctx.scale, dropout_scale=ctx.dropout_scale, need=need)
        return by_attention_input(grads, need)

    @staticmethod
    def jvp(ctx, tq, tk, tv, tmask):
        """(t_O [, t_Pd]) from the saved P: the forward's steps along the tangents (attention_jvp)."""
        q, k, v, probs, keep = ctx.saved_tensors
        xp = backend.get_array_module(probs)
        tout = xp.empty(probs.shape[:-1] + (v.shape[-1],), dtype=probs.dtype)   # (..., Tq, hdv)
        moves_scores = tq is not None or tk is not None or tmask is not None
        tweights = xp.empty_like(probs) if ctx.return_weights and moves_scores else None
        attention_jvp(q, k, v, probs, keep, ctx.scale, ctx.dropout_scale, tq, tk, tv, _at_least_2d(tmask), tout,
                      tweights)
        return (tout, tweights) if ctx.return_weights else tout


@kernel_table
def attention_jvp(q, k, v, probs, keep, scale, dropout_scale, tq, tk, tv, tmask, tout, tweights):
    """The tangent of O = Pd V along tq, tk, tv and tmask (each None, tmask at least 2-D and
    broadcastable to (..., Tq, Tk)) from the saved P and keep: writes t_O into tout (..., Tq, hdv)
    and t_Pd into tweights (..., Tq, Tk) when it is not None (it is None unless a tangent moves S)."""
    xp = backend.get_array_module(probs)
    written = False
    if tq is not None or tk is not None or tmask is not None:
        tscores = _score_tangent(q * scale, k, None if tq is None else tq * scale, tk, tmask)   # (..., Tq, Tk)
        # P = softmax(S)  ->  t_P = P (t_S - rowsum(P t_S))  (out of place: t_S may be t_mask)
        tprobs = tscores - row_dot(probs, tscores)
        tprobs *= probs
        # Pd = P * keep / (1 - p)  ->  t_Pd = t_P * keep / (1 - p)
        if keep is not None:
            tprobs *= keep
            tprobs *= dropout_scale
        if tweights is not None:
            tweights[...] = tprobs
        # O = Pd V  ->  t_O = t_Pd V
        xp.matmul(tprobs, v, out=tout)
        written = True
    if tv is not None:
        # O = Pd V  ->  t_O += Pd t_V
        dropped = probs if keep is None else probs * keep * dropout_scale       # Pd (..., Tq, Tk)
        if written:
            tout += xp.matmul(dropped, tv)
        else:
            xp.matmul(dropped, tv, out=tout)
        written = True
    if not written:
        tout[...] = 0


def naive_attention_gradients(q, k, v, probs, keep, dout, dweights, scale, dropout_scale, mask_shape, need):
    """(dQ, dK, dV, dMask) of the naive path by the kernel attention_backward, each summed to the
    shape of its input (mask_shape: the float mask's), None where `need` (four bools) says no."""
    xp = backend.get_array_module(dout)
    need_q, need_k, need_v, need_mask = need
    lead = probs.shape[:-2]
    dq = xp.empty(lead + q.shape[-2:], dtype=q.dtype) if need_q else None
    dk = xp.empty(lead + k.shape[-2:], dtype=q.dtype) if need_k else None
    dv = xp.empty(lead + v.shape[-2:], dtype=q.dtype) if need_v else None
    dmask = xp.empty_like(probs) if need_mask else None                      # (..., Tq, Tk) dS
    attention_backward(q, k, v, probs, keep, dout, dweights, scale, dropout_scale, dq, dk, dv, dmask)
    return (unbroadcast(dq, q.shape) if need_q else None,
            unbroadcast(dk, k.shape) if need_k else None,
            unbroadcast(dv, v.shape) if need_v else None,
            unbroadcast(dmask, mask_shape) if need_mask else None)


def by_attention_input(grads, need):
    """(for q, k, v, mask) from what AttentionBackward returns or receives, one array or Tensor per
    gradient it computes (those of (dQ, dK, dV, dMask) that `need` asks for): None for the others."""
    grads = iter(grads)
    return tuple(next(grads) if wanted else None for wanted in need)


class AttentionBackward(Function):
    """(q, k, v, additive mask, dO, dweights) -> those of (dQ, dK, dV, dMask) that `need` asks for:
    the naive path's backward as an op, so that the gradient of attention is one node of the graph
    (create_graph, forward over reverse). dweights is the gradient reaching the returned weights, or
    None. P (probs) and the dropout mask, AttentionFunction's saved arrays, come as constants with
    the mask's bool part and causality: the rules below differentiate through P by hand.

    forward: `attention_backward`, the first-order kernel (threads on the CPU). backward: the double
    backward `attention_double_backward`; jvp: the gradients' tangents `attention_backward_jvp`; both
    on raw (..., Tq, Tk) matrices from the saved P. differentiable_backward (third order and above):
    the double backward's formulas with Tensors, P recomputed in the graph (graph_attention_double_backward)."""

    @staticmethod
    def forward(ctx, q, k, v, additive, dout, dweights, probs, keep, blocked, causal, scale, dropout_scale, need):
        grads = naive_attention_gradients(q, k, v, probs, keep, dout, dweights, scale, dropout_scale,
                                          None if additive is None else additive.shape, need)
        ctx.save_for_backward(q, k, v, additive, probs, keep, dout, dweights)
        ctx.options = (blocked, causal, scale, dropout_scale, need)
        return tuple(g for g, wanted in zip(grads, need) if wanted)

    @staticmethod
    def backward(ctx, *grads):
        q, k, v, additive, probs, keep, dout, dweights = ctx.saved_tensors
        _, _, scale, dropout_scale, need = ctx.options
        gq, gk, gv, gmask = by_attention_input(grads, need)
        need_q, need_k, need_v, need_mask, need_dout, need_dweights = ctx.needs_input_grad
        xp = backend.get_array_module(dout)
        lead = probs.shape[:-2]
        moves_scores = gq is not None or gk is not None or gmask is not None    # W: without it dV, d dweights = 0
        dq = xp.empty(lead + q.shape[-2:], dtype=q.dtype) if need_q else None
        dk = xp.empty(lead + k.shape[-2:], dtype=q.dtype) if need_k else None
        dv = xp.empty(lead + v.shape[-2:], dtype=q.dtype) if need_v and moves_scores else None
        dmask = xp.empty_like(probs) if need_mask else None                  # (..., Tq, Tk)
        ddout = xp.empty_like(dout) if need_dout else None                   # (..., Tq, hdv)
        ddweights = xp.empty_like(probs) if need_dweights and moves_scores else None
        attention_double_backward(q, k, v, probs, keep, dout, dweights, scale, dropout_scale, gq, gk, gv,
                                  _at_least_2d(gmask), dq, dk, dv, dmask, ddout, ddweights)
        return (None if dq is None else unbroadcast(dq, q.shape), None if dk is None else unbroadcast(dk, k.shape),
                None if dv is None else unbroadcast(dv, v.shape),
                None if dmask is None else unbroadcast(dmask, additive.shape), ddout, ddweights)

    @staticmethod
    def jvp(ctx, tq, tk, tv, tmask, tdout, tdweights):
        """The tangents of the gradients it returns (`attention_backward_jvp`): what forward over
        reverse (autograd.functional.hvp) uses."""
        q, k, v, additive, probs, keep, dout, dweights = ctx.saved_tensors
        _, _, scale, dropout_scale, need = ctx.options
        xp = backend.get_array_module(dout)
        need_q, need_k, need_v, need_mask = need
        lead = probs.shape[:-2]
        moves_dv = tq is not None or tk is not None or tmask is not None or tdout is not None  # else t_dV = 0
        tangents = (xp.empty(lead + q.shape[-2:], dtype=q.dtype) if need_q else None,
                    xp.empty(lead + k.shape[-2:], dtype=q.dtype) if need_k else None,
                    xp.empty(lead + v.shape[-2:], dtype=q.dtype) if need_v and moves_dv else None,
                    xp.empty_like(probs) if need_mask else None)
        attention_backward_jvp(q, k, v, probs, keep, dout, dweights, scale, dropout_scale, tq, tk, tv,
                               _at_least_2d(tmask), tdout, tdweights, *tangents)
        shapes = (q.shape, k.shape, v.shape, None if additive is None else additive.shape)
        return tuple(None if t is None else unbroadcast(t, shape)
                     for t, shape, wanted in zip(tangents, shapes, need) if wanted)

    @staticmethod
    def differentiable_backward(ctx, *grads):
        """The double backward's formulas on whole (Tq, Tk) matrices of Tensors, P recomputed in the
        graph from q, k and the mask (graph_attention_double_backward): a third derivative, and every
        order above."""
        q, k, v, additive, probs, keep, dout, dweights = ctx.saved_tensors
        blocked, causal, scale, dropout_scale, need = ctx.options
        q, k, v, dout = (t if t is not None else Tensor(raw)
                         for t, raw in zip(ctx.inputs[:3] + ctx.inputs[4:5], (q, k, v, dout)))
        additive = ctx.inputs[3] if ctx.inputs[3] is not None else additive    # a Tensor, else the constant
        dweights = ctx.inputs[5] if ctx.inputs[5] is not None else dweights
        z = None if keep is None else keep * probs.dtype.type(dropout_scale)    # (..., Tq, Tk) Z, a constant
        grads = graph_attention_double_backward(q, k, v, additive, dout, dweights, blocked, causal, scale, z,
                                                *by_attention_input(grads, need))
        return tuple(g if wanted else None for g, wanted in zip(grads, ctx.needs_input_grad))


def _score_tangent(q_scaled, k, tq_scaled, tk, tmask):
    """t_S of S = (s Q) K^T + mask, given s Q and s t_Q: (s t_Q) K^T + (s Q) t_K^T + t_mask (each
    term where its tangent is not None; one block of it when given blocks)."""
    xp = backend.get_array_module(q_scaled)
    parts = []
    # S = s Q K^T  ->  t_S = s t_Q K^T + s Q t_K^T
    if tq_scaled is not None:
        parts.append(matmul_transposed(tq_scaled, k))
    if tk is not None:
        parts.append(matmul_transposed(q_scaled, tk))
    # S = ... + mask  ->  t_S += t_mask
    if tmask is not None:
        parts.append(tmask)
    return sum(parts[1:], parts[0])                                     # out of place: never into t_mask


def graph_probabilities(q, k, additive, blocked, causal, scale):
    """P = softmax(s Q K^T + mask) of the Tensors q, k (and a float mask Tensor or array), built
    from differentiable primitives for the differentiable backwards: S is -inf where the bool mask
    or causality hides a key; exp(S - m) / rowsum with the row max m taken as a constant (the
    softmax does not depend on it), and 0 for a fully hidden row (its sum replaced by 1, never NaN)."""
    scores = (q * scale) @ k.swapaxes(-1, -2)                                 # (..., Tq, Tk)
    if additive is not None:
        scores = scores + additive
    hidden = blocked
    if causal:
        above = causal_blocked(q.xp, 0, q.shape[-2], 0, k.shape[-2])          # (Tq, Tk) key j > query i
        hidden = above if blocked is None else blocked | above
    if hidden is not None:
        scores = where(hidden, -math.inf, scores)
    shifted = (scores - stable_row_max(scores.data, -1)).exp()               # (..., Tq, Tk)
    total = shifted.sum(axis=-1, keepdims=True)                               # (..., Tq, 1)
    return shifted / where(total.data == 0, 1.0, total)


def graph_attention_double_backward(q, k, v, additive, dout, dweights, blocked, causal, scale, z, gq, gk, gv, gmask):
    """(Qbar, Kbar, Vbar, Mbar, dObar, dWbar): the gradients of <gq, dQ> + <gk, dK> + <gv, dV> +
    <gmask, dMask> with respect to (q, k, v, mask, dO, dweights), where (dQ, dK, dV, dMask) is the
    attention backward, on whole (Tq, Tk) matrices of Tensors with P recomputed in the graph from q,
    k and the mask (attention_double_backward's formulas), so that they can be differentiated
    again, to any order: the differentiable_backward of AttentionBackward and of
    MemoryEfficientAttentionBackward. dweights: the gradient reaching the returned weights, or None;
    z: keep / (1 - p), the forward's dropout mask (a constant), or None; gq, gk, gv, gmask: Tensors or
    None (gv or one of the others given). Vbar and dWbar are None (0) without gq, gk, gmask; Mbar is
    (..., Tq, Tk), over the broadcast leading shape."""
    p = graph_probabilities(q, k, additive, blocked, causal, scale)            # P = softmax(s Q K^T + mask)
    dropped = p if z is None else p * z
    # dP = (dO V^T + dweights) Z, D = rowsum(dP P), dS = P (dP - D)
    dp = dout @ v.swapaxes(-1, -2)
    if dweights is not None:
        dp = dp + dweights
    if z is not None:
        dp = dp * z
    d = (dp * p).sum(axis=-1, keepdims=True)
    ds = None if gq is None and gk is None else p * (dp - d)                  # dQ, dK's cross terms need it
    # W = s (gq K^T + Q gk^T) + gmask reaches dS, Y = dO gv^T reaches Pd
    w = None
    if gq is not None:
        w = gq @ k.swapaxes(-1, -2)
    if gk is not None:
        w = _plus(w, q @ gk.swapaxes(-1, -2))
    if w is not None:
        w = w * scale
    if gmask is not None:
        w = _plus(w, gmask)
    # Pbar = W (dP - D) - r dP + Y Z,  C = P (W - r) Z,  with r = rowsum(W P)
    p_bar = c = None
    if w is not None:
        r = (w * p).sum(axis=-1, keepdims=True)
        p_bar = w * (dp - d) - r * dp
        c = p * (w - r) if z is None else p * (w - r) * z
    if gv is not None:
        y = dout @ gv.swapaxes(-1, -2)
        p_bar = _plus(p_bar, y if z is None else y * z)
    # Sbar = P (Pbar - rowsum(Pbar P))
    s_bar = p * (p_bar - (p_bar * p).sum(axis=-1, keepdims=True))
    # dQ = s (Sbar K + dS gk), dK = s (Sbar^T Q + dS^T gq), dV = C^T dO, d dO = C V + Pd gv, dMask = Sbar,
    # d dweights = C
    dq = s_bar @ k if gk is None else s_bar @ k + ds @ gk
    dk = s_bar.swapaxes(-1, -2) @ q if gq is None else s_bar.swapaxes(-1, -2) @ q + ds.swapaxes(-1, -2) @ gq
    dv = None if c is None else c.swapaxes(-1, -2) @ dout
    ddout = _plus(None if c is None else c @ v, None if gv is None else dropped @ gv)
    return dq * scale, dk * scale, dv, s_bar, ddout, c


class MemoryEfficientAttentionFunction(Function):
    """Same math as `AttentionFunction` without the (Tq, Tk) matrices: saves the output O and
    one logsumexp L per query row; the backward recomputes P = exp(S - L) block by block.
    The work is done by the kernel tables `attention_blockwise_forward` and
    `attention_blockwise_backward` (the blockwise reference, or the flash kernels on a GPU).
    Dropout: the contract's mask, regenerated from (seed, offset) in backward, never stored.
    """

    @staticmethod
    def forward(ctx, q, k, v, additive, blocked, causal, scale, block_size, dropout, mask_grad):
        mask = _at_least_2d(additive)
        out, lse = attention_blockwise_forward(q, k, v, blocked, mask, causal, scale, block_size, dropout, mask_grad)
        ctx.save_for_backward(q, k, v, out, lse, blocked, mask)
        ctx.options = (causal, scale, block_size, dropout)
        ctx.mask_shape = None if additive is None else additive.shape
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, blocked, mask = ctx.saved_tensors
        need_q, need_k, need_v, need_mask = ctx.needs_input_grad[:4]
        dq, dk, dv, dmask = attention_blockwise_backward(q, k, v, out, lse, dout, blocked, mask, *ctx.options,
                                                         need_mask)
        return (unbroadcast(dq, q.shape) if need_q else None,
                unbroadcast(dk, k.shape) if need_k else None,
                unbroadcast(dv, v.shape) if need_v else None,
                dmask.reshape(ctx.mask_shape) if need_mask else None)

    @staticmethod
    def differentiable_backward(ctx, dout):
        """The backward as the op `MemoryEfficientAttentionBackward`, whose own backward is the
        blockwise double backward: a second derivative without a (Tq, Tk) matrix."""
        q, k, v, out, lse, blocked, mask = ctx.saved_tensors
        operands = [t if t is not None else raw for t, raw in zip(ctx.inputs, (q, k, v, mask))]
        need = ctx.needs_input_grad[:4]
        grads = MemoryEfficientAttentionBackward.apply(*operands, dout, out=out, lse=lse, blocked=blocked,
                                                       options=ctx.options, need_mask=need[3])
        grads = grads + (None,) * (4 - len(grads))                             # no dMask without need_mask
        return tuple(g if wanted else None for g, wanted in zip(grads, need))

    @staticmethod
    def jvp(ctx, tq, tk, tv, tmask):
        """t_O block by block from the saved O and L (`attention_blockwise_jvp`), never a (Tq, Tk) matrix."""
        q, k, v, out, lse, blocked, mask = ctx.saved_tensors
        return attention_blockwise_jvp(q, k, v, out, lse, tq, tk, tv, _at_least_2d(tmask), blocked, mask,
                                       *ctx.options)


class MemoryEfficientAttentionBackward(Function):
    """(q, k, v, additive mask, dO) -> (dQ, dK, dV[, dMask]): the memory-efficient path's backward
    as an op (its forward runs `attention_blockwise_backward`, the flash kernels included), so that
    a gradient of attention can be differentiated again. O and L, the forward's saved output and
    logsumexp, come as constants: the backward below differentiates through them by hand.
    Its backward is `attention_blockwise_double_backward`, block by block, never a (Tq, Tk) matrix;
    its differentiable_backward the same formulas on whole matrices (third order and above)."""

    @staticmethod
    def forward(ctx, q, k, v, additive, dout, out, lse, blocked, options, need_mask):
        mask = _at_least_2d(additive)
        dq, dk, dv, dmask = attention_blockwise_backward(q, k, v, out, lse, dout, blocked, mask, *options, need_mask)
        ctx.save_for_backward(q, k, v, out, lse, dout, blocked, mask)
        ctx.options, ctx.mask_shape = options, None if additive is None else additive.shape
        grads = (unbroadcast(dq, q.shape), unbroadcast(dk, k.shape), unbroadcast(dv, v.shape))
        return (grads + (dmask.reshape(ctx.mask_shape),)) if need_mask else grads

    @staticmethod
    def backward(ctx, gq, gk, gv, gmask=None):
        q, k, v, out, lse, dout, blocked, mask = ctx.saved_tensors
        if gmask is not None:
            gmask = gmask.reshape(mask.shape)
        need_mask = ctx.needs_input_grad[3]
        dq, dk, dv, dmask, ddout = attention_blockwise_double_backward(
            q, k, v, out, lse, dout, blocked, mask, *ctx.options, gq, gk, gv, gmask, need_mask)
        return (unbroadcast(dq, q.shape), unbroadcast(dk, k.shape), unbroadcast(dv, v.shape),
                dmask.reshape(ctx.mask_shape) if need_mask else None, ddout)

    @staticmethod
    def differentiable_backward(ctx, gq, gk, gv, gmask=None):
        """The double backward's formulas (attention_blockwise_double_backward's) on whole (Tq, Tk)
        matrices of Tensors, P recomputed in the graph: a third derivative, and every order above.
        Its memory is the naive path's, not bounded like the second derivative's."""
        q, k, v, out, lse, dout, blocked, mask = ctx.saved_tensors
        causal, scale, _, dropout = ctx.options
        lead, (tq, tk) = out.shape[:-2], (q.shape[-2], k.shape[-2])
        q, k, v, dout = (t if t is not None else Tensor(raw)
                         for t, raw in zip(ctx.inputs[:3] + ctx.inputs[4:], (q, k, v, dout)))
        additive = ctx.inputs[3] if ctx.inputs[3] is not None else mask
        # Z = keep / (1 - p): the forward's dropout mask, a constant
        z = None
        if dropout is not None:
            z = attention_keep_block(dropout, lead, tq, tk, 0, tq, 0, tk, out) * dropout_scale(dropout[0])
        dq, dk, dv, s_bar, ddout, _ = graph_attention_double_backward(
            q, k, v, additive, dout, None, blocked, causal, scale, z, gq, gk, gv,
            None if gmask is None else gmask.reshape(mask.shape))
        return dq, dk, dv, s_bar if ctx.needs_input_grad[3] else None, ddout

def attention_blockwise_double_backward(q, k, v, out, lse, dout, blocked, additive, causal, scale, block_size,
                                        dropout, gq, gk, gv, gmask, need_mask):
    """(dQ, dK, dV, dMask, d dO) of L = <gq, dQ> + <gk, dK> + <gv, dV> + <gmask, dMask>, where
    (dQ, dK, dV, dMask) is `attention_blockwise_backward` of (q, k, v, mask, dO): its backward,
    block by block, recomputing P = exp(S - L) and never holding a (Tq, Tk) matrix. gq, gk, gv, gmask:
    the gradients reaching dQ, dK, dV (shapes of q, k, v) and dMask (additive's), each may be None.
    dQ, dK, dV, d dO have the broadcast leading shape; dMask additive's shape (None unless need_mask).

    Per tile, with Z = keep / (1 - p) (1 without dropout), dP = (dO V^T) Z, D = rowsum(dO O),
    dS = P (dP - D), W = s (gq K^T + Q gk^T) + gmask (what reaches dS) and Y = dO gv^T (what
    reaches Pd):  Pbar = W (dP - D) - r dP + Y Z,  Sbar = P (Pbar - e),  C = P (W - r) Z, with
    the row sums r = rowsum(W P) and e = rowsum(Pbar P) = rowsum(W dS) - r D + rowsum(Pd Y),
    taken in a first pass over the key blocks of each query block (docs/backprop.md derives it)."""
    xp = backend.get_array_module(dout)
    tq, tk = q.shape[-2], k.shape[-2]
    lead = out.shape[:-2]
    lse, delta, dq, dk, dv, dmask = _blockwise_backward_start(q, k, v, out, lse, dout, additive, need_mask)
    ddout = xp.zeros(lead + dout.shape[-2:], dtype=q.dtype)
    for qs in range(0, tq, block_size):
        qe = min(qs + block_size, tq)
        q_block, do_block, d_block = q[..., qs:qe, :], dout[..., qs:qe, :], delta[..., qs:qe, :]
        q_scaled = q_block * scale
        gq_block = None if gq is None else gq[..., qs:qe, :]

        def tile(ks):
            """P, Z (None without dropout), dP, dS, W, Y of the tile (query block, key block at ks)."""
            ke = min(ks + block_size, tk)
            p = recomputed_probabilities(q_scaled, k[..., ks:ke, :], blocked, additive, causal, qs, ks,
                                         lse[..., qs:qe, :])             # P = exp(S - L)  (..., bq, bk)
            z = None
            if dropout is not None:                                      # Z = keep / (1 - p), the forward's mask
                z = attention_keep_block(dropout, lead, tq, tk, qs, qe, ks, ke, q) * dropout_scale(dropout[0])
            dp = matmul_transposed(do_block, v[..., ks:ke, :])           # dP = (dO V^T) Z
            if z is not None:
                dp *= z
            ds = p * (dp - d_block)                                      # dS = P (dP - D)
            # W = s (gq K^T + Q gk^T) + gmask: the gradient reaching dS through dQ, dK, dMask
            w = xp.zeros_like(p)
            if gq_block is not None:
                w += matmul_transposed(gq_block, k[..., ks:ke, :])
            if gk is not None:
                w += matmul_transposed(q_block, gk[..., ks:ke, :])
            w *= scale
            if gmask is not None:
                w += mask_block(gmask, qs, qe, ks, ke)
            # Y = dO gv^T: the gradient reaching Pd through dV = Pd^T dO
            y = None if gv is None else matmul_transposed(do_block, gv[..., ks:ke, :])
            return ke, p, z, dp, ds, w, y

        # first pass: the row sums r = rowsum(W P) and e = rowsum(W dS) - r D + rowsum(Pd Y)
        r = xp.zeros(lead + (qe - qs, 1), dtype=q.dtype)
        e = xp.zeros(lead + (qe - qs, 1), dtype=q.dtype)
        for ks in _key_starts(qs, qe, tk, block_size, causal):
            _, p, z, dp, ds, w, y = tile(ks)
            r += (w * p).sum(axis=-1, keepdims=True)
            e += (w * ds).sum(axis=-1, keepdims=True)
            if y is not None:
                e += (p * y if z is None else p * z * y).sum(axis=-1, keepdims=True)
        e -= r * d_block
        # second pass: the gradients
        for ks in _key_starts(qs, qe, tk, block_size, causal):
            ke, p, z, dp, ds, w, y = tile(ks)
            # P enters dS = P (dP - D) (with D = rowsum(dP P)) and Pd = P Z:  Pbar = W (dP - D) - r dP + Y Z
            p_bar = w * (dp - d_block) - r * dp
            if y is not None:
                p_bar += y if z is None else y * z
            # P = softmax(S)  ->  Sbar = P (Pbar - rowsum(Pbar P)) = P (Pbar - e)
            s_bar = p * (p_bar - e)
            # dP = (dO V^T) Z enters dS and D:  C = P (W - r) Z reaches dO V^T
            c = p * (w - r)
            if z is not None:
                c *= z
            # S = s Q K^T + mask, and dQ = s dS K, dK = s dS^T Q:  dQ += s (Sbar K + dS gk), dK += s (Sbar^T Q + dS^T gq)
            dq[..., qs:qe, :] += s_bar @ k[..., ks:ke, :]
            if gk is not None:
                dq[..., qs:qe, :] += ds @ gk[..., ks:ke, :]
            dk[..., ks:ke, :] += s_bar.swapaxes(-1, -2) @ q_block
            if gq_block is not None:
                dk[..., ks:ke, :] += ds.swapaxes(-1, -2) @ gq_block
            # dO V^T  ->  dV += C^T dO, d dO += C V;  dV = Pd^T dO  ->  d dO += Pd gv
            dv[..., ks:ke, :] += c.swapaxes(-1, -2) @ do_block
            ddout[..., qs:qe, :] += c @ v[..., ks:ke, :]
            if gv is not None:
                ddout[..., qs:qe, :] += (p if z is None else p * z) @ gv[..., ks:ke, :]
            # S = s Q K^T + mask  ->  d(mask) += Sbar, summed over the mask's broadcast axes
            if need_mask:
                target = mask_block(dmask, qs, qe, ks, ke)
                target += unbroadcast(s_bar, target.shape)
    dq *= scale
    dk *= scale
    return dq, dk, dv, dmask, ddout


@kernel_table
def attention_blockwise_forward(q, k, v, blocked, additive, causal, scale, block_size, dropout, mask_grad):
    """(O (..., Tq, hdv), L (..., Tq)): attention by blocks of `block_size` queries x keys with
    an online softmax, and the logsumexp L = m + log(l) of every query row (-inf where every key
    is hidden). dropout: None or (p, seed, offset, state) of the dropout contract (state: the device
    (seed, base) of a draw under graph capture, else None). mask_grad: whether
    the backward will need d(additive) (implementations that cannot give it decline the call).

    Per query block, over key blocks: running max m, sum l and output acc; each new block
    rescales what was accumulated by exp(m_old - m_new)."""
    xp = backend.get_array_module(q)
    tq, tk = q.shape[-2], k.shape[-2]
    lead = _lead_shape(q, k, v)
    out = xp.zeros(lead + (tq, v.shape[-1]), dtype=q.dtype)              # (..., Tq, hdv)
    lse = xp.full(lead + (tq,), -math.inf, dtype=q.dtype)                # (..., Tq) L
    for qs in range(0, tq, block_size):
        qe = min(qs + block_size, tq)
        q_scaled = q[..., qs:qe, :] * scale                              # (..., bq, hd)
        row_max = xp.full(lead + (qe - qs, 1), -math.inf, dtype=q.dtype)  # m
        row_sum = xp.zeros(lead + (qe - qs, 1), dtype=q.dtype)           # l
        acc = out[..., qs:qe, :]                                         # (..., bq, hdv) view
        for ks in _key_starts(qs, qe, tk, block_size, causal):
            ke = min(ks + block_size, tk)
            p = masked_scores(q_scaled, k[..., ks:ke, :], blocked, additive, causal, qs, ks)
            new_max = xp.maximum(row_max, p.max(axis=-1, keepdims=True))   # running max, may be -inf
            shift = xp.where(xp.isfinite(new_max), new_max, 0)              # never -inf - (-inf)
            # rescale what was accumulated against the old max: exp(m_old - m_new)
            correction = xp.exp(row_max - shift)                         # exp(-inf) = 0 at start
            p -= shift
            xp.exp(p, out=p)                                             # (..., bq, bk) exp(S - m)
            row_sum *= correction
            row_sum += p.sum(axis=-1, keepdims=True)                     # l sums P before dropout
            if dropout is not None:                                      # Pd = P * keep / (1 - p)
                p *= attention_keep_block(dropout, lead, tq, tk, qs, qe, ks, ke, q)
                p *= dropout_scale(dropout[0])
            acc *= correction
            acc += p @ v[..., ks:ke, :]
            row_max = new_max
        empty = row_sum == 0                                             # fully masked rows
        xp.copyto(row_sum, 1.0, where=empty)
        acc /= row_sum                                                   # O = acc / l (0 if empty)
        block_lse = row_max + xp.log(row_sum)
        xp.copyto(block_lse, -math.inf, where=empty)
        lse[..., qs:qe] = block_lse[..., 0]
    return out, lse


def _blockwise_backward_start(q, k, v, out, lse, dout, additive, need_mask):
    """What the blockwise backward and double backward start from: L as a column with +inf on fully
    masked rows (so exp(S - L) = 0 there, never -inf - (-inf)), D = rowsum(dO O) (= rowsum(dP P),
    with dropout too: O_i = sum_j Pd_ij V_j), and zeroed dQ, dK, dV (and dMask with need_mask)."""
    xp = backend.get_array_module(dout)
    lead = out.shape[:-2]
    lse = xp.where(xp.isfinite(lse), lse, math.inf)[..., None]         # (..., Tq, 1)
    delta = xp.einsum("...ij,...ij->...i", dout, out)[..., None]        # (..., Tq, 1)
    grads = [xp.zeros(lead + a.shape[-2:], dtype=q.dtype) for a in (q, k, v)]
    dmask = xp.zeros(additive.shape, dtype=q.dtype) if need_mask else None
    return (lse, delta, *grads, dmask)


@kernel_table
def attention_blockwise_backward(q, k, v, out, lse, dout, blocked, additive, causal, scale, block_size, dropout,
                                 need_mask):
    """(dQ, dK, dV, dMask) of `attention_blockwise_forward`, all with the broadcast leading shape
    (dMask: the shape of `additive`, None unless need_mask), recomputing P = exp(S - L) block by
    block. D = rowsum(dO O) = rowsum(dP P) replaces the softmax's row sum over all keys."""
    tq, tk = q.shape[-2], k.shape[-2]
    lead = out.shape[:-2]
    lse, delta, dq, dk, dv, dmask = _blockwise_backward_start(q, k, v, out, lse, dout, additive, need_mask)
    for qs in range(0, tq, block_size):
        qe = min(qs + block_size, tq)
        q_block = q[..., qs:qe, :]
        q_scaled = q_block * scale
        do_block = dout[..., qs:qe, :]
        for ks in _key_starts(qs, qe, tk, block_size, causal):
            ke = min(ks + block_size, tk)
            p = recomputed_probabilities(q_scaled, k[..., ks:ke, :], blocked, additive, causal, qs, ks,
                                         lse[..., qs:qe, :])             # (..., bq, bk)
            dropped, keep = p, None
            if dropout is not None:                                      # the forward's mask, regenerated
                keep = attention_keep_block(dropout, lead, tq, tk, qs, qe, ks, ke, q)
                dropped = p * keep
                dropped *= dropout_scale(dropout[0])
            # O = Pd V  ->  dV_j += Pd^T dO
            dv[..., ks:ke, :] += dropped.swapaxes(-1, -2) @ do_block
            # O = Pd V  ->  dPd = dO V^T
            dp = matmul_transposed(do_block, v[..., ks:ke, :])          # (..., bq, bk)
            # Pd = P * keep / (1 - p)  ->  dP = dPd * keep / (1 - p)
            if keep is not None:
                dp *= keep
                dp *= dropout_scale(dropout[0])
            # P = softmax(S)  ->  dS = P (dP - D)
            dp -= delta[..., qs:qe, :]
            dp *= p
            # S = s Q K^T + mask  ->  d(mask) += dS, summed over the mask's broadcast axes
            if need_mask:
                target = mask_block(dmask, qs, qe, ks, ke)
                target += unbroadcast(dp, target.shape)
            # S = s Q K^T  ->  dQ_i += s dS K_j,  dK_j += s dS^T Q_i (s applied at the end)
            dq[..., qs:qe, :] += dp @ k[..., ks:ke, :]
            dk[..., ks:ke, :] += dp.swapaxes(-1, -2) @ q_block
    dq *= scale
    dk *= scale
    return dq, dk, dv, dmask


@kernel_table
def attention_blockwise_jvp(q, k, v, out, lse, tq, tk, tv, tmask, blocked, additive, causal, scale, block_size,
                            dropout):
    """t_O (..., Tq, hdv) of `attention_blockwise_forward` along the tangents tq, tk, tv, tmask (each
    None when that input does not move), recomputing P = exp(S - L) block by block (on "cuda" too,
    after the flash kernels' forward: their O and L are the reference's):

        t_O = Pd t_V + (Pd * t_S) V - rowsum(P * t_S) O,   t_S = s (t_Q K^T + Q t_K^T) + t_mask

    accumulated over key blocks as the forward accumulates O (FlashAttention-JVP): the row sums
    r = rowsum(P * t_S) and acc = sum_j (Pd t_V + (Pd * t_S) V). L is the forward's final
    logsumexp, so no running max or rescaling is needed. Dropout: the forward's mask, regenerated."""
    xp = backend.get_array_module(out)
    tq_len, tk_len = q.shape[-2], k.shape[-2]
    lead = out.shape[:-2]
    # a fully masked row has L = -inf: use +inf so exp(S - L) = 0 there, never -inf - (-inf)
    lse = xp.where(xp.isfinite(lse), lse, math.inf)[..., None]         # (..., Tq, 1)
    tout = xp.zeros_like(out)                                           # (..., Tq, hdv)
    moves_scores = tq is not None or tk is not None or tmask is not None
    for qs in range(0, tq_len, block_size):
        qe = min(qs + block_size, tq_len)
        q_scaled = q[..., qs:qe, :] * scale                             # (..., bq, hd)
        tq_scaled = None if tq is None else tq[..., qs:qe, :] * scale   # (..., bq, hd)
        acc = tout[..., qs:qe, :]                                       # (..., bq, hdv) view
        row_sum = xp.zeros(lead + (qe - qs, 1), dtype=q.dtype)         # r = rowsum(P t_S)
        for ks in _key_starts(qs, qe, tk_len, block_size, causal):
            ke = min(ks + block_size, tk_len)
            p = recomputed_probabilities(q_scaled, k[..., ks:ke, :], blocked, additive, causal, qs, ks,
                                         lse[..., qs:qe, :])            # (..., bq, bk)
            dropped, keep = p, None
            if dropout is not None:                                     # Pd = P * keep / (1 - p)
                keep = attention_keep_block(dropout, lead, tq_len, tk_len, qs, qe, ks, ke, q)
                dropped = p * keep
                dropped *= dropout_scale(dropout[0])
            # O = Pd V  ->  t_O += Pd t_V
            if tv is not None:
                acc += dropped @ tv[..., ks:ke, :]
            if not moves_scores:
                continue
            tscores = _score_tangent(q_scaled, k[..., ks:ke, :], tq_scaled, None if tk is None else tk[..., ks:ke, :],
                                     None if tmask is None else mask_block(tmask, qs, qe, ks, ke))
            # P = softmax(S)  ->  t_P = P (t_S - r), r = rowsum(P t_S) over every key block
            tscores = p * tscores                                       # (..., bq, bk) P t_S
            row_sum += tscores.sum(axis=-1, keepdims=True)
            # Pd = P * keep / (1 - p)  ->  the dropped P t_S
            if keep is not None:
                tscores *= keep
                tscores *= dropout_scale(dropout[0])
            # O = Pd V  ->  t_O += (P t_S)d V  (and - r O once the row is complete)
            acc += tscores @ v[..., ks:ke, :]
        # ... t_O -= r O: the softmax's row sum, known once every key block is seen
        acc -= row_sum * out[..., qs:qe, :]
    return tout


def recomputed_probabilities(q_scaled, k, blocked, additive, causal, q_start, k_start, lse):
    """P = exp(S - L) of one block, from the forward's logsumexp L (..., bq, 1): the blockwise
    backward, double backward and jvp recompute P block by block instead of keeping it."""
    p = masked_scores(q_scaled, k, blocked, additive, causal, q_start, k_start)
    p -= lse
    backend.get_array_module(p).exp(p, out=p)
    return p


def attention_keep_block(dropout, lead, tq, tk, q_start, q_stop, k_start, k_stop, like):
    """The dropout contract's keep-mask of the attention block (..., q rows, k cols), drawn alone:
    entry (b, i, j) of the (..., Tq, Tk) probabilities (b the flat index of the leading axes) is
    kept iff bits16(seed, offset + (b Tq + i) Tk + j) >= threshold. On the device of `like`."""
    p, seed, offset, state = dropout
    xp = backend.get_array_module(like)
    shape = lead + (q_stop - q_start, k_stop - k_start)
    if p == 1.0:
        return xp.zeros(shape, dtype=bool)
    batch = xp.arange(math.prod(lead), dtype="uint64")[:, None] * xp.uint64(tq)          # (B, 1) b Tq
    rows = batch + xp.arange(q_start, q_stop, dtype="uint64")                             # (B, bq) b Tq + i
    starts = rows * xp.uint64(tk) + xp.uint64(offset + k_start)                           # first value of each run
    bits = random.bits16_runs(seed, starts.reshape(-1), k_stop - k_start, state)          # (B bq, bk)
    return (bits >= dropout_threshold(p)).reshape(shape)


@kernel_table
def attention_keep_mask(like, shape, p, seed, offset, causal, state=None):
    """The dropout contract's keep mask of the naive path's probabilities, shape (..., Tq, Tk), on the
    device of `like`: entry i (C order) kept iff bits16(seed, offset + i) >= threshold. With causal
    =True the entries above the diagonal (key j > query i) have probability exactly 0 and their
    mask does not matter: implementations may leave them False (the reference draws them all)."""
    return keep_mask(shape, p, seed, offset, backend.device_of(like), state)


def _drawn_keep_mask(q, shape, p, causal, generator, op):
    """attention_keep_mask of the next values of the dropout stream (`generator` or the global one)."""
    draw = dropout_stream(generator, op).draw(math.prod(shape), _device(q))
    return attention_keep_mask(q, shape, p, draw.seed, draw.offset, causal, draw.state)


def _lead_shape(q, k, v):
    return broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])


def _key_starts(q_start, q_stop, tk, block_size, causal):
    """Key block starts; with a causal mask, blocks entirely right of the diagonal are skipped."""
    stop = min(tk, q_stop) if causal else tk
    return range(0, stop, block_size)


@kernel_table
def split_heads_backward(dx, grads):
    """dx (B, T, n, H, hd) <- the n head gradients (B, H, T, hd): dx[:, :, i] = grads[i] as (B, T, H, hd)."""
    for i, g in enumerate(grads):
        dx[:, :, i] = g.transpose(0, 2, 1, 3)


class SplitHeadsFunction(Function):
    """x (B, T, n E) -> n arrays (B, H, T, hd) with E = H hd: chunk i is the heads of columns
    [i E, (i + 1) E), a view of x. Backward writes the n head gradients into one (B, T, n E)
    array, the layout of x (one pass; no zero-filled copies to add up)."""

    @staticmethod
    def forward(ctx, x, chunks, num_heads):
        ctx.shape, ctx.layout = x.shape, (chunks, num_heads)
        return _heads_of(x, chunks, num_heads)

    @staticmethod
    def jvp(ctx, t):
        # out_i = the heads of x[:, :, i E:(i + 1) E], a linear map  ->  t_out_i = the heads of t_x's columns
        return _heads_of(t, *ctx.layout)

    @staticmethod
    def backward(ctx, *grads):
        return _merged_heads(grads, ctx.shape)

    @staticmethod
    def differentiable_backward(ctx, *grads):
        # the backward is linear in the gradients and does not depend on x: one op, MergeHeadsFunction
        return MergeHeadsFunction.apply(*grads, shape=ctx.shape, layout=ctx.layout)


class MergeHeadsFunction(Function):
    """n head tensors (B, H, T, hd) -> (B, T, n E): SplitHeadsFunction's backward as an op (its
    differentiable backward), one pass like the backward. It is linear and the transpose of the
    split: its backward is the split of the incoming gradient into heads, its jvp the merge of the
    tangents."""

    @staticmethod
    def forward(ctx, *heads, shape, layout):
        ctx.shape, ctx.layout, ctx.head_shape = shape, layout, heads[0].shape
        return _merged_heads(heads, shape)

    @staticmethod
    def backward(ctx, grad):
        # out[:, :, i E:(i + 1) E] = heads_i as (B, T, H, hd)  ->  d heads_i = the heads of grad's chunk i
        return _heads_of(grad, *ctx.layout)

    @staticmethod
    def differentiable_backward(ctx, grad):
        chunks, num_heads = ctx.layout
        return SplitHeadsFunction.apply(grad, chunks=chunks, num_heads=num_heads)

    @staticmethod
    def jvp(ctx, *tangents):
        like = next(t for t in tangents if t is not None)
        xp = backend.get_array_module(like)
        return _merged_heads([xp.zeros(ctx.head_shape, like.dtype) if t is None else t for t in tangents], ctx.shape)


def _heads_of(x, chunks, num_heads):
    """x (B, T, n E) -> n views (B, H, T, hd) of x: chunk i is the heads of columns [i E, (i + 1) E)."""
    B, T, width = x.shape
    heads = x.reshape(B, T, chunks, num_heads, width // (chunks * num_heads))   # (B, T, n, H, hd)
    return tuple(heads[:, :, i].transpose(0, 2, 1, 3) for i in range(chunks))  # n x (B, H, T, hd)


def _merged_heads(heads, shape):
    """The n head arrays (B, H, T, hd) written side by side into one array of `shape` (B, T, n E),
    in one pass: out[:, :, i E:(i + 1) E] = heads_i as (B, T, H, hd)."""
    xp = backend.get_array_module(heads[0])
    B, T, width = shape
    out = xp.empty((B, T, len(heads)) + heads[0].shape[1:2] + heads[0].shape[3:], dtype=heads[0].dtype)
    split_heads_backward(out, heads)
    return out.reshape(shape)


@has_twin
def split_heads(input: Tensor | Array, num_heads: int, chunks: int = 1) -> Tensor | tuple[Tensor, ...]:
    """input (B, T, chunks * E) -> `chunks` tensors (B, num_heads, T, E / num_heads) (one tensor
    when chunks=1): the heads of each E-wide block of columns, e.g. q, k, v of a packed
    projection. Views in forward; the backward assembles one gradient array. Raises ValueError
    unless input is 3-D with a width divisible by chunks * num_heads."""
    x = check_tensor("input", input, "split_heads")
    num_heads = check_int(num_heads, "num_heads", "split_heads", at_least=1)
    chunks = check_int(chunks, "chunks", "split_heads", at_least=1)
    if x.ndim != 3 or x.shape[-1] % (chunks * num_heads):
        raise ValueError(f"split_heads: input must be (batch, seq, chunks * num_heads * head_dim) with "
                         f"chunks={chunks}, num_heads={num_heads}, got shape {tuple(x.shape)}")
    heads = SplitHeadsFunction.apply(input, chunks=chunks, num_heads=num_heads)
    return heads if chunks > 1 else heads[0]


def _prepare_mask(attn_mask, q, score_shape):
    """(blocked, additive): a bool array True where attention is NOT allowed (at least 2-D), or
    a float array of q's dtype added to the scores, each broadcastable to `score_shape`."""
    if attn_mask is None:
        return None, None
    mask = on_device_of(attn_mask, q, "attn_mask", "scaled_dot_product_attention")
    if mask.dtype.kind not in "bf":
        raise TypeError("scaled_dot_product_attention: attn_mask must be bool (True = takes part) or "
                        f"floating (added to the scores), got dtype {mask.dtype}")
    if not broadcasts_to(mask.shape, score_shape):
        raise ValueError("scaled_dot_product_attention: attn_mask must broadcast to (..., Tq, Tk) = "
                         f"{score_shape}, got shape {tuple(mask.shape)}")
    if mask.dtype.kind == "b":
        return raw_computation(_blocked, mask), None
    return None, raw_computation(_as_dtype, mask, q.dtype)


def _blocked(allowed):
    """The bool mask True where attention is not allowed, at least 2-D."""
    return _at_least_2d(~allowed)


def _as_dtype(mask, dtype):
    return mask.astype(dtype, copy=False)


class _Call:
    """The checked arguments of one attention call."""

    def __init__(self, query, key, value, attn_mask, dropout_p, is_causal, scale, op):
        self.q = q = check_tensor("query", query, op)
        k = check_tensor("key", key, op)
        v = check_tensor("value", value, op)
        if q.ndim < 2 or k.ndim < 2 or v.ndim < 2:
            raise ValueError(f"{op}: query, key and value must be at least 2-D (..., T, head_dim), got shapes "
                             f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
        if q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2]:
            raise ValueError(f"{op}: expected query (..., Tq, hd), key (..., Tk, hd), value (..., Tk, hdv); got "
                             f"shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
        try:
            self.lead = _lead_shape(q, k, v)
        except ValueError:
            raise ValueError(f"{op}: the leading (batch, head) dimensions of query, key and value must "
                             f"broadcast, got shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}") from None
        self.k, self.v = k, v
        self.score_shape = self.lead + (q.shape[-2], k.shape[-2])
        self.dropout_p = check_real(dropout_p, "dropout_p", op, at_least=0, at_most=1)
        self.scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else check_real(scale, "scale", op)
        self.causal = check_bool(is_causal, "is_causal", op)
        self.blocked, self.additive = _prepare_mask(attn_mask, q, self.score_shape)
        # a float mask that requires grad enters the Function as a Tensor input: its gradient is dS
        self.mask_grad = (self.additive is not None and isinstance(attn_mask, Tensor) and attn_mask.requires_grad
                          and is_grad_enabled())
        # ... and so does one that carries a tangent (forward mode): t_S gets t_mask
        moves = (self.additive is not None and isinstance(attn_mask, Tensor)
                 and unpack_dual(attn_mask).tangent is not None)
        if self.mask_grad or moves:
            if attn_mask.dtype != q.dtype:
                why = "requires grad" if self.mask_grad else "carries a tangent"
                raise TypeError(f"{op}: a float attn_mask that {why} must have the dtype of the query "
                                f"({q.dtype}), got {attn_mask.dtype}")
            self.additive = attn_mask


def flash_unsupported(q, k, v, additive=None, mask_grad: bool = False) -> str | None:
    """Why the flash kernels cannot run attention on these arrays (a sentence), or None when they can."""
    dtypes = {a.dtype for a in (q, k, v, additive) if a is not None}
    if len(dtypes) > 1 or next(iter(dtypes)).char not in _FLASH_DTYPE_CHARS:  # (dtype names are slow to make)
        return f"dtype {sorted(map(str, dtypes))}: the kernels are compiled for one of {FLASH_DTYPES}"
    if q.shape[-1] not in FLASH_HEAD_DIMS or v.shape[-1] != q.shape[-1]:
        return (f"head dims {q.shape[-1]} (query, key) and {v.shape[-1]} (value): the kernels are compiled "
                f"for equal head dims in {FLASH_HEAD_DIMS}")
    if not 0 < q.shape[-2] < 2**31 or not 0 < k.shape[-2] < 2**31:
        return f"sequence lengths {q.shape[-2]} (query) and {k.shape[-2]} (key) must be in [1, 2^31)"
    heads = math.prod(_lead_shape(q, k, v))
    if heads * -(-max(q.shape[-2], k.shape[-2]) // 32) >= 2**31:
        return f"{heads} (batch, head) pairs of these lengths need more than 2^31 - 1 thread blocks"
    if mask_grad:
        return "the float attn_mask requires a gradient, which the kernels do not write"
    if backend.device_of(q) != "cuda":
        return f"the flash kernels run on CUDA arrays, these are on '{backend.device_of(q)}'"
    return None


def _choose_path(call, return_weights, backend_name, memory_efficient, op):
    """(path, reason): the path that runs ("naive", "memory_efficient" or "flash") and why."""
    if backend_name is not None and backend_name not in BACKENDS:
        raise ValueError(f"{op}: backend must be None or one of {BACKENDS}, got {backend_name!r}")
    memory_efficient = check_bool(memory_efficient, "memory_efficient", op)
    if memory_efficient and backend_name == "naive":
        raise ValueError(f"{op}: memory_efficient=True contradicts backend='naive'")
    asked = backend_name or ("memory_efficient" if memory_efficient else None)
    if check_bool(return_weights, "return_weights", op):
        if asked in ("memory_efficient", "flash"):
            raise ValueError(f"{op}: return_weights=True needs the full attention matrix; it cannot be combined "
                             f"with backend={asked!r} / memory_efficient=True")
        return "naive", "return_weights=True needs the (Tq, Tk) weights"
    if asked == "naive":
        return "naive", "backend='naive' was asked for"
    # the memory-efficient path's table says whether its flash kernels take the call
    args = (call.q, call.k, call.v, None, _data(call.additive), call.causal, call.scale, 1, None, call.mask_grad)
    implementation, why = attention_blockwise_forward.choose(*args)
    reason = None
    if attention_blockwise_forward.runs_reference(implementation):   # the reference, or it on threads
        if kernels.is_reference_only():
            reason = "npformer.runtime.kernels.reference_only() is active"
        else:
            reason = flash_unsupported(call.q, call.k, call.v, _data(call.additive), call.mask_grad) or why
    if asked == "flash":
        if reason:
            raise ValueError(f"{op}: backend='flash' cannot run this call: {reason}")
        return "flash", "backend='flash' was asked for"
    if asked == "memory_efficient":
        if reason:
            return "memory_efficient", f"backend='memory_efficient' was asked for; no flash kernel: {reason}"
        return "flash", "the memory-efficient path runs the flash kernels on this device"
    if reason:
        return "naive", f"the default where flash attention does not apply: {reason}"
    return "flash", "the default where flash attention applies"


def _device(array):
    return backend.device_of(array)


def _data(x):
    return x.data if isinstance(x, Tensor) else x


def attention_backend(query: Tensor | Array, key: Tensor | Array, value: Tensor | Array,
                      attn_mask: Tensor | Array | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                      scale: float | None = None, *, return_weights: bool = False, backend: str | None = None,
                      memory_efficient: bool = False) -> tuple[str, str]:
    """(path, reason): which path `scaled_dot_product_attention` takes for these arguments
    ("naive", "memory_efficient" or "flash") and why, e.g. why the flash kernels do not apply
    (the device, the dtype, a head dim they are not compiled for, a mask that needs a gradient).
    Raises what scaled_dot_product_attention would raise for them."""
    op = "attention_backend"
    call = _Call(query, key, value, attn_mask, dropout_p, is_causal, scale, op)
    return _choose_path(call, return_weights, backend, memory_efficient, op)


@has_twin
def scaled_dot_product_attention(query: Tensor | Array, key: Tensor | Array, value: Tensor | Array,
                                 attn_mask: Tensor | Array | None = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: float | None = None, *, return_weights: bool = False,
                                 backend: str | None = None, memory_efficient: bool = False, block_size: int = 512,
                                 generator: random.Philox | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """softmax(query key^T * scale + mask) value, like torch.nn.functional.scaled_dot_product_attention.

    query (..., Tq, hd), key (..., Tk, hd), value (..., Tk, hdv) -> (..., Tq, hdv); usually (B, H, T, hd).
    attn_mask: bool (True = takes part) or float (added to the scores), broadcastable to
    (..., Tq, Tk); is_causal hides keys j > i (combined with attn_mask when both are given).
    A float mask Tensor with requires_grad=True gets its gradient (dS, as torch gives it).
    scale defaults to 1/sqrt(hd). A query row with every key hidden gives 0 and zero gradients.
    dropout_p: dropout on the attention probabilities, drawn from `generator` (an
    npformer.runtime.random.Philox; None: the global dropout stream): entry i of the flat (..., Tq, Tk)
    index is kept iff value offset + i of the stream passes the keep test, on every path and device.
    return_weights=True returns (out, weights) where weights are the (dropped-out) probabilities.

    backend: which path runs (`attention_backend(...)` says which and why):
      None: "flash" on a GPU where its kernels apply, else "naive";
      "naive": keeps the (Tq, Tk) probabilities (the only one with return_weights);
      "memory_efficient" (or memory_efficient=True): blocks of `block_size` queries x keys with
        an online softmax, never a (Tq, Tk) matrix; on a GPU it runs the flash kernels where they
        apply (inside npformer.runtime.kernels.reference_only(), the blockwise numpy/CuPy reference);
      "flash": the CUDA flash-attention kernels (head dims 32/64/128, float32/float64), else ValueError.

    Raises TypeError for a mask that is neither bool nor floating, ValueError for shapes that do
    not fit (batch dims, head dims, a mask that does not broadcast) or a path that cannot run.
    """
    op = "scaled_dot_product_attention"
    call = _Call(query, key, value, attn_mask, dropout_p, is_causal, scale, op)
    path, _ = _choose_path(call, return_weights, backend, memory_efficient, op)
    p = call.dropout_p
    if path == "naive":
        keep = None
        if p > 0:  # drawn again at each replay of a recorded step
            keep = raw_computation(_drawn_keep_mask, call.q, call.score_shape, p, call.causal, generator, op)
        return AttentionFunction.apply(query, key, value, call.additive, blocked=call.blocked, causal=call.causal,
                                       scale=call.scale, keep=keep, dropout_scale=dropout_scale(p),
                                       return_weights=bool(return_weights))
    block_size = check_int(block_size, "block_size", op, at_least=1)
    dropout = None
    if p > 0:
        draw = dropout_stream(generator, op).draw(math.prod(call.score_shape), _device(call.q))
        dropout = (p, draw.seed, draw.offset, draw.state)
    return MemoryEfficientAttentionFunction.apply(query, key, value, call.additive, blocked=call.blocked,
                                                  causal=call.causal, scale=call.scale, block_size=block_size,
                                                  dropout=dropout, mask_grad=call.mask_grad)
