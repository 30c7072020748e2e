"""Scaled dot-product attention, three paths with hand-written backward passes:

- naive: keeps the (Tq, Tk) probabilities (`AttentionFunction`);
- memory-efficient: the FlashAttention scheme (online softmax over key blocks, P recomputed in
  backward from one logsumexp per query row), never a (Tq, Tk) matrix
  (`MemoryEfficientAttentionFunction`). Its blockwise forward and backward are kernel tables:
  the reference (blockwise.py: blocks of numpy/CuPy calls, every device) and, on "cuda", the
  flash-attention kernels of npformer/functional/cuda/flash_attention.cu where they apply (cuda.py);
- flash: that CUDA implementation, chosen by default on a GPU where it applies.

The folder: math.py (the naive forward and backward, the file to read first), higher.py (its
double backward and jvps), blockwise.py (the memory-efficient path), masks.py, dropout.py (the
dropout masks), tables.py (the kernel tables of those formulas), function.py (the autograd
Functions), graph.py (the third derivative as differentiable ops), split_heads.py, cpu.py and
cuda.py (the fast implementations); here, the public ops and the choice of path.

Every path is differentiable twice and more (create_graph, forward over reverse): the naive backward
is the op `AttentionBackward`, whose backward (the double backward) and jvp work from the saved P; the
memory-efficient (and flash) backward is the op `MemoryEfficientAttentionBackward`, whose backward is
the blockwise double backward, again without a (Tq, Tk) matrix. Both write their third derivative
with differentiable ops (`graph_attention_double_backward`).

Every dropout mask over the probabilities is the one of the dropout contract (activation.py):
entry i of the flat (..., Tq, Tk) index is kept iff bits16(seed, offset + i) >= threshold, so
all paths, on every device, drop the same entries for the same generator state."""
from __future__ import annotations

from math import prod, sqrt

from autograd import Tensor, backend, is_grad_enabled, raw_computation
from autograd.backend import Array
from autograd.checks import check_bool, check_int, check_real
from autograd.forward_ad import unpack_dual
from npformer.runtime import kernels, random

from .._common import broadcast_shapes, broadcasts_to, check_tensor, has_twin, on_device_of
from ..activation import dropout_scale, dropout_stream
# (besides what runs here, the names that other modules and tests import from npformer.functional.attention)
from .dropout import attention_keep_block, attention_keep_mask, drawn_keep_mask
from .function import (AttentionBackward, AttentionFunction, MemoryEfficientAttentionBackward,
                       MemoryEfficientAttentionFunction, by_attention_input, naive_attention_gradients)
from .graph import graph_attention_double_backward, graph_probabilities
from .masks import at_least_2d, causal_blocked, hidden_bias, mask_block, masked_scores
from .split_heads import MergeHeadsFunction, SplitHeadsFunction, split_heads, split_heads_backward
from .tables import (attention_backward, attention_backward_jvp, attention_blockwise_backward,
                     attention_blockwise_double_backward, attention_blockwise_forward, attention_blockwise_jvp,
                     attention_double_backward, attention_forward, attention_jvp, matmul_transposed)

__all__ = ["attention_backend", "scaled_dot_product_attention", "split_heads"]  # its public ops, which npformer.functional exports

BACKENDS = ("naive", "memory_efficient", "flash")
FLASH_HEAD_DIMS = (32, 64, 128)       # head dims the flash kernels are compiled for
FLASH_DTYPES = ("float32", "float64")
_FLASH_DTYPE_CHARS = tuple(backend.module_for("cpu").dtype(name).char for name in FLASH_DTYPES)  # "f", "d"


def _lead_shape(q, k, v):
    """The broadcast leading (batch, head) shape of q, k, v; ValueError if they do not broadcast."""
    return broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])


def _prepare_mask(attn_mask, q, score_shape):
    """(blocked, additive): a bool array True where attention is NOT allowed (at least 2-D), or
    a float array of q's dtype added to the scores, each broadcastable to `score_shape`."""
    if attn_mask is None:
        return None, None
    mask = on_device_of(attn_mask, q, "attn_mask", "scaled_dot_product_attention")
    if mask.dtype.kind not in "bf":
        raise TypeError("scaled_dot_product_attention: attn_mask must be bool (True = takes part) or "
                        f"floating (added to the scores), got dtype {mask.dtype}")
    if not broadcasts_to(mask.shape, score_shape):
        raise ValueError("scaled_dot_product_attention: attn_mask must broadcast to (..., Tq, Tk) = "
                         f"{score_shape}, got shape {tuple(mask.shape)}")
    if mask.dtype.kind == "b":
        return raw_computation(_blocked, mask), None
    return None, raw_computation(_as_dtype, mask, q.dtype)


def _blocked(allowed):
    """The bool mask True where attention is not allowed, at least 2-D."""
    return at_least_2d(~allowed)


def _as_dtype(mask, dtype):
    return mask.astype(dtype, copy=False)


