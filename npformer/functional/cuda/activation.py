"""Launchers of activation.cu: bias + ReLU / GELU forward and backward, one thread per entry."""
from autograd import backend

from ..activation import bias_activation_backward, bias_activation_forward
from . import contiguous_floats, entry_grid, function, null, short_rows

THREADS = 256


@bias_activation_forward.register("cuda", supports=lambda x, bias, kind:
                                 (bias is None or short_rows(bias.size)) and contiguous_floats(x, bias))
def bias_activation_forward_cuda(x, bias, kind):
    xp = backend.get_array_module(x)
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


@bias_activation_backward.register("cuda", supports=lambda dy, saved, kind: contiguous_floats(dy, *saved[1:])
                                   and all(a.flags.c_contiguous for a in saved))
def bias_activation_backward_cuda(dy, saved, kind):
    xp = backend.get_array_module(dy)
    dh = xp.empty_like(dy)
    if dy.size and kind == "relu":
        function("activation", "relu_backward", dy.dtype)(
            (entry_grid(dy.size, THREADS),), (THREADS,), (dy, saved[0], dh, xp.int64(dy.size)))
    elif dy.size:
        h, aux = saved
        function("activation", "gelu_backward", dy.dtype)(
            (entry_grid(dy.size, THREADS),), (THREADS,), (dy, h, aux, dh, xp.int64(dy.size), xp.int32(kind == "gelu_tanh")))
    return dh
