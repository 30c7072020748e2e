"""Optimizers mirroring `torch.optim`: SGD (momentum, Nesterov), Adam and AdamW.

Every update runs in place on `p.data` with the array module of the parameter (numpy, cupy
or the test device), in the parameter's dtype: float32 stays float32 because every scalar
is a Python float. Each step uses one scratch buffer per (device, dtype), shared by all
parameters, so a step allocates (almost) nothing. A step bumps each updated parameter's version
(`Tensor.bump_version`), so a graph recorded before it raises at backward instead of mixing old
and new weights, as torch's.

State dicts follow torch's layout: `{"state": {index: {name: array or number}},
"param_groups": [{hyperparameters..., "params": [indices]}]}`; arrays are host (numpy)
copies, and `load_state_dict` moves them to each parameter's device and dtype.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

from autograd import Tensor, backend
from autograd.checks import check_bool, check_real, is_integer, is_real
from npformer.functional.adam import AdamSettings, adam_update
from npformer.runtime import graphs

_HOST_ARRAY = backend.module_for("cpu").ndarray  # exactly: the test device's arrays subclass it


def _plain(value):
    """A saved number as a Python int or float (numpy scalars too); anything else as it is."""
    if is_integer(value):
        return int(value)
    return float(value) if is_real(value) else value


def _like(value, default):
    """Whether a saved hyperparameter has the type of the optimizer's default (bools stay bools,
    tuples stay tuples of the same length, numbers stay numbers)."""
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, tuple):
        return isinstance(value, (list, tuple)) and len(value) == len(default)
    return is_real(value)


def _is_hyperparameter(value):
    """What a saved param group may hold besides its params: None, a bool, a number or numbers."""
    if isinstance(value, (list, tuple)):
        return all(is_real(v) for v in value)
    return value is None or isinstance(value, bool) or is_real(value)


def _ordered(params, name):
    """`params` (an iterable of Tensors or of parameter groups) as a list; TypeError for one Tensor
    (iterating it would give its rows) and for a set (its order, and with it the indices of
    state_dict, changes between runs), as torch."""
    if isinstance(params, Tensor):
        raise TypeError(f"{name}: expected an iterable of Tensors or dicts, got a Tensor (wrap it in a list)")
    if isinstance(params, (set, frozenset)):
        raise TypeError(f"{name}: expected an ordered collection such as a list, got a {type(params).__name__} "
                        "(its order, and the indices of state_dict with it, would change between runs)")
    return list(params)


class Optimizer:
    """Base class: parameter groups, `zero_grad`, state dicts, a shared scratch buffer.

    params: an ordered iterable (not a set) of parameters (leaf Tensors with `.data` and `.grad`),
    or of dicts `{"params": [...] or one Tensor, **overrides}` (parameter groups, e.g. no weight
    decay on biases). defaults: the hyperparameters each group gets unless it overrides them.
    Raises ValueError for an empty list, a repeated or a non-leaf parameter, TypeError for one
    that is not a floating Tensor, for a lone Tensor or a set in place of the list, KeyError for a
    group without 'params', and TypeError / ValueError naming a bad hyperparameter.
    torch.optim.Optimizer.
    """

    # a parameter's state entries: name -> "array" (the parameter's shape), "count" (an int >= 0)
    # or "number"; a state holds all of them or none. None: any names (arrays, numbers).
    state_kinds = None

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]], defaults: dict[str, Any]):
        self.defaults = dict(defaults)
        params = _ordered(params, "params")
        if not params:
            raise ValueError("params: the optimizer got an empty parameter list")
        if not isinstance(params[0], dict):
            params = [{"params": params}]
        self.param_groups = []
        seen = set()
        for i, group in enumerate(params):
            if not isinstance(group, dict):
                raise TypeError(f"params: parameter group {i} must be a dict (like the first entry), "
                                f"got {type(group).__name__}")
            if "params" not in group:
                raise KeyError(f"params: parameter group {i} has no 'params' entry")
            group = dict(group)
            group["params"] = [group["params"]] if isinstance(group["params"], Tensor) else _ordered(
                group["params"], f"params of parameter group {i}")
            for p in group["params"]:
                if not hasattr(p, "data") or not hasattr(p, "grad"):
                    raise TypeError(f"params: expected Tensors/Parameters, got {type(p).__name__}")
                if p.data.dtype.kind != "f":
                    raise TypeError(f"params: expected floating parameters, got dtype {p.data.dtype}")
                if not getattr(p, "is_leaf", True):
                    raise ValueError("params: can't optimize a non-leaf Tensor (it never gets a .grad); "
                                     "pass the leaf Tensors it is computed from")
                if id(p) in seen:
                    raise ValueError("params: a parameter appears more than once")
                seen.add(id(p))
            for key, value in self.defaults.items():
                group.setdefault(key, value)
            self._check_group(group)
            self.param_groups.append(group)
        self.state = {}  # id(param) -> {name: array or number}
        self._scratch = {}
        self._together = {}  # group index -> {parameter ids: _Together} (Adam's small CPU parameters)

    def _scratch_like(self, data):
        """A scratch array shaped like the array `data`, a view of one flat buffer per (device, dtype):
        no allocation per parameter and step (on a GPU, none inside a captured step)."""
        key = (type(data), data.dtype)  # the array type tells the device (numpy, cupy, test)
        buf = self._scratch.get(key)
        if buf is None or buf.size < data.size:
            buf = backend.get_array_module(data).empty(data.size, dtype=data.dtype)
            self._scratch[key] = buf
        return buf[:data.size].reshape(data.shape)

    def _check_group(self, group):
        """Check a group's hyperparameters (in place) and make each number a Python float (a numpy float64
        lr would turn float32 parameters into float64)."""
        group["lr"] = check_real(group["lr"], "lr", type(self).__name__, at_least=0)

    def parameters(self) -> list[Tensor]:
        """Every parameter of every group, in order."""
        return [p for group in self.param_groups for p in group["params"]]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget every gradient (`grad = None`, torch's default) or fill it with zeros."""
        for p in self.parameters():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.data[...] = 0
                p.grad.bump_version()

    capturable = False  # its step can be captured in a CUDA graph (npformer.cuda.graphed) and replayed

    def step(self) -> None:
        """One update of every parameter that has a gradient (parameters without one are skipped).
        RuntimeError inside a CUDA graph capture for an optimizer that cannot be captured."""
        if not self.capturable and any(graphs.current(p.device) for p in self.parameters()):
            raise RuntimeError(f"{type(self).__name__}.step() cannot be captured in a graph: its hyperparameters "
                               "would be baked into the graph; use Adam or AdamW, or step it outside the graph")
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, p.grad.data, group, self.state.setdefault(id(p), {}))
                    p.bump_version()  # a graph that saved p before this step now refuses to backward

    def _update(self, p, grad, group, state):
        raise NotImplementedError

    # -- state dicts ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """`{"state": {index: {...}}, "param_groups": [...]}` with host copies of the arrays."""
        index = {}
        groups = []
        for group in self.param_groups:
            entry = {k: v for k, v in group.items() if k != "params"}
            entry["params"] = []
            for p in group["params"]:
                index[id(p)] = len(index)
                entry["params"].append(index[id(p)])
            groups.append(entry)
        state = {}
        for p_id, values in self.state.items():
            if p_id in index:
                state[index[p_id]] = {k: backend.as_numpy(v).copy() if backend.is_array(v) else v
                                      for k, v in values.items()}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore hyperparameters and per-parameter state; arrays go to each parameter's
        device and dtype. Everything is checked first (ValueError or TypeError naming what is
        wrong: group count or sizes, hyperparameter types and ranges, state names, shapes and
        dtypes); a failed load changes nothing."""
        self.prepare_load_state_dict(state_dict)()

    def prepare_load_state_dict(self, state_dict: dict[str, Any]) -> Callable[[], None]:
        """Check `state_dict` as load_state_dict does, changing nothing; returns a function
        that loads it (it cannot fail)."""
        if not isinstance(state_dict, dict) or set(state_dict) != {"state", "param_groups"}:
            raise ValueError("state_dict: expected a dict with the keys 'param_groups' and 'state', got "
                             + (str(sorted(map(str, state_dict))) if isinstance(state_dict, dict)
                                else type(state_dict).__name__))
        groups = state_dict["param_groups"]
        if not isinstance(groups, (list, tuple)) or len(groups) != len(self.param_groups):
            got = len(groups) if isinstance(groups, (list, tuple)) else type(groups).__name__
            raise ValueError(f"state_dict: expected {len(self.param_groups)} parameter groups, got {got}")
        by_index, hyperparameters = {}, []
        for i, (mine, saved) in enumerate(zip(self.param_groups, groups)):
            hyperparameters.append(self._checked_group(i, mine, saved))
            for p, j in zip(mine["params"], saved["params"]):
                if j in by_index:
                    raise ValueError(f"state_dict: parameter index {j} appears in more than one place")
                by_index[j] = p
        state = state_dict["state"]
        if not isinstance(state, dict):
            raise ValueError(f"state_dict: 'state' must be a dict, got {type(state).__name__}")
        new_state = {}
        for j, values in state.items():
            p = by_index.get(j) if is_integer(j) else None
            if p is None:
                raise ValueError(f"state_dict: state for parameter index {j!r}, which no group lists")
            new_state[id(p)] = self._checked_state(j, p, values)

        def load():
            for mine, values in zip(self.param_groups, hyperparameters):
                mine.update(values)
            self.state = new_state

        return load

    def _checked_group(self, i, mine, saved):
        """Group i's saved hyperparameters, checked against this optimizer's group `mine`."""
        if not isinstance(saved, dict):
            raise ValueError(f"state_dict: parameter group {i} must be a dict, got {type(saved).__name__}")
        params = saved.get("params")
        if not isinstance(params, (list, tuple)) or not all(is_integer(j) for j in params):
            raise ValueError(f"state_dict: group {i}: 'params' must be a list of parameter indices")
        if len(params) != len(mine["params"]):
            raise ValueError(f"state_dict: group {i} has {len(params)} parameters, "
                             f"this optimizer's has {len(mine['params'])}")
        missing = [k for k in self.defaults if k not in saved]
        if missing:
            raise ValueError(f"state_dict: group {i} lacks the hyperparameters {missing}")
        values = {}
        for key, value in saved.items():
            if key == "params":
                continue
            if not isinstance(key, str) or not _is_hyperparameter(value):
                raise TypeError(f"state_dict: group {i}: hyperparameter {key!r} must be a number, a bool, None "
                                f"or a list of numbers, got {type(value).__name__}")
            if key in self.defaults and not _like(value, self.defaults[key]):
                raise TypeError(f"state_dict: group {i}: {key} must be like this optimizer's default "
                                f"{self.defaults[key]!r}, got {value!r}")
            values[key] = tuple(map(_plain, value)) if isinstance(value, (list, tuple)) else _plain(value)
        checked = {**mine, **values}
        self._check_group(checked)
        return {key: checked[key] for key in values}

    def _checked_state(self, j, p, values):
        """Parameter j's saved state, checked against `p` and converted to its device and dtype."""
        if not isinstance(values, dict) or not all(isinstance(name, str) for name in values):
            raise ValueError(f"state_dict: the state of parameter {j} must be a dict with string keys")
        if self.state_kinds is not None and values and set(values) != set(self.state_kinds):
            raise ValueError(f"state_dict: the state of parameter {j} must have the entries "
                             f"{sorted(self.state_kinds)} (or none), got {sorted(values)}")
        restored = {}
        for name, v in values.items():
            if self.state_kinds is not None:
                kind = self.state_kinds[name]
            else:
                kind = "array" if backend.is_array(v) and v.ndim > 0 else "number"
            if kind == "array":
                if not backend.is_array(v) or tuple(v.shape) != p.shape:
                    got = tuple(v.shape) if backend.is_array(v) else type(v).__name__
                    raise ValueError(f"state_dict: {name} of parameter {j} must be an array of the parameter's "
                                     f"shape {p.shape}, got {got}")
                if not backend.module_for("cpu").can_cast(v.dtype, p.dtype, casting="same_kind"):
                    raise TypeError(f"state_dict: {name} of parameter {j} has dtype {v.dtype}, which does not "
                                    f"cast to the parameter's {p.dtype}")
                v = backend.to_device(backend.as_numpy(v), p.device).astype(p.dtype, copy=True)
            else:
                if backend.is_array(v) and v.ndim == 0:
                    v = v.item()
                if not is_real(v) or (kind == "count" and (not is_integer(v) or v < 0)):
                    raise TypeError(f"state_dict: {name} of parameter {j} must be "
                                    f"{'an int >= 0' if kind == 'count' else 'a number'}, got {v!r}")
                v = _plain(v)
            restored[name] = v
        return restored

    def __repr__(self):
        groups = ", ".join(str({k: v for k, v in g.items() if k != "params"}) for g in self.param_groups)
        return f"{type(self).__name__}({groups})"


