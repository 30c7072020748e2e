"""`Module`, `Parameter` and the containers, mirroring torch.nn.

A Module owns three ordered registries filled by plain attribute assignment: parameters
(`Parameter`), buffers (`register_buffer`, persistent or not) and submodules. Everything
that walks the tree (parameters, state_dict, to, train/eval) goes through them, so names
are torch's dotted paths (`encoder.layers.0.self_attn.in_proj_weight`).
"""
from __future__ import annotations

import contextlib
import threading
from collections import namedtuple
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from autograd import Tensor, backend, no_grad
from autograd.backend import ArrayLike, DType
from autograd.checks import check_bool, check_float_dtype
from autograd.hooks import HookHandle
from npformer.runtime import lookahead

from . import module_hooks

IncompatibleKeys = namedtuple("IncompatibleKeys", ["missing_keys", "unexpected_keys"])


class _Inference(threading.local):
    """How many inference_mode() contexts the calling thread is inside (each thread starts at 0)."""
    depth = 0


_inference = _Inference()
_no_grad = no_grad()  # reusable and reentrant: its saved modes live on a per-thread stack


class inference_mode(contextlib.ContextDecorator):
    """A context manager (and decorator) for inference in the calling thread only: no graph (as
    torch.inference_mode and no_grad), and every module acts as in eval mode (no dropout)
    without its `training` flag changing. Unlike torch.inference_mode, dropout is off too, so
    a shared model can generate in one thread while another thread trains it in train mode:
    neither sees the other's mode (modes are per thread). Reentrant, and one object may be
    shared between threads; `is_inference_mode_enabled()` says whether the calling thread is
    inside one. Modules read it through `Module.training_active`."""

    def __enter__(self):
        _no_grad.__enter__()
        _inference.depth += 1
        return self

    def __exit__(self, *exc_info):
        _inference.depth -= 1
        _no_grad.__exit__(*exc_info)


def is_inference_mode_enabled() -> bool:
    """Whether the calling thread is inside `inference_mode()` (torch.is_inference_mode_enabled)."""
    return _inference.depth > 0


class Parameter(Tensor):
    """A Tensor that a Module registers as a learnable parameter when assigned to one of its
    attributes (torch.nn.Parameter); requires_grad=True unless asked otherwise. data: an array
    (its dtype kept) or anything `Tensor` accepts.

    As in torch, an array is not copied: the parameter and `data` share memory, and optimizers
    update it in place. So a read-only array (`np.broadcast_to`'s view, whose elements share
    memory, or one marked not writeable) is refused with a ValueError; give a copy."""

    def __init__(self, data: ArrayLike, requires_grad: bool = True):
        super().__init__(data, requires_grad=requires_grad)
        if not getattr(self.data.flags, "writeable", True):  # cupy arrays are always writable
            raise ValueError(f"Parameter: data must be a writable array (optimizers update it in place), got a "
                             f"read-only {type(self.data).__name__} of shape {self.data.shape} (e.g. a view from "
                             "np.broadcast_to); pass a copy, e.g. np.array(data)")

    def __repr__(self):
        return "Parameter containing:\n" + super().__repr__()


def _host_array(value, name):
    """The host numpy array of a state_dict value: numpy/cupy array, our Tensor, or a torch tensor."""
    if isinstance(value, Tensor):
        return backend.as_numpy(value.data)
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # a torch tensor, without importing torch
        return value.detach().cpu().numpy()
    if backend.is_array(value):
        return backend.as_numpy(value)
    np = backend.module_for("cpu")
    if isinstance(value, np.generic):  # a numpy scalar, e.g. what `array + 1` gives for a 0-d array
        return np.asarray(value)
    raise TypeError(f"load_state_dict: value of {name!r} must be an array or Tensor, got {type(value).__name__}")


