"""The rest of `Tensor` (a second read): its shape methods, reductions and elementwise functions
(each one primitive op of autograd/ops.py), conversions to numpy and Python, comparisons,
`detach`, `retain_grad`, `requires_grad_`, `bump_version` (versions.py), the hook registration
(hooks.py); `where`, `concatenate`, `stack`; and the checks of the upstream gradient that
`backward()` and `autograd.grad` get. `Tensor` (autograd/tensor.py) inherits `TensorMethods`.
"""
from __future__ import annotations

import types
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from . import backend, hooks
from .backend import Array, ArrayLike, DType
from .forward_ad import set_tangent
from .function import _tensor_class
from .ops import BroadcastTo, Concatenate, Exp, Log, Max, Mean, Permute, Relu, Reshape, Sqrt, Sum, Tanh, To, Where
from .checks import as_array, check_bool

if TYPE_CHECKING:
    from .tensor import Tensor


def _as_array(data):
    """Arrays keep their dtype; Python scalars and lists of floats become float32 (torch's default)."""
    if backend.is_array(data):
        return data
    arr = as_array(data, "data", "Tensor", backend.get_array_module(data))
    return arr.astype("float32") if arr.dtype == "float64" else arr


class TensorMethods:
    """What `Tensor` does beyond its core (autograd/tensor.py): see the module's docstring."""

    _grad_hooks = ()  # a leaf's `register_hook` hooks: a list once one is registered (hooks.py)

    # -- properties ------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        """The number of dimensions."""
        return self.data.ndim

    @property
    def size(self) -> int:
        """The number of elements (an int, as numpy's `size`; torch's `numel()`)."""
        return self.data.size

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

    def _checked_grad(self, value):
        """`value`, to be set as `.grad`, or TypeError / ValueError."""
        if value is not None:
            if not isinstance(value, TensorMethods):
                raise TypeError(f"grad: expected a Tensor or None, got {type(value).__name__}; wrap an array: "
                                "Tensor(array)")
            if value.shape != self.shape or value.dtype != self.dtype or value.device != self.device:
                raise ValueError(f"grad: expected a Tensor of shape {self.shape}, dtype {self.dtype} on "
                                 f"'{self.device}', got shape {value.shape}, dtype {value.dtype} on '{value.device}'")
        return value

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

    def _set_tangent(self, level, tangent):
        """Carry `tangent` (an array, or None for none) at the dual `level` (autograd.forward_ad)."""
        set_tangent(self, level, tangent)

    def register_hook(self, hook: Callable[[Tensor], Tensor | None]) -> hooks.HookHandle:
        """Call `hook(grad)` with this tensor's gradient in every backward pass (`backward()`,
        `autograd.grad`, with create_graph and in forward mode), as torch's: a Tensor (None for an
        output of a multi-output op that got no gradient); a Tensor it returns (of the gradient's
        shape, dtype and device) is used in its place, None keeps it. For a tensor made by an op,
        the hook gets the sum of its gradients before the op's backward runs; for a leaf, its whole
        gradient of the pass, before it goes into `.grad`. Several run in registration order, each
        given the last one's result; `retain_grad()` keeps the value after all of them. Returns a
        handle whose `remove()` unregisters it. RuntimeError on a tensor that does not require
        grad; TypeError when `hook` is not callable (and, in the pass, when it returns something
        other than a Tensor or None); RuntimeError in the pass for another shape, dtype or device."""
        return hooks.register_hook(self, hook)

    def register_post_accumulate_grad_hook(self, hook: Callable[[Tensor], Any]) -> hooks.HookHandle:
        """Call `hook(self)` each time a backward pass has finished adding to this leaf's `.grad`
        (every contribution of that pass accumulated), as torch's hook of the same name.
        Returns a handle whose `remove()` unregisters it. Raises RuntimeError on a non-leaf and
        TypeError when `hook` is not callable."""
        return hooks.register_post_accumulate_grad_hook(self, hook)

    def retain_grad(self) -> Tensor:
        """Keep `.grad` of this non-leaf after backward (leaves always keep theirs); returns self."""
        if self.creator is not None:  # a weak reference, as torch's: the node must not keep its output alive
            self.creator.retained[self.output_index] = weakref.ref(self)
        return self

    def detach(self) -> Tensor:
        """A new leaf Tensor sharing this one's array (and version counter), outside the graph (no
        gradient flows back)."""
        return _tensor_class()(self)

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

    # comparisons make boolean tensors, outside the graph
    def _compare(self, other, op):
        return _tensor_class()(op(self.data, other.data if isinstance(other, TensorMethods) else other))
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

    # -- shapes, reductions, elementwise --------------------------------------------------------------------------
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

    def sum(self, axis: int | Sequence[int] | None = None, keepdims: bool | None = None, *,
            dim: int | Sequence[int] | None = None, keepdim: bool | None = None) -> Tensor:
        """The sum over `axis` (all axes by default): numpy's names `axis`/`keepdims` or torch's
        `dim`/`keepdim` (one of each pair; TypeError for both)."""
        axis, keepdims = _reduction_args("sum", axis, keepdims, dim, keepdim)
        return Sum.apply(self, axis=axis, keepdims=keepdims)

    def mean(self, axis: int | Sequence[int] | None = None, keepdims: bool | None = None, *,
             dim: int | Sequence[int] | None = None, keepdim: bool | None = None) -> Tensor:
        """The mean over `axis` (all axes by default); names as `sum`'s."""
        axis, keepdims = _reduction_args("mean", axis, keepdims, dim, keepdim)
        return Mean.apply(self, axis=axis, keepdims=keepdims)

    def max(self, dim: int | None = None, keepdim: bool | None = None, *, axis: int | Sequence[int] | None = None,
            keepdims: bool | None = None) -> Tensor | ValuesIndices:
        """torch's max: with no dim, the largest value (the gradient split evenly between ties); with
        `dim` (positional or dim=), a `ValuesIndices` (values, indices) over that one axis, the
        first maximum's index, which alone gets the gradient. numpy's `axis=`/`keepdims=`: the
        values alone, over one axis or several, ties sharing the gradient evenly."""
        return _extremum(self, "max", dim, keepdim, axis, keepdims)

    def min(self, dim: int | None = None, keepdim: bool | None = None, *, axis: int | Sequence[int] | None = None,
            keepdims: bool | None = None) -> Tensor | ValuesIndices:
        """torch's min, numpy's with axis=: as `max`, for the smallest value."""
        return _extremum(self, "min", dim, keepdim, axis, keepdims)

    def t(self) -> Tensor:
        """torch's t(): a matrix transposed; a 0-D or 1-D tensor as it is; RuntimeError beyond 2-D."""
        if self.ndim > 2:
            raise RuntimeError(f"t() expects a tensor with <= 2 dimensions, got {self.ndim} (shape {self.shape}); "
                               "use transpose(a, b) or permute")
        return self.transpose() if self.ndim == 2 else self

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


