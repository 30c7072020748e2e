"""Attention on the threads of `npformer.runtime.threads` (the "cpu" implementations of the kernel
tables of tables.py): the stacked products with a transposed operand (Q K^T, dO V^T) on a contiguous
copy of it; the naive path's forward, its jvp, backward, double backward and the backward's jvp, and
the memory-efficient path's blockwise reference on blocks of one batch axis (the batch, or the heads),
each block running the reference; the causal dropout mask drawn under the diagonal only;
split_heads' backward by blocks of the batch."""
import inspect
from math import prod

from autograd import backend
from npformer.runtime import threads
from npformer.runtime.threads import row_blocks, run_blocks

from .blockwise import lead_shape
from .tables import (attention_backward, attention_backward_jvp, attention_blockwise_backward,
                     attention_blockwise_forward, attention_double_backward, attention_forward, attention_jvp,
                     matmul_transposed)


def _splits(probs):
    """The (..., Tq, Tk) probabilities have enough entries for blocks on threads."""
    return probs.size >= threads.MIN_PARALLEL_ENTRIES


def _on_batch_blocks(table, like):
    """The "cpu" implementation of a naive-path table: its reference on blocks of a batch axis
    (batch_blocks of its arguments q, k, v, over the leading shape of its argument probs), each
    block writing its part of the outputs: every array argument cut to the block (batch_block: one
    that broadcasts along the axis passes whole), the others (scale, causal, ...) as they are; the
    threads' blocks sized for the argument named `like`. A block's results come from its own rows,
    so the naive path's tables all split this way."""
    names = [name for name in inspect.signature(table.reference).parameters if name not in ("xp", "ops")]

    def implementation(xp, *args):
        named = dict(zip(names, args))                                   # the table's parameters by name
        probs = named["probs"]
        lead = probs.shape[:-2]
        axis, blocks = batch_blocks(lead, (named["q"], named["k"], named["v"]), probs.size, named[like])

        def block(start, stop):
            part = batch_block(lead, axis, start, stop)
            table.reference(xp, **{name: part(a) if backend.is_array(a) else a for name, a in named.items()})

        run_blocks(block, blocks)

    implementation.__name__ = implementation.__qualname__ = f"{table.__name__}_cpu"
    return implementation


@matmul_transposed.register("cpu", supports=lambda xp, a, b, out=None: b.ndim > 2)
def matmul_transposed_cpu(xp, a, b, out=None):
    """b^T copied contiguous, then the product: numpy's matmul over a stack of matrices runs slower
    with a transposed view as its operand (Q K^T of the models' head views; BENCHMARKS.md)."""
    return xp.matmul(a, xp.ascontiguousarray(b.swapaxes(-1, -2)), out=out)


attention_forward.register("cpu", splits_reference=True, supports=lambda xp, q, k, v, mask, blocked, causal, scale,
                           keep, dropout_scale, probs, out, weights: _splits(probs))(
    _on_batch_blocks(attention_forward, like="q"))
attention_jvp.register("cpu", splits_reference=True, supports=lambda xp, q, k, v, probs, keep, scale, dropout_scale,
                       tq, tk, tv, tmask, tout, tweights: _splits(probs))(
    _on_batch_blocks(attention_jvp, like="probs"))    # (the tangents split like the inputs they belong to)
attention_backward.register("cpu", splits_reference=True, supports=lambda xp, q, k, v, probs, keep, dout, dweights,
                            scale, dropout_scale, dq, dk, dv, dmask: _splits(probs))(
    _on_batch_blocks(attention_backward, like="probs"))
attention_double_backward.register("cpu", splits_reference=True, supports=lambda xp, q, k, v, probs, keep, dout,
                                   dweights, scale, dropout_scale, gq, gk, gv, gmask, dq, dk, dv, dmask, ddout,
                                   ddweights: _splits(probs))(
    _on_batch_blocks(attention_double_backward, like="probs"))   # (the incoming gradients split like the inputs)
attention_backward_jvp.register("cpu", splits_reference=True, supports=lambda xp, q, k, v, probs, keep, dout,
                                dweights, scale, dropout_scale, tq, tk, tv, tmask, tdout, tdweights, dq_tangent,
                                dk_tangent, dv_tangent, dmask_tangent: _splits(probs))(
    _on_batch_blocks(attention_backward_jvp, like="probs"))


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
    lead = lead_shape(q, k, v)
    return (lead, *batch_blocks(lead, (q, k, v), prod(lead) * q.shape[-2] * k.shape[-2], q))


@attention_blockwise_forward.register("cpu", splits_reference=True, supports=lambda xp, q, k, v, blocked, additive,
                                      causal, scale, block_size, dropout, mask_grad, window=None: dropout is None)
def attention_blockwise_forward_cpu(xp, q, k, v, blocked, additive, causal, scale, block_size, dropout, mask_grad,
                                    window=None):
    """The reference on blocks of a batch axis in the threads (each block's rows are independent);
    with dropout, whose mask is numbered over the whole leading shape, the reference whole."""
    lead, axis, blocks = _blockwise_split(q, k, v)
    if len(blocks) == 1:
        return attention_blockwise_forward.reference(xp, q, k, v, blocked, additive, causal, scale, block_size,
                                                     None, mask_grad, window=window)
    out = xp.empty(lead + (q.shape[-2], v.shape[-1]), dtype=q.dtype)   # (..., Tq, hdv)
    lse = xp.empty(lead + (q.shape[-2], 1), dtype=q.dtype)             # (..., Tq, 1) L

    def block(start, stop):
        part = batch_block(lead, axis, start, stop)
        part(out)[...], part(lse)[..., 0] = attention_blockwise_forward.reference(
            xp, part(q), part(k), part(v), part(blocked), part(additive), causal, scale, block_size, None, mask_grad,
            window=window)

    run_blocks(block, blocks)
    return out, lse[..., 0]


@attention_blockwise_backward.register("cpu", splits_reference=True, supports=lambda xp, q, k, v, out, lse, dout,
                                       blocked, additive, causal, scale, block_size, dropout, need_mask, window=None:
                                       dropout is None and not need_mask)
def attention_blockwise_backward_cpu(xp, q, k, v, out, lse, dout, blocked, additive, causal, scale, block_size, dropout,
                                     need_mask, window=None):
    """The reference on blocks of a batch axis in the threads: a block's dQ, dK, dV come from its
    own rows only (not d(mask), which sums over the mask's broadcast axes: then the reference whole)."""
    lead, axis, blocks = _blockwise_split(q, k, v)
    if len(blocks) == 1:
        return attention_blockwise_backward.reference(xp, q, k, v, out, lse, dout, blocked, additive, causal, scale,
                                                      block_size, None, False, window=window)
    dq, dk, dv = (xp.empty(lead + a.shape[-2:], dtype=q.dtype) for a in (q, k, v))

    def block(start, stop):
        part = batch_block(lead, axis, start, stop)
        part(dq)[...], part(dk)[...], part(dv)[...], _ = attention_blockwise_backward.reference(
            xp, part(q), part(k), part(v), part(out), part(lse[..., None])[..., 0], part(dout), part(blocked),
            part(additive), causal, scale, block_size, None, False, window=window)

    run_blocks(block, blocks)
    return dq, dk, dv, None
