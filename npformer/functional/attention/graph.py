"""The double backward of attention as differentiable ops on Tensors, P recomputed in the graph:
the differentiable_backward of AttentionBackward and MemoryEfficientAttentionBackward (a third
derivative, and every order above). The formulas are higher.py's attention_double_backward's."""
import math

from autograd import where

from ..softmax import stable_row_max
from .higher import plus
from .masks import causal_blocked


def graph_scores(q, k, additive, blocked, causal, scale, window=None):
    """S = s Q K^T + mask of the Tensors q, k (and a float mask Tensor or array), from
    differentiable primitives: -inf where the bool mask `blocked` (True = hidden) or causality
    (with a sliding `window` W, also keys j <= i - W) hides a key. graph_probabilities' scores, and
    the scores MultiheadAttention's hook points see (npformer.nn.attention)."""
    scores = (q * scale) @ k.swapaxes(-1, -2)                                 # (..., Tq, Tk)
    if additive is not None:
        scores = scores + additive
    hidden = blocked
    if causal:
        above = causal_blocked(q.xp, 0, q.shape[-2], 0, k.shape[-2], window)  # (Tq, Tk) key j > query i
        hidden = above if blocked is None else blocked | above
    return scores if hidden is None else where(hidden, -math.inf, scores)


def graph_probabilities(q, k, additive, blocked, causal, scale, window=None):
    """P = softmax(s Q K^T + mask) of the Tensors q, k (and a float mask Tensor or array), built
    from differentiable primitives for the differentiable backwards: S = graph_scores(...);
    exp(S - m) / rowsum with the row max m taken as a constant (the softmax does not depend on it),
    and 0 for a fully hidden row (its sum replaced by 1, never NaN)."""
    scores = graph_scores(q, k, additive, blocked, causal, scale, window)     # (..., Tq, Tk)
    shifted = (scores - stable_row_max(scores.data, -1)).exp()               # (..., Tq, Tk)
    total = shifted.sum(axis=-1, keepdims=True)                               # (..., Tq, 1)
    return shifted / where(total.data == 0, 1.0, total)


def graph_attention_double_backward(q, k, v, additive, dout, dweights, blocked, causal, scale, z, gq, gk, gv, gmask,
                                    window=None):
    """(Qbar, Kbar, Vbar, Mbar, dObar, dWbar): the gradients of <gq, dQ> + <gk, dK> + <gv, dV> +
    <gmask, dMask> with respect to (q, k, v, mask, dO, dweights), where (dQ, dK, dV, dMask) is the
    attention backward, on whole (Tq, Tk) matrices of Tensors with P recomputed in the graph from q,
    k and the mask (attention_double_backward's formulas), so that they can be differentiated
    again, to any order: the differentiable_backward of AttentionBackward and of
    MemoryEfficientAttentionBackward. dweights: the gradient reaching the returned weights, or None;
    z: keep / (1 - p), the forward's dropout mask (a constant), or None; gq, gk, gv, gmask: Tensors or
    None (gv or one of the others given); window: the causal sliding window or None. Vbar and
    dWbar are None (0) without gq, gk, gmask; Mbar is (..., Tq, Tk), over the broadcast leading shape."""
    p = graph_probabilities(q, k, additive, blocked, causal, scale, window)    # P = softmax(s Q K^T + mask)
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
        w = plus(w, q @ gk.swapaxes(-1, -2))
    if w is not None:
        w = w * scale
    if gmask is not None:
        w = plus(w, gmask)
    # Pbar = W (dP - D) - r dP + Y Z,  C = P (W - r) Z,  with r = rowsum(W P)
    p_bar = c = None
    if w is not None:
        r = (w * p).sum(axis=-1, keepdims=True)
        p_bar = w * (dp - d) - r * dp
        c = p * (w - r) if z is None else p * (w - r) * z
    if gv is not None:
        y = dout @ gv.swapaxes(-1, -2)
        p_bar = plus(p_bar, y if z is None else y * z)
    # Sbar = P (Pbar - rowsum(Pbar P))
    s_bar = p * (p_bar - (p_bar * p).sum(axis=-1, keepdims=True))
    # dQ = s (Sbar K + dS gk), dK = s (Sbar^T Q + dS^T gq), dV = C^T dO, d dO = C V + Pd gv, dMask = Sbar,
    # d dweights = C
    dq = s_bar @ k if gk is None else s_bar @ k + ds @ gk
    dk = s_bar.swapaxes(-1, -2) @ q if gq is None else s_bar.swapaxes(-1, -2) @ q + ds.swapaxes(-1, -2) @ gq
    dv = None if c is None else c.swapaxes(-1, -2) @ dout
    ddout = plus(None if c is None else c @ v, None if gv is None else dropped @ gv)
    return dq * scale, dk * scale, dv, s_bar, ddout, c
