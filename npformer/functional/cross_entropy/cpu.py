"""Cross-entropy in blocks of rows on the threads of `npformer.runtime.threads` (the "cpu"
implementations of the kernel tables cross_entropy_forward / cross_entropy_backward)."""
from npformer.runtime.threads import for_rows

from ..softmax import stable_row_max
from . import cross_entropy_backward, cross_entropy_forward


@cross_entropy_forward.register("cpu")
def cross_entropy_forward_cpu(xp, logits, target, valid, weight, label_smoothing):
    """The reference's steps on blocks of rows on the threads of `npformer.runtime.threads`, the softmax
    computed in the memory of probs (the rows' maxima by softmax's row_max table)."""
    m, c = logits.shape
    e = label_smoothing
    probs = xp.empty((m, c), dtype=logits.dtype)                # (M, C)
    loss = xp.empty(m, dtype=logits.dtype)                      # (M,)
    w_sum = weight.sum() if weight is not None else c

    def rows(start, stop):
        x, t = logits[start:stop], target[start:stop]
        z = xp.subtract(x, stable_row_max(x, 1), out=probs[start:stop])   # (n, C) shifted, max 0
        z_target = z[xp.arange(stop - start), t]               # (n,)
        z_smooth = (xp.einsum("mc,c->m", z, weight) if weight is not None else z.sum(axis=1)) if e else None
        xp.exp(z, out=z)
        total = z.sum(axis=1, keepdims=True)                   # (n, 1)
        xp.copyto(total, 1.0, where=total == 0)
        z /= total                                             # softmax
        log_total = xp.log(total[:, 0])                        # (n,)
        row_loss = z_target - log_total
        if weight is not None:
            row_loss *= weight[t]
        row_loss *= -(1.0 - e)
        if e:
            z_smooth -= log_total * w_sum
            row_loss -= (e / c) * z_smooth
        loss[start:stop] = row_loss

    for_rows(rows, m, logits.size, logits)
    return xp.where(valid, loss, 0), probs


@cross_entropy_backward.register("cpu")
def cross_entropy_backward_cpu(xp, probs, target, weight, label_smoothing, dloss):
    """The reference's steps on blocks of rows on the threads of `npformer.runtime.threads`, the one-hot
    part of a subtracted at the target entries only."""
    m, c = probs.shape
    e = label_smoothing
    dloss = dloss[:, None]                                     # (M, 1)
    w_target = weight[target][:, None] if weight is not None else 1.0
    a_sum = (1.0 - e) * w_target + (e / c) * (weight.sum() if weight is not None else c)
    softmax_coef = a_sum * dloss                               # (M, 1)
    target_coef = ((1.0 - e) * w_target * dloss)[:, 0]         # (M,)  the one-hot part of a, times dloss
    dlogits = xp.empty_like(probs)                             # (M, C)

    def rows(start, stop):
        d = xp.multiply(probs[start:stop], softmax_coef[start:stop], out=dlogits[start:stop])
        if e:                                                  # the e / C part of a
            smooth = (e / c) * dloss[start:stop]               # (n, 1)
            d -= smooth * weight if weight is not None else smooth
        d[xp.arange(stop - start), target[start:stop]] -= target_coef[start:stop]

    for_rows(rows, m, probs.size, probs)
    return dlogits
