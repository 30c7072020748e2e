"""Module hooks (torch.nn.Module's): code run around a module's forward and in its backward.

`Module.register_forward_pre_hook`, `register_forward_hook`, `register_full_backward_pre_hook` and
`register_full_backward_hook` keep their hooks in the module's `ModuleHooks` (made at the first
registration; `Module.__call__` checks that one attribute, so a module without hooks costs one check).
`call_with_hooks` is `Module.__call__` when some hook is registered, in torch's order:

1. forward pre-hooks, `hook(module, args)` (with_kwargs: `hook(module, args, kwargs)`): None, or new
   args (a non-tuple becomes a one-element tuple; with_kwargs: a tuple (args, kwargs));
2. with backward hooks, and grad mode on, the positional Tensor arguments that require grad go
   through an identity op (`BackwardHook`), so forward gets new Tensors, as torch's views;
3. forward; 4. forward hooks, `hook(module, args, output)` (with_kwargs: `hook(module, args, kwargs,
   output)`): None, or a new output; a hook registered with always_call=True runs also when forward
   raised (its own error then only warned about), as torch's;
5. with backward hooks, the output's Tensors (the output, or those of a tuple) go through an
   identity op too. In the backward pass, that op's backward gets grad_output (the summed gradients
   of the outputs) and runs the backward pre-hooks, `hook(module, grad_output)` -> None or a new
   grad_output; the inputs' identity op then gets grad_input (the gradients with respect to the
   positional arguments: None for one that is no Tensor or does not require grad) and runs the full
   backward hooks, `hook(module, grad_input, grad_output)` -> None or a new grad_input, which flows
   on into the inputs. With no input that requires grad, the full backward hooks run at the
   outputs' op, with grad_input all None (they must return None).

The backward hooks run in the engine's pass as any op's backward: on Tensors outside any graph at
first order, on Tensors of the gradient's graph with create_graph (what a hook computes is
differentiated), carrying tangents in forward mode. As torch, the backward hooks that run are those
registered when forward ran.
"""
from __future__ import annotations

import warnings
from typing import Any

from autograd import Function, Tensor, is_grad_enabled
from autograd.checks import check_bool
from autograd.hooks import HookHandle
from npformer.runtime import record


class ModuleHooks:
    """A module's hooks, each list in running order of entries (hook, with_kwargs, always_call)."""

    def __init__(self):
        self.forward_pre, self.forward, self.backward_pre, self.backward = [], [], [], []

    def __bool__(self):
        return bool(self.forward_pre or self.forward or self.backward_pre or self.backward)


def register(module: Any, kind: str, hook: Any, prepend: bool, with_kwargs: bool = False,
             always_call: bool = False) -> HookHandle:
    """Keep `hook` in `module`'s list `kind` (first with prepend) and return its handle."""
    where = {"forward_pre": "register_forward_pre_hook", "forward": "register_forward_hook",
             "backward_pre": "register_full_backward_pre_hook", "backward": "register_full_backward_hook"}[kind]
    if not callable(hook):
        raise TypeError(f"{where}: hook must be callable, got {type(hook).__name__}")
    prepend, with_kwargs = check_bool(prepend, "prepend", where), check_bool(with_kwargs, "with_kwargs", where)
    always_call = check_bool(always_call, "always_call", where)
    if module._module_hooks is None:
        object.__setattr__(module, "_module_hooks", ModuleHooks())
    hooks = getattr(module._module_hooks, kind)
    record.note_hook_registered(f"a hook on a {type(module).__name__} (module hooks)")
    entry = (hook, with_kwargs, always_call)
    if prepend:
        hooks.insert(0, entry)
    else:
        hooks.append(entry)
    return HookHandle(hooks, entry)


