"""npformer.functional (imported as F): ops with hand-derived backward passes, mirroring
torch.nn.functional. `npformer.functional.composite` holds slow twins built from autograd
primitives, used as test references. Fused computations run from kernel tables
(`npformer.runtime.kernels`): a plain reference, and faster implementations per device (row blocks on
the CPU threads in `npformer.functional.cpu`, hand-written CUDA kernels in `npformer.functional.cuda`)."""
from .softmax import log_softmax, softmax  # first: its cuda.py loads npformer.functional.cuda, whose launchers load the ops
from .activation import dropout, gelu, relu
from .attention import attention_backend, scaled_dot_product_attention, split_heads
from .embedding import embedding
from .layer_norm import layer_norm
from .linear import linear
from .cross_entropy import cross_entropy
from .dropout_add import dropout_add
from .rotary import apply_rotary_emb, rotary_cos_sin

from . import cpu  # noqa: E402,F401  (registers the CPU implementations in the kernel tables)
from . import cuda  # noqa: E402,F401  (registers the CUDA kernels in the kernel tables; runs only on a GPU)

__all__ = ["apply_rotary_emb", "attention_backend", "cross_entropy", "dropout", "dropout_add", "embedding", "gelu",
           "layer_norm", "linear", "log_softmax", "relu", "rotary_cos_sin", "scaled_dot_product_attention", "softmax",
           "split_heads"]
