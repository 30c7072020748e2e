"""The composite twin of F.cross_entropy: the same function built only from autograd primitives, so that
its gradients come from the tape, a test reference beside torch and finite differences
(npformer.functional.composite installs it)."""
from autograd import Tensor, where

from .._common import on_device_of, tensor_of
from ..softmax.twin import log_softmax
from . import classes_last, is_probability_target, probability_cross_entropy, probability_target


def cross_entropy(input, target, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0):
    logits = tensor_of(input)
    x = classes_last(logits)                                  # (M, C)
    w = weight
    if weight is not None and not isinstance(weight, Tensor):  # a plain array of class weights follows the logits
        w = Tensor(on_device_of(weight, x.data, "weight", "cross_entropy").astype(x.dtype, copy=False))
    if is_probability_target(target):
        tgt = classes_last(probability_target(target, logits.data))
        loss = probability_cross_entropy(log_softmax(x, dim=1), tgt, w, label_smoothing, reduction)
        rows = logits.shape[:1] + logits.shape[2:] if logits.ndim > 1 else ()
        return loss.reshape(rows) if reduction == "none" else loss
    c = x.shape[1]
    tgt = on_device_of(target, x.data, "target", "cross_entropy")
    flat = tgt.reshape(-1)
    valid = flat != ignore_index
    safe = x.xp.where(valid, flat, 0)
    logp = log_softmax(x, dim=1)
    picked = logp[x.xp.arange(x.shape[0]), safe]
    w_target = w[safe] if w is not None else None
    nll = -(picked * w_target if w is not None else picked)
    smooth = -((logp * w).sum(axis=1) if w is not None else logp.sum(axis=1)) / c
    loss = where(valid, (1.0 - label_smoothing) * nll + label_smoothing * smooth, 0.0)
    if reduction == "none":
        return loss.reshape(tgt.shape)
    if reduction == "sum":
        return loss.sum()
    divisor = where(valid, w_target, 0.0).sum() if w is not None else float(valid.sum())
    return loss.sum() / divisor