def call_with_hooks(module: Any, args: tuple, kwargs: dict, forward: Any = None) -> Any:
    """`module(*args, **kwargs)` with its hooks (the module docstring's order). forward: what runs
    in place of `module.forward` (the hooks see `args` and `kwargs` all the same): for a parent that
    calls a child through another method (a stack's `layer.forward_masked(x, prepared_mask)`), to
    run the child's hooks as torch's parent, which calls the child, would."""
    hooks = module._module_hooks
    for hook, with_kwargs, _ in list(hooks.forward_pre):
        if with_kwargs:
            result = hook(module, args, kwargs)
            if result is not None:
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise RuntimeError(f"forward pre-hook {_name(hook)} (with_kwargs=True) must return None or a "
                                       f"tuple (new_args, new_kwargs), got {type(result).__name__}")
                args, kwargs = result
        else:
            result = hook(module, args)
            if result is not None:
                args = result if isinstance(result, tuple) else (result,)
    backward = None
    if (hooks.backward or hooks.backward_pre) and is_grad_enabled():
        backward = BackwardHook(module, [h for h, _, _ in hooks.backward], [h for h, _, _ in hooks.backward_pre])
        args = backward.wrap_inputs(args)
    output, ran = None, set()
    try:
        output = (module.forward if forward is None else forward)(*args, **kwargs)
        for entry in list(hooks.forward):
            ran.add(id(entry))
            hook, with_kwargs, _ = entry
            result = hook(module, args, kwargs, output) if with_kwargs else hook(module, args, output)
            if result is not None:
                output = result
    except Exception:
        for entry in list(hooks.forward):
            hook, with_kwargs, always_call = entry
            if always_call and id(entry) not in ran:
                try:
                    result = hook(module, args, kwargs, output) if with_kwargs else hook(module, args, output)
                    output = output if result is None else result
                except Exception as error:
                    warnings.warn(f"forward hook {_name(hook)} (always_call=True) raised {error!r}, silenced as "
                                  "the forward pass raised an error of its own", RuntimeWarning, stacklevel=2)
        raise
    if backward is not None:
        output = backward.wrap_outputs(output)
    return output


def _name(hook):
    return getattr(hook, "__qualname__", type(hook).__name__)


class BackwardHook:
    """One call's backward hooks (torch.utils.hooks.BackwardHook): the identity ops around the
    module's inputs and outputs, and the grad_output that the outputs' op keeps for the inputs'."""

    def __init__(self, module, hooks, pre_hooks):
        self.module, self.hooks, self.pre_hooks = module, hooks, pre_hooks
        self.n_inputs, self.input_index, self.grad_outputs = 0, None, None

    def wrap_inputs(self, args):
        """args with those that require grad through the inputs' identity op. As torch, grad_input
        will hold zeros for the other Tensors when some input requires grad (else None for all)."""
        self.n_inputs = len(args)
        self.input_index = [i for i, a in enumerate(args) if isinstance(a, Tensor) and a.requires_grad] or None
        if self.input_index is None:
            return args
        self.zeros = {i: a for i, a in enumerate(args) if isinstance(a, Tensor) and not a.requires_grad}
        wrapped = _identity(self, "inputs", [args[i] for i in self.input_index])
        args = list(args)
        for i, t in zip(self.input_index, wrapped):
            args[i] = t
        return tuple(args)

    def wrap_outputs(self, output):
        single = isinstance(output, Tensor)
        items = [output] if single else list(output) if isinstance(output, tuple) else None
        if items is None:
            warnings.warn(f"{type(self.module).__name__}: its backward hooks run only for an output that is a Tensor "
                          f"or a tuple of Tensors, got {type(output).__name__}", RuntimeWarning, stacklevel=3)
            return output
        self.n_outputs = len(items)
        self.output_index = [i for i, t in enumerate(items) if isinstance(t, Tensor) and t.requires_grad]
        if not self.output_index:
            return output
        for i, t in zip(self.output_index, _identity(self, "outputs", [items[i] for i in self.output_index])):
            items[i] = t
        return items[0] if single else tuple(items)

    def outputs_backward(self, grads):
        """The outputs' op's backward: the backward pre-hooks on grad_output; returns the new gradients."""
        grad_outputs = _packed(self.output_index, grads, self.n_outputs)
        for hook in self.pre_hooks:
            result = hook(self.module, grad_outputs)
            if result is not None:
                grad_outputs = _checked(result, grad_outputs, f"backward pre-hook {_name(hook)}", "grad_output")
        self.grad_outputs = grad_outputs
        if self.input_index is None:  # no input requires grad: the full backward hooks run here
            grad_inputs = (None,) * self.n_inputs
            for hook in self.hooks:
                result = hook(self.module, grad_inputs, grad_outputs)
                if result is not None and not (isinstance(result, tuple) and all(g is None for g in result)):
                    raise RuntimeError(f"full backward hook {_name(hook)}: no input of {type(self.module).__name__} "
                                       "requires grad, so it must return None (or None for every grad_input)")
            self.grad_outputs = None
        return [grad_outputs[i] for i in self.output_index]

    def inputs_backward(self, grads):
        """The inputs' op's backward: the full backward hooks on grad_input; returns the new gradients."""
        if self.grad_outputs is None:  # the gradient did not come through the module's outputs (as torch)
            return grads
        grad_inputs = list(_packed(self.input_index, grads, self.n_inputs))
        for i, t in self.zeros.items():
            grad_inputs[i] = Tensor(t.xp.zeros_like(t.data))
        grad_inputs = tuple(grad_inputs)
        for hook in self.hooks:
            result = hook(self.module, grad_inputs, self.grad_outputs)
            if result is not None:
                grad_inputs = _checked(result, grad_inputs, f"full backward hook {_name(hook)}", "grad_input")
        self.grad_outputs = None
        return [grad_inputs[i] for i in self.input_index]


