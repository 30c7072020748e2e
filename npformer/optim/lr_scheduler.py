"""Learning-rate schedulers with torch's protocol: construct after the optimizer (this sets the
first lr), call `scheduler.step()` after each `optimizer.step()`, read `get_last_lr()`.

`last_epoch` counts the optimizer steps taken so far; the lr in force for the next step is
`base_lr * factor(last_epoch)`, where base_lr is each group's 'initial_lr': as in torch, the
first scheduler made on the optimizer sets it to the group's lr then, and a later one (or one
made after `optimizer.load_state_dict`) keeps it. The lrs are Python floats.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from autograd.checks import check_int, check_real, is_integer, is_real

from .optimizer import Optimizer


class LambdaLR:
    """lr of group i = base_lr_i * lr_lambda(last_epoch), like torch.optim.lr_scheduler.LambdaLR.

    Constructing it sets the first lr (step 0). last_epoch=-1 starts fresh; another value resumes
    and needs 'initial_lr' in every group (KeyError otherwise; load a state_dict instead).
    TypeError for an optimizer without param_groups or an lr_lambda that is not callable.
    """

    def __init__(self, optimizer: Optimizer, lr_lambda: Callable[[int], float], last_epoch: int = -1):
        if not hasattr(optimizer, "param_groups"):
            raise TypeError(f"optimizer: expected an Optimizer, got {type(optimizer).__name__}")
        if not callable(lr_lambda):
            raise TypeError(f"{type(self).__name__}: lr_lambda must be a callable, got {type(lr_lambda).__name__}")
        last_epoch = check_int(last_epoch, "last_epoch", type(self).__name__, at_least=-1)
        self.optimizer = optimizer
        self.lr_lambda = lr_lambda
        for group in optimizer.param_groups:
            if last_epoch == -1:
                group.setdefault("initial_lr", group["lr"])
            elif "initial_lr" not in group:
                raise KeyError("last_epoch: resuming (last_epoch != -1) needs 'initial_lr' in every "
                               "param group; load the scheduler's state_dict instead")
        self.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
        self.last_epoch = last_epoch
        self.step()

    def get_lr(self) -> list[float]:
        """The lr of each group for the current `last_epoch` (computed, not read from the groups)."""
        factor = self.lr_lambda(self.last_epoch)
        return [base * factor for base in self.base_lrs]

    def step(self) -> None:
        """Advance one optimizer step and set every group's lr."""
        self.last_epoch += 1
        self._last_lr = [float(lr) for lr in self.get_lr()]  # a numpy factor would make the lr numpy
        for group, lr in zip(self.optimizer.param_groups, self._last_lr):
            group["lr"] = lr

    def get_last_lr(self) -> list[float]:
        """The lr of each group set by the last `step()` (the one the next optimizer step uses)."""
        return list(self._last_lr)

    def state_dict(self) -> dict[str, Any]:
        """{"last_epoch", "base_lrs", "last_lr"}: plain numbers, for checkpoints."""
        return {"last_epoch": self.last_epoch, "base_lrs": list(self.base_lrs), "last_lr": list(self._last_lr)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore last_epoch, base_lrs and last_lr (and set every group's lr). Everything is
        checked first (ValueError or TypeError); a failed load changes nothing."""
        self.prepare_load_state_dict(state_dict)()

    def prepare_load_state_dict(self, state_dict: dict[str, Any]) -> Callable[[], None]:
        """Check `state_dict` as load_state_dict does, changing nothing; returns a function
        that loads it (it cannot fail)."""
        keys = {"last_epoch", "base_lrs", "last_lr"}
        if not isinstance(state_dict, dict) or set(state_dict) != keys:
            got = sorted(map(str, state_dict)) if isinstance(state_dict, dict) else type(state_dict).__name__
            raise ValueError(f"state_dict: expected a dict with the keys {sorted(keys)}, got {got}")
        last_epoch = state_dict["last_epoch"]
        if not is_integer(last_epoch) or last_epoch < -1:
            raise TypeError(f"state_dict: last_epoch must be an int >= -1, got {last_epoch!r}")
        last_epoch = int(last_epoch)
        lrs = {}
        for key in ("base_lrs", "last_lr"):
            values = state_dict[key]
            if not isinstance(values, (list, tuple)) or not all(_is_lr(v) for v in values):
                raise TypeError(f"state_dict: {key} must be a list of finite numbers >= 0, got {values!r}")
            if len(values) != len(self.base_lrs):
                raise ValueError(f"state_dict: {len(values)} {key} for {len(self.base_lrs)} parameter groups")
            lrs[key] = [float(v) for v in values]

        def load():
            self.last_epoch, self.base_lrs, self._last_lr = last_epoch, lrs["base_lrs"], lrs["last_lr"]
            for group, base, lr in zip(self.optimizer.param_groups, self.base_lrs, self._last_lr):
                group["initial_lr"], group["lr"] = base, lr

        return load


def _is_lr(value):
    return is_real(value) and math.isfinite(value) and value >= 0


def noam_factor(step: int, d_model: int, warmup_steps: int) -> float:
    """The paper's schedule at 1-based `step`: d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)."""
    return d_model ** -0.5 * min(step ** -0.5, step * warmup_steps ** -1.5)


class NoamLR(LambdaLR):
    """"Attention Is All You Need" warmup: lr = base_lr * noam_factor(last_epoch + 1).

    The optimizer's lr multiplies the paper's formula: lr=1.0 gives the paper's schedule
    (with Adam betas (0.9, 0.98), eps 1e-9); a larger lr scales it. The peak, at
    step = warmup_steps, is base_lr * (d_model * warmup_steps)^-0.5. TypeError / ValueError
    unless d_model and warmup_steps are integers >= 1.
    """

    def __init__(self, optimizer: Optimizer, d_model: int, warmup_steps: int = 4000, last_epoch: int = -1):
        d_model = check_int(d_model, "d_model", "NoamLR", at_least=1)
        warmup_steps = check_int(warmup_steps, "warmup_steps", "NoamLR", at_least=1)
        self.d_model, self.warmup_steps = d_model, warmup_steps
        super().__init__(optimizer, lambda epoch: noam_factor(epoch + 1, d_model, warmup_steps), last_epoch)


def warmup_cosine_factor(step: int, warmup_steps: int, total_steps: int, min_ratio: float = 0.0) -> float:
    """Linear warmup to 1 over `warmup_steps` (1-based `step`), then a half cosine down to
    `min_ratio` at `total_steps`, constant after."""
    if step <= warmup_steps:
        return step / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class WarmupCosineLR(LambdaLR):
    """lr = base_lr * warmup_cosine_factor(last_epoch + 1, warmup_steps, total_steps, min_ratio):
    linear warmup, then a half cosine to min_ratio * base_lr at total_steps (nanoGPT's schedule;
    torch composes LinearLR and CosineAnnealingLR for it). ValueError when total_steps < warmup_steps.
    """

    def __init__(self, optimizer: Optimizer, warmup_steps: int, total_steps: int, min_ratio: float = 0.0,
                 last_epoch: int = -1):
        warmup_steps = check_int(warmup_steps, "warmup_steps", "WarmupCosineLR", at_least=0)
        total_steps = check_int(total_steps, "total_steps", "WarmupCosineLR", at_least=1)
        if total_steps < warmup_steps:
            raise ValueError(f"WarmupCosineLR: total_steps must be >= warmup_steps={warmup_steps}, got {total_steps}")
        min_ratio = check_real(min_ratio, "min_ratio", "WarmupCosineLR", at_least=0, at_most=1)
        self.warmup_steps, self.total_steps, self.min_ratio = warmup_steps, total_steps, min_ratio
        super().__init__(optimizer, lambda epoch: warmup_cosine_factor(epoch + 1, warmup_steps, total_steps,
                                                                       min_ratio), last_epoch)
