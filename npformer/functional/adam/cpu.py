"""Adam's update on the CPU (the "cpu" implementation of its kernel table): the reference on flat
blocks of entries, on the threads."""
from npformer.runtime.threads import for_rows

from . import adam_update


@adam_update.register("cpu", supports=lambda xp, param, grad, exp_avg, exp_avg_sq, scratch, settings, replayed=None:
                      replayed is None and param.flags.c_contiguous)
def adam_update_cpu(xp, param, grad, exp_avg, exp_avg_sq, scratch, settings, replayed=None):
    """The reference on flat blocks of entries, on the threads of `npformer.runtime.threads` (bit-identical
    for any thread count)."""
    arrays = tuple(a.reshape(-1) for a in (param, grad, exp_avg, exp_avg_sq, scratch))

    def update(start, stop):
        adam_update.reference(xp, *(a[start:stop] for a in arrays), settings)

    for_rows(update, param.size, param.size, param)
