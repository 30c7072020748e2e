"""Launchers of activation.cu (bias + ReLU / GELU forward and backward, one thread per entry) and of
dropout.cu's dropout_apply: F.dropout on a GPU draws its mask inside the kernel, forward and backward
alike, and stores nothing between them. The .cu sources are in npformer/functional/cuda/."""
from ..cuda import contiguous_floats, entry_grid, function, null, short_rows, supported_dtype
from . import bias_activation_backward, bias_activation_forward, dropout_backward, dropout_forward  # the tables
from .math import dropout_scale, dropout_threshold

THREADS = 256


@bias_activation_forward.register("cuda", supports=lambda xp, x, bias, kind:
                                 (bias is None or short_rows(bias.size)) and contiguous_floats(x, bias))
def bias_activation_forward_cuda(xp, x, bias, kind):
    y = xp.empty_like(x)
    n = bias.size if bias is not None else 1            # the bias index is i % n (n: an int)
    if kind == "relu":
        keep = xp.empty(x.shape, dtype=bool)
        if x.size:
            function("activation", "bias_relu_forward", x.dtype)(
                (entry_grid(x.size, THREADS),), (THREADS,), (x, null(bias), y, keep, xp.int64(x.size), xp.int32(n)))
        return y, (keep,)
    h = xp.empty_like(x) if bias is not None else x      # the pre-activation: backward needs it
    aux = xp.empty_like(x)
    if x.size:
        function("activation", "bias_gelu_forward", x.dtype)(
            (entry_grid(x.size, THREADS),), (THREADS,),
            (x, null(bias), y, null(h if bias is not None else None), aux, xp.int64(x.size), xp.int32(n),
             xp.int32(kind == "gelu_tanh")))
    return y, (h, aux)


@bias_activation_backward.register("cuda", supports=lambda xp, dy, saved, kind: contiguous_floats(dy, *saved[1:])
                                   and all(a.flags.c_contiguous for a in saved))
def bias_activation_backward_cuda(xp, dy, saved, kind):
    dh = xp.empty_like(dy)
    if dy.size and kind == "relu":
        function("activation", "relu_backward", dy.dtype)(
            (entry_grid(dy.size, THREADS),), (THREADS,), (dy, saved[0], dh, xp.int64(dy.size)))
    elif dy.size:
        h, aux = saved
        function("activation", "gelu_backward", dy.dtype)(
            (entry_grid(dy.size, THREADS),), (THREADS,), (dy, h, aux, dh, xp.int64(dy.size), xp.int32(kind == "gelu_tanh")))
    return dh


def philox_grid(size, offset):
    counters = (offset % 8 + size + 7) // 8                          # Philox counters covering the values
    return (max(1, min(-(-counters // THREADS), 2**31 - 1)),)        # the kernels loop past 2^31 blocks


def kernel_stream(xp, x, seed, offset, p, state):
    """(n, state, seed, offset, threshold, scale) as the kernels take them."""
    return (xp.int64(x.size), null(state), xp.uint64(seed), xp.uint64(offset), xp.uint32(dropout_threshold(p)),
            x.dtype.type(dropout_scale(p)))


def dropout_apply(xp, x, seed, offset, p, state=None):
    """x * keep * scale for the mask of (seed, offset, p) (state: the device (seed, base) under graph
    capture), as a new contiguous array (the array module comes from x: on host arrays the kernel
    runs in the test suite's emulator)."""
    y = xp.empty(x.shape, dtype=x.dtype)
    x = xp.ascontiguousarray(x)                                      # (a 0-d array comes back 1-d)
    function("dropout", "dropout_apply", x.dtype)(philox_grid(x.size, offset), (THREADS,),
                                                  (x, y, *kernel_stream(xp, x, seed, offset, p, state)))
    return y


@dropout_forward.register("cuda", supports=lambda xp, x, seed, offset, p, state=None:
                          supported_dtype(x) and x.size > 0)
def dropout_forward_cuda(xp, x, seed, offset, p, state=None):
    return dropout_apply(xp, x, seed, offset, p, state), None      # the backward regenerates the mask


@dropout_backward.register("cuda", supports=lambda xp, dy, keep, seed, offset, p, state=None:
                           keep is None and supported_dtype(dy))
def dropout_backward_cuda(xp, dy, keep, seed, offset, p, state=None):
    return dropout_apply(xp, dy, seed, offset, p, state)
