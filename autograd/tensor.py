"""`Tensor`: an array plus what reverse mode needs; `where`, `concatenate`, `stack`; and `grad`
(torch.autograd.grad), backward's twin that returns the gradients instead of accumulating them.

Its operators and methods are the primitive ops of autograd/ops.py; `backward()` and `grad()` walk
the tape of autograd/function.py.
"""
from __future__ import annotations

import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from . import backend, hooks
from .backend import Array, ArrayLike, DType
from .checks import as_array, check_bool
from .function import _forward, run_backward, tensor_gradients
from .ops import (Add, BroadcastTo, Concatenate, Div, Exp, GetItem, Log, MatMul, Max, Mean, Mul, Neg, Permute,
                  Pow, Relu, Reshape, Sqrt, Sub, Sum, Tanh, To, Where)


def _as_array(data):
    """Arrays keep their dtype; Python scalars and lists of floats become float32 (torch's default)."""
    if backend.is_array(data):
        return data
    arr = as_array(data, "data", "Tensor", backend.get_array_module(data))
    return arr.astype("float32") if arr.dtype == "float64" else arr


class Tensor:
    """An array of the active backend plus what reverse mode needs (torch.Tensor).

    data: an array (kept as it is, dtype included), a Tensor (its array is shared), or
    numbers / nested lists (float64 values become float32, torch's default). dtype and device
    ("cpu", "cuda", "test"), when given, convert the array. requires_grad=True asks for `.grad`
    after backward and needs a floating dtype (TypeError otherwise).

    Attributes: `data` (numpy/cupy array), `grad` (a Tensor or None), `requires_grad`,
    `creator` (the Function node that made it; None for leaves), `_version` (torch's: how many
    in-place changes it had, see `bump_version`; a view counts on its base). Arithmetic
    (`+ - * / @ **`, unary `-`), indexing and the methods below are differentiable; comparisons
    (`<`, `eq`, ...) give boolean Tensors outside the graph.
    """

    __array_priority__ = 1000  # numpy array (op) Tensor defers to Tensor's reflected op
    _post_accumulate_grad_hooks = ()  # a list once a hook is registered
    _tangents = None  # {dual level: tangent array} once forward mode gives it one (autograd.forward_ad)
    _version = 0  # in-place changes so far (bump_version); a class default, so making a Tensor costs nothing
    _base = None  # the tensor whose memory this one shares (a view op's output, detach()): its version counts

    def __init__(self, data: ArrayLike, requires_grad: bool = False, dtype: DType | None = None,
                 device: str | None = None):
        shared = None
        if isinstance(data, Tensor):
            shared, data = data, data.data
        arr = _as_array(data)
        if device is not None:
            arr = backend.to_device(arr, device)
        if dtype is not None:
            arr = arr.astype(dtype, copy=False)
        if requires_grad:
            if requires_grad is not True:  # "yes", 1, numpy's True: only the last is a bool
                requires_grad = check_bool(requires_grad, "requires_grad", "Tensor")
            if arr.dtype.kind != "f":
                raise TypeError(f"requires_grad=True needs a floating dtype, got {arr.dtype}")
        if shared is not None and arr is shared.data:  # the same memory: in-place changes of one are the other's
            self._base = shared if shared._base is None else shared._base
        self.data = arr
        self._grad = None
        self.requires_grad = requires_grad
        self.creator = None
        self.output_index = 0

    # -- properties ------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        """The array's shape, a tuple of ints."""
        return self.data.shape

    @property
    def ndim(self) -> int:
        """The number of dimensions."""
        return self.data.ndim

    @property
    def dtype(self) -> Any:
        """The array's dtype (a numpy dtype, e.g. float32)."""
        return self.data.dtype

    @property
    def size(self) -> int:
        """The number of elements (an int, as numpy's `size`; torch's `numel()`)."""
        return self.data.size

    @property
    def device(self) -> str:
        """Where the array lives: "cpu", "cuda" or "test"."""
        return backend.device_of(self.data)

    @property
    def xp(self) -> types.ModuleType:
        """The array module of the data (numpy, cupy or the test device's), for raw array math."""
        return backend.get_array_module(self.data)

    @property
    def is_leaf(self) -> bool:
        """True for a tensor made by the user (not by an op): leaves keep `.grad` after backward."""
        return self.creator is None

    def __len__(self):
        return len(self.data)

    def __repr__(self):
        grad = ", requires_grad=True" if self.requires_grad else ""
        return f"Tensor({backend.as_numpy(self.data)!r}, device='{self.device}'{grad})"

    # -- autograd ----------------------------------------------------------------------
    @property
    def grad(self) -> Tensor | None:
        """The gradient accumulated by `backward()`: a Tensor of this one's shape, dtype and device, or
        None. After `backward(create_graph=True)` it is part of a graph and can be differentiated."""
        return self._grad

    @grad.setter
    def grad(self, value: Tensor | None) -> None:
        if value is not None:
            if not isinstance(value, Tensor):
                raise TypeError(f"grad: expected a Tensor or None, got {type(value).__name__}; wrap an array: "
                                "Tensor(array)")
            if value.shape != self.shape or value.dtype != self.dtype or value.device != self.device:
                raise ValueError(f"grad: expected a Tensor of shape {self.shape}, dtype {self.dtype} on "
                                 f"'{self.device}', got shape {value.shape}, dtype {value.dtype} on '{value.device}'")
        self._grad = value

    def backward(self, gradient: ArrayLike | None = None, retain_graph: bool | None = None,
                 create_graph: bool = False, inputs: Sequence[Tensor] | None = None) -> None:
        """Accumulate d(self)/d(leaf) * gradient into `.grad` of every leaf that requires grad (torch's).

        gradient: the upstream gradient, of this tensor's shape and on its device; may be omitted
        for a scalar (one element) output, which then takes 1. retain_graph: keep the graph for
        another backward (default: create_graph); without it the graph is freed as the pass goes
        and a second backward through it raises, as in torch. create_graph: the gradients are
        built as a graph of their own (Tensors that can be differentiated again: Hessian-vector
        products, gradient penalties); see `autograd.grad`. inputs: accumulate only into these
        Tensors' `.grad` (leaves, or non-leaf tensors); the rest of the graph is not run.
        Raises RuntimeError when this tensor does not require grad, or the gradient is missing for
        a non-scalar or on another device, and ValueError for one of another shape."""
        if not self.requires_grad:
            raise RuntimeError("backward() on a tensor that does not require grad "
                               "(no input had requires_grad=True, or it was made under no_grad())")
        create_graph = check_bool(create_graph, "create_graph", "backward")
        retain_graph = create_graph if retain_graph is None else check_bool(retain_graph, "retain_graph", "backward")
        if inputs is not None:
            inputs = _checked_inputs(inputs, "backward")
        gradient = _upstream_gradient(self, gradient, tensor_gradients(create_graph), "backward(gradient)")
        hooks.run(hooks.backward_started)  # npformer's runtime: the forward pass's dropout masks predict the next's
        run_backward([self], [gradient], retain_graph=retain_graph, create_graph=create_graph, inputs=inputs)

    def bump_version(self) -> None:
        """Count one in-place change of this tensor's values (torch's version counter, `_version`;
        a view, or a `detach()`ed alias, counts on its base, the tensor whose memory it shares).
        Backward compares the count with the one an op saw when it saved the tensor, so a gradient
        is never computed from values that changed since the forward pass: it raises RuntimeError
        instead. Optimizer steps, `load_state_dict`, `Module.to`, `nn.init` and gradient clipping
        call it. `.data` is the escape hatch, as in torch: code that writes into `.data` itself
        calls it to have backward check (docs/torch_conventions.md, "Version counters")."""
        owner = self if self._base is None else self._base
        owner._version += 1

    def _accumulate_grad(self, grad, tensors=False):
        """Add one contribution to `.grad`: a raw array (first order) or a Tensor (create_graph,
        forward mode: see function.tensor_gradients), added out of place so that the sum keeps its
        graph and tangent."""
        current = self._grad
        if tensors:
            self._grad = grad if current is None else current + grad
        elif current is None:
            # a copy (gradients of different tensors may alias); a numpy scalar (0-d results) becomes an array
            self._grad = Tensor(grad.copy() if backend.is_array(grad) else backend.get_array_module(grad).asarray(grad))
        elif current.creator is None:
            current.data += grad
            current.bump_version()  # an op may have saved the old gradient
        else:  # a gradient made with create_graph earlier: not changed in place
            self._grad = Tensor(current.data + grad)

    def _set_tangent(self, level, tangent):
        """Carry `tangent` (an array, or None for none) at the dual `level` (autograd.forward_ad)."""
        if tangent is None:
            if self._tangents:
                self._tangents.pop(level, None)
            return
        if self._tangents is None:
            self._tangents = {}
        self._tangents[level] = tangent
        _forward.duals[level].add(self)

    def register_post_accumulate_grad_hook(self, hook: Callable[[Tensor], Any]) -> _HookHandle:
        """Call `hook(self)` each time a backward pass has finished adding to this leaf's `.grad`
        (every contribution of that pass accumulated), as torch's hook of the same name.
        Returns a handle whose `remove()` unregisters it. Raises RuntimeError on a non-leaf and
        TypeError when `hook` is not callable."""
        if self.creator is not None:
            raise RuntimeError("register_post_accumulate_grad_hook: only leaves (parameters) have one; "
                               "this tensor was made by an op")
        if not callable(hook):
            raise TypeError(f"hook: expected a callable, got {type(hook).__name__}")
        if not self._post_accumulate_grad_hooks:
            self._post_accumulate_grad_hooks = []
        self._post_accumulate_grad_hooks.append(hook)
        return _HookHandle(self._post_accumulate_grad_hooks, hook)

    def _run_post_accumulate_grad_hooks(self):
        for hook in list(self._post_accumulate_grad_hooks):
            hook(self)

    def retain_grad(self) -> Tensor:
        """Keep `.grad` of this non-leaf after backward (leaves always keep theirs); returns self."""
        if self.creator is not None:  # a weak reference, as torch's: the node must not keep its output alive
            self.creator.retained[self.output_index] = weakref.ref(self)
        return self

    def detach(self) -> Tensor:
        """A new leaf Tensor sharing this one's array (and version counter), outside the graph (no
        gradient flows back)."""
        return Tensor(self)

    def requires_grad_(self, flag: bool = True) -> Tensor:
        """Set `requires_grad` in place; returns self, as torch's. TypeError for a flag that is not
        a bool and for True on a non-floating tensor; RuntimeError for False on a tensor made by an
        op (its gradient would silently stop there: use `detach()`)."""
        flag = check_bool(flag, "requires_grad", "requires_grad_")
        if flag and self.dtype.kind != "f":
            raise TypeError(f"requires_grad_: requires_grad needs a floating dtype, got {self.dtype}")
        if not flag and self.creator is not None:
            raise RuntimeError("requires_grad_(False) on a tensor made by an op: only leaves' flags change "
                               "(as in torch); use y.detach() for a copy outside the graph")
        self.requires_grad = flag
        return self

    # -- conversion ----------------------------------------------------------------------
    # reading a value runs the host_read hooks (autograd.hooks): npformer's deferred device checks report there
    def numpy(self) -> Array:
        """The values as a numpy array: the array itself on "cpu", a host copy from "cuda"/"test".
        Reading values first runs the `host_read` hooks, where npformer's runtime reports any
        pending deferred device check of earlier ops (an id out of range, ...)."""
        hooks.run(hooks.host_read)
        return backend.as_numpy(self.data)

    def item(self) -> float | int | bool:
        """The value of a one-element tensor as a Python number (ValueError for more elements);
        runs the `host_read` hooks first, like `numpy()`."""
        hooks.run(hooks.host_read)
        return self.data.item()

    def __array__(self, dtype: DType | None = None, copy: bool | None = None) -> Array:
        """`np.asarray(tensor)` of a "cpu" tensor: its array (as torch's `__array__`); a tensor on
        another device raises TypeError, since that would be a hidden copy to the host: use `.numpy()`."""
        if self.device != "cpu":
            raise TypeError(f"can't convert a '{self.device}' tensor to a numpy array implicitly; use .numpy(), "
                            "which copies it to the host")
        hooks.run(hooks.host_read)
        data = self.data if dtype is None else self.data.astype(dtype, copy=False)
        return data.copy() if copy else data

    def tolist(self) -> list | float | int | bool:
        """The values as nested Python lists (a number for a 0-d tensor), via `numpy()`."""
        return self.numpy().tolist()

    def __float__(self):
        return float(self.item())

    def __int__(self):
        return int(self.item())

    def to(self, device: str | None = None, dtype: DType | None = None) -> Tensor:
        """Move to `device` and/or cast to `dtype`; differentiable like torch's `.to` (the gradient
        goes back to the original device and dtype). Returns self when nothing changes."""
        if (device is None or device == self.device) and (dtype is None or self.xp.dtype(dtype) == self.dtype):
            return self
        return To.apply(self, device=device or self.device, dtype=dtype or self.dtype)

    def float(self) -> Tensor:
        """This tensor as float32 (differentiable); `.to(dtype="float32")`."""
        return self.to(dtype="float32")

    def double(self) -> Tensor:
        """This tensor as float64 (differentiable; gradchecks use it); `.to(dtype="float64")`."""
        return self.to(dtype="float64")

    # -- operators ------------------------------------------------------------------------
    def __add__(self, other): return Add.apply(*_operands(self, other, Add))
    def __radd__(self, other): return Add.apply(*_operands(other, self, Add))
    def __sub__(self, other): return Sub.apply(*_operands(self, other, Sub))
    def __rsub__(self, other): return Sub.apply(*_operands(other, self, Sub))
    def __mul__(self, other): return Mul.apply(*_operands(self, other, Mul))
    def __rmul__(self, other): return Mul.apply(*_operands(other, self, Mul))
    def __truediv__(self, other): return Div.apply(*_operands(self, other, Div))
    def __rtruediv__(self, other): return Div.apply(*_operands(other, self, Div))
    def __matmul__(self, other): return MatMul.apply(*_operands(self, other, MatMul))
    def __rmatmul__(self, other): return MatMul.apply(*_operands(other, self, MatMul))
    def __pow__(self, other): return Pow.apply(*_operands(self, other, Pow))
    def __rpow__(self, other): return Pow.apply(*_operands(other, self, Pow))
    def __neg__(self): return Neg.apply(self)
    def __getitem__(self, key): return GetItem.apply(self, key=_raw_key(key))

    # comparisons make boolean tensors, outside the graph
    def _compare(self, other, op):
        return Tensor(op(self.data, other.data if isinstance(other, Tensor) else other))
    def __lt__(self, other): return self._compare(other, lambda a, b: a < b)
    def __le__(self, other): return self._compare(other, lambda a, b: a <= b)
    def __gt__(self, other): return self._compare(other, lambda a, b: a > b)
    def __ge__(self, other): return self._compare(other, lambda a, b: a >= b)

    def eq(self, other: ArrayLike) -> Tensor:
        """Elementwise `self == other` as a boolean Tensor, outside the graph (torch.eq)."""
        return self._compare(other, lambda a, b: a == b)

    def ne(self, other: ArrayLike) -> Tensor:
        """Elementwise `self != other` as a boolean Tensor, outside the graph (torch.ne)."""
        return self._compare(other, lambda a, b: a != b)

    # -- methods --------------------------------------------------------------------------
    def reshape(self, *shape: int | Sequence[int]) -> Tensor:
        """The same values in `shape` (ints, or one tuple; -1 infers a size); differentiable.
        `view` is the same method (a copy when numpy's reshape copies)."""
        return Reshape.apply(self, shape=_shape_arg(shape))

    view = reshape

    def transpose(self, *axes: int | Sequence[int]) -> Tensor:
        """With two axes, swap them (torch); with none or a full permutation, permute (numpy)."""
        if len(axes) == 2:
            return self.swapaxes(*axes)
        return Permute.apply(self, axes=_shape_arg(axes) or tuple(range(self.ndim))[::-1])

    def permute(self, *axes: int | Sequence[int]) -> Tensor:
        """The axes reordered: output axis i is input axis axes[i] (ints, or one tuple); torch.permute."""
        return Permute.apply(self, axes=_shape_arg(axes))

    def swapaxes(self, a: int, b: int) -> Tensor:
        """Axes `a` and `b` exchanged (negative axes count from the end); torch.transpose(a, b)."""
        axes = list(range(self.ndim))
        axes[a], axes[b] = axes[b], axes[a]
        return Permute.apply(self, axes=tuple(axes))

    @property
    def T(self) -> Tensor:
        """All axes reversed (a matrix's transpose), differentiable."""
        return self.transpose()

    def expand(self, *shape: int | Sequence[int]) -> Tensor:
        """Broadcast to `shape` (ints, or one tuple) without copying; the gradient is summed back
        over the broadcast axes. `broadcast_to` is the same method."""
        return BroadcastTo.apply(self, shape=_shape_arg(shape))

    broadcast_to = expand

    def sum_to(self, shape: Sequence[int]) -> Tensor:
        """Summed over the axes that broadcasting `shape` to this tensor's shape added or stretched
        (the backward of a broadcast, differentiable); `unbroadcast` does it on raw arrays."""
        shape = tuple(shape)
        if self.shape == shape:
            return self
        extra = self.ndim - len(shape)
        stretched = tuple(range(extra)) + tuple(extra + i for i, n in enumerate(shape) if n == 1 and self.shape[extra + i] != 1)
        return self.sum(axis=stretched, keepdims=True).reshape(shape)

    def sum(self, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> Tensor:
        """The sum over `axis` (all axes by default), numpy's argument names."""
        return Sum.apply(self, axis=axis, keepdims=keepdims)

    def mean(self, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> Tensor:
        """The mean over `axis` (all axes by default), numpy's argument names."""
        return Mean.apply(self, axis=axis, keepdims=keepdims)

    def max(self, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> Tensor:
        """The maximum over `axis` (all axes by default); the gradient goes to the maxima, split
        evenly between ties. Values only (torch's max(dim) also returns indices)."""
        return Max.apply(self, axis=axis, keepdims=keepdims)

    def exp(self) -> Tensor:
        """Elementwise e**x."""
        return Exp.apply(self)

    def log(self) -> Tensor:
        """Elementwise natural logarithm."""
        return Log.apply(self)

    def sqrt(self) -> Tensor:
        """Elementwise square root."""
        return Sqrt.apply(self)

    def tanh(self) -> Tensor:
        """Elementwise hyperbolic tangent."""
        return Tanh.apply(self)

    def relu(self) -> Tensor:
        """Elementwise max(x, 0) (a NaN stays NaN, as torch's); F.relu is the fused op."""
        return Relu.apply(self)

    def matmul(self, other: ArrayLike) -> Tensor:
        """Matrix product `self @ other`, numpy's rules (1-D operands, broadcast batch axes)."""
        return self @ other


class _HookHandle:
    """What `register_post_accumulate_grad_hook` returns: `remove()` unregisters the hook."""

    def __init__(self, hooks, hook):
        self.hooks, self.hook = hooks, hook

    def remove(self):
        if self.hook in self.hooks:
            self.hooks.remove(self.hook)


def grad(outputs: Tensor | Sequence[Tensor], inputs: Tensor | Sequence[Tensor],
         grad_outputs: ArrayLike | Sequence[ArrayLike | None] | None = None, retain_graph: bool | None = None,
         create_graph: bool = False, allow_unused: bool = False) -> tuple[Tensor | None, ...]:
    """The gradients of `outputs` with respect to `inputs`, returned rather than accumulated into
    `.grad` (torch.autograd.grad): sum_k grad_outputs[k] * d outputs[k] / d inputs[i] for each i.

    outputs: a Tensor or a sequence of them. inputs: the Tensors (leaves or not) to differentiate
    with respect to; only the part of the graph that leads to them is run. grad_outputs: one
    upstream gradient per output (a Tensor or array of its shape; None: 1 for a one-element
    output); with create_graph, Tensor grad_outputs that require grad are differentiated too.
    retain_graph: keep the graph (default: create_graph). create_graph: the gradients are Tensors
    of a new graph, so they can be differentiated again (Hessian-vector products, gradient
    penalties). allow_unused: an input that the outputs do not depend on gets None; without it,
    that is an error (as torch's). Returns a tuple with one entry per input.
    """
    outputs = _checked_inputs(outputs, "grad", "outputs")
    inputs = _checked_inputs(inputs, "grad", "inputs")
    create_graph = check_bool(create_graph, "create_graph", "grad")
    allow_unused = check_bool(allow_unused, "allow_unused", "grad")
    retain_graph = create_graph if retain_graph is None else check_bool(retain_graph, "retain_graph", "grad")
    if grad_outputs is None or isinstance(grad_outputs, Tensor) or backend.is_array(grad_outputs):
        grad_outputs = [grad_outputs] * len(outputs) if grad_outputs is None else [grad_outputs]
    grad_outputs = list(grad_outputs)
    if len(grad_outputs) != len(outputs):
        raise ValueError(f"grad: grad_outputs has {len(grad_outputs)} entries, expected one per output "
                         f"({len(outputs)})")
    for i, t in enumerate(inputs):
        if not t.requires_grad:
            raise RuntimeError(f"grad: inputs[{i}] does not require grad: nothing can be differentiated with "
                               "respect to it (make it with requires_grad=True)")
    roots, upstream = [], []
    for k, (out, g) in enumerate(zip(outputs, grad_outputs)):
        if out.requires_grad:
            roots.append(out)
            upstream.append(_upstream_gradient(out, g, tensor_gradients(create_graph), f"grad(grad_outputs[{k}])"))
    if not roots:
        raise RuntimeError("grad: no output requires grad (no input had requires_grad=True, or they were made "
                           "under no_grad())")
    hooks.run(hooks.backward_started)
    found = run_backward(roots, upstream, retain_graph=retain_graph, create_graph=create_graph, inputs=inputs,
                         accumulate=False)
    result = []
    for i, t in enumerate(inputs):
        g = found.get(id(t))
        if g is None and not allow_unused:
            raise RuntimeError(f"grad: inputs[{i}] (shape {t.shape}) was not used to compute the outputs; pass "
                               "allow_unused=True to get None for it")
        result.append(g if g is None or isinstance(g, Tensor) else Tensor(g))
    return tuple(result)


def _checked_inputs(tensors, where, name="inputs"):
    """A Tensor or a sequence of Tensors as a list, or a TypeError naming what came."""
    items = [tensors] if isinstance(tensors, Tensor) else list(tensors) if isinstance(tensors, (list, tuple)) else None
    if not items or not all(isinstance(t, Tensor) for t in items):
        raise TypeError(f"{where}: {name} must be a Tensor or a non-empty sequence of Tensors, got "
                        f"{type(tensors).__name__}")
    return items


def _upstream_gradient(out, gradient, tensors, where):
    """The upstream gradient of `out` for the tape: a raw array of its dtype, or a Tensor when the
    pass works on Tensors (one that requires grad then stays in the graph). 1 for a scalar when None."""
    if gradient is None:
        if out.size != 1:
            raise RuntimeError(f"{where}: a gradient is needed for a non-scalar output, got shape {out.shape}; "
                               "pass one of that shape")
        gradient = out.xp.ones_like(out.data)
    tensor = gradient if isinstance(gradient, Tensor) else None
    array = gradient.data if tensor is not None else gradient
    if not backend.is_array(array):  # torch: "gradients can be either Tensors or None"
        if getattr(array, "shape", None) == () and hasattr(array, "dtype"):  # a numpy scalar: a 0-d array
            array = out.xp.asarray(array)
    if not backend.is_array(array):
        raise TypeError(f"{where}: expected an array or a Tensor of shape {out.shape}, got "
                        f"{type(gradient).__name__}; wrap numbers and lists: Tensor(values).to(...) or xp.asarray")
    if tuple(array.shape) != out.shape:
        raise ValueError(f"{where}: expected shape {out.shape}, got {tuple(array.shape)}")
    if backend.device_of(array) != out.device:  # as torch: no silent copy between devices
        raise RuntimeError(f"{where}: expected a gradient on device '{out.device}', got one on "
                           f"'{backend.device_of(array)}'; move it with to_device(gradient, '{out.device}')")
    if not tensors:
        return array.astype(out.dtype, copy=False)
    if tensor is not None and tensor.dtype == out.dtype:
        return tensor
    return tensor.to(dtype=out.dtype) if tensor is not None else Tensor(array.astype(out.dtype, copy=False))


def _shape_arg(shape):
    return tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else tuple(shape)


def _operands(a, b, op):
    """The operands of the binary op `op`, promoted as torch promotes them where numpy 2 would
    differ: beside a floating Tensor, a numpy scalar or 0-d array (a number, like np.sqrt(d)) and
    an integer or bool array or Tensor take the Tensor's dtype (numpy would make float32 * np.float64(2)
    float64, whose backward then fails). Python numbers and two Tensors of one dtype pass as they are."""
    if (b.__class__ is float or b.__class__ is int or a.__class__ is float or a.__class__ is int
            or isinstance(a, Tensor) and isinstance(b, Tensor) and a.data.dtype == b.data.dtype):
        return a, b  # the common case, at the cost of a few comparisons
    dtype = next((t.data.dtype for t in (a, b) if isinstance(t, Tensor) and t.data.dtype.kind == "f"), None)
    if dtype is None:
        return a, b
    return _operand_as(a, dtype, op), _operand_as(b, dtype, op)


def _operand_as(x, dtype, op):
    """One operand beside a Tensor of the floating `dtype` (see `_operands`)."""
    if isinstance(x, Tensor):  # an integer Tensor never requires grad: its values are all that count
        return Tensor(x.data.astype(dtype)) if x.data.dtype.kind in "biu" else x
    kind = getattr(getattr(x, "dtype", None), "kind", None)
    if kind is None or x.dtype == dtype or kind not in "biuf":
        return x
    if kind != "f" or x.ndim == 0:
        return x.astype(dtype)
    raise TypeError(f"{op.__name__}: expected one floating dtype, got {dtype} (a Tensor) and {x.dtype} (an array "
                    f"of shape {x.shape}); cast it with .astype('{dtype}') or make it a Tensor of that dtype")


def _raw_key(key):
    if isinstance(key, tuple):
        return tuple(_raw_key(k) for k in key)
    return key.data if isinstance(key, Tensor) else key


def where(condition: ArrayLike, x: ArrayLike, y: ArrayLike) -> Tensor:
    """Elementwise `x if condition else y` (torch.where), broadcasting the three; gradients flow
    to x and y, none to the boolean condition."""
    cond = condition.data if isinstance(condition, Tensor) else condition
    return Where.apply(*_operands(x, y, Where), condition=cond)


def concatenate(tensors: Sequence[Tensor], axis: int = 0) -> Tensor:
    """The tensors joined along an existing `axis` (torch.cat); each gets its slice of the gradient."""
    return Concatenate.apply(*tensors, axis=axis)


def stack(tensors: Sequence[Tensor], axis: int = 0) -> Tensor:
    """The tensors (all of one shape) joined along a new `axis` (torch.stack); differentiable."""
    return concatenate([t.reshape(t.shape[:axis % (t.ndim + 1)] + (1,) + t.shape[axis % (t.ndim + 1):])
                        for t in tensors], axis=axis)