class _Call:
    """The checked arguments of one attention call."""

    def __init__(self, query, key, value, attn_mask, dropout_p, is_causal, scale, op):
        self.q = q = check_tensor("query", query, op)
        k = check_tensor("key", key, op)
        v = check_tensor("value", value, op)
        if q.ndim < 2 or k.ndim < 2 or v.ndim < 2:
            raise ValueError(f"{op}: query, key and value must be at least 2-D (..., T, head_dim), got shapes "
                             f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
        if q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2]:
            raise ValueError(f"{op}: expected query (..., Tq, hd), key (..., Tk, hd), value (..., Tk, hdv); got "
                             f"shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
        try:
            self.lead = _lead_shape(q, k, v)
        except ValueError:
            raise ValueError(f"{op}: the leading (batch, head) dimensions of query, key and value must "
                             f"broadcast, got shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}") from None
        self.k, self.v = k, v
        self.score_shape = self.lead + (q.shape[-2], k.shape[-2])
        self.dropout_p = check_real(dropout_p, "dropout_p", op, at_least=0, at_most=1)
        self.scale = 1.0 / sqrt(q.shape[-1]) if scale is None else check_real(scale, "scale", op)
        self.causal = check_bool(is_causal, "is_causal", op)
        self.blocked, self.additive = _prepare_mask(attn_mask, q, self.score_shape)
        # a float mask that requires grad enters the Function as a Tensor input: its gradient is dS
        self.mask_grad = (self.additive is not None and isinstance(attn_mask, Tensor) and attn_mask.requires_grad
                          and is_grad_enabled())
        # ... and so does one that carries a tangent (forward mode): t_S gets t_mask
        moves = (self.additive is not None and isinstance(attn_mask, Tensor)
                 and unpack_dual(attn_mask).tangent is not None)
        if self.mask_grad or moves:
            if attn_mask.dtype != q.dtype:
                why = "requires grad" if self.mask_grad else "carries a tangent"
                raise TypeError(f"{op}: a float attn_mask that {why} must have the dtype of the query "
                                f"({q.dtype}), got {attn_mask.dtype}")
            self.additive = attn_mask


def flash_unsupported(q, k, v, additive=None, mask_grad: bool = False) -> str | None:
    """Why the flash kernels cannot run attention on these arrays (a sentence), or None when they can."""
    dtypes = {a.dtype for a in (q, k, v, additive) if a is not None}
    if len(dtypes) > 1 or next(iter(dtypes)).char not in _FLASH_DTYPE_CHARS:  # (dtype names are slow to make)
        return f"dtype {sorted(map(str, dtypes))}: the kernels are compiled for one of {FLASH_DTYPES}"
    if q.shape[-1] not in FLASH_HEAD_DIMS or v.shape[-1] != q.shape[-1]:
        return (f"head dims {q.shape[-1]} (query, key) and {v.shape[-1]} (value): the kernels are compiled "
                f"for equal head dims in {FLASH_HEAD_DIMS}")
    if not 0 < q.shape[-2] < 2**31 or not 0 < k.shape[-2] < 2**31:
        return f"sequence lengths {q.shape[-2]} (query) and {k.shape[-2]} (key) must be in [1, 2^31)"
    heads = prod(_lead_shape(q, k, v))
    if heads * -(-max(q.shape[-2], k.shape[-2]) // 32) >= 2**31:
        return f"{heads} (batch, head) pairs of these lengths need more than 2^31 - 1 thread blocks"
    if mask_grad:
        return "the float attn_mask requires a gradient, which the kernels do not write"
    if backend.device_of(q) != "cuda":
        return f"the flash kernels run on CUDA arrays, these are on '{backend.device_of(q)}'"
    return None


def _choose_path(call, return_weights, backend_name, memory_efficient, op):
    """(path, reason): the path that runs ("naive", "memory_efficient" or "flash") and why."""
    if backend_name is not None and backend_name not in BACKENDS:
        raise ValueError(f"{op}: backend must be None or one of {BACKENDS}, got {backend_name!r}")
    memory_efficient = check_bool(memory_efficient, "memory_efficient", op)
    if memory_efficient and backend_name == "naive":
        raise ValueError(f"{op}: memory_efficient=True contradicts backend='naive'")
    asked = backend_name or ("memory_efficient" if memory_efficient else None)
    if check_bool(return_weights, "return_weights", op):
        if asked in ("memory_efficient", "flash"):
            raise ValueError(f"{op}: return_weights=True needs the full attention matrix; it cannot be combined "
                             f"with backend={asked!r} / memory_efficient=True")
        return "naive", "return_weights=True needs the (Tq, Tk) weights"
    if asked == "naive":
        return "naive", "backend='naive' was asked for"
    # the memory-efficient path's table says whether its flash kernels take the call
    args = (backend.get_array_module(call.q), call.q, call.k, call.v, None, _data(call.additive), call.causal,
            call.scale, 1, None, call.mask_grad)
    implementation, why = attention_blockwise_forward.choose(*args)
    reason = None
    if attention_blockwise_forward.runs_reference(implementation):   # the reference, or it on threads
        if kernels.is_reference_only():
            reason = "npformer.runtime.kernels.reference_only() is active"
        else:
            reason = flash_unsupported(call.q, call.k, call.v, _data(call.additive), call.mask_grad) or why
    if asked == "flash":
        if reason:
            raise ValueError(f"{op}: backend='flash' cannot run this call: {reason}")
        return "flash", "backend='flash' was asked for"
    if asked == "memory_efficient":
        if reason:
            return "memory_efficient", f"backend='memory_efficient' was asked for; no flash kernel: {reason}"
        return "flash", "the memory-efficient path runs the flash kernels on this device"
    if reason:
        return "naive", f"the default where flash attention does not apply: {reason}"
    return "flash", "the default where flash attention applies"


def _device(array):
    return backend.device_of(array)


def _data(x):
    return x.data if isinstance(x, Tensor) else x


def attention_backend(query: Tensor | Array, key: Tensor | Array, value: Tensor | Array,
                      attn_mask: Tensor | Array | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                      scale: float | None = None, *, return_weights: bool = False, backend: str | None = None,
                      memory_efficient: bool = False) -> tuple[str, str]:
    """(path, reason): which path `scaled_dot_product_attention` takes for these arguments
    ("naive", "memory_efficient" or "flash") and why, e.g. why the flash kernels do not apply
    (the device, the dtype, a head dim they are not compiled for, a mask that needs a gradient).
    Raises what scaled_dot_product_attention would raise for them."""
    op = "attention_backend"
    call = _Call(query, key, value, attn_mask, dropout_p, is_causal, scale, op)
    return _choose_path(call, return_weights, backend, memory_efficient, op)


@has_twin
def scaled_dot_product_attention(query: Tensor | Array, key: Tensor | Array, value: Tensor | Array,
                                 attn_mask: Tensor | Array | None = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: float | None = None, *, return_weights: bool = False,
                                 backend: str | None = None, memory_efficient: bool = False, block_size: int = 512,
                                 generator: random.Philox | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """softmax(query key^T * scale + mask) value, like torch.nn.functional.scaled_dot_product_attention.

    query (..., Tq, hd), key (..., Tk, hd), value (..., Tk, hdv) -> (..., Tq, hdv); usually (B, H, T, hd).
    attn_mask: bool (True = takes part) or float (added to the scores), broadcastable to
    (..., Tq, Tk); is_causal hides keys j > i (combined with attn_mask when both are given).
    A float mask Tensor with requires_grad=True gets its gradient (dS, as torch gives it).
    scale defaults to 1/sqrt(hd). A query row with every key hidden gives 0 and zero gradients.
    dropout_p: dropout on the attention probabilities, drawn from `generator` (an
    npformer.runtime.random.Philox; None: the global dropout stream): entry i of the flat (..., Tq, Tk)
    index is kept iff value offset + i of the stream passes the keep test, on every path and device.
    return_weights=True returns (out, weights) where weights are the (dropped-out) probabilities.

    backend: which path runs (`attention_backend(...)` says which and why):
      None: "flash" on a GPU where its kernels apply, else "naive";
      "naive": keeps the (Tq, Tk) probabilities (the only one with return_weights);
      "memory_efficient" (or memory_efficient=True): blocks of `block_size` queries x keys with
        an online softmax, never a (Tq, Tk) matrix; on a GPU it runs the flash kernels where they
        apply (inside npformer.runtime.kernels.reference_only(), the blockwise numpy/CuPy reference);
      "flash": the CUDA flash-attention kernels (head dims 32/64/128, float32/float64), else ValueError.

    Raises TypeError for a mask that is neither bool nor floating, ValueError for shapes that do
    not fit (batch dims, head dims, a mask that does not broadcast) or a path that cannot run.
    """
    op = "scaled_dot_product_attention"
    call = _Call(query, key, value, attn_mask, dropout_p, is_causal, scale, op)
    path, _ = _choose_path(call, return_weights, backend, memory_efficient, op)
    p = call.dropout_p
    if path == "naive":
        keep = None
        if p > 0:  # drawn again at each replay of a recorded step
            keep = raw_computation(drawn_keep_mask, call.q, call.score_shape, p, call.causal, generator, op)
        return AttentionFunction.apply(query, key, value, call.additive, blocked=call.blocked, causal=call.causal,
                                       scale=call.scale, keep=keep, dropout_scale=dropout_scale(p),
                                       return_weights=bool(return_weights))
    block_size = check_int(block_size, "block_size", op, at_least=1)
    dropout = None
    if p > 0:
        draw = dropout_stream(generator, op).draw(prod(call.score_shape), _device(call.q))
        dropout = (p, draw.seed, draw.offset, draw.state)
    return MemoryEfficientAttentionFunction.apply(query, key, value, call.additive, blocked=call.blocked,
                                                  causal=call.causal, scale=call.scale, block_size=block_size,
                                                  dropout=dropout, mask_grad=call.mask_grad)


from . import cpu, cuda  # noqa: E402,F401  (register the fast variants)
