"""Attention on the threads of `npformer.runtime.threads` (the "cpu" implementations of attention.py's
kernel tables): the stacked products with a transposed operand (Q K^T, dO V^T) on a contiguous copy
of it; the naive path's forward, its jvp, backward, double backward and the backward's jvp, and the
memory-efficient path's blockwise reference on blocks of one batch axis (the batch, or the heads),
each block running the reference; the causal dropout mask drawn under the diagonal only;
split_heads' backward by blocks of the batch."""
import math

from autograd import backend
from npformer.runtime import random, threads
from npformer.runtime.threads import for_rows, row_blocks, run_blocks

from ..activation import dropout_threshold
from ..attention import (_lead_shape, attention_backward, attention_backward_jvp, attention_blockwise_backward,
                         attention_blockwise_forward, attention_double_backward, attention_forward, attention_jvp,
                         attention_keep_mask, matmul_transposed, split_heads_backward)


def _splits(probs):
    """The (..., Tq, Tk) probabilities have enough entries for blocks on threads."""
    return probs.size >= threads.MIN_PARALLEL_ENTRIES


def _reference_on_batch_blocks(table, args, probs, like):
    """table.reference(*args) on blocks of a batch axis (batch_blocks of q, k, v = args[:3]), each
    block writing its part of the outputs: every array argument cut to the block (batch_block: one
    that broadcasts along the axis passes whole), the others (scale, causal, ...) as they are. A
    block's results come from its own rows, so the naive path's tables all split this way."""
    lead = probs.shape[:-2]
    axis, blocks = batch_blocks(lead, args[:3], probs.size, like)

    def block(start, stop):
        part = batch_block(lead, axis, start, stop)
        table.reference(*(part(a) if backend.is_array(a) else a for a in args))

    run_blocks(block, blocks)


@matmul_transposed.register("cpu", supports=lambda a, b, out=None: b.ndim > 2)
def matmul_transposed_cpu(a, b, out=None):
    """b^T copied contiguous, then the product: numpy's matmul over a stack of matrices runs slower
    with a transposed view as its operand (Q K^T on one core, us, two runs, q and k laid out as the
    models pass them, head views of the projections: gpt_char's half batch (16, 4, 64, 32) 292-299
    against 221-233 with the copy; the demo's (64, 4, 13, 16) 72-90 against 58-89; (16, 8, 64, 32)
    599-753 against 602-665; contiguous q and k there: 682 against 487)."""
    xp = backend.get_array_module(a)
    return xp.matmul(a, xp.ascontiguousarray(b.swapaxes(-1, -2)), out=out)


@attention_forward.register("cpu", splits_reference=True, supports=lambda *args: _splits(args[9]))   # probs
def attention_forward_cpu(q, k, v, mask, blocked, causal, scale, keep, dropout_scale, probs, out, weights):
    """The reference on blocks of a batch axis."""
    _reference_on_batch_blocks(attention_forward, (q, k, v, mask, blocked, causal, scale, keep, dropout_scale, probs,
                                                   out, weights), probs, q)


@attention_jvp.register("cpu", splits_reference=True, supports=lambda *args: _splits(args[3]))   # probs
def attention_jvp_cpu(q, k, v, probs, keep, scale, dropout_scale, tq, tk, tv, tmask, tout, tweights):
    """The reference on blocks of a batch axis (the tangents split like the inputs they belong to)."""
    _reference_on_batch_blocks(attention_jvp, (q, k, v, probs, keep, scale, dropout_scale, tq, tk, tv, tmask, tout,
                                               tweights), probs, probs)


@attention_backward.register("cpu", splits_reference=True, supports=lambda *args: _splits(args[3]))   # probs
def attention_backward_cpu(q, k, v, probs, keep, dout, dweights, scale, dropout_scale, dq, dk, dv, dmask):
    """The reference on blocks of a batch axis."""
    _reference_on_batch_blocks(attention_backward, (q, k, v, probs, keep, dout, dweights, scale, dropout_scale, dq, dk,
                                                    dv, dmask), probs, probs)


