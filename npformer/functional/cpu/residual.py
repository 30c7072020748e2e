"""dropout_add on the CPU (the "cpu" implementation of residual.py's kernel table): the mask
drawn, applied and the residual added chunk by chunk in the cache."""
from ..residual import dropout_add_forward
from .activation import dropout_apply_cpu


@dropout_add_forward.register("cpu", supports=lambda x, residual, seed, offset, p, state=None: state is None and p < 1.0)
def dropout_add_forward_cpu(x, residual, seed, offset, p, state=None):
    """Mask, multiply and add chunk by chunk in the cache (cpu/activation.py's dropout_apply_cpu)."""
    return dropout_apply_cpu(x, seed, offset, p, residual)
