"""What a Function gives the engine, checked like torch's engine checks it (a second read).

`Function.apply` (autograd/function.py) checks that its Tensor inputs share one device and one
floating dtype, and turns what `forward` returned into arrays (`output_arrays`); the backward pass
checks every gradient a `backward` returns (`checked_gradients`). A mistake in a custom op is an
error naming the Function, the input or output index, what was expected and what came, never a
silently wrong gradient.
"""
from __future__ import annotations

from typing import Any

from . import backend


def op_name(op: type) -> str:
    """The full path of a Function class, e.g. 'npformer.functional.normalization.LayerNormFunction'."""
    return f"{op.__module__}.{op.__qualname__}"


def output_arrays(op: type, outputs: tuple, inputs: list) -> tuple:
    """What `op.forward` returned (as a tuple), as arrays: a number becomes an array of the inputs'
    module (`inputs`: the raw arguments forward got); a Tensor or anything else is the author's
    mistake, a TypeError naming the op and the output."""
    if all(map(backend.is_array, outputs)):
        return outputs
    xp = backend.get_array_module(*inputs)
    return tuple(o if backend.is_array(o) else _output_array(op, i, o, xp) for i, o in enumerate(outputs))


def _output_array(op, index, value, xp):
    from .tensor import Tensor

    if isinstance(value, Tensor):
        raise TypeError(f"{op_name(op)}.forward returned a Tensor as output {index}: forward works on raw "
                        "arrays and must return arrays (use `.data` of a Tensor); apply wraps them in Tensors")
    if isinstance(value, (int, float, complex)) or getattr(value, "shape", None) == ():  # numbers, numpy scalars
        return xp.asarray(value)
    raise TypeError(f"{op_name(op)}.forward returned {type(value).__name__} as output {index}: expected an "
                    "array, or a tuple of arrays for several outputs")


def check_same_device_and_dtype(op: type, tensors: list) -> None:
    """RuntimeError when the Tensors `tensors` (an op's inputs) are on several devices, TypeError
    when they have several floating dtypes."""
    kind, dtype = type(tensors[0].data), tensors[0].data.dtype
    for t in tensors:  # the common case, cheaply: arrays of one type (so one device) and one dtype
        if type(t.data) is not kind or t.data.dtype != dtype:
            break
    else:
        return
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise RuntimeError(f"{op.__name__}: expected all tensors on one device, got {sorted(devices)}; "
                           "move them with .to(device)")
    floats = {t.dtype for t in tensors if t.dtype.kind == "f"}
    if len(floats) > 1:
        raise TypeError(f"{op.__name__}: expected one floating dtype, got {sorted(map(str, floats))}; "
                        "cast with .to(dtype=...) or .float()/.double() on modules")


def checked_gradients(node: Any, grads: tuple) -> tuple:
    """The gradients a backward returned, checked against the node's inputs like torch's engine:
    one per positional input of forward (extra trailing Nones are dropped), each None or an
    array of its input's shape, dtype and device. A gradient of a shape the input broadcasts to
    is summed back to the input's shape (torch's rule); any other shape is an error."""
    inputs = node.inputs
    if len(grads) != len(inputs):
        if len(grads) > len(inputs) and all(g is None for g in grads[len(inputs):]):
            grads = grads[:len(inputs)]
        else:
            raise RuntimeError(f"function {op_name(type(node))} returned an incorrect number of gradients "
                               f"(expected {len(inputs)}, got {len(grads)}): backward returns one gradient "
                               "(or None) per positional input of forward")
    fixed = None
    for i, (t, g) in enumerate(zip(inputs, grads)):
        if g is None or t is None or not t.requires_grad:
            continue
        data = t.data
        if type(g) is not type(data) or g.shape != data.shape or g.dtype != data.dtype:  # cheap: the rare path
            fixed = fixed or list(grads)
            fixed[i] = _conforming_gradient(node, i, g, data)
    return grads if fixed is None else tuple(fixed)


def _conforming_gradient(node, index, grad, data):
    """`grad` for input `index` (whose array is `data`) made to conform, or a RuntimeError
    that names the Function, the index, what was expected and what came."""
    from .ops import unbroadcast
    from .tensor import Tensor

    where = f"Function {op_name(type(node))} returned an invalid gradient at index {index}"
    if isinstance(grad, Tensor):
        raise RuntimeError(f"{where} - got a Tensor: backward works on raw arrays and must return arrays "
                           "(use `.data` of a Tensor)")
    if not backend.is_array(grad):
        if getattr(grad, "shape", None) != () or not hasattr(grad, "dtype"):  # a numpy scalar is fine
            raise RuntimeError(f"{where} - got {type(grad).__name__}: expected an array of shape "
                               f"{data.shape} or None")
        grad = backend.get_array_module(data).asarray(grad)
    if backend.device_of(grad) != backend.device_of(data):
        raise RuntimeError(f"{where} - expected device '{backend.device_of(data)}' but got "
                           f"'{backend.device_of(grad)}'")
    if grad.dtype != data.dtype:
        raise RuntimeError(f"{where} - expected dtype {data.dtype} but got {grad.dtype}: return it in the "
                           f"input's dtype (e.g. `.astype(x.dtype)`)")
    if grad.shape != data.shape:
        if not _expands_to(data.shape, grad.shape):
            raise RuntimeError(f"{where} - got shape {grad.shape} but expected shape compatible with "
                               f"{data.shape} (the input's shape, or one it broadcasts to)")
        grad = unbroadcast(grad, data.shape).reshape(data.shape)  # summed over the broadcast axes, as torch
    return grad


def _expands_to(shape, target):
    """Whether an array of `shape` broadcasts to `target` (torch's is_expandable_to)."""
    if len(shape) > len(target):
        return False
    return all(n == m or n == 1 for n, m in zip(shape[::-1], target[::-1]))
