"""Scaled dot-product attention: a naive path that keeps the (Tq, Tk) probabilities, and a
memory-efficient path (FlashAttention-style online softmax over key blocks) that keeps only
the output and one logsumexp per query row. Both have hand-written backward passes."""
import math

from autograd import Function, backend, random, unbroadcast
from autograd.checks import check_int, check_real
from autograd.threads import for_rows, row_blocks, run_blocks

from ._common import broadcast_shapes, broadcasts_to, check_tensor, has_twin, on_device_of
from .activation import dropout_mask
from .softmax import softmax_backward, softmax_forward


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


class AttentionFunction(Function):
    """q (..., Tq, hd), k (..., Tk, hd), v (..., Tk, hdv) -> out (..., Tq, hdv) [, P (..., Tq, Tk)].

    S = s Q K^T + mask, P = softmax(S) (dropout: Pd = P * keep / (1 - p)), O = Pd V;
    dV = Pd^T dO, dPd = dO V^T (+ dP from the returned weights), dS = P (dP - rowsum(dP P)),
    dQ = s dS K, dK = s dS^T Q.
    With set_num_threads(n > 1), blocks of the first batch axis run in the threads of `autograd.threads`.
    """

    @staticmethod
    def forward(ctx, q, k, v, blocked, additive, causal, scale, keep, dropout_scale, return_weights):
        xp = backend.get_array_module(q)
        lead = _lead_shape(q, k, v)
        probs = xp.empty(lead + (q.shape[-2], k.shape[-2]), dtype=q.dtype)   # (..., Tq, Tk)
        out = xp.empty(lead + (q.shape[-2], v.shape[-1]), dtype=q.dtype)     # (..., Tq, hdv)
        weights = xp.empty_like(probs) if keep is not None and return_weights else None

        def forward_block(start, stop):
            part = _batch_block(lead, start, stop)
            s = masked_scores(part(q) * scale, part(k), part(blocked), part(additive), causal, 0, 0,
                              out=part(probs))                                # S
            softmax_forward(s, -1, out=s)                                     # P
            dropped = s
            if keep is not None:                                              # Pd = P * keep / (1 - p)
                dropped = xp.multiply(s, part(keep), out=part(weights))
                dropped *= dropout_scale
            xp.matmul(dropped, part(v), out=part(out))                        # O = Pd V

        run_blocks(forward_block, _batch_blocks(lead, (q, k, v), probs.size, q))
        ctx.save_for_backward(q, k, v, probs, keep)
        ctx.scale, ctx.dropout_scale = scale, dropout_scale
        return (out, probs if weights is None else weights) if return_weights else out

    @staticmethod
    def backward(ctx, dout, dweights=None):
        q, k, v, probs, keep = ctx.saved_tensors
        xp = backend.get_array_module(dout)
        need_q, need_k, need_v = ctx.needs_input_grad
        lead = probs.shape[:-2]
        dq = xp.empty(lead + q.shape[-2:], dtype=q.dtype) if need_q else None
        dk = xp.empty(lead + k.shape[-2:], dtype=q.dtype) if need_k else None
        dv = xp.empty(lead + v.shape[-2:], dtype=q.dtype) if need_v else None

        def backward_block(start, stop):
            part = _batch_block(lead, start, stop)
            p, do = part(probs), part(dout)
            dropped = p
            if keep is not None:
                dropped = p * part(keep)
                dropped *= ctx.dropout_scale
            # O = Pd V  ->  dV = Pd^T dO
            if need_v:
                xp.matmul(dropped.swapaxes(-1, -2), do, out=part(dv))
            if not (need_q or need_k):
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
            # S = s Q K^T  ->  dQ = s dS K
            if need_q:
                dq_block = xp.matmul(dscores, part(k), out=part(dq))
                dq_block *= ctx.scale
            # S = s Q K^T  ->  dK = s dS^T Q
            if need_k:
                dk_block = xp.matmul(dscores.swapaxes(-1, -2), part(q), out=part(dk))
                dk_block *= ctx.scale

        run_blocks(backward_block, _batch_blocks(lead, (q, k, v), probs.size, probs))
        return (unbroadcast(dq, q.shape) if need_q else None,
                unbroadcast(dk, k.shape) if need_k else None,
                unbroadcast(dv, v.shape) if need_v else None)


