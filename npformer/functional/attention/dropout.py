"""The dropout masks of attention's probabilities, by the dropout contract (activation.py): entry
i of the flat (..., Tq, Tk) index is kept iff bits16(seed, offset + i) >= threshold, so every path,
on every device, drops the same entries for the same generator state. The naive path draws the
whole mask (attention_keep_mask); the memory-efficient path one block at a time (attention_keep_block)."""
from math import prod

from autograd import backend
from npformer.runtime import random
from npformer.runtime.kernels import kernel_table

from ..activation import dropout_stream, dropout_threshold, keep_mask


def attention_keep_block(dropout, lead, tq, tk, q_start, q_stop, k_start, k_stop, like):
    """The dropout contract's keep-mask of the attention block (..., q rows, k cols), drawn alone:
    entry (b, i, j) of the (..., Tq, Tk) probabilities (b the flat index of the leading axes) is
    kept iff bits16(seed, offset + (b Tq + i) Tk + j) >= threshold. On the device of `like`."""
    p, seed, offset, state = dropout
    xp = backend.get_array_module(like)
    shape = lead + (q_stop - q_start, k_stop - k_start)
    if p == 1.0:
        return xp.zeros(shape, dtype=bool)
    batch = xp.arange(prod(lead), dtype="uint64")[:, None] * xp.uint64(tq)               # (B, 1) b Tq
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


def drawn_keep_mask(q, shape, p, causal, generator, op):
    """attention_keep_mask of the next values of the dropout stream (`generator` or the global one)."""
    draw = dropout_stream(generator, op).draw(prod(shape), backend.device_of(q))
    return attention_keep_mask(q, shape, p, draw.seed, draw.offset, causal, draw.state)
