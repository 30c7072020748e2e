"""A backward pass you can step through (a second read): `backward_steps(loss)` runs the pass of
`loss.backward()` one node at a time and hands over what each node did; `print_backward(loss)`
prints a whole pass, one numbered node after another.

    for step in autograd.backward_steps(loss, names=model):
        print(step)                       # or read its fields:
        step.op                           # the Function class, e.g. LinearFunction
        step.outputs[0].grad              # the summed gradient arriving at its output 0 (an array)
        step.inputs[1].grad_norm          # |gradient| leaving towards its input 1
        step.inputs[1].name               # "decoder.layers.0.linear1.weight" (a parameter of names)
        step.formula_path, step.formula_line   # npformer/functional/linear/math.py, 19

It is the engine's own pass, not a copy of it: `BackwardPass.run_nodes` (function.py) is a
generator that pauses after each node, and each node's gradients are `BackwardPass.input_grads`'s,
checked and version-checked as in `loss.backward()`, into the same slots and `.grad`. So when the
steps run out, every leaf's `.grad` is bit for bit what `loss.backward()` gives (post-accumulate-grad
hooks and queued callbacks run as there). First order only (no create_graph). Stopping early
(`break`, closing the generator, an error in a node) leaves the graph as a failed `backward()` does:
the partial sums cleared, the nodes already run freed (kept with retain_graph=True), the `.grad`
delivered so far in place. Between two steps the caller's grad mode is its own.

Where an op's formula is: the Function's class attribute `backward_formula` (a function:
each Function of `npformer/functional/` names there, beside its backward, the formula of its folder's
math.py that the backward computes), else its own `backward` (the primitive ops of ops.py, a
Function of your own).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
from collections.abc import Iterator, Mapping
from typing import Any

from . import hooks
from .backend import get_array_module
from .function import BackwardPass, Function, _accumulate, _freed_graph_error, backward_order
from .modes import no_grad
from .tensor import Tensor
from .tensor_methods import _upstream_gradient


class StepTensor:
    """One output or one Tensor input of a step's node, with the gradient that crossed it: for an
    output, the summed gradient arriving from the loss; for an input, the gradient leaving towards it
    (None where none leaves: the input does not require grad, or the op returned None)."""

    def __init__(self, position, shape, dtype, grad, name=None, leaf=False, to_step=None, to_op=None, tensor=None):
        self.position = position  # its index among the node's outputs, or among the op's positional inputs
        self.shape, self.dtype, self.grad = shape, dtype, grad
        self.name = name          # an input leaf's name in `names`, if there
        self.leaf = leaf          # an input that is a leaf requiring grad: the gradient goes into its .grad
        self.to_step = to_step    # an input made by an op: the index of that op's step, which gets the gradient,
        self.to_op = to_op        # and that op (its Function class)
        self.tensor = tensor      # the input Tensor (None for an output)

    @functools.cached_property
    def grad_norm(self) -> float | None:
        """The gradient's Frobenius norm (sqrt of the sum of its squares), or None without a gradient."""
        if self.grad is None:
            return None
        return float(get_array_module(self.grad).linalg.norm(self.grad.reshape(-1)))


