"""Scaled dot-product attention, three paths with hand-written backward passes:

- naive: keeps the (Tq, Tk) probabilities (`AttentionFunction`);
- memory-efficient: the FlashAttention scheme (online softmax over key blocks, P recomputed in
  backward from one logsumexp per query row), never a (Tq, Tk) matrix
  (`MemoryEfficientAttentionFunction`). Its blockwise forward and backward are kernel tables:
  the reference below (blocks of numpy/CuPy calls, every device) and, on "cuda", the
  flash-attention kernels of npformer/functional/cuda/flash_attention.cu where they apply;
- flash: that CUDA implementation, chosen by default on a GPU where it applies.

Every dropout mask over the probabilities is the one of the dropout contract (activation.py):
entry i of the flat (..., Tq, Tk) index is kept iff bits16(seed, offset + i) >= threshold, so
all paths, on every device, drop the same entries for the same generator state."""
from __future__ import annotations

import math

from autograd import Function, Tensor, backend, is_grad_enabled, random, unbroadcast
from autograd.backend import Array
from autograd.checks import check_bool, check_int, check_real
from autograd.forward_ad import unpack_dual
from autograd.kernels import kernel_table
from autograd.threads import for_rows, row_blocks, run_blocks

from ._common import broadcast_shapes, broadcasts_to, check_tensor, has_twin, on_device_of
from .activation import dropout_scale, dropout_stream, dropout_threshold, keep_mask
from .softmax import softmax_backward, softmax_forward

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


def masked_scores(q_scaled, k, blocked, additive, causal, q_start, k_start, out=None):
    """S = (s q) K^T + additive, -inf where blocked or causally hidden, for one block
    (written into `out` when given)."""
    xp = backend.get_array_module(q_scaled)
    q_stop, k_stop = q_start + q_scaled.shape[-2], k_start + k.shape[-2]
    scores = xp.matmul(q_scaled, k.swapaxes(-1, -2), out=out)               # (..., bq, bk)
    if additive is not None:
        scores += mask_block(additive, q_start, q_stop, k_start, k_stop)
    if blocked is not None:
        xp.copyto(scores, -math.inf, where=mask_block(blocked, q_start, q_stop, k_start, k_stop))
    if causal:
        xp.copyto(scores, -math.inf, where=causal_blocked(xp, q_start, q_stop, k_start, k_stop))
    return scores


def _at_least_2d(mask):
    """A mask broadcastable to (..., Tq, Tk) with its last two axes present (size 1 if missing)."""
    return None if mask is None else mask.reshape((1,) * max(0, 2 - mask.ndim) + tuple(mask.shape))


