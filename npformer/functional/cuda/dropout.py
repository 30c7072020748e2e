"""Launchers of dropout.cu: F.dropout and the dropout of F.dropout_add on a GPU draw their mask inside
the kernel, forward and backward alike, and store nothing between them."""
from autograd import backend

from ..activation import dropout_backward, dropout_forward, dropout_scale, dropout_threshold
from ..residual import dropout_add_forward
from . import contiguous_floats, function, null, supported_dtype

THREADS = 256


def _grid(size, offset):
    counters = (offset % 8 + size + 7) // 8                          # Philox counters covering the values
    return (max(1, min(-(-counters // THREADS), 2**31 - 1)),)        # the kernels loop past 2^31 blocks


def _stream(xp, x, seed, offset, p, state):
    """(n, state, seed, offset, threshold, scale) as the kernels take them."""
    return (xp.int64(x.size), null(state), xp.uint64(seed), xp.uint64(offset), xp.uint32(dropout_threshold(p)),
            x.dtype.type(dropout_scale(p)))


def dropout_apply(x, seed, offset, p, state=None):
    """x * keep * scale for the mask of (seed, offset, p) (state: the device (seed, base) under graph
    capture), as a new contiguous array (the array module comes from x: on host arrays the kernel
    runs in the test suite's emulator)."""
    xp = backend.get_array_module(x)
    y = xp.empty(x.shape, dtype=x.dtype)
    x = xp.ascontiguousarray(x)                                      # (a 0-d array comes back 1-d)
    function("dropout", "dropout_apply", x.dtype)(_grid(x.size, offset), (THREADS,),
                                                  (x, y, *_stream(xp, x, seed, offset, p, state)))
    return y


@dropout_forward.register("cuda", supports=lambda x, seed, offset, p, state=None: supported_dtype(x) and x.size > 0)
def dropout_forward_cuda(x, seed, offset, p, state=None):
    return dropout_apply(x, seed, offset, p, state), None      # the backward regenerates the mask


@dropout_backward.register("cuda", supports=lambda dy, keep, seed, offset, p, state=None:
                           keep is None and supported_dtype(dy))
def dropout_backward_cuda(dy, keep, seed, offset, p, state=None):
    return dropout_apply(dy, seed, offset, p, state)


@dropout_add_forward.register("cuda", supports=lambda x, residual, seed, offset, p, state=None:
                              contiguous_floats(x, residual) and x.size > 0)
def dropout_add_forward_cuda(x, residual, seed, offset, p, state=None):
    xp = backend.get_array_module(x)
    y = xp.empty_like(x)
    function("dropout", "dropout_add_forward", x.dtype)(_grid(x.size, offset), (THREADS,),
                                                        (x, residual, y, *_stream(xp, x, seed, offset, p, state)))
    return y, None                                             # the backward regenerates the mask
