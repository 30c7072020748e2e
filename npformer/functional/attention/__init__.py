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

from .._common import broadcast_shapes, broadcasts_to, check_tensor, data_of, has_twin, on_device_of
from ..activation import dropout_scale, dropout_stream
# (besides what runs here, the names that other modules and tests import from npformer.functional.attention)
from .blockwise import window_option
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


class _GroupedHeads:
    """Grouped-query attention (enable_gqa=True) without copies of K or V, with G = H / H_kv and
    query head h = kv G + g meeting kv head h // G (torch's repeat_interleave), two ways:

    - views (`inputs`, every path): query (..., H, Tq, hd) as (..., H_kv, G, Tq, hd), key and value
      (..., H_kv, Tk, hd) as (..., H_kv, 1, Tk, hd): broadcasting pairs the heads, and the backward's
      unbroadcast sums dK and dV over each group, at every order and in forward mode. A mask
      (..., H or 1, Tq, Tk) is split the same way; `output` merges (H_kv, G) back into H;
    - folded (`folded`, the naive path): each group's queries stacked on the query axis, query as
      (..., H_kv, G Tq, hd) against the unchanged key and value, so that S = Q K^T, dK = dS^T Q and
      dV = Pd^T dO are one product per kv head, the group sum inside the product; the masks
      (causality and the window among them, whose rows are positions i, not G Tq rows) folded the
      same way as bool masks; `output_folded` unstacks.

    Either way the flat (..., Tq, Tk) index is that of (..., H, Tq, Tk), so the dropout contract
    drops the same entries as with K and V repeated."""

    def __init__(self, heads, kv_heads):
        self.heads, self.kv_heads = heads, kv_heads

    @staticmethod
    def of(query, key, value, attn_mask, op):
        """The grouping of a call with enable_gqa=True (ValueError for head counts that do not
        group), or None when there is nothing to group (H_kv = H)."""
        q, k, v = (check_tensor(name, x, op) for name, x in (("query", query), ("key", key), ("value", value)))
        if min(q.ndim, k.ndim, v.ndim) < 3:
            raise ValueError(f"{op}: enable_gqa=True needs query, key and value with a head axis (..., H, T, hd), "
                             f"got shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
        heads, kv_heads = q.shape[-3], k.shape[-3]
        if v.shape[-3] != kv_heads or heads % kv_heads:
            raise ValueError(f"{op}: enable_gqa=True needs key and value with the same number of heads H_kv "
                             f"(dim -3) dividing the query's H = {heads}, got shapes {tuple(q.shape)}, "
                             f"{tuple(k.shape)}, {tuple(v.shape)}")
        if kv_heads == heads:
            return None
        grouped = _GroupedHeads(heads, kv_heads)
        if attn_mask is not None:
            grouped.check_mask(attn_mask, q, k, op)
        return grouped

    def check_mask(self, attn_mask, q, k, op):
        """ValueError unless the mask broadcasts to (..., H, Tq, Tk)."""
        mask = data_of(attn_mask)
        lead = q.shape[:-3] if len(q.shape) >= len(k.shape) else k.shape[:-3]
        score_shape = tuple(lead) + (self.heads, q.shape[-2], k.shape[-2])
        if not backend.is_array(mask) or broadcasts_to(mask.shape, score_shape):
            return                                                # (not an array: _Call says what it is)
        raise ValueError(f"{op}: attn_mask must broadcast to (..., H, Tq, Tk) = {score_shape}, got shape "
                         f"{tuple(mask.shape)}")

    def inputs(self, query, key, value, attn_mask):
        """(query, key, value, attn_mask) as the grouped views (Tensors stay differentiable)."""
        group = (self.kv_heads, self.heads // self.kv_heads)
        mask = attn_mask
        if attn_mask is not None and attn_mask.ndim >= 3:
            per_head = attn_mask.shape[-3] == self.heads
            mask = attn_mask.reshape(attn_mask.shape[:-3] + (group if per_head else (1, 1)) + attn_mask.shape[-2:])
        return (query.reshape(query.shape[:-3] + group + query.shape[-2:]),
                key.reshape(key.shape[:-3] + (self.kv_heads, 1) + key.shape[-2:]),
                value.reshape(value.shape[:-3] + (self.kv_heads, 1) + value.shape[-2:]), mask)

    def output(self, out):
        """An output (..., H_kv, G, Tq, n) of the views as (..., H, Tq, n)."""
        return out.reshape(out.shape[:-4] + (self.heads,) + out.shape[-2:])

    def folded(self, query, tq):
        """query (..., H, Tq, hd) as (..., H_kv, G Tq, hd) (a view where its strides allow)."""
        return query.reshape(query.shape[:-3] + (self.kv_heads, self.heads // self.kv_heads * tq, query.shape[-1]))

    def fold_mask(self, mask, tq):
        """A mask broadcastable to the views' (..., H_kv, G, Tq, Tk) scores (an array, or a float
        mask Tensor: differentiably) as one broadcastable to the folded (..., H_kv, G Tq, Tk):
        repeated over the axes of G and Tq it was broadcast along, unless it was along both."""
        shape = (1,) * max(0, 3 - mask.ndim) + tuple(mask.shape)
        mask = mask.reshape(shape)
        if shape[-3] == shape[-2] == 1:
            return mask.reshape(shape[:-3] + (1, shape[-1]))
        full = shape[:-3] + (self.heads // self.kv_heads, tq, shape[-1])
        mask = mask.expand(full) if isinstance(mask, Tensor) else backend.get_array_module(mask).broadcast_to(mask, full)
        return mask.reshape(shape[:-3] + (full[-3] * tq, shape[-1]))

    def output_folded(self, out, tq):
        """An output (..., H_kv, G Tq, n) of the folded path as (..., H, Tq, n)."""
        return out.reshape(out.shape[:-3] + (self.heads, tq, out.shape[-1]))


class _Call:
    """The checked arguments of one attention call."""

    def __init__(self, query, key, value, attn_mask, dropout_p, is_causal, scale, op, sliding_window=None):
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
            hint = ""
            if min(q.ndim, k.ndim) >= 3 and 1 < k.shape[-3] < q.shape[-3] and q.shape[-3] % k.shape[-3] == 0:
                hint = " (enable_gqa=True shares each key/value head among H / H_kv query heads)"
            raise ValueError(f"{op}: the leading (batch, head) dimensions of query, key and value must "
                             f"broadcast, got shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
                             f"{hint}") from None
        self.k, self.v = k, v
        self.score_shape = self.lead + (q.shape[-2], k.shape[-2])
        self.dropout_p = check_real(dropout_p, "dropout_p", op, at_least=0, at_most=1)
        self.scale = 1.0 / sqrt(q.shape[-1]) if scale is None else check_real(scale, "scale", op)
        self.causal = check_bool(is_causal, "is_causal", op)
        self.window = None
        if sliding_window is not None:
            self.window = check_int(sliding_window, "sliding_window", op, at_least=1)
            if not self.causal:
                raise ValueError(f"{op}: sliding_window={self.window} needs is_causal=True (query i sees keys "
                                 f"i - W < j <= i), got is_causal={is_causal!r}")
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


def flash_unsupported(q, k, v, additive=None, mask_grad: bool = False, window: int | None = None) -> str | None:
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
    if window is not None:
        return (f"sliding_window={window}: the kernels have no window (the blockwise reference skips the key "
                "blocks outside it)")
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
    implementation, why = attention_blockwise_forward.choose(*args, **window_option(call.window))
    reason = None
    if attention_blockwise_forward.runs_reference(implementation):   # the reference, or it on threads
        if kernels.is_reference_only():
            reason = "npformer.runtime.kernels.reference_only() is active"
        else:
            reason = flash_unsupported(call.q, call.k, call.v, _data(call.additive), call.mask_grad, call.window) or why
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
                      scale: float | None = None, enable_gqa: bool = False, *, sliding_window: int | None = None,
                      return_weights: bool = False, backend: str | None = None,
                      memory_efficient: bool = False) -> tuple[str, str]:
    """(path, reason): which path `scaled_dot_product_attention` takes for these arguments
    ("naive", "memory_efficient" or "flash") and why, e.g. why the flash kernels do not apply
    (the device, the dtype, a head dim they are not compiled for, a mask that needs a gradient,
    a sliding window). Raises what scaled_dot_product_attention would raise for them."""
    op = "attention_backend"
    call = _call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, sliding_window, op)[0]
    return _choose_path(call, return_weights, backend, memory_efficient, op)


def _call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, sliding_window, op):
    """(call, grouped, given, views): the checked arguments (of the grouped views with grouped-query
    attention), the grouping (None without one), (query, key, value) as given and as the views."""
    grouped, given = None, (query, key, value)
    if check_bool(enable_gqa, "enable_gqa", op):
        grouped = _GroupedHeads.of(query, key, value, attn_mask, op)
        if grouped is not None:
            query, key, value, attn_mask = grouped.inputs(query, key, value, attn_mask)
    call = _Call(query, key, value, attn_mask, dropout_p, is_causal, scale, op, sliding_window)
    return call, grouped, given, (query, key, value)


def _hidden_by_position(blocked, q, k, window):
    """The naive path's bool mask with causality's part (keys j > i) and the sliding window's
    (keys j <= i - W) added: causal_blocked over the whole (Tq, Tk)."""
    hidden = causal_blocked(backend.get_array_module(q), 0, q.shape[-2], 0, k.shape[-2], window)
    return hidden if blocked is None else blocked | hidden


@has_twin
def scaled_dot_product_attention(query: Tensor | Array, key: Tensor | Array, value: Tensor | Array,
                                 attn_mask: Tensor | Array | None = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False, *,
                                 sliding_window: int | None = None, return_weights: bool = False,
                                 backend: str | None = None, memory_efficient: bool = False, block_size: int = 512,
                                 generator: random.Philox | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """softmax(query key^T * scale + mask) value, like torch.nn.functional.scaled_dot_product_attention.

    query (..., Tq, hd), key (..., Tk, hd), value (..., Tk, hdv) -> (..., Tq, hdv); usually (B, H, T, hd).
    attn_mask: bool (True = takes part) or float (added to the scores), broadcastable to
    (..., Tq, Tk); is_causal hides keys j > i (combined with attn_mask when both are given).
    A float mask Tensor with requires_grad=True gets its gradient (dS, as torch gives it).
    scale defaults to 1/sqrt(hd). A query row with every key hidden gives 0 and zero gradients.
    enable_gqa=True (grouped-query and multi-query attention, as torch's): key and value have
    H_kv heads on dim -3 where query has H, H % H_kv == 0, and query head h uses kv head
    h // (H / H_kv); their gradients sum over each group. No copy of K or V is made (broadcast
    views), on every path and at every order.
    sliding_window=W (an int >= 1, with is_causal=True): query i sees only keys i - W < j <= i,
    the last W keys (the causal diagonal aligned as is_causal aligns it). The naive path masks
    the rest; the memory-efficient path skips the key blocks outside the window, so that its time
    and memory grow as T W, not T^2 (the flash kernels have no window: the blockwise reference runs).
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
    not fit (batch dims, head dims, head counts that do not group, a mask that does not broadcast),
    a sliding window without is_causal or a path that cannot run.
    """
    op = "scaled_dot_product_attention"
    call, grouped, given, views = _call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                        sliding_window, op)
    path, _ = _choose_path(call, return_weights, backend, memory_efficient, op)
    p = call.dropout_p
    if path == "naive":
        query, key, value = given
        blocked, additive, causal, score_shape, tq = call.blocked, call.additive, call.causal, call.score_shape, \
            call.q.shape[-2]
        if call.window is not None or (causal and grouped is not None):
            # the positions' mask as a bool mask: keys j > i (and j <= i - W) hidden
            blocked = raw_computation(_hidden_by_position, blocked, call.q, call.k, call.window)
            causal = False
        if grouped is not None:  # each group's queries folded into the query axis
            query = grouped.folded(query, tq)
            if blocked is not None:
                blocked = raw_computation(grouped.fold_mask, blocked, tq)
            if additive is not None:
                additive = grouped.fold_mask(additive, tq)                  # (a Tensor: differentiably)
            score_shape = score_shape[:-4] + (score_shape[-4], score_shape[-3] * tq, score_shape[-1])
        keep = None
        if p > 0:  # drawn again at each replay of a recorded step
            keep = raw_computation(drawn_keep_mask, call.q, score_shape, p, causal, generator, op)
        out = AttentionFunction.apply(query, key, value, additive, blocked=blocked, causal=causal,
                                      scale=call.scale, keep=keep, dropout_scale=dropout_scale(p),
                                      return_weights=bool(return_weights))
        if grouped is None:
            return out
        return tuple(grouped.output_folded(o, tq) for o in out) if isinstance(out, tuple) else \
            grouped.output_folded(out, tq)
    block_size = check_int(block_size, "block_size", op, at_least=1)
    dropout = None
    if p > 0:
        draw = dropout_stream(generator, op).draw(prod(call.score_shape), _device(call.q))
        dropout = (p, draw.seed, draw.offset, draw.state)
    # (grouped-query attention: the views, so that the blocks keep their causal and window skipping)
    out = MemoryEfficientAttentionFunction.apply(*views, call.additive, blocked=call.blocked, causal=call.causal,
                                                 scale=call.scale, block_size=block_size, dropout=dropout,
                                                 mask_grad=call.mask_grad, window=call.window)
    return out if grouped is None else grouped.output(out)


from . import cpu, cuda  # noqa: E402,F401  (register the fast variants)
