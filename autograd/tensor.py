"""`Tensor`: an array plus what reverse mode needs, and `where`, `concatenate`, `stack`.

Its operators and methods are the primitive ops of autograd/ops.py; `backward()` walks the tape
of autograd/function.py.
"""
from __future__ import annotations

import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from . import backend, hooks
from .backend import Array, ArrayLike, DType
from .checks import as_array, check_bool
from .function import run_backward
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

    Attributes: `data` (numpy/cupy array), `grad` (array or None), `requires_grad`,
    `creator` (the Function node that made it; None for leaves). Arithmetic (`+ - * / @ **`,
    unary `-`), indexing and the methods below are differentiable; comparisons (`<`, `eq`, ...)
    give boolean Tensors outside the graph.
    """

    __array_priority__ = 1000  # numpy array (op) Tensor defers to Tensor's reflected op
    _post_accumulate_grad_hooks = ()  # a list once a hook is registered

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
        self.grad = None
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
    def backward(self, grad: ArrayLike | None = None, retain_graph: bool = False) -> None:
        """Accumulate d(self)/d(leaf) * grad into `.grad` of every leaf that requires grad (torch's).

        grad: the upstream gradient, of this tensor's shape and on its device; may be omitted
        for a scalar (one element) output, which then takes 1. retain_graph=False frees the graph
        as it goes (a second backward through it raises), as in torch. Raises RuntimeError when
        this tensor does not require grad, or grad is missing for a non-scalar or on another
        device, and ValueError for a grad of another shape."""
        if not self.requires_grad:
            raise RuntimeError("backward() on a tensor that does not require grad "
                               "(no input had requires_grad=True, or it was made under no_grad())")
        if grad is None:
            if self.size != 1:
                raise RuntimeError(f"backward() without a gradient needs a scalar output, got shape "
                                   f"{self.shape}; pass grad= of that shape")
            grad = self.xp.ones_like(self.data)
        grad = grad.data if isinstance(grad, Tensor) else grad
        if not backend.is_array(grad):  # torch: "gradients can be either Tensors or None"
            if getattr(grad, "shape", None) == () and hasattr(grad, "dtype"):  # a numpy scalar: a 0-d array
                grad = self.xp.asarray(grad)
        if not backend.is_array(grad):
            raise TypeError(f"backward(grad): expected an array or a Tensor of shape {self.shape}, got "
                            f"{type(grad).__name__}; wrap numbers and lists: Tensor(values).to(...) or xp.asarray")
        if tuple(grad.shape) != self.shape:
            raise ValueError(f"backward(grad): expected shape {self.shape}, got {tuple(grad.shape)}")
        if backend.device_of(grad) != self.device:  # as torch: no silent copy between devices
            raise RuntimeError(f"backward(grad): expected a gradient on device '{self.device}', got one on "
                               f"'{backend.device_of(grad)}'; move it with to_device(grad, '{self.device}')")
        hooks.run(hooks.backward_started)  # npformer's runtime: the forward pass's dropout masks predict the next's
        run_backward(self, grad.astype(self.dtype, copy=False), retain_graph)

    def _accumulate_leaf(self, grad):
        if self.grad is None:
            self.grad = grad.copy()  # own it: gradients of different leaves may alias
        else:
            self.grad += grad

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

