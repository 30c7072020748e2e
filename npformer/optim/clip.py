"""Gradient clipping by the global norm, as torch.nn.utils.clip_grad_norm_."""
from __future__ import annotations

import math
import sys
from collections.abc import Iterable

from autograd import Tensor, backend
from autograd.checks import check_real


def _parameters_with_grad(parameters):
    if hasattr(parameters, "data") and hasattr(parameters, "grad"):
        parameters = [parameters]
    return [p for p in parameters if p.grad is not None]


LOG_MAX = math.log(sys.float_info.max)


def total_norm(grads, norm_type=2.0):
    """The norm of the arrays `grads` (all on one device) together, as if concatenated into one
    vector: a 0-d float64 array on their device, computed there (no host round trip):
    `(sum_p ||g_p||^q)^(1/q)`, or `max |g|` for norm_type=inf. As torch's: inf when the sum of the
    q-th powers overflows (it is summed scaled by the largest norm, so nothing warns). Empty
    gradients count for nothing (0 when all are: torch has no inf norm of an empty tensor)."""
    xp = backend.get_array_module(grads[0])
    grads = [g for g in grads if g.size]
    if not grads:
        return xp.zeros((), dtype="float64")
    if norm_type == math.inf:
        return xp.stack([xp.abs(g).max() for g in grads]).astype("float64").max()
    norms = xp.stack([xp.linalg.norm(g.ravel(), ord=norm_type) for g in grads]).astype("float64")
    largest = norms.max()
    usable = xp.isfinite(largest) & (largest > 0)                # else the result is largest: 0, inf or NaN
    scale = xp.where(usable, largest, 1.0)
    powers = ((norms / scale) ** norm_type).sum()                # in [1, number of gradients]
    total = scale * powers ** (1.0 / norm_type)
    overflows = norm_type * xp.log(scale) + xp.log(xp.where(powers > 0, powers, 1.0)) > LOG_MAX
    return xp.where(usable, xp.where(overflows, math.inf, total), largest)


def grad_norm(parameters: Tensor | Iterable[Tensor], norm_type: float = 2.0) -> float:
    """The norm of all gradients together, as if concatenated into one vector (a Python float, so
    read on the host): `(sum_p ||g_p||^q)^(1/q)`, or `max |g|` for norm_type=inf. 0.0 when no
    gradient exists; inf when the sum of powers overflows (as torch)."""
    norm_type = check_real(norm_type, "norm_type", "grad_norm", above=0, finite=False)
    grads = [p.grad.data for p in _parameters_with_grad(parameters)]
    if not grads:
        return 0.0
    by_device = {}
    for g in grads:
        by_device.setdefault(backend.device_of(g), []).append(g)
    per_device = [float(total_norm(group, norm_type)) for group in by_device.values()]  # one read per device
    if norm_type == math.inf:
        return max(per_device)
    try:
        return math.fsum(n ** norm_type for n in per_device) ** (1.0 / norm_type)
    except OverflowError:  # gradients on several devices whose sum of powers passes float's range
        return math.inf


def clip_grad_norm_(parameters: Tensor | Iterable[Tensor], max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> Tensor:
    """Scale every gradient in place by `min(1, max_norm / (total_norm + 1e-6))`, like torch.

    parameters: an iterable of parameters (or one); those without `.grad` are skipped.
    Returns the total norm before clipping as a 0-d float64 Tensor on the gradients' device (like
    torch; `float(...)` reads it): it is computed and applied on the device, so clipping does not
    wait for the GPU (and can be captured in a CUDA graph). A non-finite total norm raises
    RuntimeError with error_if_nonfinite=True (which reads it on the host); otherwise the
    gradients are left unchanged (torch would scale them into NaN) and the norm is returned.
    """
    max_norm = check_real(max_norm, "max_norm", "clip_grad_norm_", at_least=0, finite=False)
    norm_type = check_real(norm_type, "norm_type", "clip_grad_norm_", above=0, finite=False)
    params = _parameters_with_grad(parameters)
    if not params:
        return Tensor(backend.module_for("cpu").zeros((), dtype="float64"))
    devices = {p.grad.device for p in params}
    if len(devices) > 1:
        raise RuntimeError(f"clip_grad_norm_: the gradients are on several devices {sorted(devices)}; clip each "
                           "device's parameters on their own")
    xp = params[0].grad.xp
    total = total_norm([p.grad.data for p in params], norm_type)
    if error_if_nonfinite and not bool(xp.isfinite(total)):
        raise RuntimeError(f"clip_grad_norm_: the total gradient norm of order {norm_type} is {float(total)}")
    # coef = min(1, max_norm / (total + 1e-6)); a non-finite total leaves the gradients as they are
    coef = xp.where(xp.isfinite(total), xp.minimum(max_norm / (total + 1e-6), 1.0), 1.0)
    for p in params:
        p.grad.data *= coef.astype(p.grad.dtype)
        p.grad.bump_version()  # in case an op saved this gradient
    return Tensor(total)