class ValuesIndices(NamedTuple):
    """What `max(dim)` and `min(dim)` return (torch.return_types.max): the values, a Tensor in the
    graph, and the int64 indices of the first extremum along the dim, outside it."""
    values: Tensor
    indices: Tensor


def _reduction_args(where, axis, keepdims, dim, keepdim):
    """(axis, keepdims) from numpy's or torch's names of a reduction's arguments, or TypeError for both."""
    if dim is not None and axis is not None:
        raise TypeError(f"{where}: got axis={axis!r} (numpy's name) and dim={dim!r} (torch's): pass one of them")
    if keepdim is not None and keepdims is not None:
        raise TypeError(f"{where}: got keepdims={keepdims!r} (numpy's name) and keepdim={keepdim!r} (torch's): "
                        "pass one of them")
    axis = dim if axis is None else axis
    return tuple(axis) if isinstance(axis, list) else axis, bool(keepdims or keepdim)


def _extremum(x, where, dim, keepdim, axis, keepdims):
    """Tensor.max / Tensor.min: numpy's form (axis=, keepdims=), the global value, or torch's (dim)."""
    if axis is not None or keepdims is not None:  # numpy's names: values only
        if dim is not None or keepdim is not None:
            raise TypeError(f"{where}: got numpy's axis=/keepdims= and torch's dim/keepdim together: pass one form")
        return Max.apply(x, axis=axis, keepdims=bool(keepdims)) if where == "max" else \
            -Max.apply(-x, axis=axis, keepdims=bool(keepdims))
    if dim is None:
        if keepdim is not None:
            raise TypeError(f"{where}: keepdim needs a dim (as torch's {where}(dim, keepdim))")
        return Max.apply(x, axis=None, keepdims=False) if where == "max" else -Max.apply(-x, axis=None, keepdims=False)
    if isinstance(dim, bool) or not hasattr(dim, "__index__"):
        raise TypeError(f"{where}: dim must be one int (torch's {where}(dim)), got {type(dim).__name__} {dim!r}; "
                        f"over several axes use {where}(axis=...) (numpy's form: values only)")
    dim = dim.__index__()
    if not -x.ndim <= dim < max(x.ndim, 1):
        raise IndexError(f"{where}: dim {dim} is out of range for a tensor of {x.ndim} dimensions")
    xp, ndim = x.xp, x.ndim
    dim %= max(ndim, 1)
    find = xp.argmax if where == "max" else xp.argmin
    indices = find(x.data, axis=dim, keepdims=True) if ndim else xp.zeros((), "int64")
    # the values: x at the indices along dim, every other axis walked by a broadcast arange
    key = tuple(indices if a == dim else xp.arange(n).reshape([-1 if b == a else 1 for b in range(ndim)])
                for a, n in enumerate(x.shape))
    values = x[key] if ndim else x
    if ndim and not keepdim:
        values, indices = values.reshape(values.shape[:dim] + values.shape[dim + 1:]), indices.squeeze(dim)
    return ValuesIndices(values, _tensor_class()(indices.astype("int64")))