class SGD(Optimizer):
    """Stochastic gradient descent with optional momentum, dampening, Nesterov momentum and
    L2 weight decay, exactly torch.optim.SGD:

        g = grad + weight_decay * p;  b = momentum * b + (1 - dampening) * g  (b = g at first);
        g = g + momentum * b if nesterov else b;  p -= lr * g

    params: parameters or parameter groups (see Optimizer). ValueError for nesterov=True
    without momentum > 0 and dampening == 0.
    """

    state_kinds = {"momentum_buffer": "array"}

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]], lr: float = 1e-3, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False):
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening,
                                      weight_decay=weight_decay, nesterov=nesterov))

    def _check_group(self, group):
        super()._check_group(group)
        group["nesterov"] = check_bool(group["nesterov"], "nesterov", "SGD")
        group["momentum"] = check_real(group["momentum"], "momentum", "SGD", at_least=0)
        group["dampening"] = check_real(group["dampening"], "dampening", "SGD")
        group["weight_decay"] = check_real(group["weight_decay"], "weight_decay", "SGD", at_least=0)
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError(f"SGD: nesterov=True needs momentum > 0 and dampening == 0, got "
                             f"momentum={group['momentum']}, dampening={group['dampening']}")

    def _update(self, p, grad, group, state):
        xp = p.xp
        lr, momentum, wd = group["lr"], group["momentum"], group["weight_decay"]
        g = self._scratch_like(p.data)
        if wd != 0:
            # g = grad + weight_decay * p
            xp.multiply(p.data, wd, out=g)
            g += grad
        else:
            g[...] = grad
        if momentum != 0:
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = g.copy()  # b = g on the first step
            else:
                # b = momentum * b + (1 - dampening) * g
                buf *= momentum
                if group["dampening"]:
                    buf += (1.0 - group["dampening"]) * g
                else:
                    buf += g
            if group["nesterov"]:
                # g = g + momentum * b
                g += momentum * buf
            else:
                g[...] = buf
        # p -= lr * g
        g *= lr
        p.data -= g


