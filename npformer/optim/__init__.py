"""Optimizers, gradient clipping and learning-rate schedulers (torch.optim's protocol), and
`weight_decay_groups` (nanoGPT's parameter groups: decay on matrices only).

Updates run in place on each parameter's `.data` with its own array module (numpy, cupy),
in its own dtype.
"""
from .clip import clip_grad_norm_, grad_norm
from .groups import weight_decay_groups
from .lr_scheduler import LambdaLR, NoamLR, WarmupCosineLR, noam_factor, warmup_cosine_factor
from .optimizer import SGD, Adam, AdamW, Optimizer

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "clip_grad_norm_", "grad_norm",
           "LambdaLR", "NoamLR", "WarmupCosineLR", "noam_factor", "warmup_cosine_factor", "weight_decay_groups"]