def _checked_inputs(tensors, where, name="inputs"):
    """A Tensor or a sequence of Tensors as a list, or a TypeError naming what came."""
    items = [tensors] if isinstance(tensors, TensorMethods) else list(tensors) if isinstance(tensors, (list, tuple)) else None
    if not items or not all(isinstance(t, TensorMethods) for t in items):
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
    tensor = gradient if isinstance(gradient, TensorMethods) else None
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
    return tensor.to(dtype=out.dtype) if tensor is not None else _tensor_class()(array.astype(out.dtype, copy=False))


def _shape_arg(shape):
    return tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else tuple(shape)


def _operands(a, b, op):
    """The operands of the binary op `op`, promoted as torch promotes them where numpy 2 would
    differ: beside a floating Tensor, a numpy scalar or 0-d array (a number, like np.sqrt(d)) and
    an integer or bool array or Tensor take the Tensor's dtype (numpy would make float32 * np.float64(2)
    float64, whose backward then fails). Python numbers and two Tensors of one dtype pass as they are."""
    if (b.__class__ is float or b.__class__ is int or a.__class__ is float or a.__class__ is int
            or isinstance(a, TensorMethods) and isinstance(b, TensorMethods) and a.data.dtype == b.data.dtype):
        return a, b  # the common case, at the cost of a few comparisons
    dtype = next((t.data.dtype for t in (a, b) if isinstance(t, TensorMethods) and t.data.dtype.kind == "f"), None)
    if dtype is None:
        return a, b
    return _operand_as(a, dtype, op), _operand_as(b, dtype, op)


def _operand_as(x, dtype, op):
    """One operand beside a Tensor of the floating `dtype` (see `_operands`)."""
    if isinstance(x, TensorMethods):  # an integer Tensor never requires grad: its values are all that count
        return _tensor_class()(x.data.astype(dtype)) if x.data.dtype.kind in "biu" else x
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
    return key.data if isinstance(key, TensorMethods) else key


def where(condition: ArrayLike, x: ArrayLike, y: ArrayLike) -> Tensor:
    """Elementwise `x if condition else y` (torch.where), broadcasting the three; gradients flow
    to x and y, none to the boolean condition."""
    cond = condition.data if isinstance(condition, TensorMethods) else condition
    return Where.apply(*_operands(x, y, Where), condition=cond)


def concatenate(tensors: Sequence[Tensor], axis: int = 0) -> Tensor:
    """The tensors joined along an existing `axis` (torch.cat); each gets its slice of the gradient."""
    return Concatenate.apply(*tensors, axis=axis)


def stack(tensors: Sequence[Tensor], axis: int = 0) -> Tensor:
    """The tensors (all of one shape) joined along a new `axis` (torch.stack); differentiable."""
    return concatenate([t.reshape(t.shape[:axis % (t.ndim + 1)] + (1,) + t.shape[axis % (t.ndim + 1):])
                        for t in tensors], axis=axis)


