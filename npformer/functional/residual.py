"""Dropout fused with the residual add: y = residual + dropout(x), the mask drawn from a Philox
stream (autograd.random) by the dropout contract; on a GPU drawn again in backward instead of
stored (the CPU keeps it: there, drawing costs more than a byte per entry)."""
from autograd import Function, Tensor, backend, random
from autograd.checks import check_real
from autograd.kernels import kernel_table
from autograd.threads import for_rows

from ._common import check_tensor, has_twin
from .activation import elementwise_product


def keep_threshold(p):
    """Entry i is kept iff its 16-bit value is >= this (p rounded to a multiple of 2^-16)."""
    return min(round(p * 2**16), 2**16 - 1)


def dropout_scale(like, p, draw):
    """keep / (1 - p) in the shape and dtype of the array `like`, keep drawn from the PhiloxDraw
    `draw` by the dropout contract: entry i (C order) kept iff value offset + i >= keep_threshold(p)."""
    bits = random.bits16(draw.seed, draw.offset, like.size, backend.device_of(like), state=draw.state)
    return (bits >= keep_threshold(p)).reshape(like.shape).astype(like.dtype) * (1.0 / (1.0 - p))


@kernel_table
def dropout_add_forward(x, residual, p, draw):
    """(residual + x * keep / (1 - p), keep or None) for arrays of one shape, 0 < p < 1: keep (bool)
    when the implementation keeps the mask for backward, None when backward draws it again."""
    return residual + x * dropout_scale(x, p, draw), None


@dropout_add_forward.register("cpu", supports=lambda x, residual, p, draw: draw.state is None)
def dropout_add_forward_cpu(x, residual, p, draw):
    """In flat blocks on the threads of `autograd.threads`, each block drawing its own slice of the
    stream; the mask is kept (1 byte per entry): on the CPU drawing it again costs more."""
    xp = backend.get_array_module(x)
    y, keep = xp.empty(x.shape, dtype=x.dtype), xp.empty(x.shape, dtype=bool)
    xf, rf, yf, kf = x.reshape(-1), residual.reshape(-1), y.reshape(-1), keep.reshape(-1)
    threshold, scale = keep_threshold(p), 1.0 / (1.0 - p)

    def block(start, stop):
        xp.greater_equal(random.bits16(draw.seed, draw.offset + start, stop - start), threshold, out=kf[start:stop])
        yb = xp.multiply(xf[start:stop], kf[start:stop], out=yf[start:stop])   # y = residual + x * keep * scale
        yb *= scale
        yb += rf[start:stop]

    for_rows(block, x.size, x.size, x)
    return y, keep


@kernel_table
def dropout_backward(dy, p, draw, keep=None):
    """dx = dy * keep / (1 - p), with the forward's keep, or drawn again from `draw` (keep None)."""
    if keep is not None:
        return dy * (keep.astype(dy.dtype) * (1.0 / (1.0 - p)))
    return dy * dropout_scale(dy, p, draw)


@dropout_backward.register("cpu", supports=lambda dy, p, draw, keep=None: keep is not None)
def dropout_backward_cpu(dy, p, draw, keep=None):
    return elementwise_product(dy, keep, 1.0 / (1.0 - p))


class DropoutAddFunction(Function):
    """y = residual + x * m, m = keep / (1 - p) from a Philox draw.  dx = dy * m,  dresidual = dy."""

    @staticmethod
    def forward(ctx, x, residual, p, draw):
        y, ctx.keep = dropout_add_forward(x, residual, p, draw)  # keep: None where backward draws m again
        ctx.p, ctx.draw = p, draw
        return y

    @staticmethod
    def backward(ctx, dy):
        # y = residual + x * m  ->  dx = dy * m,  dresidual = dy
        return dropout_backward(dy, ctx.p, ctx.draw, ctx.keep), dy


def check_dropout_add(input, residual, p, generator, op):
    x = check_tensor("input", input, op)
    r = check_tensor("residual", residual, op)
    if tuple(x.shape) != tuple(r.shape):
        raise ValueError(f"{op}: input and residual must have one shape, got {tuple(x.shape)} and {tuple(r.shape)}")
    if generator is not None and not isinstance(generator, random.Philox):
        raise TypeError(f"{op}: generator must be an autograd.random.Philox or None, got {type(generator).__name__}")
    return x, check_real(p, "p", op, at_least=0, at_most=1)


@has_twin
def dropout_add(input, residual, p=0.5, training=True, generator=None):
    """residual + dropout(input, p): the residual connection of a Transformer sublayer in one op.
    The mask comes from `generator` (an autograd.random.Philox; default the global dropout stream)
    by the dropout contract, so a GPU kernel draws the same mask as the CPU, and backward draws it
    again from (seed, offset) instead of storing it. p=0 or training=False: residual + input."""
    x, p = check_dropout_add(input, residual, p, generator, "dropout_add")
    as_tensor = lambda t: t if isinstance(t, Tensor) else Tensor(t)  # noqa: E731
    if not training or p == 0.0:
        return as_tensor(residual) + input
    if p == 1.0:
        return as_tensor(residual) + as_tensor(input) * 0.0
    draw = (generator or random.dropout_stream()).draw(x.size, backend.device_of(x))
    return DropoutAddFunction.apply(input, residual, p=p, draw=draw)