class AttentionFunction(Function):
    """q (..., Tq, hd), k (..., Tk, hd), v (..., Tk, hdv) [, additive mask] -> out (..., Tq, hdv)
    [, P (..., Tq, Tk)].

    S = s Q K^T + mask, P = softmax(S) (dropout: Pd = P * keep / (1 - p)), O = Pd V;
    dV = Pd^T dO, dPd = dO V^T (+ dP from the returned weights), dS = P (dP - rowsum(dP P)),
    dQ = s dS K, dK = s dS^T Q, and d(additive mask) = dS summed over its broadcast axes.
    With set_num_threads(n > 1), blocks of a batch axis (the batch, or the heads) run in the threads of
    `autograd.threads`.
    """

    @staticmethod
    def forward(ctx, q, k, v, additive, blocked, causal, scale, keep, dropout_scale, return_weights):
        xp = backend.get_array_module(q)
        lead = _lead_shape(q, k, v)
        mask = _at_least_2d(additive)
        probs = xp.empty(lead + (q.shape[-2], k.shape[-2]), dtype=q.dtype)   # (..., Tq, Tk)
        out = xp.empty(lead + (q.shape[-2], v.shape[-1]), dtype=q.dtype)     # (..., Tq, hdv)
        weights = xp.empty_like(probs) if keep is not None and return_weights else None

        axis, blocks = _batch_blocks(lead, (q, k, v), probs.size, q)

        def forward_block(start, stop):
            part = _batch_block(lead, axis, start, stop)
            s = masked_scores(part(q) * scale, part(k), part(blocked), part(mask), causal, 0, 0,
                              out=part(probs))                                # S
            softmax_forward(s, -1, out=s)                                     # P
            dropped = s
            if keep is not None:                                              # Pd = P * keep / (1 - p)
                dropped = xp.multiply(s, part(keep), out=part(weights))
                dropped *= dropout_scale
            xp.matmul(dropped, part(v), out=part(out))                        # O = Pd V

        run_blocks(forward_block, blocks)
        ctx.save_for_backward(q, k, v, probs, keep)
        ctx.scale, ctx.dropout_scale, ctx.return_weights = scale, dropout_scale, return_weights
        ctx.mask_shape = None if additive is None else additive.shape
        return (out, probs if weights is None else weights) if return_weights else out

    @staticmethod
    def backward(ctx, dout, dweights=None):
        q, k, v, probs, keep = ctx.saved_tensors
        xp = backend.get_array_module(dout)
        need_q, need_k, need_v, need_mask = ctx.needs_input_grad[:4]
        lead = probs.shape[:-2]
        dq = xp.empty(lead + q.shape[-2:], dtype=q.dtype) if need_q else None
        dk = xp.empty(lead + k.shape[-2:], dtype=q.dtype) if need_k else None
        dv = xp.empty(lead + v.shape[-2:], dtype=q.dtype) if need_v else None
        dmask = xp.empty_like(probs) if need_mask else None                  # (..., Tq, Tk) dS

        axis, blocks = _batch_blocks(lead, (q, k, v), probs.size, probs)

        def backward_block(start, stop):
            part = _batch_block(lead, axis, start, stop)
            p, do = part(probs), part(dout)
            dropped = p
            if keep is not None:
                dropped = p * part(keep)
                dropped *= ctx.dropout_scale
            # O = Pd V  ->  dV = Pd^T dO
            if need_v:
                xp.matmul(dropped.swapaxes(-1, -2), do, out=part(dv))
            if not (need_q or need_k or need_mask):
                return
            # O = Pd V  ->  dPd = dO V^T (plus the gradient reaching the returned weights Pd)
            dprobs = do @ part(v).swapaxes(-1, -2)                            # (..., Tq, Tk)
            if dweights is not None:
                dprobs += part(dweights)
            # Pd = P * keep / (1 - p)  ->  dP = dPd * keep / (1 - p)
            if keep is not None:
                dprobs *= part(keep)
                dprobs *= ctx.dropout_scale
            # P = softmax(S)  ->  dS = P (dP - rowsum(dP P)); masked entries have P = 0, so dS = 0
            dscores = softmax_backward(p, dprobs, -1, out=dprobs)             # (..., Tq, Tk)
            # S = s Q K^T + mask  ->  d(mask) = dS
            if need_mask:
                part(dmask)[...] = dscores
            # S = s Q K^T  ->  dQ = s dS K
            if need_q:
                dq_block = xp.matmul(dscores, part(k), out=part(dq))
                dq_block *= ctx.scale
            # S = s Q K^T  ->  dK = s dS^T Q
            if need_k:
                dk_block = xp.matmul(dscores.swapaxes(-1, -2), part(q), out=part(dk))
                dk_block *= ctx.scale

        run_blocks(backward_block, blocks)
        return (unbroadcast(dq, q.shape) if need_q else None,
                unbroadcast(dk, k.shape) if need_k else None,
                unbroadcast(dv, v.shape) if need_v else None,
                unbroadcast(dmask, ctx.mask_shape) if need_mask else None)

    @staticmethod
    def jvp(ctx, tq, tk, tv, tmask):
        """(t_O [, t_Pd]) from the saved P, by (batch, head) blocks in the threads like forward."""
        q, k, v, probs, keep = ctx.saved_tensors
        xp = backend.get_array_module(probs)
        lead = probs.shape[:-2]
        moves_scores = tq is not None or tk is not None or tmask is not None
        tout = xp.empty(lead + (q.shape[-2], v.shape[-1]), dtype=q.dtype)      # (..., Tq, hdv)
        tweights = xp.empty_like(probs) if ctx.return_weights and moves_scores else None   # (..., Tq, Tk)
        tmask = _at_least_2d(tmask)
        axis, blocks = _batch_blocks(lead, (q, k, v), probs.size, probs)

        def jvp_block(start, stop):
            part = _batch_block(lead, axis, start, stop)
            p, t_out = part(probs), part(tout)
            if moves_scores:
                tscores = _score_tangent(part(q) * ctx.scale, part(k), None if tq is None else part(tq) * ctx.scale,
                                         part(tk), part(tmask))
                # P = softmax(S)  ->  t_P = P (t_S - rowsum(P t_S))
                tprobs = p * tscores
                tprobs -= p * tprobs.sum(axis=-1, keepdims=True)
                # Pd = P * keep / (1 - p)  ->  t_Pd = t_P * keep / (1 - p)
                if keep is not None:
                    tprobs *= part(keep)
                    tprobs *= ctx.dropout_scale
                if tweights is not None:
                    part(tweights)[...] = tprobs
                # O = Pd V  ->  t_O = t_Pd V (+ Pd t_V)
                xp.matmul(tprobs, part(v), out=t_out)
            if tv is not None:
                dropped = p if keep is None else p * part(keep) * ctx.dropout_scale   # Pd
                # O = Pd V  ->  t_O += Pd t_V
                if moves_scores:
                    t_out += dropped @ part(tv)
                else:
                    xp.matmul(dropped, part(tv), out=t_out)

        run_blocks(jvp_block, blocks)
        return (tout, tweights) if ctx.return_weights else tout


