"""Adam's update of one parameter: the kernel table that `optim.Adam` and `optim.AdamW` step with,
its formula in math.py, its CUDA kernel in cuda.py.

It is a kernel table like those of the fused ops, so it lives in their layer: its CUDA kernel
(npformer/functional/cuda/adam.cu, launched by cuda.py) registers here as theirs do, which it could
not do with a table in npformer.optim, a layer to the right of the kernels. It is no op of
npformer.functional (no Function, no gradient), so it is not in npformer.functional.OPS.
"""
from npformer.runtime.kernels import kernel_table

from . import math
from .math import AdamSettings  # noqa: F401  (re-exported for the optimizer)

__all__ = []  # no public op

adam_update = kernel_table(math.adam_update)

from . import cuda  # noqa: E402,F401  (registers the CUDA kernels)
