"""`Tensor` and the primitive differentiable ops, each a small `Function`."""
from __future__ import annotations

import copy
import math
import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from . import backend, deferred, lookahead
from .backend import Array, ArrayLike, DType
from .checks import as_array, check_bool
from .function import Function, _forward, run_backward, tensor_gradients


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
    `creator` (the Function node that made it; None for leaves). Arithmetic (`+ - * / @ **`,
    unary `-`), indexing and the methods below are differentiable; comparisons (`<`, `eq`, ...)
    give boolean Tensors outside the graph.
    """

    __array_priority__ = 1000  # numpy array (op) Tensor defers to Tensor's reflected op
    _post_accumulate_grad_hooks = ()  # a list once a hook is registered
    _tangents = None  # {dual level: tangent array} once forward mode gives it one (autograd.forward_ad)

    def __init__(self, data: ArrayLike, requires_grad: bool = False, dtype: DType | None = None,
                 device: str | None = None):
        if isinstance(data, Tensor):
            data = data.data
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
        lookahead.end_pass()  # the forward pass's dropout masks predict the next pass's
        run_backward([self], [gradient], retain_graph=retain_graph, create_graph=create_graph, inputs=inputs)

    def _accumulate_grad(self, grad, tensors=False):
        """Add one contribution to `.grad`: a raw array (first order) or a Tensor (create_graph,
        forward mode: see function.tensor_gradients), added out of place so that the sum keeps its
        graph and tangent."""
        current = self._grad
        if tensors:
            self._grad = grad if current is None else current + grad
        elif current is None:
            self._grad = Tensor(backend.get_array_module(grad).array(grad))  # a copy: gradients may alias
        elif current.creator is None:
            current.data += grad
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
        """A new leaf Tensor sharing this one's array, outside the graph (no gradient flows back)."""
        return Tensor(self.data)

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
    # reading a value is where the deferred device checks of the ops before it report (autograd.deferred)
    def numpy(self) -> Array:
        """The values as a numpy array: the array itself on "cpu", a host copy from "cuda"/"test".
        Reading values first reports any pending deferred device check of earlier ops (an id out
        of range, ...)."""
        deferred.raise_pending()
        return backend.as_numpy(self.data)

    def item(self) -> float | int | bool:
        """The value of a one-element tensor as a Python number (ValueError for more elements);
        reports pending deferred checks first, like `numpy()`."""
        deferred.raise_pending()
        return self.data.item()

    def __array__(self, dtype: DType | None = None, copy: bool | None = None) -> Array:
        """`np.asarray(tensor)` of a "cpu" tensor: its array (as torch's `__array__`); a tensor on
        another device raises TypeError, since that would be a hidden copy to the host: use `.numpy()`."""
        if self.device != "cpu":
            raise TypeError(f"can't convert a '{self.device}' tensor to a numpy array implicitly; use .numpy(), "
                            "which copies it to the host")
        deferred.raise_pending()
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
    lookahead.end_pass()
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


def unbroadcast(grad: Array, shape: tuple[int, ...]) -> Array:
    """Sum the raw array `grad` over the axes that broadcasting added or stretched, back to
    `shape`: the backward of a broadcast, for hand-written ops' backward."""
    if grad.shape == shape:
        return grad
    extra = grad.ndim - len(shape)
    if extra:
        grad = grad.sum(axis=tuple(range(extra)))
    stretched = tuple(i for i, n in enumerate(shape) if n == 1 and grad.shape[i] != 1)
    return grad.sum(axis=stretched, keepdims=True) if stretched else grad


def _shape(x):
    return getattr(x, "shape", None)  # None for Python scalars: they get no gradient