def _score_tangent(q_scaled, k, tq_scaled, tk, tmask):
    """t_S of S = (s Q) K^T + mask, given s Q and s t_Q: (s t_Q) K^T + (s Q) t_K^T + t_mask (each
    term where its tangent is not None; one block of it when given blocks)."""
    xp = backend.get_array_module(q_scaled)
    parts = []
    # S = s Q K^T  ->  t_S = s t_Q K^T + s Q t_K^T
    if tq_scaled is not None:
        parts.append(xp.matmul(tq_scaled, k.swapaxes(-1, -2)))
    if tk is not None:
        parts.append(xp.matmul(q_scaled, tk.swapaxes(-1, -2)))
    # S = ... + mask  ->  t_S += t_mask
    if tmask is not None:
        parts.append(tmask)
    return sum(parts[1:], parts[0])                                     # out of place: never into t_mask


def _batch_blocks(lead, inputs, entries, like):
    """(axis, blocks) for `autograd.threads`: blocks of one batch axis, one per thread, along the
    longest axis that every input has in full (a broadcast input is shared by every block; B = 1
    with H heads splits the heads), else the single block of axis 0."""
    full = [i for i, n in enumerate(lead) if all(a.ndim == len(lead) + 2 and a.shape[i] == n for a in inputs)]
    if not full:
        return 0, [(0, lead[0] if lead else 1)]
    axis = max(full, key=lambda i: lead[i])  # the first of the longest
    return axis, row_blocks(lead[axis], entries, like)


def _batch_block(lead, axis, start, stop):
    """part(a): entries [start, stop) of batch axis `axis` of `a` (its axes aligned to the right
    of (*lead, rows, cols)); an array that broadcasts along that axis, or None, passes whole."""
    def part(a):
        if a is None or not lead:
            return a
        at = axis - (len(lead) + 2 - a.ndim)
        if at < 0 or a.shape[at] != lead[axis]:
            return a
        return a[(slice(None),) * at + (slice(start, stop),)]
    return part


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
    def jvp(ctx, tq, tk, tv, tmask):
        """t_O block by block from the saved O and L (`attention_blockwise_jvp`), never a (Tq, Tk) matrix."""
        q, k, v, out, lse, blocked, mask = ctx.saved_tensors
        return attention_blockwise_jvp(q, k, v, out, lse, tq, tk, tv, _at_least_2d(tmask), blocked, mask,
                                       *ctx.options)


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


@kernel_table
def attention_blockwise_backward(q, k, v, out, lse, dout, blocked, additive, causal, scale, block_size, dropout,
                                 need_mask):
    """(dQ, dK, dV, dMask) of `attention_blockwise_forward`, all with the broadcast leading shape
    (dMask: the shape of `additive`, None unless need_mask), recomputing P = exp(S - L) block by
    block. D = rowsum(dO O) = rowsum(dP P) replaces the softmax's row sum over all keys."""
    xp = backend.get_array_module(dout)
    tq, tk = q.shape[-2], k.shape[-2]
    lead = out.shape[:-2]
    # a fully masked row has L = -inf: use +inf so exp(S - L) = 0 there, never -inf - (-inf)
    lse = xp.where(xp.isfinite(lse), lse, math.inf)[..., None]         # (..., Tq, 1)
    # D_i = rowsum(dO_i * O_i) = rowsum(dP_i * P_i) (with dropout too: O_i = sum_j Pd_ij V_j)
    delta = xp.einsum("...ij,...ij->...i", dout, out)[..., None]        # (..., Tq, 1)
    dq = xp.zeros(lead + q.shape[-2:], dtype=q.dtype)
    dk = xp.zeros(lead + k.shape[-2:], dtype=q.dtype)
    dv = xp.zeros(lead + v.shape[-2:], dtype=q.dtype)
    dmask = xp.zeros(additive.shape, dtype=q.dtype) if need_mask else None
    for qs in range(0, tq, block_size):
        qe = min(qs + block_size, tq)
        q_block = q[..., qs:qe, :]
        q_scaled = q_block * scale
        do_block = dout[..., qs:qe, :]
        for ks in _key_starts(qs, qe, tk, block_size, causal):
            ke = min(ks + block_size, tk)
            p = masked_scores(q_scaled, k[..., ks:ke, :], blocked, additive, causal, qs, ks)
            # forward: P = exp(S - L), recomputed block by block
            p -= lse[..., qs:qe, :]
            xp.exp(p, out=p)                                             # (..., bq, bk)
            dropped, keep = p, None
            if dropout is not None:                                      # the forward's mask, regenerated
                keep = attention_keep_block(dropout, lead, tq, tk, qs, qe, ks, ke, q)
                dropped = p * keep
                dropped *= dropout_scale(dropout[0])
            # O = Pd V  ->  dV_j += Pd^T dO
            dv[..., ks:ke, :] += dropped.swapaxes(-1, -2) @ do_block
            # O = Pd V  ->  dPd = dO V^T
            dp = do_block @ v[..., ks:ke, :].swapaxes(-1, -2)           # (..., bq, bk)
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
            # forward: P = exp(S - L), recomputed block by block
            p = masked_scores(q_scaled, k[..., ks:ke, :], blocked, additive, causal, qs, ks)
            p -= lse[..., qs:qe, :]
            xp.exp(p, out=p)                                            # (..., bq, bk)
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


