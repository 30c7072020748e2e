"""Parameter initialisers (torch.nn.init), drawing from the tensor's device generator.

Each fills `tensor.data` in place (the Tensor object is kept, so optimizers holding it see
the new values) and returns the tensor. Random numbers come from `generator` when given,
else from `npformer.runtime.random.global_rng(tensor.device)` (seed with `npformer.manual_seed`).
Draws are made in float64 and cast to the tensor's dtype.
"""
from __future__ import annotations

import math
from typing import Any

from autograd import Tensor
from autograd.checks import check_real
from npformer.runtime import random

__all__ = ["uniform_", "normal_", "constant_", "zeros_", "ones_", "xavier_uniform_", "kaiming_uniform_",
           "calculate_fan_in_and_fan_out"]

Generator = Any  # a numpy.random.Generator (or CuPy's) on the tensor's device


def _generator(tensor, generator):
    return generator if generator is not None else random.global_rng(tensor.device)


def _fill(tensor, values):
    tensor.data = values.astype(tensor.dtype, copy=False)
    tensor.bump_version()
    return tensor


def calculate_fan_in_and_fan_out(tensor: Tensor) -> tuple[int, int]:
    """(fan_in, fan_out) of a weight shaped [out, in, *receptive field] (torch's rule); ValueError
    for fewer than 2 dimensions."""
    if tensor.ndim < 2:
        raise ValueError(f"fan in and fan out need a tensor with at least 2 dimensions, got shape {tensor.shape}")
    receptive = math.prod(tensor.shape[2:])
    return tensor.shape[1] * receptive, tensor.shape[0] * receptive


def uniform_(tensor: Tensor, a: float = 0.0, b: float = 1.0, generator: Generator | None = None) -> Tensor:
    """Fill with U(a, b); torch.nn.init.uniform_."""
    a, b = check_real(a, "a", "uniform_"), check_real(b, "b", "uniform_")
    return _fill(tensor, _generator(tensor, generator).uniform(a, b, size=tensor.shape))


def normal_(tensor: Tensor, mean: float = 0.0, std: float = 1.0, generator: Generator | None = None) -> Tensor:
    """Fill with N(mean, std^2); torch.nn.init.normal_. ValueError for std < 0."""
    mean, std = check_real(mean, "mean", "normal_"), check_real(std, "std", "normal_", at_least=0)
    return _fill(tensor, _generator(tensor, generator).standard_normal(tensor.shape) * std + mean)


def constant_(tensor: Tensor, value: float) -> Tensor:
    """Fill with `value` (inf and NaN allowed); torch.nn.init.constant_."""
    value = check_real(value, "value", "constant_", finite=False)
    return _fill(tensor, tensor.xp.full(tensor.shape, value, dtype=tensor.dtype))


def zeros_(tensor: Tensor) -> Tensor:
    """Fill with 0; torch.nn.init.zeros_."""
    return constant_(tensor, 0.0)


def ones_(tensor: Tensor) -> Tensor:
    """Fill with 1; torch.nn.init.ones_."""
    return constant_(tensor, 1.0)


def xavier_uniform_(tensor: Tensor, gain: float = 1.0, generator: Generator | None = None) -> Tensor:
    """U(-a, a) with a = gain * sqrt(6 / (fan_in + fan_out)) (Glorot & Bengio 2010);
    torch.nn.init.xavier_uniform_ (nn.Transformer's initialisation)."""
    fan_in, fan_out = calculate_fan_in_and_fan_out(tensor)
    bound = check_real(gain, "gain", "xavier_uniform_") * math.sqrt(6.0 / (fan_in + fan_out))
    return uniform_(tensor, -bound, bound, generator)


def xavier_normal_(tensor: Tensor, gain: float = 1.0, generator: Generator | None = None) -> Tensor:
    """N(0, std^2) with std = gain * sqrt(2 / (fan_in + fan_out)) (Glorot & Bengio 2010)."""
    fan_in, fan_out = calculate_fan_in_and_fan_out(tensor)
    return normal_(tensor, 0.0, gain * math.sqrt(2.0 / (fan_in + fan_out)), generator)


def kaiming_uniform_(tensor: Tensor, a: float = 0.0, generator: Generator | None = None) -> Tensor:
    """U(-b, b) with b = sqrt(6 / ((1 + a^2) fan_in)) (leaky-ReLU gain, fan_in mode).
    torch's Linear uses a = sqrt(5), i.e. b = 1 / sqrt(fan_in)."""
    fan_in, _ = calculate_fan_in_and_fan_out(tensor)
    a = check_real(a, "a", "kaiming_uniform_")
    bound = math.sqrt(6.0 / ((1.0 + a * a) * fan_in))
    return uniform_(tensor, -bound, bound, generator)
