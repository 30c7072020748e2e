"""Optimizers mirroring `torch.optim`: SGD (momentum, Nesterov), Adam and AdamW.

Every update runs in place on `p.data` with the array module of the parameter (numpy, cupy
or the test device), in the parameter's dtype: float32 stays float32 because every scalar
is a Python float. Each step uses one scratch buffer per (device, dtype), shared by all
parameters, so a step allocates (almost) nothing.

State dicts follow torch's layout: `{"state": {index: {name: array or number}},
"param_groups": [{hyperparameters..., "params": [indices]}]}`; arrays are host (numpy)
copies, and `load_state_dict` moves them to each parameter's device and dtype.
"""
import functools
import math

from autograd import backend
from autograd.checks import check_real
from autograd.threads import for_rows


class Optimizer:
    """Base class: parameter groups, `zero_grad`, state dicts, a shared scratch buffer.

    params: an iterable of parameters (Tensors with `.data` and `.grad`), or of dicts
    `{"params": [...], **overrides}` (parameter groups, e.g. no weight decay on biases).
    defaults: the hyperparameters each group gets unless it overrides them.
    """

    def __init__(self, params, defaults):
        self.defaults = dict(defaults)
        params = list(params)
        if not params:
            raise ValueError("params: the optimizer got an empty parameter list")
        if not isinstance(params[0], dict):
            params = [{"params": params}]
        self.param_groups = []
        seen = set()
        for group in params:
            group = dict(group)
            group["params"] = list(group["params"])
            for p in group["params"]:
                if not hasattr(p, "data") or not hasattr(p, "grad"):
                    raise TypeError(f"params: expected Tensors/Parameters, got {type(p).__name__}")
                if p.data.dtype.kind != "f":
                    raise TypeError(f"params: expected floating parameters, got dtype {p.data.dtype}")
                if id(p) in seen:
                    raise ValueError("params: a parameter appears more than once")
                seen.add(id(p))
            for key, value in self.defaults.items():
                group.setdefault(key, value)
            self._check_group(group)
            self.param_groups.append(group)
        self.state = {}  # id(param) -> {name: array or number}
        self._scratch = {}

    def _check_group(self, group):
        """Check a group's hyperparameters and make each number a Python float (a numpy float64
        lr would turn float32 parameters into float64)."""
        group["lr"] = check_real(group["lr"], "lr", type(self).__name__, at_least=0)

    def parameters(self):
        return [p for group in self.param_groups for p in group["params"]]

    def zero_grad(self, set_to_none=True):
        """Forget every gradient (`grad = None`, torch's default) or fill it with zeros."""
        for p in self.parameters():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad[...] = 0

    def step(self):
        """One update of every parameter that has a gradient (parameters without one are skipped)."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, p.grad, group, self.state.setdefault(id(p), {}))

    def _update(self, p, grad, group, state):
        raise NotImplementedError

    def _scratch_like(self, p):
        """A scratch array shaped like `p`, a view of one flat buffer per (device, dtype)."""
        data = p.data
        key = (type(data), data.dtype)  # the array type tells the device (numpy, cupy, test)
        buf = self._scratch.get(key)
        if buf is None or buf.size < data.size:
            buf = p.xp.empty(data.size, dtype=data.dtype)
            self._scratch[key] = buf
        return buf[:data.size].reshape(data.shape)

    # -- state dicts ----------------------------------------------------------------------
    def state_dict(self):
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

    def load_state_dict(self, state_dict):
        """Restore hyperparameters and per-parameter state; arrays go to each parameter's
        device and dtype. Raises ValueError when the groups or shapes do not match."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"state_dict: expected {len(self.param_groups)} parameter groups, got {len(groups)}")
        by_index = {}
        for i, (mine, saved) in enumerate(zip(self.param_groups, groups)):
            if len(mine["params"]) != len(saved["params"]):
                raise ValueError(f"state_dict: group {i} has {len(saved['params'])} parameters, "
                                 f"this optimizer's has {len(mine['params'])}")
            for p, j in zip(mine["params"], saved["params"]):
                by_index[int(j)] = p
        new_state = {}
        for j, values in state_dict["state"].items():
            p = by_index.get(int(j))
            if p is None:
                raise ValueError(f"state_dict: state for parameter index {j}, which no group lists")
            restored = {}
            for name, v in values.items():
                if backend.is_array(v) and v.ndim > 0:
                    if tuple(v.shape) != p.shape:
                        raise ValueError(f"state_dict: {name} of parameter {j} has shape {tuple(v.shape)}, "
                                         f"the parameter has {p.shape}")
                    v = backend.to_device(backend.as_numpy(v), p.device).astype(p.dtype, copy=True)
                elif backend.is_array(v):
                    v = v.item()
                restored[name] = v
            new_state[id(p)] = restored
        for mine, saved in zip(self.param_groups, groups):
            for key, value in saved.items():
                if key != "params":
                    mine[key] = tuple(value) if key == "betas" else value
        self.state = new_state

    def __repr__(self):
        groups = ", ".join(str({k: v for k, v in g.items() if k != "params"}) for g in self.param_groups)
        return f"{type(self).__name__}({groups})"