def _blockwise_split(q, k, v):
    """(lead, axis, blocks): the batch axis (batch or heads) and its blocks on which the CPU runs the
    blockwise references in threads, as the naive path splits (see _batch_blocks)."""
    lead = _lead_shape(q, k, v)
    return (lead, *_batch_blocks(lead, (q, k, v), math.prod(lead) * q.shape[-2] * k.shape[-2], q))


@attention_blockwise_forward.register("cpu", supports=lambda q, k, v, blocked, additive, causal, scale, block_size,
                                      dropout, mask_grad: dropout is None)
def attention_blockwise_forward_cpu(q, k, v, blocked, additive, causal, scale, block_size, dropout, mask_grad):
    """The reference on blocks of a batch axis in the threads (each block's rows are independent);
    with dropout, whose mask is numbered over the whole leading shape, the reference whole."""
    lead, axis, blocks = _blockwise_split(q, k, v)
    if len(blocks) == 1:
        return attention_blockwise_forward.reference(q, k, v, blocked, additive, causal, scale, block_size,
                                                     None, mask_grad)
    xp = backend.get_array_module(q)
    out = xp.empty(lead + (q.shape[-2], v.shape[-1]), dtype=q.dtype)   # (..., Tq, hdv)
    lse = xp.empty(lead + (q.shape[-2], 1), dtype=q.dtype)             # (..., Tq, 1) L

    def block(start, stop):
        part = _batch_block(lead, axis, start, stop)
        part(out)[...], part(lse)[..., 0] = attention_blockwise_forward.reference(
            part(q), part(k), part(v), part(blocked), part(additive), causal, scale, block_size, None, mask_grad)

    run_blocks(block, blocks)
    return out, lse[..., 0]


@attention_blockwise_backward.register("cpu", supports=lambda q, k, v, out, lse, dout, blocked, additive, causal,
                                       scale, block_size, dropout, need_mask: dropout is None and not need_mask)
def attention_blockwise_backward_cpu(q, k, v, out, lse, dout, blocked, additive, causal, scale, block_size, dropout,
                                     need_mask):
    """The reference on blocks of a batch axis in the threads: a block's dQ, dK, dV come from its
    own rows only (not d(mask), which sums over the mask's broadcast axes: then the reference whole)."""
    lead, axis, blocks = _blockwise_split(q, k, v)
    if len(blocks) == 1:
        return attention_blockwise_backward.reference(q, k, v, out, lse, dout, blocked, additive, causal, scale,
                                                      block_size, None, False)
    xp = backend.get_array_module(dout)
    dq, dk, dv = (xp.empty(lead + a.shape[-2:], dtype=q.dtype) for a in (q, k, v))

    def block(start, stop):
        part = _batch_block(lead, axis, start, stop)
        part(dq)[...], part(dk)[...], part(dv)[...], _ = attention_blockwise_backward.reference(
            part(q), part(k), part(v), part(out), part(lse[..., None])[..., 0], part(dout), part(blocked),
            part(additive), causal, scale, block_size, None, False)

    run_blocks(block, blocks)
    return dq, dk, dv, None


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


@attention_keep_mask.register("cpu", supports=lambda like, shape, p, seed, offset, causal, state=None:
                              causal and p < 1.0 and state is None)
