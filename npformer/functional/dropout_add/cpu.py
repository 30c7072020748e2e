"""dropout_add on the CPU (the "cpu" implementation of this folder's kernel table, xp first): the mask
drawn, applied and the residual added chunk by chunk in the cache."""
from ..activation.cpu import dropout_apply_cpu
from . import dropout_add_forward  # the table


@dropout_add_forward.register("cpu", supports=lambda xp, x, residual, seed, offset, p, state=None:
                              state is None and p < 1.0)
def dropout_add_forward_cpu(xp, x, residual, seed, offset, p, state=None):
    """Mask, multiply and add chunk by chunk in the cache (activation/cpu.py's dropout_apply_cpu)."""
    return dropout_apply_cpu(xp, x, seed, offset, p, residual)
