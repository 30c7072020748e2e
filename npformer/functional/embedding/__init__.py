"""Embedding lookup; its backward is a scatter-add of rows (a kernel table). torch's options:
max_norm / norm_type (the referenced rows renormalised in place first) and scale_grad_by_freq."""
from __future__ import annotations

from autograd import Function, Tensor, backend, where
from autograd.backend import Array, ArrayLike
from autograd.checks import check_bool, check_int, check_real
from npformer.runtime.kernels import kernel_table

from .._common import check_index_range, check_tensor, has_twin, on_device_of
from . import math

__all__ = ["embedding"]  # its public ops, which npformer.functional exports

# the kernel table of the backward's scatter-add: math.py's as the reference, the CPU's sorted runs
# (cpu.py) and CUDA's atomics (cuda.py) beside it
scatter_add_rows = kernel_table(math.scatter_add_rows)


class EmbeddingFunction(Function):
    """ids (...) integers, weight (V, D) -> out (...,  D) = weight[ids].

    dweight[v] = sum of dout over the positions where ids == v; dweight[padding_idx] = 0; with
    scale_grad_by_freq each row divided by the number of times its id occurs in ids.
    """
    backward_formula = staticmethod(math.scatter_add_rows)

    @staticmethod
    def forward(ctx, weight, ids, padding_idx, scale_grad_by_freq=False):
        ctx.ids, ctx.padding_idx, ctx.num_embeddings = ids, padding_idx, weight.shape[0]
        ctx.scale_grad_by_freq = scale_grad_by_freq
        return math.embedding_forward(backend.get_array_module(weight), weight, ids)   # (..., D)

    @staticmethod
    def backward(ctx, dout):
        xp = backend.get_array_module(dout)
        ids = ctx.ids.reshape(-1)                         # (N,)
        # out[n] = weight[ids[n]]  ->  dweight[v] = sum_{n: ids[n] = v} dout[n]
        dweight = scatter_add_rows(xp, ids, dout.reshape(ids.shape[0], dout.shape[-1]), ctx.num_embeddings)
        # scale_grad_by_freq, padding_idx
        return math.embedding_backward_options(xp, dweight, ids, ctx.padding_idx, ctx.scale_grad_by_freq)

    @staticmethod
    def differentiable_backward(ctx, dout):
        xp = backend.get_array_module(ctx.ids)
        ids = ctx.ids.reshape(-1)                         # (N,)
        # dweight = the scatter-add of dout's rows at ids: linear in dout, and no function of weight, so
        #   d/d(dout) <dweight, U> = U[ids] (the lookup again), and no second derivative in weight
        rows = dout.reshape(ids.shape[0], dout.shape[-1])
        dweight = ScatterAddRowsFunction.apply(rows, ids=ids, num_rows=ctx.num_embeddings)
        if ctx.scale_grad_by_freq:  # dweight[v] / count(v): a constant factor per row
            dweight = dweight / Tensor(math.id_counts(xp, ids, ctx.num_embeddings, rows.dtype))
        if ctx.padding_idx is not None:
            is_padding = xp.arange(ctx.num_embeddings)[:, None] == ctx.padding_idx
            dweight = where(is_padding, 0, dweight)
        return dweight

    @staticmethod
    def jvp(ctx, t_weight):
        # out[n] = weight[ids[n]]  ->  t_out[n] = t_weight[ids[n]], the padding row held still
        return math.embedding_tangent(backend.get_array_module(t_weight), t_weight, ctx.ids, ctx.padding_idx)


