"""Named hook points: every intermediate of a Transformer by name, as TransformerLens names them.

A `HookPoint` is an identity module placed on one intermediate of a layer (a residual stream,
an attention pattern, an MLP hidden...). Its name is its owner's module path plus its attribute,
e.g. 'encoder.layers.0.self_attn.hook_pattern'; docs/hook_points.md lists every name, its shape
and what it is, for each model kind, and `hook_point_names(model)` lists a model's.

    logits, cache = model.run_with_cache(ids, loss_fn=lambda logits: F.cross_entropy(...))
    cache["encoder.layers.0.self_attn.hook_pattern"]          # P, a Tensor (B, H, T, S)
    cache.grad("encoder.layers.0.self_attn.hook_pattern")     # dL/dP, a Tensor (or cache[name + "_grad"])
    logits = model.run_with_hooks(ids, fwd_hooks=[(name, fn)], bwd_hooks=[(name, fn)])

A forward hook is `fn(activation, hook)` (hook: the HookPoint; hook.name its name) returning
None (keep the activation) or a Tensor that replaces it downstream (activation patching); a
backward hook is `fn(grad, hook)` on the gradient arriving at the activation (a Tensor),
returning None or a replacement gradient. Hooks are the model's state (not per thread, like
torch's module hooks): every thread calling the model meanwhile runs them.

Cost: a module with hook points runs its usual code unless one of its own hook points has a
hook (one flag, `hooks_active`, checked per call); only then does it run the hooked code, which
calls every hook point. An attention module computes its scores, P and dropped P as separate
differentiable ops (nodes of the graph) only while one of those three hook points has a hook;
otherwise the fused F.scaled_dot_product_attention runs as always.

The hook points are plain attributes, not registered submodules: state_dict, parameters, repr
and `.to()` are those of the model without them.
"""
from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from autograd import Tensor, is_grad_enabled
from npformer.runtime import record

from .module import Module


def _replacement(value, like, point, direction):
    """A hook's returned value as the Tensor that replaces `like`: TypeError unless a Tensor of
    like's shape (a hook that changes shapes would break the layers after it)."""
    if not isinstance(value, Tensor):
        raise TypeError(f"{direction} hook at {point.name!r} returned {type(value).__name__}; expected None or "
                        f"an autograd.Tensor of shape {like.shape}")
    if value.shape != like.shape:
        raise ValueError(f"{direction} hook at {point.name!r} returned shape {value.shape}; expected {like.shape}")
    return value


class _GradientHook:
    """A backward hook fn(grad, hook) of `point` as Tensor.register_hook's hook(grad)."""

    def __init__(self, fn, point):
        self.fn, self.point = fn, point

    def __call__(self, grad):
        replaced = self.fn(grad, hook=self.point)
        return None if replaced is None else _replacement(replaced, grad, self.point, "backward")


class HookPointHandle:
    """What `HookPoint.add_hook` returns: `remove()` takes that hook off (again: nothing)."""

    def __init__(self, point: HookPoint, fn: Callable, direction: str):
        self.point, self.fn, self.direction = point, fn, direction

    def remove(self) -> None:
        hooks = self.point.fwd_hooks if self.direction == "fwd" else self.point.bwd_hooks
        if self.fn in hooks:
            hooks.remove(self.fn)
            self.point.owner_changed()


