"""Embedding lookup; its backward is a scatter-add of rows (a kernel table)."""
from __future__ import annotations

from autograd import Function, Tensor, backend
from autograd.backend import Array, ArrayLike
from autograd.checks import check_int
from npformer.runtime.kernels import kernel_table

from ._common import check_index_range, check_tensor, has_twin, on_device_of


@kernel_table
def scatter_add_rows(ids, rows, num_rows):
    """out (num_rows, D) with out[i] = sum of rows[n] over every n where ids[n] == i; ids (N,), rows (N, D)."""
    xp = backend.get_array_module(rows)
    out = xp.zeros((num_rows, rows.shape[1]), dtype=rows.dtype)
    xp.add.at(out, ids, rows)
    return out


class EmbeddingFunction(Function):
    """ids (...) integers, weight (V, D) -> out (...,  D) = weight[ids].

    dweight[v] = sum of dout over the positions where ids == v; dweight[padding_idx] = 0.
    """

    @staticmethod
    def forward(ctx, weight, ids, padding_idx):
        ctx.ids, ctx.padding_idx, ctx.num_embeddings = ids, padding_idx, weight.shape[0]
        return weight[ids]                                # (..., D)

    @staticmethod
    def backward(ctx, dout):
        ids = ctx.ids.reshape(-1)                         # (N,)
        # out[n] = weight[ids[n]]  ->  dweight[v] = sum_{n: ids[n] = v} dout[n]
        dweight = scatter_add_rows(ids, dout.reshape(ids.shape[0], dout.shape[-1]), ctx.num_embeddings)
        # the padding row takes no part in learning
        if ctx.padding_idx is not None:
            dweight[ctx.padding_idx] = 0
        return dweight


def check_token_ids(ids, num, op, name="input"):
    """Integer token ids in [0, num): host ids now, device ids on the device (read with the next
    result; npformer.runtime.deferred)."""
    if ids.dtype.kind not in "iu":
        raise TypeError(f"{op}: {name} must hold integer token ids, got dtype {ids.dtype}")
    check_index_range(ids, num, lambda lo, hi: IndexError(
        f"{op}: token ids must be in [0, {num - 1}] (num_embeddings={num}), got min {lo} and max {hi}"))


@has_twin
def embedding(input: Tensor | ArrayLike, weight: Tensor | Array, padding_idx: int | None = None) -> Tensor:
    """weight[input] like torch.nn.functional.embedding: input integer ids of any shape,
    weight (num_embeddings, embedding_dim) -> (*input.shape, embedding_dim). The
    `padding_idx` row (negative counts from the end) gets exactly zero gradient. Ids that arrive as
    host arrays are checked at once; ids already on a GPU are checked there, and a bad one raises
    when the result is first read (npformer.runtime.deferred). Raises TypeError for non-integer ids,
    IndexError for ids outside [0, num_embeddings), ValueError for a weight that is not 2-D."""
    w = check_tensor("weight", weight, "embedding")
    if w.ndim != 2:
        raise ValueError(f"embedding: weight must be 2-D (num_embeddings, embedding_dim), got shape {tuple(w.shape)}")
    num = w.shape[0]
    ids = on_device_of(input, w, "input", "embedding", check=lambda ids: check_token_ids(ids, num, "embedding"))
    if padding_idx is not None:
        padding_idx = check_int(padding_idx, "padding_idx", "embedding", at_least=-num, at_most=num - 1) % num
    return EmbeddingFunction.apply(weight, ids=ids, padding_idx=padding_idx)