@attention_double_backward.register("cpu", splits_reference=True, supports=lambda *args: _splits(args[3]))  # probs
def attention_double_backward_cpu(q, k, v, probs, keep, dout, dweights, scale, dropout_scale, gq, gk, gv, gmask,
                                  dq, dk, dv, dmask, ddout, ddweights):
    """The reference on blocks of a batch axis (the incoming gradients split like the inputs they
    belong to)."""
    _reference_on_batch_blocks(attention_double_backward, (q, k, v, probs, keep, dout, dweights, scale, dropout_scale,
                                                           gq, gk, gv, gmask, dq, dk, dv, dmask, ddout, ddweights),
                               probs, probs)


@attention_backward_jvp.register("cpu", splits_reference=True, supports=lambda *args: _splits(args[3]))  # probs
def attention_backward_jvp_cpu(q, k, v, probs, keep, dout, dweights, scale, dropout_scale, tq, tk, tv, tmask, tdout,
                               tdweights, dq_tangent, dk_tangent, dv_tangent, dmask_tangent):
    """The reference on blocks of a batch axis (the tangents split like the inputs they belong to)."""
    _reference_on_batch_blocks(attention_backward_jvp, (q, k, v, probs, keep, dout, dweights, scale, dropout_scale, tq,
                                                        tk, tv, tmask, tdout, tdweights, dq_tangent, dk_tangent,
                                                        dv_tangent, dmask_tangent), probs, probs)


def batch_blocks(lead, inputs, entries, like):
    """(axis, blocks) for `npformer.runtime.threads`: blocks of one batch axis, one per thread, along the
    longest axis that every input has in full (a broadcast input is shared by every block; B = 1
    with H heads splits the heads), else the single block of axis 0."""
    full = [i for i, n in enumerate(lead) if all(a.ndim == len(lead) + 2 and a.shape[i] == n for a in inputs)]
    if not full:
        return 0, [(0, lead[0] if lead else 1)]
    axis = max(full, key=lambda i: lead[i])  # the first of the longest
    return axis, row_blocks(lead[axis], entries, like)


def batch_block(lead, axis, start, stop):
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


def _blockwise_split(q, k, v):
    """(lead, axis, blocks): the batch axis (batch or heads) and its blocks on which the CPU runs the
    blockwise references in threads, as the naive path splits (see batch_blocks)."""
    lead = _lead_shape(q, k, v)
    return (lead, *batch_blocks(lead, (q, k, v), math.prod(lead) * q.shape[-2] * k.shape[-2], q))


@attention_blockwise_forward.register("cpu", splits_reference=True, supports=lambda q, k, v, blocked, additive,
                                      causal, scale, block_size, dropout, mask_grad: dropout is None)
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
        part = batch_block(lead, axis, start, stop)
        part(out)[...], part(lse)[..., 0] = attention_blockwise_forward.reference(
            part(q), part(k), part(v), part(blocked), part(additive), causal, scale, block_size, None, mask_grad)

    run_blocks(block, blocks)
    return out, lse[..., 0]


@attention_blockwise_backward.register("cpu", splits_reference=True, supports=lambda q, k, v, out, lse, dout, blocked,
                                       additive, causal, scale, block_size, dropout, need_mask:
                                       dropout is None and not need_mask)
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
        part = batch_block(lead, axis, start, stop)
        part(dq)[...], part(dk)[...], part(dv)[...], _ = attention_blockwise_backward.reference(
            part(q), part(k), part(v), part(out), part(lse[..., None])[..., 0], part(dout), part(blocked),
            part(additive), causal, scale, block_size, None, False)

    run_blocks(block, blocks)
    return dq, dk, dv, None


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


@split_heads_backward.register("cpu", splits_reference=True,
                               supports=lambda dx, grads: dx.size >= threads.MIN_PARALLEL_ENTRIES)
def split_heads_backward_cpu(dx, grads):
    """The reference on blocks of the batch."""
    def rows(start, stop):
        split_heads_backward.reference(dx[start:stop], [g[start:stop] for g in grads])

    for_rows(rows, dx.shape[0], dx.size, dx)
