"""A forward pass cut into named steps, to derive its backward one line at a time.

Each step computes one named value from the earlier ones, on the engine's Tensors (autograd's
operators and npformer.functional). One run records every intermediate's gradient: autograd's
backward, kept with retain_grad. Re-running only the steps after one value, with that value
perturbed, gives its gradient by central differences. `ForwardSteps.compare` judges a
hand-derived gradient against both in one printed line (backprop ninja's cmp()).

    steps = ForwardSteps({"x": x}, {"y": lambda a: F.softmax(a["x"])})
    dy = steps.upstream                     # the random upstream gradient the output is contracted with
    steps.compare("x", y * (dy - (y * dy).sum(-1, keepdims=True)))   # prints: dx  exact ...
"""
from collections.abc import Callable, Sequence
from typing import TextIO

import numpy as np

from autograd import Tensor, no_grad
from autograd.gradcheck import numeric_gradient

from .checker import GradientResult, compare

Step = Callable[[dict], Tensor]


class ForwardSteps:
    """inputs: name -> array (the leaves, as float64); steps: name -> a function of the values so
    far ({name: Tensor}) that returns the next value as a Tensor, in order; the last step is the
    output. upstream: dL/d(output), the gradient the output is contracted with, L = sum(output *
    upstream); None draws a standard normal one (seed), since a plain sum() hides mistakes (a
    softmax's gradient of sum() is zero). After construction: `values` and `grads` ({name:
    numpy array}, every input and step; a value no gradient reaches has zeros)."""

    def __init__(self, inputs: dict[str, object], steps: dict[str, Step], upstream: object = None, seed: int = 0):
        if not inputs or not steps:
            raise ValueError(f"ForwardSteps: expected at least one input and one step, got {len(inputs)} "
                             f"inputs and {len(steps)} steps")
        clash = sorted(set(inputs) & set(steps))
        if clash:
            raise ValueError(f"ForwardSteps: names must be unique, {clash} name both an input and a step")
        self.steps = dict(steps)
        self.inputs = list(inputs)
        self.order = self.inputs + list(steps)
        values = {name: Tensor(np.array(a, dtype=np.float64), requires_grad=True) for name, a in inputs.items()}
        for name, step in self.steps.items():
            values[name] = self._step(name, values).retain_grad()
        out = values[self.order[-1]]
        self.upstream = np.random.default_rng(seed).standard_normal(out.shape) if upstream is None \
            else np.asarray(upstream, dtype=np.float64)
        if self.upstream.shape != out.shape:
            raise ValueError(f"ForwardSteps: upstream must have the output's shape {out.shape}, got "
                             f"{self.upstream.shape}")
        out.backward(self.upstream.copy())
        self.values = {name: t.numpy() for name, t in values.items()}
        self.grads = {name: np.zeros(t.shape) if t.grad is None else np.asarray(t.grad) for name, t in values.items()}

    def _step(self, name, values):
        value = self.steps[name](values)
        if not isinstance(value, Tensor):
            raise TypeError(f"ForwardSteps: step {name!r} must return a Tensor, got {type(value).__name__}")
        return value

    def loss(self, values: dict[str, Tensor]) -> float:
        """L = sum(output * upstream) for the values given, recomputing every step not among them."""
        values = dict(values)
        with no_grad():
            for name in self.steps:
                if name not in values:
                    values[name] = self._step(name, values)
        return float((values[self.order[-1]].numpy() * self.upstream).sum())

    def numeric(self, name: str) -> np.ndarray:
        """dL/d(name) by float64 central differences: the inputs and the values up to `name`
        held, `name` perturbed entry by entry, the steps after it rerun."""
        held = dict.fromkeys(self.inputs + self.order[:self._index(name) + 1])
        values = {n: Tensor(self.values[n].copy()) for n in held}
        return np.asarray(numeric_gradient(lambda: self.loss(values), values[name]))

    def compare(self, name: str, mine: object, axes: Sequence[str] | None = None,
                stream: TextIO | None = None) -> GradientResult:
        """Judge your dL/d(name) against the engine's and the finite differences: prints one line
        (d<name>, exact / close / wrong, the largest differences) and returns the GradientResult."""
        self._index(name)
        return compare(f"d{name}", mine, self.grads[name], self.numeric(name), axes=axes, stream=stream)

    def _index(self, name):
        if name not in self.order:
            raise KeyError(f"ForwardSteps: no value {name!r}; the values are {', '.join(self.order)}")
        return self.order.index(name)
