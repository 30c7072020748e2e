"""Launchers of npformer/functional/cuda/cross_entropy.cu: cross-entropy of (M, C) logits, and
log-softmax along the last axis (the file's other kernels, registered with softmax's tables
log_softmax_forward / log_softmax_backward, in their signature)."""

from ..cuda import contiguous_floats, entry_grid, function, null, row_grid, row_shape, row_threads, short_rows
from ..softmax import log_softmax_backward, log_softmax_forward
from . import cross_entropy_backward, cross_entropy_forward

THREADS = 256


def _last_axis(x, axis):
    return axis in (-1, x.ndim - 1) and x.ndim > 0 and short_rows(x.shape[-1])


@log_softmax_forward.register("cuda", supports=lambda xp, x, axis: _last_axis(x, axis) and contiguous_floats(x))
def log_softmax_forward_cuda(xp, x, axis):
    y = xp.empty_like(x)
    n = x.shape[-1]
    if x.size:
        rows = x.size // n
        function("cross_entropy", "log_softmax_forward", x.dtype)(
            (row_grid(rows),), (row_threads(n),), (x, y, *row_shape(xp, rows, n)))
    return y


@log_softmax_backward.register("cuda", supports=lambda xp, logp, dy, axis: _last_axis(logp, axis)
                               and contiguous_floats(logp, dy))
def log_softmax_backward_cuda(xp, logp, dy, axis):
    dx = xp.empty_like(dy)
    n = logp.shape[-1]
    if dy.size:
        rows = dy.size // n
        function("cross_entropy", "log_softmax_backward", dy.dtype)(
            (row_grid(rows),), (row_threads(n),), (logp, dy, dx, *row_shape(xp, rows, n)))
    return dx


@cross_entropy_forward.register("cuda", supports=lambda xp, logits, target, valid, weight, label_smoothing:
                                short_rows(logits.shape[1]) and contiguous_floats(logits, weight))
def cross_entropy_forward_cuda(xp, logits, target, valid, weight, label_smoothing):
    m, c = logits.shape
    probs = xp.empty_like(logits)
    loss = xp.empty(m, dtype=logits.dtype)
    if logits.size:
        function("cross_entropy", "cross_entropy_forward", logits.dtype)(
            (row_grid(m),), (row_threads(c),),
            (logits, xp.ascontiguousarray(target, dtype="int64"), xp.ascontiguousarray(valid, dtype=bool),
             null(weight), probs, loss, float(label_smoothing), *row_shape(xp, m, c)))
    else:
        loss[...] = 0
    return loss, probs


@cross_entropy_backward.register("cuda", supports=lambda xp, probs, target, weight, label_smoothing, dloss:
                                 short_rows(probs.shape[1]) and contiguous_floats(probs, weight, dloss))
def cross_entropy_backward_cuda(xp, probs, target, weight, label_smoothing, dloss):
    m, c = probs.shape
    dlogits = xp.empty_like(probs)
    if probs.size:
        weight_sum = weight.sum(keepdims=True) if weight is not None else None    # (1,), stays on the device
        function("cross_entropy", "cross_entropy_backward", probs.dtype)(
            (entry_grid(probs.size, THREADS),), (THREADS,),
            (probs, xp.ascontiguousarray(target, dtype="int64"), dloss, null(weight), null(weight_sum), dlogits,
             float(label_smoothing), *row_shape(xp, m, c)))
    return dlogits
