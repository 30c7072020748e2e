"""Layer norm in blocks of rows on the threads of `npformer.runtime.threads` (the "cpu" implementations
of this family's kernel tables), with einsum row sums."""
from npformer.runtime.threads import for_rows, on_row_blocks

from ..softmax import row_sum
from . import layer_norm_backward, layer_norm_backward_jvp, layer_norm_double_backward, layer_norm_forward


# below this, the blocks' extra calls cost more than they save: a decoding step normalizes a few rows
CPU_MIN_ENTRIES = 1 << 14


def on_named_row_blocks(fn, rows, whole, combine, like):
    """fn(**rows, **whole) on blocks of rows, one per thread (npformer.runtime.threads.on_row_blocks):
    the arrays of `rows` (same number of rows, or None) are sliced to each block, those of `whole`
    pass whole; `combine` says how each output is put back together ("rows" or "sum")."""
    names = tuple(rows)

    def block(*sliced):
        return fn(**dict(zip(names, sliced)), **whole)
    return on_row_blocks(block, tuple(rows.values()), range(len(names)), combine, like)


@layer_norm_forward.register("cpu", supports=lambda xp, x, weight, bias, eps: x.size >= CPU_MIN_ENTRIES)
def layer_norm_forward_cpu(xp, x, weight, bias, eps):
    """The reference's steps on blocks of rows on the threads of `npformer.runtime.threads`, with einsum
    row sums (faster than numpy's reductions over rows of a few hundred entries)."""
    d = x.shape[1]
    xhat = xp.empty(x.shape, dtype=x.dtype)                       # (N, D)
    rstd = xp.empty((x.shape[0], 1), dtype=x.dtype)               # (N, 1)
    y = xp.empty_like(xhat)

    def rows(start, stop):
        xb, xh = x[start:stop], xhat[start:stop]
        mean = row_sum(xb, 1) / d                                 # (n, 1)
        xp.subtract(xb, mean, out=xh)                             # x - mean
        xh -= row_sum(xh, 1) / d                                  # the refinement step
        var = xp.einsum("nd,nd->n", xh, xh)[:, None]              # (n, 1)  two-pass sum (x - mean)^2
        var /= d
        var += eps
        xp.sqrt(var, out=var)
        xp.divide(1.0, var, out=rstd[start:stop])                 # rstd = 1 / sqrt(var + eps)
        xh *= rstd[start:stop]                                    # (n, D)  xhat
        yb = y[start:stop]                                        # y = xhat * weight + bias
        if weight is not None:
            xp.multiply(xh, weight, out=yb)
        else:
            yb[...] = xh
        if bias is not None:
            yb += bias

    for_rows(rows, x.shape[0], x.size, x)
    return y, xhat, rstd


@layer_norm_backward.register("cpu")
def layer_norm_backward_cpu(xp, dy, xhat, rstd, weight, need_x, need_w, need_b):
    """The reference's steps on blocks of rows on the threads of `npformer.runtime.threads` (column sums:
    one partial per block), with einsum row sums."""
    d = xhat.shape[1]
    dx = xp.empty_like(xhat) if need_x else None                  # (N, D)

    def rows(start, stop):
        dyb, xh = dy[start:stop], xhat[start:stop]
        dweight = xp.einsum("nd,nd->d", dyb, xh) if need_w else None
        dbias = dyb.sum(axis=0) if need_b else None
        if need_x:
            g = dyb * weight if weight is not None else dyb                     # (n, D)
            mean_g = row_sum(g, 1) / d                                          # (n, 1)
            mean_gx = xp.einsum("nd,nd->n", g, xh)[:, None]                     # (n, 1)
            mean_gx /= d
            dxb = xp.multiply(xh, mean_gx, out=dx[start:stop])                  # (n, D)
            xp.subtract(g, dxb, out=dxb)
            dxb -= mean_g
            dxb *= rstd[start:stop]
        return dweight, dbias

    partial = for_rows(rows, dy.shape[0], dy.size, dy)            # per block: column sums
    dweight = sum(p[0] for p in partial) if need_w else None
    dbias = sum(p[1] for p in partial) if need_b else None
    return dx, dweight, dbias


def _splits(xp, dy, *rest):
    return dy.size >= CPU_MIN_ENTRIES


@layer_norm_double_backward.register("cpu", splits_reference=True, supports=_splits)
def layer_norm_double_backward_cpu(xp, dy, xhat, rstd, weight, dx, gx, gw, gb, need_dy, need_x, need_w):
    """The reference on blocks of rows (d weight, a column sum: one partial per block)."""
    return on_named_row_blocks(layer_norm_double_backward.reference,
                               dict(dy=dy, xhat=xhat, rstd=rstd, dx=dx, gx=gx),
                               dict(xp=xp, weight=weight, gw=gw, gb=gb, need_dy=need_dy, need_x=need_x, need_w=need_w),
                               ("rows", "rows", "sum"), dy)


@layer_norm_backward_jvp.register("cpu", splits_reference=True, supports=_splits)
def layer_norm_backward_jvp_cpu(xp, dy, xhat, rstd, weight, dx, t_dy, t_x, t_w, need_x, need_w, need_b):
    """The reference on blocks of rows (the weight's and the bias's tangents, column sums: one
    partial per block)."""
    return on_named_row_blocks(layer_norm_backward_jvp.reference,
                               dict(dy=dy, xhat=xhat, rstd=rstd, dx=dx, t_dy=t_dy, t_x=t_x),
                               dict(xp=xp, weight=weight, t_w=t_w, need_x=need_x, need_w=need_w, need_b=need_b),
                               ("rows", "sum", "sum"), dy)
