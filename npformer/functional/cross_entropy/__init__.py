"""Cross-entropy on logits, fused with log-softmax, label smoothing, class weights and ignore_index;
with class-probability targets (soft labels) composed of log_softmax and primitives."""
from __future__ import annotations

from math import prod

from autograd import Function, Tensor, backend, forward_ad, is_grad_enabled, raw_computation
from autograd.backend import Array, ArrayLike
from autograd.checks import check_int, check_real
from npformer.runtime import deferred
from npformer.runtime.kernels import kernel_table

from .._common import (check_index_range, check_one_dtype, check_tensor, data_of, has_twin, on_device_of,
                       tensor_of)
from ..softmax import SoftmaxFunction, log_softmax
from . import math

__all__ = ["cross_entropy"]  # its public ops, which npformer.functional exports


# the kernel tables: math.py's formulas as the reference, the CPU's row blocks on threads (cpu.py) and
# CUDA's kernels (cuda.py) beside them
cross_entropy_forward = kernel_table(math.cross_entropy_forward)
cross_entropy_backward = kernel_table(math.cross_entropy_backward)


class CrossEntropyFunction(Function):
    """logits (M, C), target (M,) class ids -> per-row loss (M,) or its sum/mean.

    With q = (1 - e) onehot(target) + e / C, a = q * w (w the class weights, 1 without),
    loss_i = -sum_c a_ic logp_ic on valid rows (target != ignore_index), 0 elsewhere;
    "mean" divides by sum of w[target] over valid rows (n_valid without weights).
    dlogits_i = (softmax_i * sum_c a_ic - a_i) * valid_i * dloss_i (/ the mean's divisor).
    The kernel table cross_entropy_forward / cross_entropy_backward runs it (the formulas: math.py;
    cpu: row blocks on threads, cpu.py; cuda: hand-written kernels, cuda.py); the softmax is saved for
    backward.
    """
    backward_formula = staticmethod(math.cross_entropy_backward)

    @staticmethod
    def forward(ctx, logits, weight, safe_target, valid, divisor, reduction, label_smoothing):
        # safe_target: ignored rows point at class 0; divisor: "mean"'s sum of w[target] (or n_valid)
        loss, probs = cross_entropy_forward(backend.get_array_module(logits), logits, safe_target, valid, weight,
                                            label_smoothing)
        out = math.reduced(loss, divisor, reduction)
        ctx.save_for_backward(probs, weight, safe_target, valid, divisor)
        ctx.label_smoothing, ctx.reduction = label_smoothing, reduction
        return out

    @staticmethod
    def backward(ctx, dout):
        probs, weight, target, valid, divisor = ctx.saved_tensors
        xp = backend.get_array_module(probs)
        # out = loss, sum(loss) or sum(loss) / divisor  ->  dloss_i = dout (/ divisor), 0 on ignored rows
        dloss = dout / divisor if divisor is not None else dout
        dloss = xp.where(valid, dloss, 0).astype(probs.dtype, copy=False)   # (M,)
        return cross_entropy_backward(xp, probs, target, weight, ctx.label_smoothing, dloss), None

    @staticmethod
    def differentiable_backward(ctx, dout):
        probs_saved, weight, target, valid, divisor = ctx.saved_tensors
        logits = ctx.inputs[0]
        if logits is None:
            return None, None
        xp = backend.get_array_module(probs_saved)
        # dloss_i = dout (/ divisor), 0 on ignored rows: dout times a constant per row
        per_row = xp.where(valid, 1.0 if divisor is None else 1.0 / divisor, 0.0).astype(probs_saved.dtype)
        dloss = (dout * Tensor(per_row)).reshape(-1, 1)                                  # (M, 1)
        a, a_sum = math.smoothed_weighted_targets(xp, target, weight, ctx.label_smoothing, probs_saved.shape[1],
                                                  probs_saved.dtype)
        # dlogits = (softmax * sum(a) - a) dloss, the softmax formed again in the graph:
        #   d/d(dout) <dlogits, u> = sum_c u_ic (softmax_ic sum(a_i) - a_ic) per row, times the constant;
        #   d/dlogits <dlogits, u> = softmax's backward of u * sum(a_i) dloss_i (softmax's Jacobian)
        probs = SoftmaxFunction.apply(logits, dim=1)
        return (probs * a_sum - Tensor(a)) * dloss, None

    @staticmethod
    def jvp(ctx, t_logits, t_weight):
        # t_weight is None: cross_entropy refuses class weights that carry a tangent
        probs, weight, target, valid, divisor = ctx.saved_tensors
        return math.cross_entropy_tangent(backend.get_array_module(probs), probs, target, valid, weight,
                                          ctx.label_smoothing, divisor, ctx.reduction, t_logits)