# ----------------------------------------------------------------------------------------
# Primitive ops. Each caches only what its backward needs.
# ----------------------------------------------------------------------------------------
class To(Function):
    @staticmethod
    def forward(ctx, x, device, dtype):
        ctx.device, ctx.dtype, ctx.target = backend.device_of(x), x.dtype, (device, dtype)
        return backend.to_device(x, device).astype(dtype, copy=False)

    @staticmethod
    def backward(ctx, grad):
        return backend.to_device(grad, ctx.device).astype(ctx.dtype, copy=False)

    @staticmethod
    def differentiable_backward(ctx, grad):
        return grad.to(device=ctx.device, dtype=ctx.dtype)

    @staticmethod
    def jvp(ctx, t):
        device, dtype = ctx.target
        return backend.to_device(t, device).astype(dtype, copy=False)


class Add(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.shapes = _shape(a), _shape(b)
        return a + b

    @staticmethod
    def backward(ctx, grad):
        # out = a + b  ->  da = grad, db = grad (summed over broadcast axes)
        return tuple(unbroadcast(grad, s) if need else None
                     for s, need in zip(ctx.shapes, ctx.needs_input_grad))

    @staticmethod
    def differentiable_backward(ctx, grad):
        return tuple(grad.sum_to(s) if need else None for s, need in zip(ctx.shapes, ctx.needs_input_grad))

    @staticmethod
    def jvp(ctx, ta, tb):
        # out = a + b  ->  t_out = ta + tb
        return _tangent_sum(ctx.shapes, ta, tb)


class Sub(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.shapes = _shape(a), _shape(b)
        return a - b

    @staticmethod
    def backward(ctx, grad):
        # out = a - b  ->  da = grad, db = -grad
        da = unbroadcast(grad, ctx.shapes[0]) if ctx.needs_input_grad[0] else None
        db = unbroadcast(-grad, ctx.shapes[1]) if ctx.needs_input_grad[1] else None
        return da, db

    @staticmethod
    def differentiable_backward(ctx, grad):
        da = grad.sum_to(ctx.shapes[0]) if ctx.needs_input_grad[0] else None
        db = (-grad).sum_to(ctx.shapes[1]) if ctx.needs_input_grad[1] else None
        return da, db

    @staticmethod
    def jvp(ctx, ta, tb):
        # out = a - b  ->  t_out = ta - tb
        return _tangent_sum(ctx.shapes, ta, None if tb is None else -tb)


class Mul(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        # out = a * b  ->  da = grad * b, db = grad * a
        da = unbroadcast(grad * b, a.shape) if ctx.needs_input_grad[0] else None
        db = unbroadcast(grad * a, b.shape) if ctx.needs_input_grad[1] else None
        return da, db

    @staticmethod
    def differentiable_backward(ctx, grad):
        a, b = _graph_operands(ctx)
        da = (grad * b).sum_to(a.shape) if ctx.needs_input_grad[0] else None
        db = (grad * a).sum_to(b.shape) if ctx.needs_input_grad[1] else None
        return da, db

    @staticmethod
    def jvp(ctx, ta, tb):
        a, b = ctx.saved_tensors
        # out = a * b  ->  t_out = ta * b + a * tb
        return _tangent_sum((_shape(a), _shape(b)), None if ta is None else ta * b, None if tb is None else a * tb)


class Div(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a / b

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        # out = a / b  ->  da = grad / b, db = -grad * a / b^2, computed as (a / b) / b as torch does
        # (b * b underflows to 0 for |b| < 1e-19 in float32, and a / 0 is inf where the gradient is finite)
        da = unbroadcast(grad / b, a.shape) if ctx.needs_input_grad[0] else None
        db = unbroadcast(-grad * (a / b / b), b.shape) if ctx.needs_input_grad[1] else None
        return da, db

    @staticmethod
    def differentiable_backward(ctx, grad):
        a, b = _graph_operands(ctx)
        da = (grad / b).sum_to(a.shape) if ctx.needs_input_grad[0] else None
        db = (-grad * (a / b / b)).sum_to(b.shape) if ctx.needs_input_grad[1] else None
        return da, db

    @staticmethod
    def jvp(ctx, ta, tb):
        a, b = ctx.saved_tensors
        # out = a / b  ->  t_out = ta / b - tb * a / b^2, as (a / b) / b like the backward
        return _tangent_sum((_shape(a), _shape(b)), None if ta is None else ta / b, None if tb is None else -tb * (a / b / b))


class Neg(Function):
    @staticmethod
    def forward(ctx, x):
        return -x

    @staticmethod
    def backward(ctx, grad):
        return -grad

    @staticmethod
    def differentiable_backward(ctx, grad):
        return -grad

    @staticmethod
    def jvp(ctx, t):
        return -t


class Pow(Function):
    @staticmethod
    def forward(ctx, a, b):
        out = a ** b
        ctx.save_for_backward(a, b, out)
        return out

    @staticmethod
    def backward(ctx, grad):
        a, b, out = ctx.saved_tensors
        xp = backend.get_array_module(out)
        da = db = None
        if ctx.needs_input_grad[0]:
            # out = a^b  ->  da = grad * b * a^(b-1); 0 where b == 0 (torch's: not 0 * 0^-1 = NaN at a = 0)
            da = grad * b * a ** (b - 1)
            if backend.is_array(b):
                da = xp.where(b == 0, 0, da)
            elif b == 0:
                da = xp.zeros_like(da)
            da = unbroadcast(da, a.shape)
        if ctx.needs_input_grad[1]:
            # out = a^b  ->  db = grad * out * log(a); 0 where a == 0 and b >= 0 (torch's: not 0 * -inf = NaN)
            log_a = xp.log(a) if hasattr(a, "dtype") else math.log(a) if a > 0 else -math.inf if a == 0 else math.nan
            db = unbroadcast(grad * xp.where((a == 0) & (b >= 0), 0, out * log_a), b.shape)
        return da, db

    @staticmethod
    def differentiable_backward(ctx, grad):
        a, b = _graph_operands(ctx)
        a_raw, b_raw, out = ctx.saved_tensors
        da = db = None
        if ctx.needs_input_grad[0]:  # the first-order rule's zero where b == 0, as a constant mask
            da = (grad * b * a ** (b - 1)).sum_to(a_raw.shape)
            if backend.is_array(b_raw) or b_raw == 0:
                da = where(b_raw == 0, 0, da) if backend.is_array(b_raw) else da * 0
        if ctx.needs_input_grad[1]:  # log(a) is taken of 1 where a == 0: where's other branch gets no NaN
            zero = (a_raw == 0) & (b_raw >= 0)
            log_a = (where(a_raw == 0, 1, a).log() if isinstance(a, Tensor) else
                     math.log(a) if a > 0 else -math.inf if a == 0 else math.nan)
            db = (grad * where(zero, 0, ctx.as_output(out) * log_a)).sum_to(b_raw.shape)
        return da, db

    @staticmethod
    def jvp(ctx, ta, tb):
        a, b, out = ctx.saved_tensors
        xp = backend.get_array_module(out)
        da = db = None
        if ta is not None:  # out = a^b  ->  ta * b * a^(b-1), 0 where b == 0 (as the backward)
            da = xp.where(b == 0, 0, ta * b * a ** (b - 1)) if backend.is_array(b) or b == 0 else ta * b * a ** (b - 1)
        if tb is not None:  # out = a^b  ->  tb * out * log(a), 0 where a == 0 and b >= 0
            log_a = xp.log(xp.where(a == 0, 1, a)) if hasattr(a, "dtype") else (math.log(a) if a > 0 else 0.0 if a == 0
                                                                                 else math.nan)
            db = tb * xp.where((a == 0) & (b >= 0), 0, out * log_a)
        return _tangent_sum((_shape(a), _shape(b)), da, db).astype(out.dtype, copy=False)


class MatMul(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a @ b

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        # 1-D operands behave as (1, k) rows / (k, 1) columns with that axis removed
        a2 = a[None, :] if a.ndim == 1 else a
        b2 = b[:, None] if b.ndim == 1 else b
        g = grad[..., None] if b.ndim == 1 else grad
        g = g[..., None, :] if a.ndim == 1 else g
        # out = a @ b  ->  da = grad @ b^T, db = a^T @ grad (summed over broadcast batch axes)
        da = db = None
        if ctx.needs_input_grad[0]:
            da = unbroadcast(g @ b2.swapaxes(-1, -2), a2.shape).reshape(a.shape)
        if ctx.needs_input_grad[1]:
            db = unbroadcast(a2.swapaxes(-1, -2) @ g, b2.shape).reshape(b.shape)
        return da, db

    @staticmethod
    def differentiable_backward(ctx, grad):
        a, b = _graph_operands(ctx)
        a2 = a.reshape(1, -1) if a.ndim == 1 else a
        b2 = b.reshape(-1, 1) if b.ndim == 1 else b
        g = grad.reshape(grad.shape + (1,)) if b.ndim == 1 else grad
        g = g.reshape(g.shape[:-1] + (1, g.shape[-1])) if a.ndim == 1 else g
        da = (g @ b2.swapaxes(-1, -2)).sum_to(a2.shape).reshape(a.shape) if ctx.needs_input_grad[0] else None
        db = (a2.swapaxes(-1, -2) @ g).sum_to(b2.shape).reshape(b.shape) if ctx.needs_input_grad[1] else None
        return da, db

    @staticmethod
    def jvp(ctx, ta, tb):
        a, b = ctx.saved_tensors
        # out = a @ b  ->  t_out = ta @ b + a @ tb
        parts = [p for p in (None if ta is None else ta @ b, None if tb is None else a @ tb) if p is not None]
        return parts[0] if len(parts) == 1 else parts[0] + parts[1]


class Exp(Function):
    @staticmethod
    def forward(ctx, x):
        out = backend.get_array_module(x).exp(x)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return grad * out  # d exp(x) = exp(x)

    @staticmethod
    def differentiable_backward(ctx, grad):
        return grad * ctx.as_output(ctx.saved_tensors[0])

    @staticmethod
    def jvp(ctx, t):
        return t * ctx.saved_tensors[0]  # d exp(x) = exp(x) dx


class Log(Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return backend.get_array_module(x).log(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad / x  # d log(x) = 1/x

    @staticmethod
    def differentiable_backward(ctx, grad):
        return grad / ctx.inputs[0]

    @staticmethod
    def jvp(ctx, t):
        return t / ctx.saved_tensors[0]  # d log(x) = dx / x


class Sqrt(Function):
    @staticmethod
    def forward(ctx, x):
        out = backend.get_array_module(x).sqrt(x)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return grad / (2 * out)  # d sqrt(x) = 1 / (2 sqrt(x))

    @staticmethod
    def differentiable_backward(ctx, grad):
        return grad / (2 * ctx.as_output(ctx.saved_tensors[0]))

    @staticmethod
    def jvp(ctx, t):
        return t / (2 * ctx.saved_tensors[0])  # d sqrt(x) = dx / (2 sqrt(x))


class Tanh(Function):
    @staticmethod
    def forward(ctx, x):
        out = backend.get_array_module(x).tanh(x)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return grad * (1 - out * out)  # d tanh(x) = 1 - tanh(x)^2

    @staticmethod
    def differentiable_backward(ctx, grad):
        out = ctx.as_output(ctx.saved_tensors[0])
        return grad * (1 - out * out)

    @staticmethod
    def jvp(ctx, t):
        (out,) = ctx.saved_tensors
        return t * (1 - out * out)  # d tanh(x) = (1 - tanh(x)^2) dx


class Relu(Function):
    @staticmethod
    def forward(ctx, x):
        out = backend.get_array_module(x).maximum(x, 0)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return grad * ~(out <= 0)  # d relu(x) = [x > 0], taken as [not x <= 0]: a NaN passes grad (torch's)

    @staticmethod
    def differentiable_backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return grad * ~(out <= 0)  # the step's derivative is 0: the mask is a constant

    @staticmethod
    def jvp(ctx, t):
        (out,) = ctx.saved_tensors
        return t * ~(out <= 0)  # d relu(x) = [x > 0] dx


class Where(Function):
    @staticmethod
    def forward(ctx, x, y, condition):
        xp = backend.get_array_module(x, y, condition)
        ctx.condition, ctx.shapes = condition, (_shape(x), _shape(y))
        ctx.out_shape = _broadcast_shape(_shape(condition), _shape(x), _shape(y))
        return xp.where(condition, x, y)

    @staticmethod
    def backward(ctx, grad):
        xp = backend.get_array_module(grad)
        # out = where(c, x, y)  ->  dx = grad where c, dy = grad where not c
        dx = unbroadcast(xp.where(ctx.condition, grad, 0), ctx.shapes[0]) if ctx.needs_input_grad[0] else None
        dy = unbroadcast(xp.where(ctx.condition, 0, grad), ctx.shapes[1]) if ctx.needs_input_grad[1] else None
        return dx, dy

    @staticmethod
    def differentiable_backward(ctx, grad):
        dx = where(ctx.condition, grad, 0).sum_to(ctx.shapes[0]) if ctx.needs_input_grad[0] else None
        dy = where(ctx.condition, 0, grad).sum_to(ctx.shapes[1]) if ctx.needs_input_grad[1] else None
        return dx, dy

    @staticmethod
    def jvp(ctx, tx, ty):
        xp = backend.get_array_module(*[t for t in (tx, ty) if t is not None])
        # out = where(c, x, y)  ->  t_out = where(c, tx, ty)
        out = xp.where(ctx.condition, 0 if tx is None else tx, 0 if ty is None else ty)
        return out if out.shape == ctx.out_shape else xp.broadcast_to(out, ctx.out_shape)


def _reduced_grad(grad, shape, axis, keepdims):
    """Put back the reduced axes (size 1) so `grad` broadcasts against the input."""
    if axis is not None and not keepdims:
        axes = (axis,) if isinstance(axis, int) else axis
        grad = grad.reshape([1 if i in [a % len(shape) for a in axes] else n for i, n in enumerate(shape)])
    elif axis is None and not keepdims:
        grad = grad.reshape((1,) * len(shape))
    return grad


class Sum(Function):
    @staticmethod
    def forward(ctx, x, axis, keepdims):
        ctx.shape, ctx.axis, ctx.keepdims = x.shape, axis, keepdims
        return x.sum(axis=axis, keepdims=keepdims)

    @staticmethod
    def backward(ctx, grad):
        xp = backend.get_array_module(grad)
        # out = sum(x)  ->  dx = grad broadcast over the summed axes
        return xp.broadcast_to(_reduced_grad(grad, ctx.shape, ctx.axis, ctx.keepdims), ctx.shape)

    @staticmethod
    def differentiable_backward(ctx, grad):
        return _reduced_grad(grad, ctx.shape, ctx.axis, ctx.keepdims).expand(ctx.shape)

    @staticmethod
    def jvp(ctx, t):
        return t.sum(axis=ctx.axis, keepdims=ctx.keepdims)


class Mean(Function):
    @staticmethod
    def forward(ctx, x, axis, keepdims):
        out = x.mean(axis=axis, keepdims=keepdims)
        ctx.shape, ctx.axis, ctx.keepdims, ctx.count = x.shape, axis, keepdims, x.size // max(out.size, 1)
        return out

    @staticmethod
    def backward(ctx, grad):
        xp = backend.get_array_module(grad)
        # out = sum(x) / n  ->  dx = grad / n broadcast over the reduced axes
        g = _reduced_grad(grad, ctx.shape, ctx.axis, ctx.keepdims) / ctx.count
        return xp.broadcast_to(g, ctx.shape)

    @staticmethod
    def differentiable_backward(ctx, grad):
        return (_reduced_grad(grad, ctx.shape, ctx.axis, ctx.keepdims) / ctx.count).expand(ctx.shape)

    @staticmethod
    def jvp(ctx, t):
        return t.mean(axis=ctx.axis, keepdims=ctx.keepdims)


class Max(Function):
    @staticmethod
    def forward(ctx, x, axis, keepdims):
        out = x.max(axis=axis, keepdims=True)
        ctx.save_for_backward(x, out)
        ctx.axis, ctx.keepdims = axis, keepdims
        return out if keepdims else _squeeze(out, axis)

    @staticmethod
    def backward(ctx, grad):
        x, out = ctx.saved_tensors
        # out = max(x)  ->  dx = grad at the maximum (shared evenly between ties)
        is_max = x == out
        share = is_max / is_max.sum(axis=ctx.axis, keepdims=True)
        return share.astype(x.dtype) * _reduced_grad(grad, x.shape, ctx.axis, ctx.keepdims)

    @staticmethod
    def differentiable_backward(ctx, grad):
        x, out = ctx.saved_tensors
        is_max = x == out  # which entries are maxima is constant near x: the share is too
        share = is_max / is_max.sum(axis=ctx.axis, keepdims=True)
        return _reduced_grad(grad, x.shape, ctx.axis, ctx.keepdims) * share.astype(x.dtype)

    @staticmethod
    def jvp(ctx, t):
        x, out = ctx.saved_tensors
        # out = max(x)  ->  t_out = the mean of t over the maxima (ties share, as in the backward)
        is_max = x == out
        share = (is_max / is_max.sum(axis=ctx.axis, keepdims=True)).astype(t.dtype)
        return (t * share).sum(axis=ctx.axis, keepdims=ctx.keepdims)


def _squeeze(x, axis):
    return x.reshape(()) if axis is None else x.squeeze(axis)


class Reshape(Function):
    @staticmethod
    def forward(ctx, x, shape):
        ctx.shape, ctx.target = x.shape, shape
        return x.reshape(shape)

    @staticmethod
    def backward(ctx, grad):
        return grad.reshape(ctx.shape)

    @staticmethod
    def differentiable_backward(ctx, grad):
        return grad.reshape(ctx.shape)

    @staticmethod
    def jvp(ctx, t):
        return t.reshape(ctx.target)


class Permute(Function):
    @staticmethod
    def forward(ctx, x, axes):
        ctx.axes = axes
        return x.transpose(axes)

    @staticmethod
    def backward(ctx, grad):
        # out = x.transpose(axes)  ->  dx = grad.transpose(inverse of axes)
        return grad.transpose(sorted(range(len(ctx.axes)), key=ctx.axes.__getitem__))

    @staticmethod
    def differentiable_backward(ctx, grad):
        return grad.permute(sorted(range(len(ctx.axes)), key=ctx.axes.__getitem__))

    @staticmethod
    def jvp(ctx, t):
        return t.transpose(ctx.axes)


class BroadcastTo(Function):
    @staticmethod
    def forward(ctx, x, shape):
        ctx.shape, ctx.target = x.shape, shape
        return backend.get_array_module(x).broadcast_to(x, shape)

    @staticmethod
    def backward(ctx, grad):
        return unbroadcast(grad, ctx.shape)

    @staticmethod
    def differentiable_backward(ctx, grad):
        return grad.sum_to(ctx.shape)

    @staticmethod
    def jvp(ctx, t):
        return backend.get_array_module(t).broadcast_to(t, ctx.target)


class GetItem(Function):
    @staticmethod
    def forward(ctx, x, key):
        ctx.shape = x.shape
        keys = key if isinstance(key, tuple) else (key,)
        ctx.scatter = any(backend.is_array(k) or isinstance(k, list) for k in keys)
        # array and list keys are kept as copies: a caller refilling its index buffer before
        # backward must not move the gradient (torch raises "modified by an inplace operation")
        ctx.key = _copied_key(key) if ctx.scatter else key
        return x[key]

    @staticmethod
    def backward(ctx, grad):
        # out = x[key]  ->  dx = zeros with dx[key] += grad
        return _index_added(grad, ctx.shape, ctx.key, ctx.scatter)

    @staticmethod
    def differentiable_backward(ctx, grad):
        return IndexAdd.apply(grad, shape=ctx.shape, key=ctx.key, scatter=ctx.scatter)

    @staticmethod
    def jvp(ctx, t):
        return t[ctx.key]


def _index_added(grad, shape, key, scatter):
    """Zeros of `shape` with `grad` added at `key`; integer-array keys may repeat, so they scatter-add."""
    xp = backend.get_array_module(grad)
    dx = xp.zeros(shape, grad.dtype)
    if scatter:
        xp.add.at(dx, key, grad)
    else:
        dx[key] = grad
    return dx


def _copied_key(key):
    """An index key with its arrays and lists copied (slices, ints, None and Ellipsis are immutable)."""
    if isinstance(key, tuple):
        return tuple(_copied_key(k) for k in key)
    return key.copy() if backend.is_array(key) else copy.deepcopy(key) if isinstance(key, list) else key


class Concatenate(Function):
    @staticmethod
    def forward(ctx, *arrays, axis):
        ctx.axis, ctx.sizes, ctx.shapes = axis, [a.shape[axis] for a in arrays], [a.shape for a in arrays]
        return backend.get_array_module(*arrays).concatenate(arrays, axis=axis)

    @staticmethod
    def backward(ctx, grad):
        xp = backend.get_array_module(grad)
        # out = [a, b, ...] along axis  ->  each input gets its slice of grad
        bounds = [sum(ctx.sizes[:i]) for i in range(1, len(ctx.sizes))]
        return tuple(xp.split(grad, bounds, axis=ctx.axis))

    @staticmethod
    def differentiable_backward(ctx, grad):
        bounds = [0] + [sum(ctx.sizes[:i + 1]) for i in range(len(ctx.sizes))]
        before = (slice(None),) * (ctx.axis % grad.ndim)
        return tuple(grad[before + (slice(lo, hi),)] for lo, hi in zip(bounds, bounds[1:]))

    @staticmethod
    def jvp(ctx, *tangents):
        like = next(t for t in tangents if t is not None)
        xp = backend.get_array_module(like)
        return xp.concatenate([xp.zeros(shape, like.dtype) if t is None else t for t, shape in zip(tangents, ctx.shapes)],
                              axis=ctx.axis)


class IndexAdd(Function):
    """Zeros of `shape` with `grad` added at `key` (repeated integer-array keys add up): GetItem's
    backward as an op, so that it can be differentiated again (its backward is GetItem's forward)."""

    @staticmethod
    def forward(ctx, grad, shape, key, scatter):
        ctx.key, ctx.shape, ctx.scatter = key, shape, scatter
        return _index_added(grad, shape, key, scatter)

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.key]

    @staticmethod
    def differentiable_backward(ctx, grad):
        return GetItem.apply(grad, key=ctx.key)

    @staticmethod
    def jvp(ctx, t):
        return _index_added(t, ctx.shape, ctx.key, ctx.scatter)


def _graph_operands(ctx):
    """The two operands of a binary op for its differentiable backward: the input Tensors of the
    graph, or, for an operand that was no Tensor, its raw value (a constant), as forward saved it."""
    raw = ctx.saved_tensors
    return tuple(t if t is not None else r for t, r in zip(ctx.inputs, raw))


def _tangent_sum(shapes, ta, tb):
    """ta + tb for a binary op's operands of `shapes`, where either may be None (no tangent): the
    result has the broadcast shape of the output, as the op's output does."""
    present = [t for t in (ta, tb) if t is not None]
    xp = backend.get_array_module(*present)
    shape = _broadcast_shape(*shapes)
    total = present[0] if len(present) == 1 else present[0] + present[1]
    return total if total.shape == shape else xp.broadcast_to(total, shape)


def _broadcast_shape(*shapes):
    """The shape that arrays of `shapes` broadcast to (None entries: Python numbers, shape ())."""
    shapes = [s for s in shapes if s is not None]
    ndim = max((len(s) for s in shapes), default=0)
    out = []
    for axis in range(-ndim, 0):
        sizes = {s[axis] for s in shapes if len(s) >= -axis} - {1}
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)