class Module:
    """Base class of every layer and model (torch.nn.Module's API, batch-first, numpy-backed).

    Subclasses call `super().__init__()` first, assign Parameters, submodules and buffers as
    attributes (they are registered in that order) and define `forward`; `module(...)` calls it.
    Dotted names (`encoder.layers.0.linear1.weight`), `state_dict`, `to`, `train`/`eval` and
    `zero_grad` follow torch. Hooks (`register_forward_hook`, ...: module_hooks.py) run in
    `module(...)` as torch's."""

    _module_hooks = None  # a module_hooks.ModuleHooks once a hook is registered

    def __init__(self):
        object.__setattr__(self, "_parameters", {})
        object.__setattr__(self, "_buffers", {})
        object.__setattr__(self, "_non_persistent", set())
        object.__setattr__(self, "_modules", {})
        object.__setattr__(self, "training", True)

    # -- registration ---------------------------------------------------------------------
    def __setattr__(self, name, value):
        if "_parameters" not in self.__dict__:
            raise AttributeError(f"{type(self).__name__}: call super().__init__() before assigning {name!r}")
        params, buffers, modules = self._parameters, self._buffers, self._modules
        if isinstance(value, Parameter):
            if name not in params:  # keep the registration order when replacing
                self._forget(name)
            params[name] = value
        elif isinstance(value, Module):
            if name not in modules:
                self._forget(name)
            modules[name] = value
        elif name in params:
            if value is not None:
                raise TypeError(f"cannot assign {type(value).__name__} to parameter {name!r} "
                                "(expected a Parameter or None)")
            params[name] = None
        elif name in modules:
            if value is not None:
                raise TypeError(f"cannot assign {type(value).__name__} to submodule {name!r} "
                                "(expected a Module or None)")
            modules[name] = None
        elif name in buffers:
            buffers[name] = self._as_buffer(value, name)
        else:
            object.__setattr__(self, name, value)

    def _check_new_name(self, name, kind):
        """torch's checks of a name given to register_parameter / register_buffer / add_module:
        TypeError unless a str, KeyError for "", a "." (it would break the dotted names) or an
        attribute that exists but is not of this kind (`training`, a method, a plain value)."""
        if not isinstance(name, str):
            raise TypeError(f"{kind} name should be a string, got {type(name).__name__}")
        if not name:
            raise KeyError(f"{kind} name must not be empty")
        if "." in name:
            raise KeyError(f"{kind} name must not contain a dot, got {name}")
        registry = {"parameter": self._parameters, "buffer": self._buffers, "module": self._modules}[kind]
        if name not in registry and hasattr(self, name):
            raise KeyError(f"attribute '{name}' already exists")

    def _forget(self, name):
        for registry in (self._parameters, self._buffers, self._modules):
            registry.pop(name, None)
        self._non_persistent.discard(name)
        self.__dict__.pop(name, None)

    def __getattr__(self, name):  # only called when normal lookup fails
        for registry in ("_parameters", "_buffers", "_modules"):
            values = self.__dict__.get(registry)
            if values is not None and name in values:
                return values[name]
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def __delattr__(self, name):
        if name in self._parameters or name in self._buffers or name in self._modules:
            self._forget(name)
        else:
            object.__delattr__(self, name)

    @staticmethod
    def _as_buffer(value, name):
        if value is None or isinstance(value, Tensor):
            return value
        if backend.is_array(value):
            return Tensor(value)
        raise TypeError(f"buffer {name!r} must be a Tensor, an array or None, got {type(value).__name__}")

    def register_parameter(self, name: str, param: Parameter | None) -> None:
        """Register `param` (a Parameter, or None for an absent one) as `name`, like assigning
        `self.name = param`; TypeError for anything else. The name is checked as torch does (a
        non-empty str without ".", not an existing attribute of another kind: KeyError)."""
        self._check_new_name(name, "parameter")
        if param is not None and not isinstance(param, Parameter):
            raise TypeError(f"register_parameter({name!r}): expected a Parameter or None, got {type(param).__name__}")
        self._forget(name)
        self._parameters[name] = param

    def register_buffer(self, name: str, tensor: Tensor | ArrayLike | None, persistent: bool = True) -> None:
        """Register a non-learnable state Tensor (an array is wrapped) as `name`: it moves with
        `to()`, and persistent buffers go into state_dict (torch's). TypeError for other values;
        the name is checked as in register_parameter."""
        self._check_new_name(name, "buffer")
        buffer = self._as_buffer(tensor, name)
        self._forget(name)
        self._buffers[name] = buffer
        if not persistent:
            self._non_persistent.add(name)

    def add_module(self, name: str, module: Module | None) -> None:
        """Register `module` (or None) as the submodule `name`, like assigning `self.name = module`;
        TypeError for anything else; the name is checked as in register_parameter.
        `register_module` is the same method."""
        self._check_new_name(name, "module")
        if module is not None and not isinstance(module, Module):
            raise TypeError(f"add_module({name!r}): expected a Module or None, got {type(module).__name__}")
        self._forget(name)
        self._modules[name] = module

    register_module = add_module

    # -- traversal ------------------------------------------------------------------------
    def named_modules(self, prefix: str = "", memo: set | None = None) -> Iterator[tuple[str, Module]]:
        """(name, module) for this module (name `prefix`) and every descendant, each module once,
        depth first in registration order. memo: ids already visited (internal)."""
        memo = set() if memo is None else memo
        if id(self) in memo:
            return
        memo.add(id(self))
        yield prefix, self
        for name, child in self._modules.items():
            if child is not None:
                yield from child.named_modules(f"{prefix}.{name}" if prefix else name, memo)

    def modules(self) -> Iterator[Module]:
        """This module and every descendant, each once (the modules of `named_modules`)."""
        for _, m in self.named_modules():
            yield m

    def named_children(self) -> Iterator[tuple[str, Module]]:
        """(name, module) of the direct submodules, each once."""
        seen = set()
        for name, child in self._modules.items():
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                yield name, child

    def children(self) -> Iterator[Module]:
        """The direct submodules, each once."""
        for _, child in self.named_children():
            yield child

    def _named_members(self, registry, prefix, recurse, remove_duplicate=True):
        seen = set()
        modules = self.named_modules(prefix) if recurse else [(prefix, self)]
        for module_prefix, module in modules:
            for name, value in getattr(module, registry).items():
                if value is None or (remove_duplicate and id(value) in seen):
                    continue
                seen.add(id(value))
                yield (f"{module_prefix}.{name}" if module_prefix else name), value

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, Parameter]]:
        """(dotted name, Parameter) pairs in registration order; a Parameter shared by two modules
        (tied weights) appears once unless remove_duplicate=False. recurse=False: own ones only."""
        yield from self._named_members("_parameters", prefix, recurse, remove_duplicate)

    def parameters(self, recurse: bool = True) -> Iterator[Parameter]:
        """Every Parameter (each once), what an optimizer takes: `optim.Adam(model.parameters())`."""
        for _, p in self.named_parameters(recurse=recurse):
            yield p

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, Tensor]]:
        """(dotted name, Tensor) of every buffer, persistent or not, like `named_parameters`."""
        yield from self._named_members("_buffers", prefix, recurse, remove_duplicate)

    def buffers(self, recurse: bool = True) -> Iterator[Tensor]:
        """Every buffer Tensor (each once)."""
        for _, b in self.named_buffers(recurse=recurse):
            yield b

    def apply(self, fn: Callable[[Module], Any]) -> Module:
        """Call fn(module) on every submodule (children first) and on self, like torch; returns self."""
        for child in self.children():
            child.apply(fn)
        fn(self)
        return self

    # -- state ----------------------------------------------------------------------------
    def _state_tensors(self):
        """name -> Tensor of every parameter and persistent buffer (torch's state_dict order)."""
        state = {}
        for prefix, module in self.named_modules():
            dot = prefix + "." if prefix else ""
            for name, p in module._parameters.items():
                if p is not None:
                    state[dot + name] = p
            for name, b in module._buffers.items():
                if b is not None and name not in module._non_persistent:
                    state[dot + name] = b
        return state

    def state_dict(self) -> dict[str, Any]:
        """{dotted name: numpy array (a host copy)} of every parameter and persistent buffer, in
        torch's order and with torch's names (numpy arrays where torch has tensors). Unlike torch,
        a submodule registered under two names (Seq2SeqTransformer's shared embedding) is saved
        once, under its first name (a parameter shared by two modules keeps both names, as in torch)."""
        return {name: backend.as_numpy(t.data).copy() for name, t in self._state_tensors().items()}

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> IncompatibleKeys:
        """Copy arrays (numpy, cupy, our Tensors or torch tensors) into the parameters and
        buffers, casting to each one's dtype and device. Mis-shaped keys and values of another
        kind of dtype (complex into float, float into int) always raise; with strict=True missing
        and unexpected keys raise too; one RuntimeError lists every problem. Everything is checked
        before anything is replaced: a failed load changes nothing.
        Returns (missing_keys, unexpected_keys)."""
        return self.prepare_load_state_dict(state_dict, strict)()

    def prepare_load_state_dict(self, state_dict: Mapping[str, Any],
                                strict: bool = True) -> Callable[[], IncompatibleKeys]:
        """Check `state_dict` as load_state_dict does and convert its arrays, changing nothing;
        returns a function that puts them in place (it cannot fail) and returns
        (missing_keys, unexpected_keys). Lets a caller validate several objects before loading any.
        Raises what load_state_dict raises."""
        if not hasattr(state_dict, "keys") or not hasattr(state_dict, "__getitem__"):
            raise TypeError(f"load_state_dict: expected a dict of arrays, got {type(state_dict).__name__}")
        own = self._state_tensors()
        missing = [k for k in own if k not in state_dict]
        unexpected = [k for k in state_dict if k not in own]
        host, misshaped, mistyped = {}, [], []
        for name in own:
            if name not in state_dict:
                continue
            array = host[name] = _host_array(state_dict[name], name)
            target = own[name]
            if tuple(array.shape) != tuple(target.shape):
                misshaped.append(f"{name}: checkpoint {tuple(array.shape)}, model {tuple(target.shape)}")
            elif not backend.module_for("cpu").can_cast(array.dtype, target.dtype, casting="same_kind"):
                mistyped.append(f"{name}: checkpoint {array.dtype}, model {target.dtype}")
        problems = []
        if strict and missing:
            problems.append(f"missing keys ({len(missing)}): {', '.join(missing)}")
        if strict and unexpected:
            problems.append(f"unexpected keys ({len(unexpected)}): {', '.join(map(str, unexpected))}")
        if misshaped:
            problems.append(f"mis-shaped keys ({len(misshaped)}): {'; '.join(misshaped)}")
        if mistyped:
            problems.append(f"keys of another kind of dtype ({len(mistyped)}): {'; '.join(mistyped)}")
        if problems:
            raise RuntimeError(f"Error(s) in loading state_dict for {type(self).__name__}:\n  "
                               + "\n  ".join(problems))
        converted = {name: backend.to_device(array.astype(own[name].dtype, copy=True), own[name].device)
                     for name, array in host.items()}

        def load():
            for name, data in converted.items():
                own[name].data = data
                own[name].bump_version()  # a graph recorded with the old values refuses to backward
            return IncompatibleKeys(missing, unexpected)

        return load

    # -- mode, gradients, device and dtype ---------------------------------------------------
    def train(self, mode: bool = True) -> Module:
        """Set training mode (dropout active) on this module and, through each child's own
        `train(mode)` (so a subclass that overrides train() keeps control, as in torch), every
        descendant; returns self. TypeError unless mode is a bool."""
        if not isinstance(mode, bool):
            raise TypeError(f"train(mode): expected a bool, got {type(mode).__name__}")
        object.__setattr__(self, "training", mode)
        for child in self.children():
            child.train(mode)
        return self

    def eval(self) -> Module:
        """Evaluation mode (dropout off): `train(False)`; returns self."""
        return self.train(False)

    @property
    def training_active(self) -> bool:
        """Whether this module acts in training mode (dropout on) in the calling thread now:
        `training`, unless the thread is inside `inference_mode()`. The dropout layers read it."""
        return self.training and _inference.depth == 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear every parameter's `.grad`: None by default (torch's), or, with set_to_none=False,
        fill the gradient arrays with zeros in place (as torch and Optimizer.zero_grad do)."""
        for p in self.parameters():
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.data[...] = 0
                    p.grad.bump_version()

    def requires_grad_(self, requires_grad: bool = True) -> Module:
        """Set `requires_grad` of every parameter (False freezes them); returns self. TypeError
        unless requires_grad is a bool (numpy's too), as torch."""
        requires_grad = check_bool(requires_grad, "requires_grad", f"{type(self).__name__}.requires_grad_")
        for p in self.parameters():
            p.requires_grad = requires_grad
        return self

    def to(self, device: str | None = None, dtype: DType | None = None) -> Module:
        """Move every parameter and buffer (in place, keeping the Parameter objects) to
        `device` ("cpu", "cuda", "test") and cast floating ones to `dtype`; returns self.
        Raises ValueError / RuntimeError for an unknown or unavailable device and TypeError for
        a dtype that is not floating."""
        if device is not None:
            backend.module_for(device)  # a clear error for an unknown or unavailable device
        if dtype is not None:
            dtype = check_float_dtype(dtype, "dtype", "Module.to")
        for m in self.modules():
            m._move(device, dtype)
        return self

    def _move(self, device, dtype):
        """Move this module's own parameters and buffers (subclasses may rebuild derived buffers)."""
        for t in list(self._parameters.values()) + list(self._buffers.values()):
            if t is None:
                continue
            cast = dtype if dtype is not None and t.dtype.kind == "f" else None
            moved = _moved(t.data, device, cast)
            if moved is not t.data:
                t.data = moved
                t.bump_version()
            if t.grad is not None:
                t.grad = Tensor(_moved(t.grad.data, device, cast))

    def double(self) -> Module:
        """Cast floating parameters and buffers to float64 (gradchecks); returns self."""
        return self.to(dtype="float64")

    def float(self) -> Module:
        """Cast floating parameters and buffers to float32 (the default); returns self."""
        return self.to(dtype="float32")

    def cpu(self) -> Module:
        """Move to the CPU (numpy): `to("cpu")`; returns self."""
        return self.to("cpu")

    def cuda(self) -> Module:
        """Move to the GPU (CuPy): `to("cuda")`; returns self. RuntimeError without a GPU."""
        return self.to("cuda")

    # -- calling and printing ------------------------------------------------------------------
    def forward(self, *args, **kwargs) -> Any:
        """The module's computation; every subclass defines it (NotImplementedError here)."""
        raise NotImplementedError(f"{type(self).__name__} does not define forward()")

    def __call__(self, *args, **kwargs) -> Any:
        """`module(...)` runs `forward(...)` with the same arguments, and the module's hooks around
        it when it has some (module_hooks.py)."""
        try:
            if self._module_hooks:
                return module_hooks.call_with_hooks(self, args, kwargs)
            return self.forward(*args, **kwargs)
        except BaseException:  # the forward pass stops here: drop the dropout masks drawn ahead for it
            lookahead.abandon_pass()
            raise

    # -- hooks (torch's; module_hooks.py) ------------------------------------------------------------
    def register_forward_pre_hook(self, hook: Callable[..., Any], *, prepend: bool = False,
                                  with_kwargs: bool = False) -> HookHandle:
        """Call `hook(module, args)` before each forward (with_kwargs: `hook(module, args, kwargs)`);
        it returns None, or new args (a value not a tuple is wrapped in one; with_kwargs: a tuple
        (args, kwargs)). prepend: run it before the hooks already registered. Returns a handle whose
        `remove()` unregisters it (torch.nn.Module.register_forward_pre_hook)."""
        return module_hooks.register(self, "forward_pre", hook, prepend, with_kwargs)

    def register_forward_hook(self, hook: Callable[..., Any], *, prepend: bool = False, with_kwargs: bool = False,
                              always_call: bool = False) -> HookHandle:
        """Call `hook(module, args, output)` after each forward (with_kwargs: `hook(module, args,
        kwargs, output)`); it returns None, or a new output. always_call: run it also when forward
        raises. prepend: before the hooks already registered. Returns a handle (`remove()`)."""
        return module_hooks.register(self, "forward", hook, prepend, with_kwargs, always_call)

    def register_full_backward_pre_hook(self, hook: Callable[..., Any], prepend: bool = False) -> HookHandle:
        """Call `hook(module, grad_output)` in each backward pass when the gradients of this module's
        outputs are complete (a tuple, one per output Tensor); it returns None, or a new
        grad_output (a tuple as long) that flows on into the module. Returns a handle (`remove()`)."""
        return module_hooks.register(self, "backward_pre", hook, prepend)

    def register_full_backward_hook(self, hook: Callable[..., Any], prepend: bool = False) -> HookHandle:
        """Call `hook(module, grad_input, grad_output)` in each backward pass when the gradients with
        respect to this module's positional inputs are computed (grad_input: one per positional
        argument, None for one that is no Tensor or does not require grad); it returns None, or a
        new grad_input (a tuple as long) that flows on to the inputs. The module's forward gets its
        Tensor inputs, and its caller its Tensor outputs, through an identity op (torch: views).
        Returns a handle (`remove()`)."""
        return module_hooks.register(self, "backward", hook, prepend)

    def extra_repr(self) -> str:
        """The module's own settings, shown in its repr (`in_features=4, out_features=8, bias=True`)."""
        return ""

    def __repr__(self):
        lines = []
        for name, child in self._modules.items():
            child_repr = repr(child).replace("\n", "\n  ")
            lines.append(f"({name}): {child_repr}")
        extra = self.extra_repr()
        if not lines:
            return f"{type(self).__name__}({extra})"
        head = f"{type(self).__name__}(" + (f"{extra}" if extra else "")
        return head + "\n  " + "\n  ".join(lines) + "\n)"


def _moved(array, device, dtype):
    if device is not None:
        array = backend.to_device(array, device)
    if dtype is not None and array.dtype != dtype:
        array = array.astype(dtype)
    return array


class ModuleList(Module):
    """A list of submodules registered as "0", "1", ... (torch.nn.ModuleList): indexing, slicing
    (a new ModuleList), len and iteration."""

    def __init__(self, modules: Iterable[Module] | None = None):
        super().__init__()
        for m in modules or ():
            self.append(m)

    def append(self, module: Module) -> ModuleList:
        """Add `module` at the end (named by its index); returns self."""
        self.add_module(str(len(self._modules)), module)
        return self

    def extend(self, modules: Iterable[Module]) -> ModuleList:
        """Append each of `modules`; returns self."""
        for m in modules:
            self.append(m)
        return self

    def __getitem__(self, index):
        values = list(self._modules.values())
        if isinstance(index, slice):
            return ModuleList(values[index])
        return values[index]

    def __len__(self):
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())


class Sequential(ModuleList):
    """Submodules applied in order: Sequential(a, b, c)(x) == c(b(a(x))). A slice is a Sequential
    of the same modules under their names (torch's; a ModuleList slice renumbers them)."""

    def __init__(self, *modules: Module):
        super().__init__(modules)

    def __getitem__(self, index):
        if isinstance(index, slice):  # keeps the names, as torch: Sequential(a, b, c)[1:] has "1", "2"
            part = Sequential()
            for name, module in list(self._modules.items())[index]:
                part.add_module(name, module)
            return part
        return super().__getitem__(index)

    def forward(self, x: Any) -> Any:
        """x through each submodule in order; returns the last one's output."""
        for m in self:
            x = m(x)
        return x