def _batch_blocks(lead, inputs, entries, like):
    """Blocks of the first batch axis for `autograd.threads`: one per thread when every input has that
    axis in full, else a single block (a broadcast input is shared by every block)."""
    rows = lead[0] if lead else 1
    if lead and all(a.ndim == len(lead) + 2 and a.shape[0] == rows for a in inputs):
        return row_blocks(rows, entries, like)
    return [(0, rows)]


def _batch_block(lead, start, stop):
    """part(a): rows [start, stop) of the first batch axis of `a` when a has that axis in full
    (a broadcast array, a lower-dimensional mask or None pass whole)."""
    def part(a):
        if a is None or not lead or a.ndim != len(lead) + 2 or a.shape[0] != lead[0]:
            return a
        return a[start:stop]
    return part


class MemoryEfficientAttentionFunction(Function):
    """Same math as `AttentionFunction` without the (Tq, Tk) matrices: blocks of queries x keys.

    Forward (online softmax per query block): running max m, sum l and output acc over key
    blocks; saves O and L = m + log(l) (-inf for a fully masked row).
    Backward per block: P = exp(S - L), D = rowsum(dO O), dV += P^T dO, dP = dO V^T,
    dS = P (dP - D), dQ += s dS K, dK += s dS^T Q.
    Dropout: the mask of block (i, j) is drawn from a generator seeded by (seed, i, j), so the
    backward regenerates exactly the forward's mask instead of storing it.
    """

    @staticmethod
    def forward(ctx, q, k, v, blocked, additive, causal, scale, block_size, dropout_p, dropout_seed):
        xp = backend.get_array_module(q)
        dropout_scale = 1.0 / (1.0 - dropout_p) if dropout_p < 1.0 else 0.0
        tq, tk = q.shape[-2], k.shape[-2]
        lead = _lead_shape(q, k, v)
        out = xp.zeros(lead + (tq, v.shape[-1]), dtype=q.dtype)              # (..., Tq, hdv)
        lse = xp.full(lead + (tq, 1), -math.inf, dtype=q.dtype)              # (..., Tq, 1) L
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
                if dropout_p:                                                # Pd = P * keep / (1 - p)
                    p *= dropout_block_mask(dropout_seed, qs, ks, p.shape, dropout_p, q)
                    p *= dropout_scale
                acc *= correction
                acc += p @ v[..., ks:ke, :]
                row_max = new_max
            empty = row_sum == 0                                             # fully masked rows
            xp.copyto(row_sum, 1.0, where=empty)
            acc /= row_sum                                                   # O = acc / l (0 if empty)
            block_lse = row_max + xp.log(row_sum)
            xp.copyto(block_lse, -math.inf, where=empty)
            lse[..., qs:qe, :] = block_lse
        ctx.save_for_backward(q, k, v, out, lse, blocked, additive)
        ctx.causal, ctx.scale, ctx.block_size = causal, scale, block_size
        ctx.dropout = (dropout_p, dropout_seed, dropout_scale)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, blocked, additive = ctx.saved_tensors
        xp = backend.get_array_module(dout)
        scale, block_size, causal = ctx.scale, ctx.block_size, ctx.causal
        dropout_p, dropout_seed, dropout_scale = ctx.dropout
        tq, tk = q.shape[-2], k.shape[-2]
        lead = out.shape[:-2]
        # a fully masked row has L = -inf: use +inf so exp(S - L) = 0 there, never -inf - (-inf)
        lse = xp.where(xp.isfinite(lse), lse, math.inf)
        # D_i = rowsum(dO_i * O_i) = rowsum(dP_i * P_i) (with dropout too: O_i = sum_j Pd_ij V_j)
        delta = xp.einsum("...ij,...ij->...i", dout, out)[..., None]        # (..., Tq, 1)
        dq = xp.zeros(lead + q.shape[-2:], dtype=q.dtype)
        dk = xp.zeros(lead + k.shape[-2:], dtype=q.dtype)
        dv = xp.zeros(lead + v.shape[-2:], dtype=q.dtype)
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
                if dropout_p:                                                # the forward's mask, regenerated
                    keep = dropout_block_mask(dropout_seed, qs, ks, p.shape, dropout_p, q)
                    dropped = p * keep
                    dropped *= dropout_scale
                # O = Pd V  ->  dV_j += Pd^T dO
                dv[..., ks:ke, :] += dropped.swapaxes(-1, -2) @ do_block
                # O = Pd V  ->  dPd = dO V^T
                dp = do_block @ v[..., ks:ke, :].swapaxes(-1, -2)           # (..., bq, bk)
                # Pd = P * keep / (1 - p)  ->  dP = dPd * keep / (1 - p)
                if keep is not None:
                    dp *= keep
                    dp *= dropout_scale
                # P = softmax(S)  ->  dS = P (dP - D)
                dp -= delta[..., qs:qe, :]
                dp *= p
                # S = s Q K^T  ->  dQ_i += s dS K_j,  dK_j += s dS^T Q_i (s applied at the end)
                dq[..., qs:qe, :] += dp @ k[..., ks:ke, :]
                dk[..., ks:ke, :] += dp.swapaxes(-1, -2) @ q_block
        dq *= scale
        dk *= scale
        need_q, need_k, need_v = ctx.needs_input_grad
        return (unbroadcast(dq, q.shape) if need_q else None,
                unbroadcast(dk, k.shape) if need_k else None,
                unbroadcast(dv, v.shape) if need_v else None)


