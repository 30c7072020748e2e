"""`Tensor`: an array, its gradient and the op that made it (the first read of the core, with
autograd/function.py and autograd/gradcheck.py).

A Tensor holds `data` (an array), `requires_grad`, `creator` (the Function node that made it,
None for a leaf) and, after backward, `grad`. Its arithmetic operators are primitive ops
(autograd/ops.py) applied through `Function.apply`, which records the graph; `backward()` checks
the upstream gradient and runs the backward pass (`function.run_backward`). The rest of its
methods (reshape, sum, numpy(), comparisons, ...) it inherits from `TensorMethods`, a second read
(autograd/tensor_methods.py).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from . import backend, hooks
from .backend import ArrayLike, DType
from .checks import check_bool
from .function import run_backward, tensor_gradients
from .ops import Add, Div, GetItem, MatMul, Mul, Neg, Pow, Sub
from .tensor_methods import (TensorMethods, _as_array, _checked_inputs, _operands, _raw_key,  # noqa: F401 (where,
                             _upstream_gradient, concatenate, stack, where)  # ...: autograd.tensor's too)


class Tensor(TensorMethods):
    """An array of the active backend plus what reverse mode needs (torch.Tensor).

    data: an array (kept as it is, dtype included), a Tensor (its array is shared), or
    numbers / nested lists (float64 values become float32, torch's default). dtype and device
    ("cpu", "cuda", "test"), when given, convert the array. requires_grad=True asks for `.grad`
    after backward and needs a floating dtype (TypeError otherwise). Attributes: `data`, `grad`
    (a Tensor or None), `requires_grad`, `creator` (the Function node that made it; None for
    leaves), `_version` (in-place changes: versions.py). Arithmetic (`+ - * / @ **`, unary `-`),
    indexing and TensorMethods' methods are differentiable; comparisons give boolean Tensors.
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
    def dtype(self) -> Any:
        """The array's dtype (a numpy dtype, e.g. float32)."""
        return self.data.dtype

    @property
    def device(self) -> str:
        """Where the array lives: "cpu", "cuda" or "test"."""
        return backend.device_of(self.data)

    # -- autograd ----------------------------------------------------------------------
    @property
    def grad(self) -> Tensor | None:
        """The gradient accumulated by `backward()`: a Tensor of this one's shape, dtype and device, or
        None. After `backward(create_graph=True)` it is part of a graph and can be differentiated."""
        return self._grad

    @grad.setter
    def grad(self, value: Tensor | None) -> None:
        self._grad = self._checked_grad(value)  # a Tensor of this one's shape, dtype and device, or None

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


