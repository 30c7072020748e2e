"""Scaled dot-product attention, the naive path's higher derivatives on whole (..., Tq, Tk)
matrices from the forward's saved P, written on `xp`: the forward's tangent (attention_jvp), the
double backward (the gradients of <g, (dQ, dK, dV, dMask)>) and the backward's tangent (forward over
reverse). The forward and first-order backward they start from: math.py; `ops` as there.
derivation.md derives each formula."""
from .math import PLAIN


def attention_jvp(xp, q, k, v, probs, keep, scale, dropout_scale, tq, tk, tv, tmask, tout, tweights, *,
                  ops=PLAIN):
    """The tangent of O = Pd V along tq, tk, tv and tmask (each None, tmask at least 2-D and
    broadcastable to (..., Tq, Tk)) from the saved P and keep: writes t_O into tout (..., Tq, hdv)
    and t_Pd into tweights (..., Tq, Tk) when it is not None (it is None unless a tangent moves S)."""
    written = False
    if tq is not None or tk is not None or tmask is not None:
        tscores = score_tangent(xp, ops, q * scale, k, None if tq is None else tq * scale, tk, tmask)   # (..., Tq, Tk)
        # P = softmax(S)  ->  t_P = P (t_S - rowsum(P t_S))  (out of place: t_S may be t_mask)
        tprobs = tscores - ops.row_dot(xp, probs, tscores)
        tprobs *= probs
        # Pd = P * keep / (1 - p)  ->  t_Pd = t_P * keep / (1 - p)
        if keep is not None:
            tprobs *= keep
            tprobs *= dropout_scale
        if tweights is not None:
            tweights[...] = tprobs
        # O = Pd V  ->  t_O = t_Pd V
        xp.matmul(tprobs, v, out=tout)
        written = True
    if tv is not None:
        # O = Pd V  ->  t_O += Pd t_V
        dropped = probs if keep is None else probs * keep * dropout_scale       # Pd (..., Tq, Tk)
        if written:
            tout += xp.matmul(dropped, tv)
        else:
            xp.matmul(dropped, tv, out=tout)
        written = True
    if not written:
        tout[...] = 0


def attention_double_backward(xp, q, k, v, probs, keep, dout, dweights, scale, dropout_scale, gq, gk, gv, gmask,
                              dq, dk, dv, dmask, ddout, ddweights, *, ops=PLAIN):
    """The naive path's double backward on whole (..., Tq, Tk) matrices, from what attention_forward
    saved (P in probs, the mask keep or None): the gradients of L = <gq, dQ> + <gk, dK> + <gv, dV> +
    <gmask, dMask>, where (dQ, dK, dV, dMask) is attention_backward of (q, k, v, mask, dout, dweights).
    gq, gk, gv (shapes of q, k, v) and gmask (broadcastable to (..., Tq, Tk), at least 2-D) reach dQ,
    dK, dV and dMask; each may be None, but gv or one of the others is given. Writes the gradients of
    q, k, v into dq, dk, dv, of the mask into dmask (..., Tq, Tk), of dout into ddout and of dweights
    into ddweights (each over the broadcast leading shape), those that are not None; dv and ddweights
    need one of gq, gk, gmask (without them both gradients are 0).

    With Z = keep / (1 - p) (1 without dropout), dP = (dO V^T + dweights) Z, D = rowsum(dP P),
    dS = P (dP - D), W = s (gq K^T + Q gk^T) + gmask (what reaches dS), r = rowsum(W P) and
    Y = dO gv^T (what reaches Pd):  Pbar = (W - r) dP - W D + Y Z,  Sbar = P (Pbar - rowsum(Pbar P)),
    C = P (W - r) Z;  then dq = s (Sbar K + dS gk), dk = s (Sbar^T Q + dS^T gq), dv = C^T dO,
    d dO = C V + Pd gv, dmask = Sbar, d dweights = C (derivation.md derives them)."""
    z, dprobs, delta = _first_order_dp(xp, ops, v, probs, keep, dout, dweights, dropout_scale)
    # W = s (gq K^T + Q gk^T) + gmask: the gradient reaching dS through dQ = s dS K, dK = s dS^T Q, dMask = dS
    w = None
    if gq is not None:
        w = ops.matmul_transposed(xp, gq, k)
    if gk is not None:
        product = ops.matmul_transposed(xp, q, gk)                                   # (gq K^T's shape)
        w = product if w is None else xp.add(w, product, out=w)
    if w is not None:
        w *= scale
    if gmask is not None:
        w = plus(w, gmask)                                                  # (out of place: never into gmask)
    p_bar = w_centered = None
    if w is not None:
        w_centered = w - ops.row_dot(xp, w, probs)                       # (..., Tq, Tk) W - r, r = rowsum(W P)
        # P enters dS = P (dP - D) and D = rowsum(dP P):  Pbar = W (dP - D) - r dP = (W - r) dP - W D
        p_bar = w_centered * dprobs
        p_bar -= w * delta
    if gv is not None:
        # dV = Pd^T dO  ->  Y = dO gv^T reaches Pd = P Z:  Pbar += Y Z
        y = ops.matmul_transposed(xp, dout, gv)                                      # (..., Tq, Tk)
        if z is not None:
            y *= z
        p_bar = y if p_bar is None else xp.add(p_bar, y, out=p_bar)
    # P = softmax(S)  ->  Sbar = P (Pbar - rowsum(Pbar P)), in place
    s_bar = xp.subtract(p_bar, ops.row_dot(xp, p_bar, probs), out=p_bar)
    s_bar *= probs
    # dS = P (dP - D), in dP's place: dQ = s dS K and dK = s dS^T Q multiply it by gk and gq
    ds = None
    if (dq is not None and gk is not None) or (dk is not None and gq is not None):
        ds = xp.subtract(dprobs, delta, out=dprobs)
        ds *= probs
    # S = s Q K^T + mask  ->  dq = s (Sbar K + dS gk), dk = s (Sbar^T Q + dS^T gq), dmask = Sbar
    _through_scores(xp, s_bar, ds, q, k, gq, gk, scale, dq, dk, dmask)
    # dP = (dO V^T + dweights) Z enters dS and D:  C = P (W - r) Z reaches dO V^T and dweights
    c = None
    if w_centered is not None:
        c = w_centered
        c *= probs
        if z is not None:
            c *= z
    # dO V^T  ->  dv = C^T dO;  dweights  ->  d dweights = C
    if dv is not None:
        xp.matmul(c.swapaxes(-1, -2), dout, out=dv)
    if ddweights is not None:
        ddweights[...] = c
    # dO V^T  ->  d dO = C V;  dV = Pd^T dO  ->  d dO += Pd gv
    if ddout is not None:
        if c is not None:
            xp.matmul(c, v, out=ddout)
        if gv is not None:
            dropped = probs if z is None else probs * z
            if c is None:
                xp.matmul(dropped, gv, out=ddout)
            else:
                ddout += xp.matmul(dropped, gv)