def _every_target_ignored(ignore_index):
    """The verdict on the number of valid targets of a "mean" cross-entropy."""
    return lambda n_valid: None if n_valid else ValueError(
        f"cross_entropy: every target equals ignore_index={ignore_index}, so the mean over valid targets is "
        "undefined (torch returns NaN); use reduction='sum' or check the targets")


def _class_targets(target, ignore_index, weight, reduction, dtype):
    """(safe_target, valid, divisor) of class targets, flattened: the ids with ignored ones made 0,
    which are not ignored, and the mean's divisor (None unless reduction="mean")."""
    xp = backend.get_array_module(target)
    flat_target = target.reshape(-1)
    valid = flat_target != ignore_index
    safe_target = xp.where(valid, flat_target, 0)
    divisor = None  # "mean": the sum of w[target] over valid targets (checked like the ids), or their number
    if reduction == "mean" and weight is not None:
        divisor = (weight[safe_target] * valid).sum()
        deferred.defer(_zero_weighted_mean, divisor)
    elif reduction == "mean":
        divisor = valid.sum().astype(dtype)
    if divisor is not None:  # a 0 divisor is reported by the checks; meanwhile the loss is 0, not NaN
        divisor = backend.get_array_module(divisor).where(divisor == 0, 1, divisor).astype(dtype, copy=False)
    return safe_target, valid, divisor


def _zero_weighted_mean(divisor):
    """The verdict on the divisor of a weighted "mean" cross-entropy (after the valid-target check)."""
    return None if divisor else ValueError(
        "cross_entropy: the class weights of every valid target are 0, so the weighted mean is undefined "
        "(torch returns NaN); use reduction='sum' or check weight")


def classes_last(x):
    """A Tensor of logits (or class probabilities) (N, C, d1, ...), (N, C) or (C,) as rows of
    classes (N d1 ..., C)."""
    if x.ndim > 2:  # (N, C, d1, ...) -> (N, d1, ..., C)
        x = x.permute(0, *range(2, x.ndim), 1)
    return x if x.ndim == 2 else x.reshape(-1, x.shape[-1])


def is_probability_target(target):
    """Whether a cross-entropy target holds class probabilities (a floating array or Tensor)."""
    raw = data_of(target)
    return backend.is_array(raw) and raw.dtype.kind == "f"


def probability_target(target, logits):
    """A class-probability target as a Tensor on the device of the array `logits`, of its shape and
    dtype (a Tensor that requires grad stays in the graph: the loss is differentiated in it too)."""
    if tuple(target.shape) != tuple(logits.shape):
        raise ValueError(f"cross_entropy: a floating target holds class probabilities and must have the input's "
                         f"shape {tuple(logits.shape)}, got shape {tuple(target.shape)} (class indices must be "
                         "integers)")
    check_one_dtype("cross_entropy", logits, data_of(target))
    if isinstance(target, Tensor):
        on_device_of(target, logits, "target", "cross_entropy")   # checks the device
        return target
    return Tensor(on_device_of(target, logits, "target", "cross_entropy"))


def probability_cross_entropy(logp, target, weight, label_smoothing, reduction):
    """The cross-entropy of class-probability targets (soft labels: distillation, mixup), written
    with differentiable ops, so its every derivative comes from theirs: logp (M, C) log-probabilities,
    target (M, C) probabilities (Tensors), weight (C,) or None ->
    loss_i = -sum_c w_c q_ic logp_ic with q = (1 - e) target + e / C (torch's smoothing of
    probabilities); "mean" divides by M, not by the weights (as torch)."""
    e, c = label_smoothing, logp.shape[1]
    q = target * (1.0 - e) + e / c if e else target
    loss = -(logp * (q * weight if weight is not None else q)).sum(axis=1)     # (M,)
    if reduction == "none":
        return loss
    return loss.sum() if reduction == "sum" else loss.mean()


