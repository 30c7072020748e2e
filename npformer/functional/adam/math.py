"""Adam's update of one parameter, entry by entry, on `xp` (torch.optim's functional Adam,
`torch.optim._functional.adam`): the formula that `optim.Adam` and `optim.AdamW` step with."""
from typing import NamedTuple


class AdamSettings(NamedTuple):
    """The scalars of one Adam step: hyperparameters, the variant ("plain", "l2": Adam's coupled
    weight decay, "decoupled": AdamW's) and the step-dependent step_size = lr / (1 - beta1^t),
    bias_correction2_sqrt = sqrt(1 - beta2^t), decay = 1 - lr * weight_decay."""
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float
    eps: float
    weight_decay: float
    variant: str
    step_size: float
    bias_correction2_sqrt: float
    decay: float

    @property
    def step_scalars(self):
        """(step_size, bias_correction2_sqrt, decay): what changes from step to step, and what a
        captured step reads from device memory instead (see adam_update's `replayed`)."""
        return self.step_size, self.bias_correction2_sqrt, self.decay


def adam_update(xp, param, grad, exp_avg, exp_avg_sq, scratch, settings, replayed=None):
    """One Adam/AdamW step of one parameter in place (param, exp_avg = m, exp_avg_sq = v; scratch: a
    temporary of the parameter's shape), lines m, v and theta of the paper's Algorithm 1 with the
    arithmetic of torch.optim.Adam. replayed: None, or (under graph capture) a float64 device
    array (3,) holding settings.step_scalars, rewritten before each replay, which then replace them."""
    s, g, m, v, tmp = settings, grad, exp_avg, exp_avg_sq, scratch
    step_size, bias_correction2_sqrt, decay = s.step_scalars
    if replayed is not None:  # read on the device, in the parameter's dtype (as a float argument would be)
        step_size, bias_correction2_sqrt, decay = (replayed[i:i + 1].astype(param.dtype) for i in range(3))
    if s.variant == "decoupled":
        # AdamW: p = p * (1 - lr * weight_decay), before the Adam step
        param *= decay
    elif s.variant == "l2":
        # Adam: g = grad + weight_decay * p (a new array: grad itself is not touched)
        g = g + s.weight_decay * param
    # m = beta1 * m + (1 - beta1) * g, computed as lerp(m, g, 1 - beta1) = m + (1 - beta1) * (g - m)
    xp.subtract(g, m, out=tmp)
    tmp *= s.one_minus_beta1
    m += tmp
    # v = beta2 * v + (1 - beta2) * g * g
    v *= s.beta2
    xp.multiply(g, s.one_minus_beta2, out=tmp)
    tmp *= g
    v += tmp
    # p -= lr * m_hat / (sqrt(v_hat) + eps), with m_hat = m / (1 - beta1^t) and v_hat = v / (1 - beta2^t):
    # denom = sqrt(v) / sqrt(1 - beta2^t) + eps
    xp.sqrt(v, out=tmp)
    tmp /= bias_correction2_sqrt
    tmp += s.eps
    # p -= lr / (1 - beta1^t) * m / denom
    xp.divide(m, tmp, out=tmp)
    tmp *= step_size
    param -= tmp
