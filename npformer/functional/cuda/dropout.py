"""Launchers of dropout.cu: residual + dropout(x) and its backward, the mask drawn in the kernel."""
from autograd import backend

from ..residual import dropout_add_forward, dropout_backward, keep_threshold
from . import contiguous_floats, entry_grid, function, null

THREADS = 256


def _philox_arguments(xp, p, draw):
    """(state, seed, offset, threshold, scale) as the kernels take them."""
    return (null(draw.state), xp.uint64(draw.seed), xp.uint64(draw.offset), xp.uint32(keep_threshold(p)),
            1.0 / (1.0 - p))


@dropout_add_forward.register("cuda", supports=lambda x, residual, p, draw: contiguous_floats(x, residual))
def dropout_add_forward_cuda(x, residual, p, draw):
    xp = backend.get_array_module(x)
    y = xp.empty_like(x)
    if x.size:
        function("dropout", "dropout_add_forward", x.dtype)(
            (entry_grid(-(-x.size // 8), THREADS),), (THREADS,),
            (x, residual, y, *_philox_arguments(xp, p, draw), xp.int64(x.size)))
    return y, None                        # the mask is not kept: backward draws it again


@dropout_backward.register("cuda", supports=lambda dy, p, draw, keep=None: keep is None and contiguous_floats(dy))
def dropout_backward_cuda(dy, p, draw, keep=None):
    xp = backend.get_array_module(dy)
    dx = xp.empty_like(dy)
    if dy.size:
        function("dropout", "dropout_backward", dy.dtype)(
            (entry_grid(-(-dy.size // 8), THREADS),), (THREADS,), (dy, dx, *_philox_arguments(xp, p, draw),
                                                                  xp.int64(dy.size)))
    return dx