class HookPoint(Module):
    """An identity module on one named intermediate (TransformerLens's HookPoint).

    `add_hook(fn, dir="fwd")`: fn(activation, hook) runs when the activation is computed and may
    return a replacement; `add_hook(fn, dir="bwd")`: fn(grad, hook) runs when its gradient
    arrives in a backward pass and may return a replacement. `remove_hooks()` takes them off.
    `name`: its full name in the model (set by hook_points(model); None before), `owner`: the
    module it belongs to."""

    def __init__(self, owner: Module | None = None, name: str | None = None):
        super().__init__()
        object.__setattr__(self, "owner", owner)  # not a submodule: the owner holds this one, not the reverse
        self.name = name
        self.fwd_hooks: list[Callable] = []
        self.bwd_hooks: list[Callable] = []

    @property
    def active(self) -> bool:
        """Whether a hook is on this point."""
        return bool(self.fwd_hooks or self.bwd_hooks)

    def add_hook(self, fn: Callable, dir: str = "fwd") -> HookPointHandle:
        """Add fn(activation, hook) (dir="fwd") or fn(grad, hook) (dir="bwd"); returns its handle."""
        if not callable(fn):
            raise TypeError(f"HookPoint.add_hook: fn must be callable, got {type(fn).__name__}")
        if dir not in ("fwd", "bwd"):
            raise ValueError(f"HookPoint.add_hook: dir must be 'fwd' or 'bwd', got {dir!r}")
        (self.fwd_hooks if dir == "fwd" else self.bwd_hooks).append(fn)
        record.note_hook_registered(f"a hook on the hook point {self.name!r}" if self.name else
                                    f"a hook on a hook point of a {type(self.owner).__name__}")
        self.owner_changed()
        return HookPointHandle(self, fn, dir)

    def remove_hooks(self, dir: str = "both") -> None:
        """Take off the forward ("fwd"), backward ("bwd") or all ("both") hooks."""
        if dir not in ("fwd", "bwd", "both"):
            raise ValueError(f"HookPoint.remove_hooks: dir must be 'fwd', 'bwd' or 'both', got {dir!r}")
        if dir in ("fwd", "both"):
            self.fwd_hooks.clear()
        if dir in ("bwd", "both"):
            self.bwd_hooks.clear()
        self.owner_changed()

    def owner_changed(self) -> None:
        """Set the owner's `hooks_active` flag: whether any of its hook points has a hook."""
        if self.owner is not None:
            owner = self.owner
            owner.hooks_active = any(getattr(owner, name).active for name in owner.hook_point_attributes)

    def forward(self, x: Tensor) -> Tensor:
        """x through the forward hooks (each may replace it); the backward hooks go onto x's
        gradient (Tensor.register_hook: bound to this graph, they run in its backward pass)."""
        for fn in self.fwd_hooks:
            replaced = fn(x, hook=self)
            if replaced is not None:
                x = _replacement(replaced, x, self, "forward")
        if self.bwd_hooks and x.requires_grad and is_grad_enabled():
            if x.creator is None:  # a leaf would keep its hooks for every later pass: hook a node of this graph
                x = x.reshape(x.shape)
            for fn in self.bwd_hooks:
                x.register_hook(_GradientHook(fn, self))
        return x

    def extra_repr(self) -> str:
        return repr(self.name) if self.name else ""


def add_hook_points(module: Module, *names: str) -> None:
    """Give `module` a HookPoint at each attribute of `names` (outside its registries: no state,
    no repr), `hook_point_attributes` = names and `hooks_active` = False."""
    for name in names:
        object.__setattr__(module, name, HookPoint(module))
    object.__setattr__(module, "hook_point_attributes", tuple(names))
    object.__setattr__(module, "hooks_active", False)


def hook_points(model: Module) -> dict[str, HookPoint]:
    """{name: HookPoint} of every hook point in `model`, in the order of model.named_modules()
    (each module's in the order it declares them); names are the owner's module path plus the
    attribute ('transformer.decoder.layers.1.multihead_attn.hook_pattern'). Sets each point's
    `name`."""
    if not isinstance(model, Module):
        raise TypeError(f"hook_points: model must be an npformer.nn.Module, got {type(model).__name__}")
    points = {}
    for path, module in model.named_modules():
        for attribute in getattr(module, "hook_point_attributes", ()):
            name = f"{path}.{attribute}" if path else attribute
            point = getattr(module, attribute)
            point.name = name
            points[name] = point
    return points


