"""The masks of attention on `xp`: a bool mask (True = hidden), a float mask added to the scores
and causality (key j > query i hidden), for the whole (..., Tq, Tk) scores or one block of them
(the memory-efficient path works block by block): the scores with every hidden entry at -inf."""
import math


def causal_blocked(xp, q_start, q_stop, k_start, k_stop):
    """(q rows, k cols) bool, True where key j > query i (top-left aligned, like torch's is_causal)."""
    return xp.arange(k_start, k_stop)[None, :] > xp.arange(q_start, q_stop)[:, None]


def mask_block(mask, q_start, q_stop, k_start, k_stop):
    """The (..., q rows, k cols) block of a mask broadcastable to (..., Tq, Tk)."""
    rows = slice(q_start, q_stop) if mask.shape[-2] != 1 else slice(None)
    cols = slice(k_start, k_stop) if mask.shape[-1] != 1 else slice(None)
    return mask[..., rows, cols]


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


def masked_scores(xp, ops, q_scaled, k, blocked, additive, causal, q_start, k_start, out=None):
    """S = (s q) K^T + additive, -inf where blocked or causally hidden, for one block starting at
    query q_start and key k_start (written into `out` when given); ops.matmul_transposed forms Q K^T."""
    q_stop, k_stop = q_start + q_scaled.shape[-2], k_start + k.shape[-2]
    scores = ops.matmul_transposed(xp, q_scaled, k, out=out)                 # (..., bq, bk)
    if additive is not None:
        scores += mask_block(additive, q_start, q_stop, k_start, k_stop)
    # -inf where hidden: one add of a bias of the masks' size (cheaper than copyto's where= over S)
    bias = hidden_bias(xp, blocked, causal, q_start, q_stop, k_start, k_stop, scores.dtype)
    if bias is not None:
        scores += bias
    return scores


def at_least_2d(mask):
    """A mask broadcastable to (..., Tq, Tk) with its last two axes present (size 1 if missing)."""
    return None if mask is None else mask.reshape((1,) * max(0, 2 - mask.ndim) + tuple(mask.shape))