def attention_backward_jvp(xp, q, k, v, probs, keep, dout, dweights, scale, dropout_scale, tq, tk, tv, tmask, tdout,
                           tdweights, dq_tangent, dk_tangent, dv_tangent, dmask_tangent, *, ops=PLAIN):
    """The tangents of attention_backward's (dQ, dK, dV, dMask) along the tangents tq, tk, tv, tmask
    (broadcastable to (..., Tq, Tk), at least 2-D), tdout and tdweights of (q, k, v, mask, dout,
    dweights) (None where that input does not move, at least one given), on whole (..., Tq, Tk)
    matrices from the saved P and keep. Writes them into dq_tangent, dk_tangent, dv_tangent and
    dmask_tangent (each over the broadcast leading shape), those that are not None; dv_tangent needs
    one of tq, tk, tmask, tdout (without them it is 0).

    Every first-order step along its tangents (forward over reverse): t_S = s (t_Q K^T + Q t_K^T) +
    t_mask, t_P = P (t_S - rowsum(P t_S)), t_dP = (t_dO V^T + dO t_V^T + t_dweights) Z,
    t_dS = t_P (dP - D) + P (t_dP - t_D) with t_D = rowsum(t_dP P + dP t_P), then
    t_dQ = s (t_dS K + dS t_K), t_dK = s (t_dS^T Q + dS^T t_Q), t_dV = t_Pd^T dO + Pd^T t_dO, t_dMask = t_dS."""
    z, dprobs, delta = _first_order_dp(xp, ops, v, probs, keep, dout, dweights, dropout_scale)
    tprobs = tdropped = None
    if tq is not None or tk is not None or tmask is not None:
        # S = s Q K^T + mask  ->  t_S = s (t_Q K^T + Q t_K^T) + t_mask
        tscores = score_tangent(xp, ops, q * scale, k, None if tq is None else tq * scale, tk, tmask)
        # P = softmax(S)  ->  t_P = P (t_S - rowsum(P t_S))  (out of place: t_S may be t_mask)
        tprobs = tscores - ops.row_dot(xp, probs, tscores)                           # (..., Tq, Tk)
        tprobs *= probs
        # Pd = P Z  ->  t_Pd = t_P Z
        tdropped = tprobs if z is None else tprobs * z
    # dPd = dO V^T + dweights  ->  t_dPd = t_dO V^T + dO t_V^T + t_dweights;  dP = dPd Z  ->  t_dP = t_dPd Z
    tdprobs = None
    if tdout is not None:
        tdprobs = ops.matmul_transposed(xp, tdout, v)
    if tv is not None:
        product = ops.matmul_transposed(xp, dout, tv)                                # (..., Tq, Tk)
        tdprobs = product if tdprobs is None else xp.add(tdprobs, product, out=tdprobs)
    if tdweights is not None:
        tdprobs = plus(tdprobs, tdweights)                                  # (out of place: never into t_dweights)
    if tdprobs is not None and z is not None:
        tdprobs = tdprobs * z
    # dV = Pd^T dO  ->  t_dV = t_Pd^T dO + Pd^T t_dO
    if dv_tangent is not None:
        if tdropped is not None:
            xp.matmul(tdropped.swapaxes(-1, -2), dout, out=dv_tangent)
        if tdout is not None:
            dropped = probs if z is None else probs * z                      # Pd = P Z
            if tdropped is None:
                xp.matmul(dropped.swapaxes(-1, -2), tdout, out=dv_tangent)
            else:
                dv_tangent += xp.matmul(dropped.swapaxes(-1, -2), tdout)
    # dS = P (dP - D), D = rowsum(dP P)  ->  t_dS = t_P (dP - D) + P (t_dP - t_D), t_D = rowsum(t_dP P + dP t_P)
    centered = dprobs - delta                                                # (..., Tq, Tk) dP - D
    tds = tdelta = None
    if tprobs is not None:
        tds = tprobs * centered
        tdelta = ops.row_dot(xp, dprobs, tprobs)
    if tdprobs is not None:
        moved = probs * tdprobs                                              # P t_dP
        tds = moved if tds is None else xp.add(tds, moved, out=tds)
        tdelta = plus(tdelta, ops.row_dot(xp, tdprobs, probs))
    tds -= probs * tdelta
    ds = centered                                                            # dS = P (dP - D), in place
    ds *= probs
    # dQ = s dS K, dK = s dS^T Q, dMask = dS  ->  t_dQ = s (t_dS K + dS t_K), t_dK = s (t_dS^T Q + dS^T t_Q),
    # t_dMask = t_dS
    _through_scores(xp, tds, ds, q, k, tq, tk, scale, dq_tangent, dk_tangent, dmask_tangent)


