"""Launcher of dropout.cu's dropout_add_forward: y = residual + dropout(x) in one kernel that draws the
mask (the backward, F.dropout's, draws it again: nothing is stored between them)."""
from ..activation.cuda import THREADS, kernel_stream, philox_grid
from ..cuda import contiguous_floats, function
from . import dropout_add_forward  # the table


@dropout_add_forward.register("cuda", supports=lambda xp, x, residual, seed, offset, p, state=None:
                              contiguous_floats(x, residual) and x.size > 0)
def dropout_add_forward_cuda(xp, x, residual, seed, offset, p, state=None):
    y = xp.empty_like(x)
    function("dropout", "dropout_add_forward", x.dtype)(philox_grid(x.size, offset), (THREADS,),
                                                        (x, residual, y, *kernel_stream(xp, x, seed, offset, p, state)))
    return y, None                                             # the backward regenerates the mask
