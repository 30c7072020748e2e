"""Launchers of dropout.cu: F.dropout on a GPU draws its mask inside the kernel, forward and
backward alike, and stores nothing between them."""
from autograd import backend

from ..activation import dropout_backward, dropout_forward, dropout_scale, dropout_threshold
from . import function, supported_dtype

THREADS = 256


def dropout_apply(x, seed, offset, p):
    """x * keep * scale for the mask of (seed, offset, p), as a new contiguous array (the
    array module comes from x: on host arrays the kernel runs in the test suite's emulator)."""
    xp = backend.get_array_module(x)
    x = xp.ascontiguousarray(x)
    y = xp.empty_like(x)
    counters = (offset % 8 + x.size + 7) // 8                        # Philox counters covering the values
    blocks = max(1, min(-(-counters // THREADS), 2**31 - 1))         # the kernel loops past 2^31 blocks
    function("dropout", "dropout_apply", x.dtype)(
        (blocks,), (THREADS,), (x, y, xp.int64(x.size), xp.uint64(seed), xp.uint64(offset),
                               xp.uint32(dropout_threshold(p)), x.dtype.type(dropout_scale(p))))
    return y


@dropout_forward.register("cuda", supports=lambda x, seed, offset, p: supported_dtype(x) and x.size > 0)
def dropout_forward_cuda(x, seed, offset, p):
    return dropout_apply(x, seed, offset, p), None      # the backward regenerates the mask


@dropout_backward.register("cuda", supports=lambda dy, keep, seed, offset, p: keep is None and supported_dtype(dy))
def dropout_backward_cuda(dy, keep, seed, offset, p):
    return dropout_apply(dy, seed, offset, p)
