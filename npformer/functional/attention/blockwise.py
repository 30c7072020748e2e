"""Scaled dot-product attention, the memory-efficient path (the FlashAttention scheme) on `xp`:
blocks of `block_size` queries x keys, never a (Tq, Tk) matrix. The forward keeps an online
softmax (running max m, sum l) and saves one logsumexp L per query row; the backward, its tangent
and the double backward recompute P = exp(S - L) block by block. The same math as the naive path
(math.py, higher.py); `ops` as there, with ops.keep_block for dropout (the dropout contract's mask
of one block: `dropout` = (p, seed, offset, state), regenerated, never stored). A causal sliding
`window` W (keyword, None: none) hides keys j <= i - W too: each query block visits only the key
blocks that meet its band (key_starts), so time and memory grow as T W, not T^2.
derivation.md derives each formula."""
import math

from .higher import score_tangent
from .masks import mask_block, masked_scores
from .math import PLAIN


def window_option(window):
    """The keyword arguments that pass a sliding window to the blockwise tables: none without one,
    so that every call without a window is the call it was (implementations registered with a
    fixed signature take it)."""
    return {} if window is None else {"window": window}


def lead_shape(q, k, v):
    """The leading (batch, head) shape of q, k and v broadcast together (they are checked to broadcast)."""
    shapes = [a.shape[:-2] for a in (q, k, v)]
    if shapes[0] == shapes[1] == shapes[2]:                 # the common case
        return shapes[0]
    ndim = max(len(s) for s in shapes)
    padded = [(1,) * (ndim - len(s)) + tuple(s) for s in shapes]
    return tuple(next((n for n in sizes if n != 1), 1) for sizes in zip(*padded))


def sum_to(x, shape):
    """x summed over the axes that broadcasting added or stretched, back to `shape` (d mask of a
    broadcast mask)."""
    if x.shape == shape:
        return x
    x = x.sum(axis=tuple(range(x.ndim - len(shape)))) if x.ndim > len(shape) else x
    stretched = tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1)
    return x.sum(axis=stretched, keepdims=True) if stretched else x


def _kept_scale(dropout):
    """1 / (1 - p) of a dropout (p, seed, offset, state): the scale of the kept entries (0 for p = 1)."""
    if dropout is None:
        return None
    return 1.0 / (1.0 - dropout[0]) if dropout[0] < 1.0 else 0.0


def attention_blockwise_forward(xp, q, k, v, blocked, additive, causal, scale, block_size, dropout, mask_grad, *,
                                window=None, ops=PLAIN):
    """(O (..., Tq, hdv), L (..., Tq)): attention by blocks of `block_size` queries x keys with
    an online softmax, and the logsumexp L = m + log(l) of every query row (-inf where every key
    is hidden). dropout: None or (p, seed, offset, state) of the dropout contract (state: the device
    (seed, base) of a draw under graph capture, else None). mask_grad: whether
    the backward will need d(additive) (implementations that cannot give it decline the call).

    Per query block, over key blocks: running max m, sum l and output acc; each new block
    rescales what was accumulated by exp(m_old - m_new)."""
    tq, tk = q.shape[-2], k.shape[-2]
    lead = lead_shape(q, k, v)
    kept_scale = _kept_scale(dropout)                                   # 1 / (1 - p)
    out = xp.zeros(lead + (tq, v.shape[-1]), dtype=q.dtype)              # (..., Tq, hdv)
    lse = xp.full(lead + (tq,), -math.inf, dtype=q.dtype)                # (..., Tq) L
    for qs in range(0, tq, block_size):
        qe = min(qs + block_size, tq)
        q_scaled = q[..., qs:qe, :] * scale                              # (..., bq, hd)
        row_max = xp.full(lead + (qe - qs, 1), -math.inf, dtype=q.dtype)  # m
        row_sum = xp.zeros(lead + (qe - qs, 1), dtype=q.dtype)           # l
        acc = out[..., qs:qe, :]                                         # (..., bq, hdv) view
        for ks in key_starts(qs, qe, tk, block_size, causal, window):
            ke = min(ks + block_size, tk)
            p = masked_scores(xp, ops, q_scaled, k[..., ks:ke, :], blocked, additive, causal, qs, ks, window=window)
            new_max = xp.maximum(row_max, p.max(axis=-1, keepdims=True))   # running max, may be -inf
            shift = xp.where(xp.isfinite(new_max), new_max, 0)              # never -inf - (-inf)
            # rescale what was accumulated against the old max: exp(m_old - m_new)
            correction = xp.exp(row_max - shift)                         # exp(-inf) = 0 at start
            p -= shift
            xp.exp(p, out=p)                                             # (..., bq, bk) exp(S - m)
            row_sum *= correction
            row_sum += p.sum(axis=-1, keepdims=True)                     # l sums P before dropout
            if dropout is not None:                                      # Pd = P * keep / (1 - p)
                p *= ops.keep_block(xp, dropout, lead, tq, tk, qs, qe, ks, ke, q)
                p *= kept_scale
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