def _packed(index, grads, n):
    packed = [None] * n
    for i, g in zip(index, grads):
        packed[i] = g
    return tuple(packed)


def _checked(result, previous, who, name):
    """What a backward hook returned in place of the tuple `previous`: a tuple (or list) as long,
    each entry None or a Tensor of the shape and dtype of the one it replaces."""
    if not isinstance(result, (tuple, list)) or len(result) != len(previous):
        got = f"{len(result)} entries" if isinstance(result, (tuple, list)) else type(result).__name__
        raise RuntimeError(f"{who} returned an invalid {name}: expected None or a tuple of {len(previous)} "
                           f"(one per entry of {name}), got {got}")
    for i, (new, old) in enumerate(zip(result, previous)):
        if new is not None and not isinstance(new, Tensor):
            raise TypeError(f"{who} returned {name}[{i}] of type {type(new).__name__}: expected a Tensor or None")
        if new is not None and old is not None and (new.shape != old.shape or new.dtype != old.dtype):
            raise RuntimeError(f"{who} returned {name}[{i}] of shape {new.shape}, dtype {new.dtype}: expected shape "
                               f"{old.shape}, dtype {old.dtype}")
    return tuple(result)


def _identity(state, side, tensors):
    """`tensors` through one `_BackwardHookIdentity` node; each output shares its input's memory
    (and so its version counter, as a view)."""
    outputs = _BackwardHookIdentity.apply(*tensors, state=state, side=side)
    for out, t in zip(outputs, tensors):
        out._base = t if t._base is None else t._base
    return outputs


class _BackwardHookIdentity(Function):
    """The identity on a module's input or output Tensors, whose backward runs its backward hooks
    (torch's BackwardHookFunction): `state.outputs_backward` or `state.inputs_backward`. A Tensor
    that got no gradient in the pass (its slot in the engine's `output_grads` empty; the engine
    gives backward zeros for it) is None to the hooks, as torch's."""

    @staticmethod
    def forward(ctx, *arrays, state, side):
        ctx.run = state.outputs_backward if side == "outputs" else state.inputs_backward
        return tuple(arrays)

    @staticmethod
    def backward(ctx, *grads):  # first order: the hooks see Tensors outside any graph
        result = ctx.run([None if got is None else Tensor(g) for g, got in zip(grads, ctx.output_grads)])
        return tuple(None if g is None else g.data for g in result)

    @staticmethod
    def differentiable_backward(ctx, *grads):  # create_graph, forward mode: Tensors of the graph
        return tuple(ctx.run([None if got is None else g for g, got in zip(grads, ctx.output_grads)]))

    @staticmethod
    def jvp(ctx, *tangents):
        return tangents
