"""The CPU's faster implementations, plugged into the kernel tables of npformer.functional.

One module per op family, mirroring `npformer/functional/cuda/`: each registers its
implementations with the tables whose references live beside the op, e.g.
`@linear_forward.register("cpu", supports=...)`. Most split the reference's work into blocks of
rows on the threads of `npformer.runtime.threads` (`set_num_threads`), with the same arithmetic per
block, so results do not depend on the thread count (but for the GEMMs' last bits); others use
faster numpy calls for the same values (einsum row sums, the dropout mask made in cache-sized
chunks). Each is tested against its reference (tests/functional/cpu/test_cpu_implementations.py).
"""
from . import adam  # noqa: F401