def _blockwise_backward_start(xp, q, k, v, out, lse, dout, additive, need_mask):
    """What the blockwise backward and double backward start from: L as a column with +inf on fully
    masked rows (so exp(S - L) = 0 there, never -inf - (-inf)), D = rowsum(dO O) (= rowsum(dP P),
    with dropout too: O_i = sum_j Pd_ij V_j), and zeroed dQ, dK, dV (and dMask with need_mask)."""
    lead = out.shape[:-2]
    lse = xp.where(xp.isfinite(lse), lse, math.inf)[..., None]         # (..., Tq, 1)
    delta = xp.einsum("...ij,...ij->...i", dout, out)[..., None]        # (..., Tq, 1)
    grads = [xp.zeros(lead + a.shape[-2:], dtype=q.dtype) for a in (q, k, v)]
    dmask = xp.zeros(additive.shape, dtype=q.dtype) if need_mask else None
    return (lse, delta, *grads, dmask)


def attention_blockwise_backward(xp, q, k, v, out, lse, dout, blocked, additive, causal, scale, block_size, dropout,
                                 need_mask, *, window=None, ops=PLAIN):
    """(dQ, dK, dV, dMask) of `attention_blockwise_forward`, all with the broadcast leading shape
    (dMask: the shape of `additive`, None unless need_mask), recomputing P = exp(S - L) block by
    block. D = rowsum(dO O) = rowsum(dP P) replaces the softmax's row sum over all keys."""
    tq, tk = q.shape[-2], k.shape[-2]
    lead = out.shape[:-2]
    kept_scale = _kept_scale(dropout)                                   # 1 / (1 - p)
    lse, delta, dq, dk, dv, dmask = _blockwise_backward_start(xp, q, k, v, out, lse, dout, additive, need_mask)
    for qs in range(0, tq, block_size):
        qe = min(qs + block_size, tq)
        q_block = q[..., qs:qe, :]
        q_scaled = q_block * scale
        do_block = dout[..., qs:qe, :]
        for ks in key_starts(qs, qe, tk, block_size, causal, window):
            ke = min(ks + block_size, tk)
            p = recomputed_probabilities(xp, ops, q_scaled, k[..., ks:ke, :], blocked, additive, causal, qs, ks,
                                         lse[..., qs:qe, :], window)             # (..., bq, bk)
            dropped, keep = p, None
            if dropout is not None:                                      # the forward's mask, regenerated
                keep = ops.keep_block(xp, dropout, lead, tq, tk, qs, qe, ks, ke, q)
                dropped = p * keep
                dropped *= kept_scale
            # O = Pd V  ->  dV_j += Pd^T dO
            dv[..., ks:ke, :] += dropped.swapaxes(-1, -2) @ do_block
            # O = Pd V  ->  dPd = dO V^T
            dp = ops.matmul_transposed(xp, do_block, v[..., ks:ke, :])          # (..., bq, bk)
            # Pd = P * keep / (1 - p)  ->  dP = dPd * keep / (1 - p)
            if keep is not None:
                dp *= keep
                dp *= kept_scale
            # P = softmax(S)  ->  dS = P (dP - D)
            dp -= delta[..., qs:qe, :]
            dp *= p
            # S = s Q K^T + mask  ->  d(mask) += dS, summed over the mask's broadcast axes
            if need_mask:
                target = mask_block(dmask, qs, qe, ks, ke)
                target += sum_to(dp, target.shape)
            # S = s Q K^T  ->  dQ_i += s dS K_j,  dK_j += s dS^T Q_i (s applied at the end)
            dq[..., qs:qe, :] += dp @ k[..., ks:ke, :]
            dk[..., ks:ke, :] += dp.swapaxes(-1, -2) @ q_block
    dq *= scale
    dk *= scale
    return dq, dk, dv, dmask