def dropout_block_mask(seed, q_start, k_start, shape, p, like):
    """Keep-mask (True with probability 1 - p) of the attention block starting at query q_start
    and key k_start: a pure function of (seed, q_start, k_start), on the device of `like`."""
    block_seed = hash((seed, q_start, k_start)) & (2**63 - 1)  # ints hash the same in every process
    device = backend.device_of(like)
    return dropout_mask(shape, p, device, random.default_rng(block_seed, device))


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
        ctx.shape = x.shape
        heads = x.reshape(B, T, chunks, num_heads, width // (chunks * num_heads))   # (B, T, n, H, hd)
        return tuple(heads[:, :, i].transpose(0, 2, 1, 3) for i in range(chunks))  # n x (B, H, T, hd)

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
def split_heads(input, num_heads, chunks=1):
    """input (B, T, chunks * E) -> `chunks` tensors (B, num_heads, T, E / num_heads) (one tensor
    when chunks=1): the heads of each E-wide block of columns, e.g. q, k, v of a packed
    projection. Views in forward; the backward assembles one gradient array."""
    x = check_tensor("input", input, "split_heads")
    num_heads = check_int(num_heads, "num_heads", "split_heads", at_least=1)
    chunks = check_int(chunks, "chunks", "split_heads", at_least=1)
    if x.ndim != 3 or x.shape[-1] % (chunks * num_heads):
        raise ValueError(f"split_heads: input must be (batch, seq, chunks * num_heads * head_dim) with "
                         f"chunks={chunks}, num_heads={num_heads}, got shape {tuple(x.shape)}")
    heads = SplitHeadsFunction.apply(input, chunks=chunks, num_heads=num_heads)
    return heads if chunks > 1 else heads[0]


def _prepare_mask(attn_mask, q, score_shape):
    """(blocked, additive): a bool array True where attention is NOT allowed, or a float array
    added to the scores, each at least 2-D and broadcastable to `score_shape`."""
    if attn_mask is None:
        return None, None
    mask = on_device_of(attn_mask, q, "attn_mask", "scaled_dot_product_attention")
    if mask.dtype.kind not in "bf":
        raise TypeError("scaled_dot_product_attention: attn_mask must be bool (True = takes part) or "
                        f"floating (added to the scores), got dtype {mask.dtype}")
    if not broadcasts_to(mask.shape, score_shape):
        raise ValueError("scaled_dot_product_attention: attn_mask must broadcast to (..., Tq, Tk) = "
                         f"{score_shape}, got shape {tuple(mask.shape)}")
    mask = mask.reshape((1,) * max(0, 2 - mask.ndim) + tuple(mask.shape))
    if mask.dtype.kind == "b":
        return ~mask, None
    return None, mask.astype(q.dtype, copy=False)


@has_twin
def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                 scale=None, *, return_weights=False, memory_efficient=False,
                                 block_size=512, generator=None):
    """softmax(query key^T * scale + mask) value, like torch.nn.functional.scaled_dot_product_attention.

    query (..., Tq, hd), key (..., Tk, hd), value (..., Tk, hdv) -> (..., Tq, hdv); usually (B, H, T, hd).
    attn_mask: bool (True = takes part) or float (added to the scores), broadcastable to
    (..., Tq, Tk); is_causal hides keys j > i (combined with attn_mask when both are given).
    scale defaults to 1/sqrt(hd). A query row with every key hidden gives 0 and zero gradients.
    dropout_p: dropout on the attention probabilities (drawn from `generator` or the global one).
    return_weights=True returns (out, weights) where weights are the (dropped-out) probabilities.
    memory_efficient=True runs blocks of `block_size` queries x keys with an online softmax
    and never stores (Tq, Tk) matrices; no return_weights there. Its dropout masks come from one
    seed drawn per call from `generator` (regenerated per block in backward), so they differ
    from the naive path's masks for the same generator state.
    """
    op = "scaled_dot_product_attention"
    q = check_tensor("query", query, op)
    k = check_tensor("key", key, op)
    v = check_tensor("value", value, op)
    if q.ndim < 2 or k.ndim < 2 or v.ndim < 2:
        raise ValueError(f"{op}: query, key and value must be at least 2-D (..., T, head_dim), got shapes "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2]:
        raise ValueError(f"{op}: expected query (..., Tq, hd), key (..., Tk, hd), value (..., Tk, hdv); got "
                         f"shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    try:
        lead = _lead_shape(q, k, v)
    except ValueError:
        raise ValueError(f"{op}: the leading (batch, head) dimensions of query, key and value must "
                         f"broadcast, got shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}") from None
    dropout_p = check_real(dropout_p, "dropout_p", op, at_least=0, at_most=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else check_real(scale, "scale", op)
    blocked, additive = _prepare_mask(attn_mask, q, lead + (q.shape[-2], k.shape[-2]))
    causal = bool(is_causal)
    if memory_efficient:
        if return_weights:
            raise ValueError(f"{op}: return_weights=True needs the full attention matrix; "
                             "it cannot be combined with memory_efficient=True")
        block_size = check_int(block_size, "block_size", op, at_least=1)
        seed = None
        if dropout_p > 0:
            rng = generator if generator is not None else random.global_rng(backend.device_of(q))
            seed = int(rng.integers(0, 2**62))
        return MemoryEfficientAttentionFunction.apply(query, key, value, blocked=blocked, additive=additive,
                                              causal=causal, scale=scale, block_size=block_size,
                                              dropout_p=dropout_p, dropout_seed=seed)
    keep, dropout_scale = None, 1.0
    if dropout_p > 0:
        device = backend.device_of(q)
        if dropout_p == 1.0:
            keep, dropout_scale = backend.module_for(device).zeros(lead + (q.shape[-2], k.shape[-2]), dtype=bool), 0.0
        else:
            keep = dropout_mask(lead + (q.shape[-2], k.shape[-2]), dropout_p, device, generator)
            dropout_scale = 1.0 / (1.0 - dropout_p)
    return AttentionFunction.apply(query, key, value, blocked=blocked, additive=additive, causal=causal,
                           scale=scale, keep=keep, dropout_scale=dropout_scale,
                           return_weights=bool(return_weights))