def hook_point_names(model: Module) -> list[str]:
    """The names of every hook point of `model` (see hook_points; docs/hook_points.md lists them)."""
    return list(hook_points(model))


def _name_error(name, points, what="hook point"):
    close = difflib.get_close_matches(name, list(points), n=5, cutoff=0.6)
    hint = f"; close names: {close}" if close else ""
    return KeyError(f"no {what} named {name!r}{hint} (model.hook_point_names() lists all {len(points)}; "
                    f"see docs/hook_points.md)")


def select_points(points: dict[str, HookPoint], selector: str | Iterable[str] | Callable[[str], bool] | None,
                  argument: str = "name") -> list[HookPoint]:
    """The hook points of `points` that `selector` picks: None (all), a name, a list of names
    or a function name -> bool. KeyError naming close names for a name that is not there."""
    if selector is None:
        return list(points.values())
    if isinstance(selector, str):
        if selector not in points:
            raise _name_error(selector, points)
        return [points[selector]]
    if callable(selector):
        return [point for name, point in points.items() if selector(name)]
    if isinstance(selector, Iterable):
        selected = []
        for name in selector:
            if not isinstance(name, str):
                raise TypeError(f"{argument}: expected names (str), got {type(name).__name__} in the list")
            selected.extend(select_points(points, name, argument))
        return selected
    raise TypeError(f"{argument}: expected None, a name, a list of names or a function name -> bool, "
                    f"got {type(selector).__name__}")


class ActivationCache(Mapping):
    """The activations of one run by hook-point name (TransformerLens's ActivationCache), and
    their gradients once a backward pass has reached them.

    cache[name]: the activation, a Tensor of the graph (as the model used it); cache.grad(name)
    or cache[name + "_grad"]: dL/d(activation), a Tensor, after a backward pass (None when the
    loss does not depend on it); names(), keys(), items(): the cached activations. KeyError with
    close names for a name that is not cached. `loss`: the loss of run_with_cache(loss_fn=...).
    """

    def __init__(self, activations: dict[str, Tensor], has_grads: bool, loss: Tensor | None = None):
        self.activations, self.has_grads, self.loss = activations, has_grads, loss

    def __getitem__(self, name: str) -> Tensor:
        if not isinstance(name, str):
            raise KeyError(f"ActivationCache: names are str (hook point names), got {type(name).__name__}")
        if name in self.activations:
            return self.activations[name]
        if name.endswith("_grad") and name[:-5] in self.activations:
            return self.grad(name[:-5])
        raise _name_error(name, self.activations, "cached activation")

    def __iter__(self) -> Iterator[str]:
        return iter(self.activations)

    def __len__(self) -> int:
        return len(self.activations)

    def names(self) -> list[str]:
        """The cached activations' names, in the order they ran."""
        return list(self.activations)

    def grad(self, name: str) -> Tensor | None:
        """dL/d(activation `name`) after a backward pass (None when none reached it). RuntimeError
        for a cache made without gradients (run_with_cache(loss_fn=...) or grads=True)."""
        activation = self.activations.get(name)
        if activation is None:
            raise _name_error(name, self.activations, "cached activation")
        if not self.has_grads:
            raise RuntimeError("ActivationCache.grad: this cache keeps no gradients; run_with_cache(..., "
                               "loss_fn=fn) runs the backward pass, or grads=True keeps those of yours")
        return activation.grad

    def __repr__(self):
        return f"ActivationCache({len(self)} activations{', with gradients' if self.has_grads else ''})"


def _check_hooks(hooks, argument):
    """(selector, fn) pairs of run_with_hooks' fwd_hooks / bwd_hooks, checked."""
    pairs = list(hooks)
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2 and callable(pair[1])):
            raise TypeError(f"run_with_hooks: {argument} must be (name or filter, fn) pairs, got {pair!r}")
    return pairs


