"""The primitive differentiable ops, each a small `Function` on raw arrays, and `unbroadcast`.

Every op here is forward and backward side by side: forward computes on the raw arrays of the
active backend and keeps only what backward needs; backward turns the output's gradient into
one gradient per input (None where an input needs none). `Tensor`'s operators and methods
(autograd/tensor.py) call them; nothing here knows about Tensors.
"""
from __future__ import annotations

import copy
import math

from . import backend
from .backend import Array
from .function import Function


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
        ctx.device, ctx.dtype = backend.device_of(x), x.dtype
        return backend.to_device(x, device).astype(dtype, copy=False)

    @staticmethod
    def backward(ctx, grad):
        return backend.to_device(grad, ctx.device).astype(ctx.dtype, copy=False)


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


class Neg(Function):
    @staticmethod
    def forward(ctx, x):
        return -x

    @staticmethod
    def backward(ctx, grad):
        return -grad


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


class Log(Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return backend.get_array_module(x).log(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad / x  # d log(x) = 1/x


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


class Where(Function):
    @staticmethod
    def forward(ctx, x, y, condition):
        xp = backend.get_array_module(x, y, condition)
        ctx.condition, ctx.shapes = condition, (_shape(x), _shape(y))
        return xp.where(condition, x, y)

    @staticmethod
    def backward(ctx, grad):
        xp = backend.get_array_module(grad)
        # out = where(c, x, y)  ->  dx = grad where c, dy = grad where not c
        dx = unbroadcast(xp.where(ctx.condition, grad, 0), ctx.shapes[0]) if ctx.needs_input_grad[0] else None
        dy = unbroadcast(xp.where(ctx.condition, 0, grad), ctx.shapes[1]) if ctx.needs_input_grad[1] else None
        return dx, dy


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


def _squeeze(x, axis):
    return x.reshape(()) if axis is None else x.squeeze(axis)


class Reshape(Function):
    @staticmethod
    def forward(ctx, x, shape):
        ctx.shape = x.shape
        return x.reshape(shape)

    @staticmethod
    def backward(ctx, grad):
        return grad.reshape(ctx.shape)


class Permute(Function):
    @staticmethod
    def forward(ctx, x, axes):
        ctx.axes = axes
        return x.transpose(axes)

    @staticmethod
    def backward(ctx, grad):
        # out = x.transpose(axes)  ->  dx = grad.transpose(inverse of axes)
        return grad.transpose(sorted(range(len(ctx.axes)), key=ctx.axes.__getitem__))


class BroadcastTo(Function):
    @staticmethod
    def forward(ctx, x, shape):
        ctx.shape = x.shape
        return backend.get_array_module(x).broadcast_to(x, shape)

    @staticmethod
    def backward(ctx, grad):
        return unbroadcast(grad, ctx.shape)


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
        xp = backend.get_array_module(grad)
        dx = xp.zeros(ctx.shape, grad.dtype)
        # out = x[key]  ->  dx[key] += grad; integer-array keys may repeat, so scatter-add
        if ctx.scatter:
            xp.add.at(dx, ctx.key, grad)
        else:
            dx[ctx.key] = grad
        return dx


def _copied_key(key):
    """An index key with its arrays and lists copied (slices, ints, None and Ellipsis are immutable)."""
    if isinstance(key, tuple):
        return tuple(_copied_key(k) for k in key)
    return key.copy() if backend.is_array(key) else copy.deepcopy(key) if isinstance(key, list) else key


class Concatenate(Function):
    @staticmethod
    def forward(ctx, *arrays, axis):
        ctx.axis, ctx.sizes = axis, [a.shape[axis] for a in arrays]
        return backend.get_array_module(*arrays).concatenate(arrays, axis=axis)

    @staticmethod
    def backward(ctx, grad):
        xp = backend.get_array_module(grad)
        # out = [a, b, ...] along axis  ->  each input gets its slice of grad
        bounds = [sum(ctx.sizes[:i]) for i in range(1, len(ctx.sizes))]
        return tuple(xp.split(grad, bounds, axis=ctx.axis))