class ScatterAddRowsFunction(Function):
    """rows (N, D) -> out (num_rows, D), out[v] = the sum of rows[n] over every n with ids[n] == v:
    the embedding's backward as an op (its differentiable backward), run by the kernel table
    scatter_add_rows (on the CPU: sorted runs, cpu.py). It is linear in rows and the
    transpose of the lookup: its backward is the lookup g[ids], its jvp the scatter-add of the tangent."""
    backward_formula = staticmethod(math.embedding_forward)

    @staticmethod
    def forward(ctx, rows, ids, num_rows):
        ctx.ids, ctx.num_rows = ids, num_rows
        return scatter_add_rows(backend.get_array_module(rows), ids, rows, num_rows)

    @staticmethod
    def backward(ctx, grad):
        # out[v] = sum_{n: ids[n] = v} rows[n]  ->  d rows[n] = grad[ids[n]]
        return grad[ctx.ids]

    @staticmethod
    def differentiable_backward(ctx, grad):
        return EmbeddingFunction.apply(grad, ids=ctx.ids, padding_idx=None)   # the lookup: its gradient is this op

    @staticmethod
    def jvp(ctx, t_rows):
        return scatter_add_rows(backend.get_array_module(t_rows), ctx.ids, t_rows, ctx.num_rows)


def check_token_ids(ids, num, op, name="input"):
    """Integer token ids in [0, num): host ids now, device ids on the device (read with the next
    result; npformer.runtime.deferred)."""
    if ids.dtype.kind not in "iu":
        raise TypeError(f"{op}: {name} must hold integer token ids, got dtype {ids.dtype}")
    check_index_range(ids, num, lambda lo, hi: IndexError(
        f"{op}: token ids must be in [0, {num - 1}] (num_embeddings={num}), got min {lo} and max {hi}"))


def check_embedding_options(max_norm, norm_type, scale_grad_by_freq, op="embedding"):
    """(max_norm, norm_type, scale_grad_by_freq) checked: max_norm None or a real >= 0, norm_type a
    real > 0 (inf: the largest |entry|), scale_grad_by_freq a bool."""
    if max_norm is not None:
        max_norm = check_real(max_norm, "max_norm", op, at_least=0)
    norm_type = check_real(norm_type, "norm_type", op, above=0, finite=False)
    return max_norm, norm_type, check_bool(scale_grad_by_freq, "scale_grad_by_freq", op)


@has_twin
def embedding(input: Tensor | ArrayLike, weight: Tensor | Array, padding_idx: int | None = None,
              max_norm: float | None = None, norm_type: float = 2.0, scale_grad_by_freq: bool = False) -> Tensor:
    """weight[input] like torch.nn.functional.embedding: input integer ids of any shape,
    weight (num_embeddings, embedding_dim) -> (*input.shape, embedding_dim). The
    `padding_idx` row (negative counts from the end) gets exactly zero gradient. Ids that arrive as
    host arrays are checked at once; ids already on a GPU are checked there, and a bad one raises
    when the result is first read (npformer.runtime.deferred).

    max_norm: each row that `input` refers to whose `norm_type`-norm exceeds max_norm is scaled
    to norm max_norm first, **in place in weight** (as torch's: an update outside the graph, like
    an optimizer step; a weight that an earlier op of the graph saved must not be renormalised
    before that op's backward). scale_grad_by_freq: each row's gradient is divided by how often
    its id occurs in `input`.
    Raises TypeError for non-integer ids, IndexError for ids outside [0, num_embeddings),
    ValueError for a weight that is not 2-D, a negative max_norm or a norm_type <= 0."""
    w = check_tensor("weight", weight, "embedding")
    if w.ndim != 2:
        raise ValueError(f"embedding: weight must be 2-D (num_embeddings, embedding_dim), got shape {tuple(w.shape)}")
    num = w.shape[0]
    ids = on_device_of(input, w, "input", "embedding", check=lambda ids: check_token_ids(ids, num, "embedding"))
    if padding_idx is not None:
        padding_idx = check_int(padding_idx, "padding_idx", "embedding", at_least=-num, at_most=num - 1) % num
    max_norm, norm_type, scale_grad_by_freq = check_embedding_options(max_norm, norm_type, scale_grad_by_freq)
    if max_norm is not None:  # on the raw array: outside the graph
        math.renormalize_rows(backend.get_array_module(w), w, ids, max_norm, norm_type)
    return EmbeddingFunction.apply(weight, ids=ids, padding_idx=padding_idx, scale_grad_by_freq=scale_grad_by_freq)


from . import cpu, cuda  # noqa: E402,F401  (register the fast variants)
