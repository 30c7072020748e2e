"""Embedding: out = weight[ids], its gradient (a scatter-add of rows) and its tangent, on whole
arrays of `xp` (numpy or CuPy), with torch's options: padding_idx, scale_grad_by_freq, max_norm."""
import math


def embedding_forward(xp, weight, ids):
    """ids (...) integers, weight (V, D) -> out (..., D) = weight[ids]."""
    return weight[ids]                                   # (..., D)


def scatter_add_rows(xp, ids, rows, num_rows):
    """out (num_rows, D) with out[i] = sum of rows[n] over every n where ids[n] == i; ids (N,), rows (N, D)."""
    out = xp.zeros((num_rows, rows.shape[1]), dtype=rows.dtype)
    xp.add.at(out, ids, rows)
    return out


def embedding_backward_options(xp, dweight, ids, padding_idx, scale_grad_by_freq):
    """torch's options applied in place to dweight (V, D) = scatter_add_rows(xp, ids, dout rows, V),
    the gradient of out[n] = weight[ids[n]]: dweight[v] = sum_{n: ids[n] = v} dout[n]; ids (N,)."""
    if scale_grad_by_freq:  # dweight[v] /= count(v), the ids of this batch
        dweight /= id_counts(xp, ids, dweight.shape[0], dweight.dtype)
    # the padding row takes no part in learning
    if padding_idx is not None:
        dweight[padding_idx] = 0
    return dweight


def embedding_tangent(xp, t_weight, ids, padding_idx):
    """t_weight (V, D) the tangent of weight -> t_out (..., D)."""
    # out[n] = weight[ids[n]]  ->  t_out[n] = t_weight[ids[n]]
    t_out = t_weight[ids]                                # (..., D)
    # the padding row is held still, as the backward holds its gradient at 0 (so <g, J u> = <J^T g, u>)
    if padding_idx is not None:
        xp.copyto(t_out, 0, where=(ids == padding_idx)[..., None])
    return t_out


def id_counts(xp, ids, num_embeddings, dtype):
    """(V, 1): how often each id occurs in `ids` (at least 1, so ids that never occur divide by 1)."""
    counts = xp.bincount(ids, minlength=num_embeddings)[:, None]
    return xp.maximum(counts, 1).astype(dtype)


def renormalize_rows(xp, weight, ids, max_norm, norm_type):
    """torch's embedding_renorm_: in place, each row of the raw array `weight` that `ids` refers to
    and whose p-norm (p = norm_type) exceeds max_norm is multiplied by max_norm / (norm + 1e-7)."""
    if ids.size == 0 or weight.shape[1] == 0:            # no row to rescale
        return
    rows = xp.unique(ids.reshape(-1))                    # (K,) each referenced row once
    picked = weight[rows]                                # (K, D)
    if math.isinf(norm_type):
        norms = xp.abs(picked).max(axis=1)               # (K,)
    else:
        norms = (xp.abs(picked) ** norm_type).sum(axis=1) ** (1.0 / norm_type)   # (K,)
    # w_row -> w_row * max_norm / (norm + 1e-7) where norm > max_norm
    scale = xp.where(norms > max_norm, max_norm / (norms + 1e-7), 1.0).astype(weight.dtype)
    weight[rows] = picked * scale[:, None]
