"""Gradient clipping by the global norm, as torch.nn.utils.clip_grad_norm_."""
import math

from autograd import backend
from autograd.checks import check_real


def _parameters_with_grad(parameters):
    if hasattr(parameters, "data") and hasattr(parameters, "grad"):
        parameters = [parameters]
    return [p for p in parameters if p.grad is not None]


def grad_norm(parameters, norm_type=2.0):
    """The norm of all gradients together, as if concatenated into one vector (a Python float):
    `(sum_p ||g_p||^q)^(1/q)`, or `max |g|` for norm_type=inf. 0.0 when no gradient exists;
    inf when the sum of powers overflows (as torch)."""
    norm_type = check_real(norm_type, "norm_type", "grad_norm", above=0, finite=False)
    grads = [p.grad for p in _parameters_with_grad(parameters)]
    if not grads:
        return 0.0
    by_device = {}
    for g in grads:
        by_device.setdefault(backend.device_of(g), []).append(g)
    per_param = []
    for group in by_device.values():  # one host transfer per device
        xp = backend.get_array_module(group[0])
        if norm_type == math.inf:
            norms = xp.stack([xp.abs(g).max() for g in group])
        else:
            norms = xp.stack([xp.linalg.norm(g.ravel(), ord=norm_type) for g in group])
        per_param.extend(float(n) for n in norms.tolist())
    if norm_type == math.inf:
        return max(per_param)
    try:
        return math.fsum(n ** norm_type for n in per_param) ** (1.0 / norm_type)
    except OverflowError:  # the sum of powers passes float's range (e.g. float64 gradients of 1e154):
        return math.inf    # inf, as torch's norm of the per-parameter norms gives


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False):
    """Scale every gradient in place by `max_norm / (total_norm + 1e-6)` when that is below 1.

    parameters: an iterable of parameters (or one); those without `.grad` are skipped.
    Returns the total norm before clipping (a Python float), computed as in `grad_norm`.
    A non-finite total norm raises RuntimeError with error_if_nonfinite=True; otherwise the
    gradients are left unchanged (torch would scale them into NaN) and the norm is returned.
    """
    max_norm = check_real(max_norm, "max_norm", "clip_grad_norm_", at_least=0, finite=False)
    params = _parameters_with_grad(parameters)
    total = grad_norm(params, norm_type)
    if not math.isfinite(total):
        if error_if_nonfinite:
            raise RuntimeError(f"clip_grad_norm_: the total gradient norm of order {norm_type} is {total}")
        return total  # unlike torch, leave the gradients as they are instead of making them NaN
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:
        for p in params:
            p.grad *= coef
    return total
