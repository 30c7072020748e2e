"""The masks of attention on `xp`: a bool mask (True = hidden), a float mask added to the scores,
causality (key j > query i hidden) and a sliding window of W keys (also key j <= i - W hidden),
for the whole (..., Tq, Tk) scores or one block of them (the memory-efficient path works block by
block): the scores with every hidden entry at -inf."""
import math


def causal_blocked(xp, q_start, q_stop, k_start, k_stop, window=None):
    """(q rows, k cols) bool, True where key j > query i (top-left aligned, like torch's is_causal)
    and, with a sliding `window` W, also where j <= i - W: query i sees keys i - W < j <= i."""
    keys, queries = xp.arange(k_start, k_stop)[None, :], xp.arange(q_start, q_stop)[:, None]
    hidden = keys > queries
    if window is not None:
        hidden |= keys <= queries - window
    return hidden


def block_hides(q_start, q_stop, k_start, k_stop, window=None):
    """Whether causality (and the window W) hide any key of the block [q_start, q_stop) x
    [k_start, k_stop): its last key is right of its first query (j > i), or its first key is
    W or more left of its last query (j <= i - W). A block inside the band needs no mask."""
    return k_stop - 1 > q_start or (window is not None and k_start <= q_stop - 1 - window)


def mask_block(mask, q_start, q_stop, k_start, k_stop):
    """The (..., q rows, k cols) block of a mask broadcastable to (..., Tq, Tk)."""
    rows = slice(q_start, q_stop) if mask.shape[-2] != 1 else slice(None)
    cols = slice(k_start, k_stop) if mask.shape[-1] != 1 else slice(None)
    return mask[..., rows, cols]


def hidden_bias(xp, blocked, causal, q_start, q_stop, k_start, k_stop, dtype, window=None):
    """-inf where `blocked` (a bool mask broadcastable to (..., Tq, Tk)) or causal (with a sliding
    `window`: causal_blocked) hides key j from query i, 0 elsewhere, for one (..., q rows, k cols)
    block, over the masks' own broadcast shape (or None when nothing is hidden): the bool masks
    added to the scores as one bias, as torch's math attention adds them."""
    hidden = None if blocked is None else mask_block(blocked, q_start, q_stop, k_start, k_stop)
    if causal and block_hides(q_start, q_stop, k_start, k_stop, window):
        above = causal_blocked(xp, q_start, q_stop, k_start, k_stop, window)  # (q rows, k cols)
        hidden = above if hidden is None else hidden | above
    if hidden is None:
        return None
    bias = xp.zeros(hidden.shape, dtype=dtype)
    xp.copyto(bias, -math.inf, where=hidden)
    return bias


def masked_scores(xp, ops, q_scaled, k, blocked, additive, causal, q_start, k_start, out=None, window=None):
    """S = (s q) K^T + additive, -inf where blocked or causally hidden (outside the sliding `window`
    too, when given), for one block starting at query q_start and key k_start (written into `out`
    when given); ops.matmul_transposed forms Q K^T."""
    q_stop, k_stop = q_start + q_scaled.shape[-2], k_start + k.shape[-2]
    scores = ops.matmul_transposed(xp, q_scaled, k, out=out)                 # (..., bq, bk)
    if additive is not None:
        scores += mask_block(additive, q_start, q_stop, k_start, k_stop)
    # -inf where hidden: one add of a bias of the masks' size (cheaper than copyto's where= over S)
    bias = hidden_bias(xp, blocked, causal, q_start, q_stop, k_start, k_stop, scores.dtype, window)
    if bias is not None:
        scores += bias
    return scores


def at_least_2d(mask):
    """A mask broadcastable to (..., Tq, Tk) with its last two axes present (size 1 if missing)."""
    return None if mask is None else mask.reshape((1,) * max(0, 2 - mask.ndim) + tuple(mask.shape))