class HookedModel:
    """What a model with hook points offers (mixed into Seq2SeqTransformer, CausalLM, the
    BERT-style encoders and nn.Transformer): hook_points, hook_point_names, add_hook,
    reset_hooks, run_with_hooks, run_with_cache (TransformerLens's HookedRootModule)."""

    def hook_points(self) -> dict[str, HookPoint]:
        """{name: HookPoint} of every hook point (see npformer.nn.hook_points.hook_points)."""
        return hook_points(self)

    def hook_point_names(self) -> list[str]:
        """Every hook point's name, in the order the model is built (docs/hook_points.md)."""
        return list(hook_points(self))

    def add_hook(self, name: str | Iterable[str] | Callable[[str], bool], fn: Callable,
                 dir: str = "fwd") -> list[HookPointHandle]:
        """Add fn on the hook points that `name` selects (a name, names, or a filter name -> bool);
        dir "fwd" or "bwd". Returns the handles. KeyError with close names for an unknown name."""
        return [point.add_hook(fn, dir) for point in select_points(hook_points(self), name, "name")]

    def reset_hooks(self) -> None:
        """Take every hook off every hook point."""
        for point in hook_points(self).values():
            if point.active:
                point.remove_hooks()

    def run_with_hooks(self, *inputs: Any, fwd_hooks: Iterable = (), bwd_hooks: Iterable = (),
                       reset_hooks_end: bool = True, loss_fn: Callable[[Any], Tensor] | None = None,
                       **kwargs: Any) -> Any:
        """The model's output on `inputs` (and `kwargs`) with hooks on for this call:
        fwd_hooks / bwd_hooks are (name or names or filter, fn) pairs (see the module docstring).
        loss_fn(output) -> scalar loss: its backward pass runs here, so that the backward hooks
        run. Backward hooks are bound to the graph at the forward pass: without loss_fn, a
        backward pass of yours later runs them too, after they are reset. reset_hooks_end=False
        leaves the hooks on (reset_hooks() takes them off). Returns the output."""
        points = hook_points(self)
        wanted = [(point, fn, "fwd") for selector, fn in _check_hooks(fwd_hooks, "fwd_hooks")
                  for point in select_points(points, selector, "fwd_hooks")]
        wanted += [(point, fn, "bwd") for selector, fn in _check_hooks(bwd_hooks, "bwd_hooks")
                   for point in select_points(points, selector, "bwd_hooks")]
        handles = [point.add_hook(fn, direction) for point, fn, direction in wanted]
        try:
            output = self(*inputs, **kwargs)
            if loss_fn is not None:
                loss_fn(output).backward()
        finally:
            if reset_hooks_end:
                for handle in handles:
                    handle.remove()
        return output

    def run_with_cache(self, *inputs: Any, names_filter: str | Iterable[str] | Callable[[str], bool] | None = None,
                       loss_fn: Callable[[Any], Tensor] | None = None, grads: bool = False,
                       **kwargs: Any) -> tuple[Any, ActivationCache]:
        """(output, cache): the model's output on `inputs` (and `kwargs`) and an ActivationCache of
        the activations at the hook points `names_filter` selects (None: all; a name, names, or a
        filter name -> bool). loss_fn(output) -> scalar loss: its backward pass runs here and the
        cache holds each activation's gradient too (cache.loss is the loss); grads=True: the
        cache keeps the gradients of a backward pass you run later. The output equals the
        model's without the cache (the attention probabilities, then nodes of the graph, take
        separate ops)."""
        points = select_points(hook_points(self), names_filter, "names_filter")
        keep_grads = grads or loss_fn is not None
        activations = {}

        def store(x, hook):
            if keep_grads and x.requires_grad and is_grad_enabled():
                x.retain_grad()
            activations[hook.name] = x

        handles = [point.add_hook(store) for point in points]
        try:
            output = self(*inputs, **kwargs)
        finally:
            for handle in handles:
                handle.remove()
        loss = None
        if loss_fn is not None:
            loss = loss_fn(output)
            loss.backward()
        return output, ActivationCache(activations, keep_grads, loss)
