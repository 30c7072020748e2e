"""The embedding backward's scatter-add on the CPU (the "cpu" implementation of the kernel table
scatter_add_rows): sorted segments instead of numpy's slow add.at."""
from . import scatter_add_rows


@scatter_add_rows.register("cpu")
def scatter_add_rows_cpu(xp, ids, rows, num_rows):
    """Sort the ids once, sum each run of equal ids with add.reduceat, write each sum once
    (numpy's add.at is much slower)."""
    out = xp.zeros((num_rows, rows.shape[1]), dtype=rows.dtype)
    if ids.size == 0:
        return out
    order = xp.argsort(ids, kind="stable")                # (N,)
    sorted_ids = ids[order]                               # (N,)
    starts = xp.flatnonzero(xp.concatenate([xp.ones(1, dtype=bool), sorted_ids[1:] != sorted_ids[:-1]]))
    out[sorted_ids[starts]] = xp.add.reduceat(rows[order], starts, axis=0)
    return out
