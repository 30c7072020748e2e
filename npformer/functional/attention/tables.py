"""The kernel tables of attention: each formula of math.py, higher.py and blockwise.py is the
reference of a table of the same name, run with OPS, whose steps are kernel tables themselves
(the softmax's row sums and softmax, Q K^T), as they ran inside the references before: the
"cpu" implementations (cpu.py) and the flash kernels (cuda.py) plug in beside each."""
import functools

from npformer.runtime.kernels import kernel_table

from ..softmax import row_dot, softmax_forward
from . import blockwise, higher, math
from .dropout import attention_keep_block

matmul_transposed = kernel_table(math.matmul_transposed)


def _softmax(xp, x, out=None):
    return softmax_forward(xp, x, -1, out=out)


def _row_dot(xp, a, b):
    return row_dot(a, b)


def _keep_block(xp, dropout, lead, tq, tk, q_start, q_stop, k_start, k_stop, like):
    return attention_keep_block(dropout, lead, tq, tk, q_start, q_stop, k_start, k_stop, like)


OPS = math.Ops(matmul_transposed, _softmax, _row_dot, _keep_block)


def _table(formula):
    """The kernel table whose reference is `formula` with ops=OPS (named and documented as it)."""
    return kernel_table(functools.update_wrapper(functools.partial(formula, ops=OPS), formula))


attention_forward = _table(math.attention_forward)
attention_backward = _table(math.attention_backward)
attention_jvp = _table(higher.attention_jvp)
attention_double_backward = _table(higher.attention_double_backward)
attention_backward_jvp = _table(higher.attention_backward_jvp)
attention_blockwise_forward = _table(blockwise.attention_blockwise_forward)
attention_blockwise_backward = _table(blockwise.attention_blockwise_backward)
attention_blockwise_jvp = _table(blockwise.attention_blockwise_jvp)
attention_blockwise_double_backward = functools.partial(blockwise.attention_blockwise_double_backward, ops=OPS)