class BackwardStep:
    """One node of a backward pass, after its backward ran: `index` (0, 1, ...) of `count` nodes in
    the pass's order (function.backward_order), `op` the Function class and `name` its class name,
    `outputs` and `inputs` (StepTensor: shape, dtype, grad, grad_norm; only Tensor inputs), and
    `formula_path` (relative to the folder of its top package), `formula_line`, `formula_name`:
    where the op's backward formula is. `str(step)` is its lines of print_backward."""

    def __init__(self, index, count, op, outputs, inputs):
        self.index, self.count, self.op, self.name = index, count, op, op.__qualname__
        self.outputs, self.inputs = outputs, inputs
        self.formula_path, self.formula_line, self.formula_name = formula_location(op)

    def __str__(self) -> str:
        lines = [f"#{self.index} {self.name}  {self.formula_path}:{self.formula_line} ({self.formula_name})"]
        rows = [(f"out[{o.position}]", o, f"arriving |g| = {_number(o.grad_norm)}") for o in self.outputs]
        for i in self.inputs:
            if i.grad is None:
                rows.append((f"in[{i.position}]", i, "no gradient"))
            else:
                to = f"leaf {i.name or '(unnamed)'}" if i.leaf else f"#{i.to_step} {i.to_op.__qualname__}"
                rows.append((f"in[{i.position}]", i, f"leaving  |g| = {_number(i.grad_norm)}  -> {to}"))
        for label, t, text in rows:
            lines.append(f"    {label:<7} {str(t.shape):<18} {str(t.dtype):<8} {text}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<BackwardStep #{self.index} of {self.count}: {self.name}>"


def _number(x):
    return "None" if x is None else f"{x:.6g}"


def backward_steps(loss: Tensor, grad: Any = None, *, names: Any = None,
                   retain_graph: bool = False) -> Iterator[BackwardStep]:
    """`loss.backward(grad, retain_graph=retain_graph)`, one node at a time: a generator of a
    BackwardStep per node, in the order the pass runs them; `.grad` fills as it goes and is
    complete when it ends. names: a model (anything with `named_parameters()`) or a {name: Tensor}
    mapping, to name the leaves the gradients go to. The arguments (and that the graph is still there)
    are checked when it is called; the pass starts at the first step asked for."""
    if not isinstance(loss, Tensor):
        raise TypeError(f"backward_steps: loss must be a Tensor, got {type(loss).__name__}")
    if not loss.requires_grad:
        raise RuntimeError("backward_steps: loss does not require grad (no input had requires_grad=True, "
                           "or it was made under no_grad())")
    if not isinstance(retain_graph, bool):
        raise TypeError(f"backward_steps: retain_graph must be a bool, got {type(retain_graph).__name__}")
    if loss.creator is not None and loss.creator.inputs is None:
        raise _freed_graph_error()
    gradient = _upstream_gradient(loss, grad, False, "backward_steps(grad)")
    return _steps(loss, gradient, _names_by_id(names), retain_graph)


def print_backward(loss: Tensor, grad: Any = None, *, names: Any = None, retain_graph: bool = False,
                   file: Any = None) -> list[BackwardStep]:
    """Run `loss.backward(grad)` through backward_steps, printing each node as it runs (to `file`,
    default sys.stdout); returns the steps."""
    file = sys.stdout if file is None else file
    steps = []
    print(f"backward pass of a {loss.shape} {loss.dtype} tensor, node by node "
          "(|g|: a gradient's Frobenius norm; -> where it goes)", file=file)
    for step in backward_steps(loss, grad, names=names, retain_graph=retain_graph):
        print(step, file=file)
        steps.append(step)
    print(f"{len(steps)} nodes", file=file)
    return steps


def _names_by_id(names):
    if names is None:
        return {}
    if hasattr(names, "named_parameters"):
        names = dict(names.named_parameters())
    if not isinstance(names, Mapping) or not all(isinstance(t, Tensor) for t in names.values()):
        raise TypeError(f"backward_steps: names must be a model (with named_parameters()) or a mapping of names "
                        f"to Tensors, got {type(names).__name__}")
    return {id(t): name for name, t in names.items()}


class _SteppingPass(BackwardPass):
    """BackwardPass keeping what each node's backward got and gave (`seen`)."""

    seen = None

    def input_grads(self, node, grads):
        self.seen = (tuple(node.inputs), list(node.output_meta), list(grads))
        result = super().input_grads(node, grads)
        self.seen += (result,)
        return result


def _steps(loss, gradient, names, retain_graph):
    hooks.run(hooks.backward_started)
    walker, callbacks = _SteppingPass(retain_graph), []
    if loss.creator is None:  # a leaf: its gradient is the upstream one, and no node runs
        with _inside_pass(callbacks):
            walker.run([loss], [gradient])
        _run_callbacks(callbacks)
        return
    nodes = backward_order([loss.creator])  # (raises if an earlier backward freed the graph)
    position = {id(node): i for i, node in enumerate(nodes)}
    _accumulate(loss.creator.output_grads, loss.output_index, gradient)
    engine, finished = walker.run_nodes(nodes), False
    try:
        for i, node in enumerate(nodes):
            walker.seen = None
            with _inside_pass(callbacks):
                next(engine)
            yield _step(i, len(nodes), type(node), walker.seen, position, names)
        with _inside_pass(callbacks):
            next(engine, None)  # the engine's loop ends
        finished = True
    finally:
        if not finished:  # stopped midway, as BackwardPass.run after an error: no partial sums left in the graph
            engine.close()
            for node in nodes:
                if node.inputs is not None:
                    node.output_grads = [None] * len(node.output_meta)
    _run_callbacks(callbacks)


def _step(index, count, op, seen, position, names):
    inputs, output_meta, arriving, leaving = seen
    outputs = tuple(StepTensor(j, shape, dtype, g) for j, ((shape, dtype), g) in enumerate(zip(output_meta, arriving)))
    ins = []
    for k, (t, g) in enumerate(zip(inputs, leaving)):
        if t is None:
            continue
        g = g if t.requires_grad else None  # the engine drops a gradient towards an input not requiring grad
        made = t.creator is not None
        ins.append(StepTensor(k, t.shape, t.dtype, g, name=names.get(id(t)), leaf=not made and t.requires_grad,
                              to_step=position.get(id(t.creator)) if made else None,
                              to_op=type(t.creator) if made else None, tensor=t))
    return BackwardStep(index, count, op, outputs, tuple(ins))


@contextlib.contextmanager
def _inside_pass(callbacks):
    """One step's work as run_backward runs a pass: grad mode off (just there: the caller's code between
    steps keeps its own), and queue_callback adding to this pass's callbacks."""
    outer, hooks._backward.callbacks = getattr(hooks._backward, "callbacks", None), callbacks
    try:
        with no_grad():
            yield
    finally:
        hooks._backward.callbacks = outer


def _run_callbacks(callbacks):
    for fn in callbacks:
        fn()


@functools.lru_cache(maxsize=1024)
def formula_location(op: type) -> tuple[str, int, str]:
    """(path, line, name) of the backward formula of the Function class `op`: its `backward_formula`
    (a function) if it has one, else its `backward`; the path relative to the folder holding the
    formula's top package (npformer/functional/softmax/math.py), the line that of its `def`."""
    if not (isinstance(op, type) and issubclass(op, Function)):
        raise TypeError(f"formula_location: op must be a Function class, got {op!r}")
    fn = inspect.unwrap(getattr(op, "backward_formula", None) or op.backward)
    code = getattr(fn, "__code__", None)
    if code is None:
        return "<unknown>", 0, getattr(fn, "__qualname__", repr(fn))
    path, line = inspect.getsourcefile(fn) or code.co_filename, code.co_firstlineno
    try:
        source, start = inspect.getsourcelines(fn)
        line = start + next(i for i, text in enumerate(source) if text.lstrip().startswith(("def ", "async def ")))
    except (OSError, TypeError, StopIteration):
        pass
    return _relative(path, fn.__module__), line, fn.__qualname__


def _relative(path, module):
    """`path` relative to the folder holding `module`'s top package (or module), when it is inside it."""
    top = getattr(sys.modules.get(module.partition(".")[0]), "__file__", None)
    if not top:
        return path
    root = os.path.dirname(os.path.abspath(top))
    if os.path.basename(top) == "__init__.py":
        root = os.path.dirname(root)
    path = os.path.abspath(path)
    return os.path.relpath(path, root) if path.startswith(root + os.sep) else path