@has_twin
def cross_entropy(input: Tensor | Array, target: Tensor | ArrayLike, weight: Tensor | Array | None = None,
                  ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0) -> Tensor:
    """Like torch.nn.functional.cross_entropy, with class-index or class-probability targets.

    input: logits (N, C), (N, C, d1, ...) or (C,); target: integer ids (N,), (N, d1, ...) or (),
    or class probabilities (soft labels) of the input's shape and dtype (a Tensor of them may
    require grad); weight: class weights (C,) or None. Targets equal to `ignore_index` add nothing
    (ids only; probabilities have none, as in torch).
    reduction: "mean" (over the targets that count, weighted; for probabilities over the N d1 ...
    rows, unweighted, as torch's; default), "sum" or "none" (the shape without the class axis).
    label_smoothing in [0, 1] mixes in the uniform distribution, as torch's.
    Raises ValueError when reduction="mean" and every target is ignored (torch returns NaN there),
    TypeError for non-integer targets, IndexError for a class id outside [0, C).
    Targets that arrive as host arrays are checked at once; targets already on a GPU are checked
    there, and a bad one raises when the result is first read (npformer.runtime.deferred).
    The class weights are constants: a weight Tensor that requires grad is refused, as in torch.
    """
    logits = check_tensor("input", input, "cross_entropy")
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(f"cross_entropy: reduction must be 'none', 'mean' or 'sum', got {reduction!r}")
    label_smoothing = check_real(label_smoothing, "label_smoothing", "cross_entropy", at_least=0, at_most=1)
    ignore_index = check_int(ignore_index, "ignore_index", "cross_entropy")
    if logits.ndim == 0:
        raise ValueError("cross_entropy: input must have a class dimension, got a 0-d input")
    class_dim = 0 if logits.ndim == 1 else 1
    c = logits.shape[class_dim]

    def check_classes(ids):  # where the targets are: on the host before their copy, else on the device
        if ids.dtype.kind not in "iu":
            raise TypeError(f"cross_entropy: target must hold integer class indices (or be a floating array of "
                            f"class probabilities of the input's shape), got dtype {ids.dtype}")
        check_index_range(ids, c, lambda lo, hi: IndexError(
            f"cross_entropy: target class indices must be in [0, {c - 1}] (C={c}) or ignore_index={ignore_index}, "
            f"got min {lo} and max {hi}"), skip=ignore_index)
        if reduction == "mean" and ids.size:
            deferred.defer(_every_target_ignored(ignore_index), (ids != ignore_index).sum())

    expected = logits.shape[:class_dim] + logits.shape[class_dim + 1:]
    probabilities = is_probability_target(target)
    if probabilities:
        tgt = probability_target(target, logits)
    else:
        tgt = on_device_of(target, logits, "target", "cross_entropy", check=check_classes)
        if tuple(tgt.shape) != tuple(expected):
            raise ValueError(f"cross_entropy: target shape must be {tuple(expected)} for input shape "
                             f"{tuple(logits.shape)}, got {tuple(tgt.shape)}")
    if weight is not None:
        if tuple(check_tensor("weight", weight, "cross_entropy").shape) != (c,):
            raise ValueError(f"cross_entropy: weight must have shape ({c},), got {tuple(weight.shape)}")
        if isinstance(weight, Tensor) and weight.requires_grad and is_grad_enabled():
            raise RuntimeError("cross_entropy: weight requires grad, but the class weights are constants and get "
                             "no gradient (torch refuses them too); pass weight.detach()")
        if isinstance(weight, Tensor) and forward_ad.unpack_dual(weight).tangent is not None:
            raise RuntimeError("cross_entropy: weight carries a tangent (forward mode), but the class weights are "
                               "constants and get none; pass forward_ad.unpack_dual(weight).primal")
        if not isinstance(weight, Tensor):  # a plain array of class weights follows the logits
            weight = on_device_of(weight, logits, "weight", "cross_entropy").astype(logits.dtype, copy=False)
    if reduction == "mean" and prod(expected) == 0:
        raise ValueError(f"cross_entropy: no targets (input shape {tuple(logits.shape)}), so the mean is "
                         "undefined; skip empty batches or use reduction='sum'")
    x = classes_last(tensor_of(input))       # (M, C)
    if probabilities:
        loss = probability_cross_entropy(log_softmax(x, dim=1), classes_last(tgt), weight, label_smoothing, reduction)
        return loss.reshape(expected) if reduction == "none" else loss
    weights = None if weight is None else data_of(weight)
    safe_target, valid, divisor = raw_computation(_class_targets, tgt, ignore_index, weights, reduction, logits.dtype)
    loss = CrossEntropyFunction.apply(x, weight, safe_target=safe_target, valid=valid, divisor=divisor,
                                      reduction=reduction, label_smoothing=label_smoothing)
    return loss.reshape(tgt.shape) if reduction == "none" else loss


from . import cuda  # noqa: E402,F401  (registers the CUDA kernels)