def _first_order_dp(xp, ops, v, probs, keep, dout, dweights, dropout_scale):
    """(Z, dP, D) as the first-order backward forms them from the saved P: Z = keep / (1 - p) (None
    without dropout), dP = (dO V^T + dweights) Z (..., Tq, Tk), D = rowsum(dP P) (..., Tq, 1)."""
    z = None if keep is None else keep * probs.dtype.type(dropout_scale)    # (..., Tq, Tk) Z = keep / (1 - p)
    # O = Pd V  ->  dPd = dO V^T (+ dweights);  Pd = P Z  ->  dP = dPd Z
    dprobs = ops.matmul_transposed(xp, dout, v)                                      # (..., Tq, Tk)
    if dweights is not None:
        dprobs += dweights
    if z is not None:
        dprobs *= z
    return z, dprobs, ops.row_dot(xp, dprobs, probs)                                 # D = rowsum(dP P)


def _through_scores(xp, a, ds, q, k, bq, bk, scale, dq, dk, dmask):
    """The last step of the double backward (a = Sbar, bq, bk = the incoming gq, gk) and of the
    gradients' tangent (a = t_dS, bq, bk = t_Q, t_K), through S = s Q K^T + mask with dS the
    first-order score gradient: writes dq = s (a K + dS bk), dk = s (a^T Q + dS^T bq) and dmask = a
    into those outputs that are not None (a term whose bq or bk is None left out)."""
    if dq is not None:
        xp.matmul(a, k, out=dq)
        if bk is not None:
            dq += xp.matmul(ds, bk)
        dq *= scale
    if dk is not None:
        xp.matmul(a.swapaxes(-1, -2), q, out=dk)
        if bq is not None:
            dk += xp.matmul(ds.swapaxes(-1, -2), bq)
        dk *= scale
    if dmask is not None:
        dmask[...] = a


def plus(total, term):
    """total + term out of place, or term when total is None: the sum of the terms that exist
    (arrays or Tensors)."""
    return term if total is None else total + term


def score_tangent(xp, ops, q_scaled, k, tq_scaled, tk, tmask):
    """t_S of S = (s Q) K^T + mask, given s Q and s t_Q: (s t_Q) K^T + (s Q) t_K^T + t_mask (each
    term where its tangent is not None; one block of it when given blocks)."""
    parts = []
    # S = s Q K^T  ->  t_S = s t_Q K^T + s Q t_K^T
    if tq_scaled is not None:
        parts.append(ops.matmul_transposed(xp, tq_scaled, k))
    if tk is not None:
        parts.append(ops.matmul_transposed(xp, q_scaled, tk))
    # S = ... + mask  ->  t_S += t_mask
    if tmask is not None:
        parts.append(tmask)
    return sum(parts[1:], parts[0])                                     # out of place: never into t_mask