class SGD(Optimizer):
    """Stochastic gradient descent with optional momentum, dampening, Nesterov momentum and
    L2 weight decay, exactly torch.optim.SGD:

        g = grad + weight_decay * p;  b = momentum * b + (1 - dampening) * g  (b = g at first);
        g = g + momentum * b if nesterov else b;  p -= lr * g
    """

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False):
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening,
                                      weight_decay=weight_decay, nesterov=nesterov))

    def _check_group(self, group):
        super()._check_group(group)
        group["momentum"] = check_real(group["momentum"], "momentum", "SGD", at_least=0)
        group["dampening"] = check_real(group["dampening"], "dampening", "SGD")
        group["weight_decay"] = check_real(group["weight_decay"], "weight_decay", "SGD", at_least=0)
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError(f"SGD: nesterov=True needs momentum > 0 and dampening == 0, got "
                             f"momentum={group['momentum']}, dampening={group['dampening']}")

    def _update(self, p, grad, group, state):
        xp = p.xp
        lr, momentum, wd = group["lr"], group["momentum"], group["weight_decay"]
        g = self._scratch_like(p)
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
    """Adam (Kingma & Ba), step for step the same arithmetic as torch.optim.Adam:

        g = grad + weight_decay * p                  (L2 penalty, coupled: Adam only)
        m = m + (1 - beta1) * (g - m);  v = beta2 * v + (1 - beta2) * g * g
        p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
    """

    decoupled = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
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

    def _update(self, p, grad, group, state):
        xp = p.xp
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        if not state:
            state["step"] = 0
            state["exp_avg"] = xp.zeros_like(p.data)  # m
            state["exp_avg_sq"] = xp.zeros_like(p.data)  # v
        state["step"] += 1
        t = state["step"]
        bias_correction1, bias_correction2_sqrt = 1.0 - beta1 ** t, math.sqrt(1.0 - beta2 ** t)
        if p.device != "cpu":  # one fused kernel instead of ~13 launches
            variant = "decoupled" if wd != 0 and self.decoupled else "l2" if wd != 0 else "plain"
            _adam_kernel(xp, variant)(grad, 1.0 - beta1, beta2, 1.0 - beta2, lr / bias_correction1,
                                      bias_correction2_sqrt, eps, wd, 1.0 - lr * wd,
                                      p.data, state["exp_avg"], state["exp_avg_sq"])
            return
        arrays = (p.data, grad, state["exp_avg"], state["exp_avg_sq"], self._scratch_like(p))

        def update(start, stop):  # the entries [start, stop) of flat arrays, or whole arrays
            param, g, m, v, tmp = (a[start:stop] for a in arrays) if stop is not None else arrays
            if wd != 0:
                if self.decoupled:
                    # AdamW: p = p * (1 - lr * weight_decay), before the Adam step
                    param *= 1.0 - lr * wd
                else:
                    # Adam: g = grad + weight_decay * p (a new array: grad itself is not touched)
                    g = g + wd * param
            # m = lerp(m, g, 1 - beta1) = m + (1 - beta1) * (g - m)
            xp.subtract(g, m, out=tmp)
            tmp *= 1.0 - beta1
            m += tmp
            # v = beta2 * v + (1 - beta2) * g * g
            v *= beta2
            xp.multiply(g, 1.0 - beta2, out=tmp)
            tmp *= g
            v += tmp
            # denom = sqrt(v) / sqrt(1 - beta2^t) + eps
            xp.sqrt(v, out=tmp)
            tmp /= bias_correction2_sqrt
            tmp += eps
            # p -= lr / (1 - beta1^t) * m / denom
            xp.divide(m, tmp, out=tmp)
            tmp *= lr / bias_correction1
            param -= tmp

        if p.data.flags.c_contiguous:  # flat views, split across npformer's threads when big
            arrays = tuple(a.reshape(-1) for a in arrays)
            for_rows(update, p.size, p.size, p.data)
        else:
            update(0, None)


# Adam's update of one entry as the body of a fused elementwise kernel (cupy.ElementwiseKernel
# on a GPU; the test device runs the same text with numpy): the arithmetic of the host path
# above, operation for operation, so the test device agrees with the CPU bit for bit (a GPU
# may fuse a * b + c into one FMA, as torch's CUDA Adam does). {g} is the gradient used:
# g, or g + weight_decay * p (Adam's L2 penalty); AdamW first decays p.
ADAM_KERNEL_BODY = """
m = m + one_minus_beta1 * ({g} - m);
v = beta2 * v + one_minus_beta2 * {g} * {g};
p = p - step_size * (m / (sqrt(v) / bias_correction2_sqrt + eps));
"""


@functools.lru_cache(maxsize=None)  # the body is put together once, not for every parameter at every step
def _adam_kernel(xp, variant):
    """The fused Adam step of a device's array module; variant "plain", "l2" or "decoupled"."""
    body = ADAM_KERNEL_BODY.format(g="(g + weight_decay * p)" if variant == "l2" else "g")
    if variant == "decoupled":
        body = "p = p * decay;" + body
    return backend.elementwise_kernel(
        xp, "T g, T one_minus_beta1, T beta2, T one_minus_beta2, T step_size, T bias_correction2_sqrt, "
        "T eps, T weight_decay, T decay", "T p, T m, T v", body, f"npformer_adam_{variant}")


class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov & Hutter), as torch.optim.AdamW:
    `p *= 1 - lr * weight_decay`, then the Adam step on the raw gradient."""

    decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