def attention_blockwise_jvp(xp, q, k, v, out, lse, tq, tk, tv, tmask, blocked, additive, causal, scale, block_size,
                            dropout, *, window=None, ops=PLAIN):
    """t_O (..., Tq, hdv) of `attention_blockwise_forward` along the tangents tq, tk, tv, tmask (each
    None when that input does not move), recomputing P = exp(S - L) block by block (on "cuda" too,
    after the flash kernels' forward: their O and L are the reference's):

        t_O = Pd t_V + (Pd * t_S) V - rowsum(P * t_S) O,   t_S = s (t_Q K^T + Q t_K^T) + t_mask

    accumulated over key blocks as the forward accumulates O (FlashAttention-JVP): the row sums
    r = rowsum(P * t_S) and acc = sum_j (Pd t_V + (Pd * t_S) V). L is the forward's final
    logsumexp, so no running max or rescaling is needed. Dropout: the forward's mask, regenerated."""
    tq_len, tk_len = q.shape[-2], k.shape[-2]
    lead = out.shape[:-2]
    kept_scale = _kept_scale(dropout)                                   # 1 / (1 - p)
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
        for ks in key_starts(qs, qe, tk_len, block_size, causal, window):
            ke = min(ks + block_size, tk_len)
            p = recomputed_probabilities(xp, ops, q_scaled, k[..., ks:ke, :], blocked, additive, causal, qs, ks,
                                         lse[..., qs:qe, :], window)            # (..., bq, bk)
            dropped, keep = p, None
            if dropout is not None:                                     # Pd = P * keep / (1 - p)
                keep = ops.keep_block(xp, dropout, lead, tq_len, tk_len, qs, qe, ks, ke, q)
                dropped = p * keep
                dropped *= kept_scale
            # O = Pd V  ->  t_O += Pd t_V
            if tv is not None:
                acc += dropped @ tv[..., ks:ke, :]
            if not moves_scores:
                continue
            tscores = score_tangent(xp, ops, q_scaled, k[..., ks:ke, :], tq_scaled,
                                    None if tk is None else tk[..., ks:ke, :],
                                     None if tmask is None else mask_block(tmask, qs, qe, ks, ke))
            # P = softmax(S)  ->  t_P = P (t_S - r), r = rowsum(P t_S) over every key block
            tscores = p * tscores                                       # (..., bq, bk) P t_S
            row_sum += tscores.sum(axis=-1, keepdims=True)
            # Pd = P * keep / (1 - p)  ->  the dropped P t_S
            if keep is not None:
                tscores *= keep
                tscores *= kept_scale
            # O = Pd V  ->  t_O += (P t_S)d V  (and - r O once the row is complete)
            acc += tscores @ v[..., ks:ke, :]
        # ... t_O -= r O: the softmax's row sum, known once every key block is seen
        acc -= row_sum * out[..., qs:qe, :]
    return tout


