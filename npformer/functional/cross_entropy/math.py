"""Cross-entropy of class-index targets, fused with log-softmax, label smoothing e, class weights w
and ignored rows, on whole arrays of `xp` (numpy or CuPy): the loss, its gradient and its tangent.

With q = (1 - e) onehot(target) + e / C and a = q * w (w = 1 without weights), each row's loss is
loss_i = -sum_c a_ic logp_ic, logp = log_softmax(logits); 0 on ignored rows (valid False).
(Class-probability targets are composed of log_softmax and primitives: see __init__.py.)
"""


def cross_entropy_forward(xp, logits, target, valid, weight, label_smoothing):
    """logits (M, C), target (M,) class ids (any id where valid is False), valid (M,) bool, weight
    (C,) or None -> (loss (M,), probs (M, C)): loss_i = -sum_c a_ic logp_ic, 0 where not valid, with
    a = ((1 - e) onehot(target) + e / C) * weight; probs = softmax(logits), saved for backward."""
    m, c = logits.shape
    e = label_smoothing
    # the shift of each row: its maximum, 0 for a row of all -inf (no -inf - (-inf)) or of no classes
    # (softmax's stable_row_max)
    shift = logits.max(axis=1, keepdims=True) if c else xp.zeros((m, 1), dtype=logits.dtype)   # (M, 1)
    xp.copyto(shift, 0.0, where=shift == -xp.inf)
    z = logits - shift                                          # (M, C) shifted, max 0
    z_target = z[xp.arange(m), target]                          # (M,)
    # logp = z - log(total): the smoothing term sum_c w_c logp_c = z @ w - log(total) sum(w)
    # (einsum, not BLAS: OpenBLAS's gemv can raise a spurious invalid-value flag, numpy#24067)
    z_smooth = (xp.einsum("mc,c->m", z, weight) if weight is not None else z.sum(axis=1)) if e else None
    probs = xp.exp(z)
    total = probs.sum(axis=1, keepdims=True)                    # (M, 1)
    xp.copyto(total, 1.0, where=total == 0)                     # fully -inf row: log 1 = 0, logp -inf
    probs /= total                                              # softmax
    log_total = xp.log(total[:, 0])                             # (M,)
    # loss_i = -(1 - e) w_t logp_it - (e / C) sum_c w_c logp_ic
    loss = (z_target - log_total) * (-(1.0 - e))
    if weight is not None:
        loss *= weight[target]
    if e:
        loss -= (e / c) * (z_smooth - log_total * (weight.sum() if weight is not None else c))
    return xp.where(valid, loss, 0), probs                      # ignored rows add nothing


def smoothed_weighted_targets(xp, target, weight, label_smoothing, c, dtype):
    """target (M,) class ids, weight (C,) or None -> (a (M, C), sum_c a (M, 1)): a_ic = q_ic w_c with
    q_ic = (1 - e) [c = t_i] + e / C, the coefficients of logp in each row's loss."""
    m, e = target.shape[0], label_smoothing
    w_target = weight[target][:, None] if weight is not None else 1.0               # (M, 1)
    # a_ic = (1 - e) w_t [c == t] + (e / C) w_c  ->  sum_c a_ic = (1 - e) w_t + (e / C) sum(w)
    a_sum = (1.0 - e) * w_target + (e / c) * (weight.sum() if weight is not None else c)
    a = xp.zeros((m, c), dtype=dtype)                                               # (M, C)
    a[xp.arange(m), target] = ((1.0 - e) * w_target * xp.ones((m, 1), dtype=dtype))[:, 0]
    a += (e / c) * (weight if weight is not None else 1.0)
    return a, a_sum.astype(dtype, copy=False) if weight is not None else a_sum  # a number: no host-to-device copy


def cross_entropy_backward(xp, probs, target, weight, label_smoothing, dloss):
    """probs (M, C) softmax, target (M,), weight (C,) or None, dloss (M,) the upstream gradient of each
    row's loss (0 on ignored rows) -> dlogits (M, C) = (probs * sum_c a_ic - a_i) * dloss_i."""
    a, a_sum = smoothed_weighted_targets(xp, target, weight, label_smoothing, probs.shape[1], probs.dtype)
    # loss_i = -sum_c a_ic logp_ic, logp = log_softmax(logits)  ->  dlogits = (softmax * sum(a) - a) dloss
    return (probs * a_sum - a) * dloss[:, None]


def reduced(loss, divisor, reduction):
    """The loss of each row (M,) reduced: itself ("none"), its sum, or its sum / divisor ("mean":
    the sum of w[target] over valid rows, or their number)."""
    return loss if reduction == "none" else loss.sum() if divisor is None else loss.sum() / divisor


def cross_entropy_tangent(xp, probs, target, valid, weight, label_smoothing, divisor, reduction, t_logits):
    """probs (M, C) softmax saved by the forward, t_logits (M, C) the logits' tangent -> the tangent of
    the reduced loss (the class weights are constants: no tangent)."""
    m, c = probs.shape
    e = label_smoothing
    w_target = weight[target] if weight is not None else 1.0                  # (M,)
    # logp = x - lse(x)  ->  t_logp_ic = t_x_ic - t_lse_i,  t_lse_i = sum_j softmax_ij t_x_ij
    t_lse = xp.einsum("mc,mc->m", probs, t_logits)                            # (M,)
    # a_ic = (1 - e) w_target [c == target] + (e / C) w_c  ->  a_i . t_x_i, the one-hot part ...
    a_t = (1.0 - e) * w_target * t_logits[xp.arange(m), target]               # (M,)
    if e:                                                                     # ... and the e / C part
        a_t += (e / c) * (xp.einsum("mc,c->m", t_logits, weight) if weight is not None else t_logits.sum(axis=1))
    # A_i = sum_c a_ic = (1 - e) w_target + (e / C) sum(w)
    a_sum = (1.0 - e) * w_target + (e / c) * (weight.sum() if weight is not None else c)
    # loss_i = -sum_c a_ic logp_ic  ->  t_loss_i = -sum_c a_ic (t_x_ic - t_lse_i) = A_i t_lse_i - a_i . t_x_i
    t_loss = xp.where(valid, a_sum * t_lse - a_t, 0)                          # ignored rows add nothing
    # out = loss, sum(loss) or sum(loss) / divisor  ->  the same of t_loss
    return reduced(t_loss, divisor, reduction)
