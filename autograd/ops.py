"""The primitive differentiable ops, each a small `Function`, and `unbroadcast`.

Every op here is forward and backward side by side: forward computes on the raw arrays of the
active backend and keeps only what backward needs; backward turns the output's gradient into
one gradient per input (None where an input needs none). Beside them, each op's two other rules:
`differentiable_backward`, the same gradient built from Tensor ops (so that it can be
differentiated again: create_graph), and `jvp`, forward mode's tangent of the output (raw arrays).
`Tensor`'s operators and methods (autograd/tensor.py) call these ops.
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
                da = Where.apply(0, da, condition=b_raw == 0) if backend.is_array(b_raw) else da * 0
        if ctx.needs_input_grad[1]:  # log(a) is taken of 1 where a == 0: where's other branch gets no NaN
            zero = (a_raw == 0) & (b_raw >= 0)
            log_a = (Where.apply(1, a, condition=a_raw == 0).log() if ctx.inputs[0] is not None else
                     math.log(a) if a > 0 else -math.inf if a == 0 else math.nan)
            db = (grad * Where.apply(0, ctx.as_output(out) * log_a, condition=zero)).sum_to(b_raw.shape)
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
        dx = Where.apply(grad, 0, condition=ctx.condition).sum_to(ctx.shapes[0]) if ctx.needs_input_grad[0] else None
        dy = Where.apply(0, grad, condition=ctx.condition).sum_to(ctx.shapes[1]) if ctx.needs_input_grad[1] else None
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
    view = True  # the output may share the input's memory

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
    view = True  # the output may share the input's memory

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
    view = True  # the output may share the input's memory

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
    view = True  # the output may share the input's memory

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