class Adam(Optimizer):
    """Adam (Kingma & Ba, Algorithm 1), step for step the same arithmetic as torch.optim.Adam:

        t = t + 1;  g = grad + weight_decay * p      (L2 penalty, coupled: Adam only)
        m = beta1 * m + (1 - beta1) * g;  v = beta2 * v + (1 - beta2) * g * g
        m_hat = m / (1 - beta1^t);  v_hat = v / (1 - beta2^t);  p -= lr * m_hat / (sqrt(v_hat) + eps)

    params: parameters or parameter groups (see Optimizer); betas: (beta1, beta2), each in
    [0, 1). Its step can be captured in a CUDA graph (npformer.cuda.graphed).
    """

    decoupled = False
    capturable = True  # under graph capture the step-dependent scalars are replayed (npformer.runtime.graphs.replayed)
    state_kinds = {"step": "count", "exp_avg": "array", "exp_avg_sq": "array"}

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0):
        betas = tuple(betas) if isinstance(betas, (list, tuple)) else betas     # else refused by _check_group
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def _check_group(self, group):
        super()._check_group(group)
        owner = type(self).__name__
        betas = group["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            error = ValueError if isinstance(betas, (tuple, list)) else TypeError
            raise error(f"{owner}: betas must be a pair (beta1, beta2), got {betas!r}")
        group["betas"] = tuple(check_real(b, f"betas[{i}]", owner, at_least=0, below=1) for i, b in enumerate(betas))
        group["eps"] = check_real(group["eps"], "eps", owner, at_least=0)
        group["weight_decay"] = check_real(group["weight_decay"], "weight_decay", owner, at_least=0)

    def step(self) -> None:
        """One update of every parameter that has a gradient (see Optimizer.step). On the CPU the
        small parameters of a group that share a dtype and a step count are updated together, as
        torch's foreach Adam does: their m and v are views of two flat arrays, the parameters and
        gradients are gathered into two more, one adam_update runs on them all and the new values
        are copied back (one update's numpy calls for the group where each parameter made as many of
        its own). The same arithmetic entry by entry, so
        the same bits as one parameter at a time."""
        together = set()
        for index, group in enumerate(self.param_groups):
            for p in group["params"]:
                if p.grad is not None:
                    self.state.setdefault(id(p), {})   # in the parameters' order, however they step
            together.update(_Together.step(self, index, group))
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if id(p) not in together:
                    self._update(p, p.grad.data, group, self.state.setdefault(id(p), {}))
                p.bump_version()  # a graph that saved p before this step now refuses to backward

    def _update(self, p, grad, group, state):
        """One step of the algorithm for p: t = t + 1, the bias corrections of step t, then m, v and
        p entry by entry (the kernel table adam_update). A captured step reads the step-dependent
        scalars from the device, where each replay finds those of the step it performs."""
        if not state:  # t = 0, m = 0, v = 0
            if graphs.current(p.device) is not None:
                raise RuntimeError("Adam: a parameter without optimizer state inside a graph capture: run one "
                                   "step eagerly first (npformer.cuda.graphed does: warmup >= 1)")
            state.update(step=0, exp_avg=p.xp.zeros_like(p.data), exp_avg_sq=p.xp.zeros_like(p.data))
        state["step"] += 1
        settings = self._settings(group, state["step"])
        replayed = graphs.replayed(p.device, settings.step_scalars, lambda: self._next_step_scalars(group, state))
        adam_update(p.xp, p.data, grad, state["exp_avg"], state["exp_avg_sq"], self._scratch_like(p.data), settings, replayed)

    def _settings(self, group, t):
        """The AdamSettings of step t of `group`: its hyperparameters, and the bias corrections
        1 - beta1^t of m and 1 - beta2^t of v folded into step_size = lr / (1 - beta1^t) and the
        denominator's sqrt(1 - beta2^t), as torch does."""
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        return AdamSettings(1.0 - beta1, beta2, 1.0 - beta2, eps, wd,
                            "decoupled" if wd != 0 and self.decoupled else "l2" if wd != 0 else "plain",
                            lr / (1.0 - beta1 ** t), math.sqrt(1.0 - beta2 ** t), 1.0 - lr * wd)

    def _next_step_scalars(self, group, state):
        """What a replay of a captured step needs, computed just before it: the parameter's next
        step count and the step scalars of the group's lr then (a scheduler stepped outside the
        graph applies)."""
        state["step"] += 1
        return self._settings(group, state["step"]).step_scalars


class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov & Hutter), as torch.optim.AdamW:
    `p *= 1 - lr * weight_decay`, then the Adam step on the raw gradient. weight_decay defaults
    to 1e-2 (torch's); everything else as Adam."""

    decoupled = True

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


class _Together:
    """Small CPU parameters of one Adam group updated by one adam_update (Adam.step): m and v of
    each are views of the flat arrays m and v; params and grads are gathered into two more."""
    MAX_ENTRIES = 1 << 16   # a bigger parameter steps alone (its own update is long enough: no gain, no copies)

    def __init__(self, params):
        self.params = params
        self.offsets = [0]
        for p in params:
            self.offsets.append(self.offsets[-1] + p.data.size)
        self.m, self.v, self.p, self.g = (backend.module_for("cpu").empty(self.offsets[-1], dtype=params[0].data.dtype)
                                          for _ in range(4))
        self.views = [(self.m[a:b].reshape(p.data.shape), self.v[a:b].reshape(p.data.shape))
                      for p, a, b in zip(params, self.offsets, self.offsets[1:])]

    @classmethod
    def step(cls, optimizer, index, group):
        """Update together, in one call per set, the group's parameters that can be (on the CPU,
        outside graph capture, a gradient of their shape and dtype, contiguous, small) and share a
        dtype and a step count; returns their ids. A set seen at the last step keeps its arrays."""
        sets = {}
        for p in group["params"]:
            grad = p.grad.data if p.grad is not None else None
            if (grad is not None and type(p.data) is _HOST_ARRAY and type(grad) is _HOST_ARRAY
                    and p.data.size <= cls.MAX_ENTRIES and p.data.flags.c_contiguous
                    and grad.shape == p.data.shape and grad.dtype == p.data.dtype):
                sets.setdefault((p.data.dtype, optimizer.state[id(p)].get("step", 0)), []).append(p)
        before, now, stepped = optimizer._together.get(index, {}), {}, []
        for params in sets.values():
            key = tuple(map(id, params))
            if len(params) < 2:
                continue
            flat = before.get(key)
            if flat is None or not flat.holds(optimizer):
                flat = cls(params)
                flat.adopt(optimizer)
            flat.update(optimizer, group)
            now[key] = flat
            stepped.extend(key)
        optimizer._together[index] = now
        return stepped

    def update(self, optimizer, group):
        xp = backend.module_for("cpu")
        xp.concatenate([p.data.reshape(-1) for p in self.params], out=self.p)
        xp.concatenate([p.grad.data.reshape(-1) for p in self.params], out=self.g)
        for p in self.params:
            optimizer.state[id(p)]["step"] += 1
        settings = optimizer._settings(group, optimizer.state[id(self.params[0])]["step"])
        adam_update(xp, self.p, self.g, self.m, self.v, optimizer._scratch_like(self.p), settings)
        for p, a, b in zip(self.params, self.offsets, self.offsets[1:]):
            xp.copyto(p.data, self.p[a:b].reshape(p.data.shape))

    def holds(self, optimizer):
        """Whether every member's m and v are still this set's views (a loaded state dict puts
        arrays of its own there)."""
        return all(optimizer.state[id(p)].get("exp_avg") is m and optimizer.state[id(p)]["exp_avg_sq"] is v
                   and m.shape == p.data.shape for p, (m, v) in zip(self.params, self.views))

    def adopt(self, optimizer):
        """Take each member's m and v (zeros for a parameter without state) into the flat arrays and
        put the views in the optimizer's state in their place."""
        for p, (m, v) in zip(self.params, self.views):
            state = optimizer.state[id(p)]
            if not state:
                state.update(step=0, exp_avg=None, exp_avg_sq=None)
                m[...], v[...] = 0, 0
            else:
                m[...], v[...] = state["exp_avg"], state["exp_avg_sq"]
            state["exp_avg"], state["exp_avg_sq"] = m, v
