"""split_heads: (B, T, chunks * E) -> chunks tensors (B, H, T, E / H), the heads of each E-wide
block of columns (q, k, v of a packed projection): views in forward, one gradient array in backward."""
from __future__ import annotations

from autograd import Function, Tensor, backend
from autograd.backend import Array
from autograd.checks import check_int
from npformer.runtime.kernels import kernel_table

from .._common import check_tensor, has_twin


@kernel_table
def split_heads_backward(dx, grads):
    """dx (B, T, n, H, hd) <- the n head gradients (B, H, T, hd): dx[:, :, i] = grads[i] as (B, T, H, hd)."""
    for i, g in enumerate(grads):
        dx[:, :, i] = g.transpose(0, 2, 1, 3)


def _heads_of(x, chunks, num_heads):
    """x (B, T, n E) -> n views (B, H, T, hd) of x: chunk i is the heads of columns [i E, (i + 1) E)."""
    B, T, width = x.shape
    heads = x.reshape(B, T, chunks, num_heads, width // (chunks * num_heads))   # (B, T, n, H, hd)
    return tuple(heads[:, :, i].transpose(0, 2, 1, 3) for i in range(chunks))  # n x (B, H, T, hd)


class SplitHeadsFunction(Function):
    """x (B, T, n E) -> n arrays (B, H, T, hd) with E = H hd: chunk i is the heads of columns
    [i E, (i + 1) E), a view of x. Backward writes the n head gradients into one (B, T, n E)
    array, the layout of x (one pass; no zero-filled copies to add up)."""
    backward_formula = staticmethod(split_heads_backward)

    view = True  # the heads are views of x: an in-place change of x is theirs (autograd/versions.py)

    @staticmethod
    def forward(ctx, x, chunks, num_heads):
        ctx.shape, ctx.layout = x.shape, (chunks, num_heads)
        return _heads_of(x, chunks, num_heads)

    @staticmethod
    def jvp(ctx, t):
        # out_i = the heads of x[:, :, i E:(i + 1) E], a linear map  ->  t_out_i = the heads of t_x's columns
        return _heads_of(t, *ctx.layout)

    @staticmethod
    def backward(ctx, *grads):
        return _merged_heads(grads, ctx.shape)

    @staticmethod
    def differentiable_backward(ctx, *grads):
        # the backward is linear in the gradients and does not depend on x: one op, MergeHeadsFunction
        return MergeHeadsFunction.apply(*grads, shape=ctx.shape, layout=ctx.layout)


class MergeHeadsFunction(Function):
    """n head tensors (B, H, T, hd) -> (B, T, n E): SplitHeadsFunction's backward as an op (its
    differentiable backward), one pass like the backward. It is linear and the transpose of the
    split: its backward is the split of the incoming gradient into heads, its jvp the merge of the
    tangents."""
    backward_formula = staticmethod(_heads_of)

    @staticmethod
    def forward(ctx, *heads, shape, layout):
        ctx.shape, ctx.layout, ctx.head_shape = shape, layout, heads[0].shape
        return _merged_heads(heads, shape)

    @staticmethod
    def backward(ctx, grad):
        # out[:, :, i E:(i + 1) E] = heads_i as (B, T, H, hd)  ->  d heads_i = the heads of grad's chunk i
        return _heads_of(grad, *ctx.layout)

    @staticmethod
    def differentiable_backward(ctx, grad):
        chunks, num_heads = ctx.layout
        return SplitHeadsFunction.apply(grad, chunks=chunks, num_heads=num_heads)

    @staticmethod
    def jvp(ctx, *tangents):
        like = next(t for t in tangents if t is not None)
        xp = backend.get_array_module(like)
        return _merged_heads([xp.zeros(ctx.head_shape, like.dtype) if t is None else t for t in tangents], ctx.shape)


def _merged_heads(heads, shape):
    """The n head arrays (B, H, T, hd) written side by side into one array of `shape` (B, T, n E),
    in one pass: out[:, :, i E:(i + 1) E] = heads_i as (B, T, H, hd)."""
    xp = backend.get_array_module(heads[0])
    B, T, width = shape
    out = xp.empty((B, T, len(heads)) + heads[0].shape[1:2] + heads[0].shape[3:], dtype=heads[0].dtype)
    split_heads_backward(out, heads)
    return out.reshape(shape)


@has_twin
def split_heads(input: Tensor | Array, num_heads: int, chunks: int = 1) -> Tensor | tuple[Tensor, ...]:
    """input (B, T, chunks * E) -> `chunks` tensors (B, num_heads, T, E / num_heads) (one tensor
    when chunks=1): the heads of each E-wide block of columns, e.g. q, k, v of a packed
    projection. Views in forward; the backward assembles one gradient array. Raises ValueError
    unless input is 3-D with a width divisible by chunks * num_heads."""
    x = check_tensor("input", input, "split_heads")
    num_heads = check_int(num_heads, "num_heads", "split_heads", at_least=1)
    chunks = check_int(chunks, "chunks", "split_heads", at_least=1)
    if x.ndim != 3 or x.shape[-1] % (chunks * num_heads):
        raise ValueError(f"split_heads: input must be (batch, seq, chunks * num_heads * head_dim) with "
                         f"chunks={chunks}, num_heads={num_heads}, got shape {tuple(x.shape)}")
    heads = SplitHeadsFunction.apply(input, chunks=chunks, num_heads=num_heads)
    return heads if chunks > 1 else heads[0]