def attention_keep_mask_cpu(like, shape, p, seed, offset, causal, state=None):
    """Draws only the counters under the causal diagonal: row i of every (Tq, Tk) block needs its
    first min(i + 1, Tk) entries (~56% of the values at T = 64, ~50% for long sequences); an entry
    to their right is False, or its own test where it shares a counter with them."""
    xp = backend.get_array_module(like)
    tq, tk = shape[-2], shape[-1]
    rows = xp.arange(math.prod(shape[:-1]), dtype="int64")                          # flat (b, i) = b Tq + i
    lengths = xp.minimum(rows % tq + 1, tk)                                          # keys j <= i
    keep = random.bits16_at_least_in_runs(seed, offset, math.prod(shape), dropout_threshold(p), rows * tk, lengths)
    return keep.reshape(shape)


def _lead_shape(q, k, v):
    return broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])


def _key_starts(q_start, q_stop, tk, block_size, causal):
    """Key block starts; with a causal mask, blocks entirely right of the diagonal are skipped."""
    stop = min(tk, q_stop) if causal else tk
    return range(0, stop, block_size)


class SplitHeadsFunction(Function):
    """x (B, T, n E) -> n arrays (B, H, T, hd) with E = H hd: chunk i is the heads of columns
    [i E, (i + 1) E), a view of x. Backward writes the n head gradients into one (B, T, n E)
    array, the layout of x (one pass; no zero-filled copies to add up)."""

    @staticmethod
    def forward(ctx, x, chunks, num_heads):
        B, T, width = x.shape
        ctx.shape, ctx.layout = x.shape, (chunks, num_heads)
        heads = x.reshape(B, T, chunks, num_heads, width // (chunks * num_heads))   # (B, T, n, H, hd)
        return tuple(heads[:, :, i].transpose(0, 2, 1, 3) for i in range(chunks))  # n x (B, H, T, hd)

    @staticmethod
    def jvp(ctx, t):
        # out_i = the heads of x[:, :, i E:(i + 1) E], a linear map  ->  t_out_i = the heads of t_x's columns
        return SplitHeadsFunction.forward(ctx, t, *ctx.layout)

    @staticmethod
    def backward(ctx, *grads):
        xp = backend.get_array_module(grads[0])
        B, T, width = ctx.shape
        # out_i = x[:, :, i E:(i + 1) E] as heads  ->  dx[:, :, i E:(i + 1) E] = dout_i as (B, T, H, hd)
        dx = xp.empty((B, T, len(grads)) + grads[0].shape[1:2] + grads[0].shape[3:], dtype=grads[0].dtype)

        def rows(start, stop):
            for i, g in enumerate(grads):
                dx[start:stop, :, i] = g[start:stop].transpose(0, 2, 1, 3)

        for_rows(rows, B, dx.size, dx)
        return dx.reshape(ctx.shape)


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
        return _at_least_2d(~mask), None
    return None, mask.astype(q.dtype, copy=False)


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
    args = (call.q, call.k, call.v, None, _data(call.additive), call.causal, call.scale, 1, None, call.mask_grad)
    reason = None
    not_flash = (attention_blockwise_forward.reference, attention_blockwise_forward_cpu)  # (the reference on threads)
    if attention_blockwise_forward.select(*args) in not_flash:
        flash, supports = attention_blockwise_forward.implementations.get(_device(call.q), (None, None))
        if flash not in (None, *not_flash) and (supports is None or supports(*args)):
            reason = "autograd.kernels.reference_only() is active"
        else:
            reason = flash_unsupported(call.q, call.k, call.v, _data(call.additive), call.mask_grad)
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
    autograd.random.Philox; None: the global dropout stream): entry i of the flat (..., Tq, Tk)
    index is kept iff value offset + i of the stream passes the keep test, on every path and device.
    return_weights=True returns (out, weights) where weights are the (dropped-out) probabilities.

    backend: which path runs (`attention_backend(...)` says which and why):
      None: "flash" on a GPU where its kernels apply, else "naive";
      "naive": keeps the (Tq, Tk) probabilities (the only one with return_weights);
      "memory_efficient" (or memory_efficient=True): blocks of `block_size` queries x keys with
        an online softmax, never a (Tq, Tk) matrix; on a GPU it runs the flash kernels where they
        apply (inside autograd.kernels.reference_only(), the blockwise numpy/CuPy reference);
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
        if p > 0:
            draw = dropout_stream(generator, op).draw(math.prod(call.score_shape), _device(call.q))
            keep = attention_keep_mask(call.q, call.score_shape, p, draw.seed, draw.offset, call.causal, draw.state)
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
