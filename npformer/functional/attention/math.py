"""Scaled dot-product attention, the naive path: forward and first-order backward, on whole
(B, H, Tq, Tk) matrices, written on `xp` (numpy or CuPy), like llm.c's attention_forward/backward.

    forward                                      backward (each line undoes the one left of it)
    scores = q k^T * scale (+ mask)              dQ = dS K * scale,  dK = dS^T Q * scale,  d mask = dS
    P = softmax(scores)                          dS = P * (dP - rowsum(dP * P))
    Pd = P * keep / (1 - p)      (dropout)       dP = dPd * keep / (1 - p)
    out = Pd v                                   dV = Pd^T dO,  dPd = dO V^T

q (B, H, Tq, hd), k (B, H, Tk, hd), v (B, H, Tk, hdv): any leading axes that broadcast, usually
(batch, heads). The shape comments write them (B, H). The derivation: derivation.md.

Three steps have faster kernels than their plain xp lines (npformer.functional.softmax's row
sums and softmax, a Q K^T on a contiguous K^T): the formulas call them through `ops`, whose
default PLAIN is the plain xp code below; the binding (tables.py) passes its kernel tables.
The double backward and the jvps: higher.py; the memory-efficient path: blockwise.py; the masks
(bool, float, causal) as one -inf bias: masks.py.
"""
from typing import Callable, NamedTuple

from ..softmax import math as softmax_math
from .masks import masked_scores


class Ops(NamedTuple):
    """The steps of the formulas that have kernels of their own; each takes xp first."""
    matmul_transposed: Callable   # (xp, a, b, out=None) -> a @ b^T: Q K^T, dO V^T
    softmax: Callable             # (xp, x, out=None) -> softmax over the last axis (an all -inf row gives 0)
    row_dot: Callable             # (xp, a, b) -> rowsum(a * b) (..., 1)
    keep_block: Callable = None   # (xp, dropout, lead, Tq, Tk, q0, q1, k0, k1, like) -> a block's dropout mask


def matmul_transposed(xp, a, b, out=None):
    """a (..., m, k) @ b (..., n, k)^T -> (..., m, n) (written into `out` when given): Q K^T, dO V^T."""
    return xp.matmul(a, b.swapaxes(-1, -2), out=out)


def softmax(xp, x, out=None):
    """Softmax over the last axis (npformer/functional/softmax/math.py): a row that is entirely -inf
    (every key hidden) gives zeros. out=x: in place."""
    return softmax_math.softmax_forward(xp, x, -1, out=out)


def row_dot(xp, a, b):
    """rowsum(a * b): sum over the last axis, keepdims: (..., n), (..., n) -> (..., 1)."""
    return (a * b).sum(axis=-1, keepdims=True)


PLAIN = Ops(matmul_transposed, softmax, row_dot)


def attention_forward(xp, q, k, v, mask, blocked, causal, scale, keep, dropout_scale, probs, out, weights, *,
                      ops=PLAIN):
    """The naive path's forward: q (B, H, Tq, hd), k (B, H, Tk, hd), v (B, H, Tk, hdv); a float
    `mask` added to the scores and a bool `blocked` (True = hidden), each broadcastable to
    (B, H, Tq, Tk) or None; causal: hide keys j > query i; keep: the dropout mask (True = kept) or
    None, dropout_scale = 1 / (1 - p). Writes P into probs (B, H, Tq, Tk), the output into out
    (B, H, Tq, hdv) and, with dropout, Pd into weights (None: a temporary)."""
    # scores = q k^T * scale + mask, -inf where blocked or causally hidden
    scores = masked_scores(xp, ops, q * scale, k, blocked, mask, causal, 0, 0, out=probs)   # (B, H, Tq, Tk)
    # P = softmax(scores), in place
    ops.softmax(xp, scores, out=scores)                                      # (B, H, Tq, Tk)
    # dropout: Pd = P * keep / (1 - p)
    dropped = scores
    if keep is not None:
        dropped = xp.multiply(scores, keep, out=weights)                    # (B, H, Tq, Tk)
        dropped *= dropout_scale
    # out = Pd v
    xp.matmul(dropped, v, out=out)                                           # (B, H, Tq, hdv)


def attention_backward(xp, q, k, v, probs, keep, dout, dweights, scale, dropout_scale, dq, dk, dv, dmask, *,
                       ops=PLAIN):
    """The naive path's backward from what attention_forward saved (P in probs, the dropout mask
    keep or None), dout (B, H, Tq, hdv) and dweights (B, H, Tq, Tk), the gradient reaching the
    returned weights Pd, or None. Writes dQ into dq, dK into dk, dV into dv (each (B, H, T, hd)
    over the broadcast leading shape) and d mask = dS into dmask (B, H, Tq, Tk), those not None."""
    dropped = probs                                                          # (B, H, Tq, Tk) Pd
    if keep is not None:
        dropped = probs * keep
        dropped *= dropout_scale
    # out = Pd v  ->  dV = Pd^T dO
    if dv is not None:
        xp.matmul(dropped.swapaxes(-1, -2), dout, out=dv)                    # (B, H, Tk, hdv)
    if dq is None and dk is None and dmask is None:
        return
    # out = Pd v  ->  dPd = dO V^T (plus the gradient reaching the returned weights Pd)
    dprobs = ops.matmul_transposed(xp, dout, v)                              # (B, H, Tq, Tk)
    if dweights is not None:
        dprobs += dweights
    # Pd = P * keep / (1 - p)  ->  dP = dPd * keep / (1 - p)
    if keep is not None:
        dprobs *= keep
        dprobs *= dropout_scale
    # P = softmax(scores)  ->  dS = P * (dP - rowsum(dP * P)), in dP's place; a hidden key has P = 0, so dS = 0
    dscores = xp.subtract(dprobs, ops.row_dot(xp, dprobs, probs), out=dprobs)   # (B, H, Tq, Tk)
    dscores *= probs
    # scores = q k^T * scale + mask  ->  d mask = dS
    if dmask is not None:
        dmask[...] = dscores
    # scores = q k^T * scale  ->  dQ = dS K * scale
    if dq is not None:
        xp.matmul(dscores, k, out=dq)                                        # (B, H, Tq, hd)
        dq *= scale
    # scores = q k^T * scale  ->  dK = dS^T Q * scale
    if dk is not None:
        xp.matmul(dscores.swapaxes(-1, -2), q, out=dk)                       # (B, H, Tk, hd)
        dk *= scale