def attention_blockwise_double_backward(xp, q, k, v, out, lse, dout, blocked, additive, causal, scale, block_size,
                                        dropout, gq, gk, gv, gmask, need_mask, *, window=None, ops=PLAIN):
    """(dQ, dK, dV, dMask, d dO) of L = <gq, dQ> + <gk, dK> + <gv, dV> + <gmask, dMask>, where
    (dQ, dK, dV, dMask) is `attention_blockwise_backward` of (q, k, v, mask, dO): its backward,
    block by block, recomputing P = exp(S - L) and never holding a (Tq, Tk) matrix. gq, gk, gv, gmask:
    the gradients reaching dQ, dK, dV (shapes of q, k, v) and dMask (additive's), each may be None.
    dQ, dK, dV, d dO have the broadcast leading shape; dMask additive's shape (None unless need_mask).

    Per tile, with Z = keep / (1 - p) (1 without dropout), dP = (dO V^T) Z, D = rowsum(dO O),
    dS = P (dP - D), W = s (gq K^T + Q gk^T) + gmask (what reaches dS) and Y = dO gv^T (what
    reaches Pd):  Pbar = W (dP - D) - r dP + Y Z,  Sbar = P (Pbar - e),  C = P (W - r) Z, with
    the row sums r = rowsum(W P) and e = rowsum(Pbar P) = rowsum(W dS) - r D + rowsum(Pd Y),
    taken in a first pass over the key blocks of each query block (derivation.md derives it)."""
    tq, tk = q.shape[-2], k.shape[-2]
    lead = out.shape[:-2]
    kept_scale = _kept_scale(dropout)                                   # 1 / (1 - p)
    lse, delta, dq, dk, dv, dmask = _blockwise_backward_start(xp, q, k, v, out, lse, dout, additive, need_mask)
    ddout = xp.zeros(lead + dout.shape[-2:], dtype=q.dtype)
    for qs in range(0, tq, block_size):
        qe = min(qs + block_size, tq)
        q_block, do_block, d_block = q[..., qs:qe, :], dout[..., qs:qe, :], delta[..., qs:qe, :]
        q_scaled = q_block * scale
        gq_block = None if gq is None else gq[..., qs:qe, :]

        def tile(ks):
            """P, Z (None without dropout), dP, dS, W, Y of the tile (query block, key block at ks)."""
            ke = min(ks + block_size, tk)
            p = recomputed_probabilities(xp, ops, q_scaled, k[..., ks:ke, :], blocked, additive, causal, qs, ks,
                                         lse[..., qs:qe, :], window)             # P = exp(S - L)  (..., bq, bk)
            z = None
            if dropout is not None:                                      # Z = keep / (1 - p), the forward's mask
                z = ops.keep_block(xp, dropout, lead, tq, tk, qs, qe, ks, ke, q) * kept_scale
            dp = ops.matmul_transposed(xp, do_block, v[..., ks:ke, :])           # dP = (dO V^T) Z
            if z is not None:
                dp *= z
            ds = p * (dp - d_block)                                      # dS = P (dP - D)
            # W = s (gq K^T + Q gk^T) + gmask: the gradient reaching dS through dQ, dK, dMask
            w = xp.zeros_like(p)
            if gq_block is not None:
                w += ops.matmul_transposed(xp, gq_block, k[..., ks:ke, :])
            if gk is not None:
                w += ops.matmul_transposed(xp, q_block, gk[..., ks:ke, :])
            w *= scale
            if gmask is not None:
                w += mask_block(gmask, qs, qe, ks, ke)
            # Y = dO gv^T: the gradient reaching Pd through dV = Pd^T dO
            y = None if gv is None else ops.matmul_transposed(xp, do_block, gv[..., ks:ke, :])
            return ke, p, z, dp, ds, w, y

        # first pass: the row sums r = rowsum(W P) and e = rowsum(W dS) - r D + rowsum(Pd Y)
        r = xp.zeros(lead + (qe - qs, 1), dtype=q.dtype)
        e = xp.zeros(lead + (qe - qs, 1), dtype=q.dtype)
        for ks in key_starts(qs, qe, tk, block_size, causal, window):
            _, p, z, dp, ds, w, y = tile(ks)
            r += (w * p).sum(axis=-1, keepdims=True)
            e += (w * ds).sum(axis=-1, keepdims=True)
            if y is not None:
                e += (p * y if z is None else p * z * y).sum(axis=-1, keepdims=True)
        e -= r * d_block
        # second pass: the gradients
        for ks in key_starts(qs, qe, tk, block_size, causal, window):
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
            # S = s Q K^T + mask, and dQ = s dS K, dK = s dS^T Q:
            #   dQ += s (Sbar K + dS gk), dK += s (Sbar^T Q + dS^T gq)
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
                target += sum_to(s_bar, target.shape)
    dq *= scale
    dk *= scale
    return dq, dk, dv, dmask, ddout


def recomputed_probabilities(xp, ops, q_scaled, k, blocked, additive, causal, q_start, k_start, lse, window=None):
    """P = exp(S - L) of one block, from the forward's logsumexp L (..., bq, 1): the blockwise
    backward, double backward and jvp recompute P block by block instead of keeping it."""
    p = masked_scores(xp, ops, q_scaled, k, blocked, additive, causal, q_start, k_start, window=window)
    p -= lse
    xp.exp(p, out=p)
    return p


def key_starts(q_start, q_stop, tk, block_size, causal, window=None):
    """The starts of the key blocks that the query block [q_start, q_stop) visits. With a causal
    mask, blocks entirely right of the diagonal are skipped (every key j > q_stop - 1); with a
    sliding window W too, blocks entirely left of it (every key j <= q_start - W, the first query's
    first key q_start - W + 1 lies in the block starting at floor((q_start - W + 1) / bk) bk):
    about (bq + W) / bk + 1 blocks per query block, whatever Tk (derivation.md)."""
    stop = min(tk, q_stop) if causal else tk
    start = 0
    if causal and window is not None:
        start = max(0, (q_start - window + 1) // block_size * block_size)
    return range(start, stop, block_size)
