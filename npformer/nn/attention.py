"""MultiheadAttention, and the one mask convention inside npformer.nn.

Masks, at the public entry points (torch.nn's convention; MultiheadAttention.forward, the
Transformer layers' and stacks' forward, the models' forward and decode_step, decoding):
- attn_mask (T, S) or (B*H, T, S): bool True = query i may NOT attend to key j, or a float
  mask added to the scores (-inf hides);
- key_padding_mask (B, S): bool True = key j is padding (no query attends to it), or float added;
- is_causal: key j > query i hidden.
Inside the library, one convention only: F.scaled_dot_product_attention's, carried as an
`AttentionMask(mask, is_causal)`: mask None, or bool True = takes part, or float added,
broadcastable to (B, H, T, S); is_causal True when the causal mask is the only one (SDPA applies
it without materialising a mask). `attention_mask` converts the public masks to it, once, at
the entry point; every layer below receives the converted mask (`forward_masked`, `attend`),
and the KV cache keeps its keys' padding in it too (`DecoderCache.attendable`, True = takes part).
A float mask Tensor that requires grad stays a Tensor through the conversion, so it gets its
gradient, as in torch (dS summed over the axes it was broadcast over).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import npformer.functional as F
from autograd import Tensor, backend, concatenate, is_grad_enabled, raw_computation
from autograd.backend import Array, ArrayLike, DType
from autograd.checks import as_array, check_bool, check_int
from npformer.functional.attention.graph import graph_scores

from . import init
from .config import TransformerConfig
from .hook_points import add_hook_points
from .layers import Linear, new_parameter
from .module import Module
from .positional import RotaryEmbedding


class AttentionMask(NamedTuple):
    """A mask in F.scaled_dot_product_attention's convention (see the module docstring): `mask`
    None, bool (True = takes part) or float (added; a Tensor when it requires grad), broadcastable
    to (B, H, T, S); `is_causal`: keys j > query i hidden as well."""

    mask: Array | Tensor | None = None
    is_causal: bool = False


def _mask_array(mask, name, like):
    """A user mask (array, list or Tensor) as a bool or floating array on the device of `like`
    (floating masks cast to like's dtype); a Tensor that requires grad (grad mode on) stays that
    Tensor, which must have like's dtype and device."""
    if isinstance(mask, Tensor):
        if mask.requires_grad and is_grad_enabled():
            if mask.dtype != like.dtype:
                raise TypeError(f"{name} requires grad, so it must have the inputs' dtype {like.dtype}, "
                                f"got {mask.dtype}")
            if mask.device != backend.device_of(like):
                raise RuntimeError(f"{name} is on device '{mask.device}' but the inputs are on "
                                   f"'{backend.device_of(like)}'; move it with .to(device)")
            return mask
        mask = mask.data
    if not backend.is_array(mask):
        mask = as_array(mask, name, None, backend.get_array_module(like))
    if mask.dtype.kind == "f":
        mask = mask.astype(like.dtype, copy=False)
    elif mask.dtype != bool:
        raise TypeError(f"{name} must be a bool or floating mask, got dtype {mask.dtype}")
    return backend.to_device(mask, backend.device_of(like))


def attention_mask(attn_mask: ArrayLike | None, key_padding_mask: ArrayLike | None, like: Array,
                   shape: tuple[int, int, int, int], is_causal: bool = False,
                   names: tuple[str, str] = ("attn_mask", "key_padding_mask"),
                   sliding_window: int | None = None) -> AttentionMask:
    """torch.nn-convention masks converted, once, to one AttentionMask (SDPA convention).

    attn_mask: (T, S) or (B*H, T, S), bool True = may not attend, or float added.
    key_padding_mask: (B, S), bool True = padding, or float added.
    shape: (B, H, T, S); like: an array of the inputs (device and floating dtype); names: the
    two masks' argument names in errors. is_causal: used only when attn_mask is None: key
    j > query i may not attend. The result's is_causal is True only when no mask is needed
    besides causality (SDPA applies it without materialising a mask). Float mask Tensors that
    require grad are combined with Tensor ops: their gradients flow.
    sliding_window: W (needs is_causal=True, ValueError otherwise; applied even beside an attn_mask): key j <= query i - W
    may not attend either. When the causal mask is the only one, the result is
    AttentionMask(None, True) all the same: the attention module applies its window then
    (F.scaled_dot_product_attention(sliding_window=W), which never materialises it).
    """
    batch, heads, tgt_len, src_len = shape
    attn_name, padding_name = names
    if sliding_window is not None and not is_causal:  # a window without causality would be dropped unseen
        raise ValueError(f"the config's sliding_window={sliding_window} applies to causal self-attention only; "
                         f"pass is_causal=True (with or without {attn_name}), or build the layer without it")
    parts = []
    if attn_mask is not None:
        mask = _mask_array(attn_mask, attn_name, like)
        if mask.ndim == 2 and mask.shape == (tgt_len, src_len):
            parts.append(mask.reshape(1, 1, tgt_len, src_len))                 # (1, 1, T, S)
        elif mask.ndim == 3 and mask.shape == (batch * heads, tgt_len, src_len):
            parts.append(mask.reshape(batch, heads, tgt_len, src_len))        # (B, H, T, S)
        else:
            raise ValueError(f"{attn_name} must have shape {(tgt_len, src_len)} or "
                             f"{(batch * heads, tgt_len, src_len)} (batch*heads, T, S), got {mask.shape}")
    if key_padding_mask is not None:
        mask = _mask_array(key_padding_mask, padding_name, like)
        if mask.shape != (batch, src_len):
            raise ValueError(f"{padding_name} must have shape (batch, S) = {(batch, src_len)}, got {mask.shape}")
        parts.append(mask.reshape(batch, 1, 1, src_len))                       # (B, 1, 1, S)
    if not parts:
        return AttentionMask(None, bool(is_causal))
    causal = None  # or (T, S, hide the future, window): the causal mask and / or the sliding window too
    if is_causal and (attn_mask is None or sliding_window is not None):
        causal = (tgt_len, src_len, attn_mask is None, sliding_window)
    if all(p.dtype == bool for p in parts):
        return AttentionMask(raw_computation(_allowed, tuple(parts), causal), False)  # again at each replay
    if any(isinstance(p, Tensor) for p in parts):  # combined with ops: their gradients flow
        return AttentionMask(_added(tuple(parts), causal, like.dtype), False)
    return AttentionMask(raw_computation(_added, tuple(parts), causal, like.dtype), False)


def _with_causal(parts, causal):
    """The bool masks `parts` (True = blocked) and, when `causal` is (T, S, future, window), the
    causal one (future: keys j > i blocked; window W: keys j <= i - W blocked; top-left aligned)."""
    if causal is None:
        return parts
    xp = backend.get_array_module(parts[0].data if isinstance(parts[0], Tensor) else parts[0])
    tgt_len, src_len, future, window = causal
    blocked = xp.zeros((tgt_len, src_len), dtype=bool)
    if future:
        blocked |= xp.triu(xp.ones((tgt_len, src_len), dtype=bool), 1)
    if window is not None:
        blocked |= xp.tril(xp.ones((tgt_len, src_len), dtype=bool), -window)
    return parts + (blocked[None, None],)                                                # (1, 1, T, S)


def _allowed(parts, causal):
    """True where no bool mask of `parts` (True = blocked), nor the causal mask, blocks."""
    parts = _with_causal(parts, causal)
    blocked = parts[0]
    for p in parts[1:]:
        blocked = blocked | p
    return ~blocked


def _added(parts, causal, dtype):
    """The sum of the masks `parts` (and the causal one) as floats of `dtype` (bool ones: -inf
    where blocked)."""
    added = None
    for p in _with_causal(parts, causal):
        if p.dtype == bool:  # True = blocked -> -inf, like torch's _canonical_mask
            p = backend.get_array_module(p).where(p, -math.inf, 0.0).astype(dtype)
        added = p if added is None else added + p  # a Tensor once one part is (array + Tensor defers to it)
    return added


def repeat_kv_heads(x: Tensor, num_heads: int) -> Tensor:
    """Key or value heads (B, H_kv, S, hd) repeated for `num_heads` query heads -> (B, num_heads,
    S, hd): query head h reads kv head h // (num_heads / H_kv), as F.scaled_dot_product_attention's
    enable_gqa groups them (autograd ops, so the gradient of each kv head sums over its group)."""
    B, kv_heads, S, hd = x.shape
    groups = num_heads // kv_heads
    if groups == 1:
        return x
    return x.reshape(B, kv_heads, 1, S, hd).expand(B, kv_heads, groups, S, hd).reshape(B, num_heads, S, hd)


# MultiheadAttention's hook points (npformer.nn.hook_points; docs/hook_points.md)
ATTENTION_HOOK_POINTS = ("hook_q", "hook_k", "hook_v", "hook_attn_scores", "hook_pattern", "hook_pattern_dropped",
                         "hook_z")

_NAMES = {"d_model": "embed_dim", "nhead": "num_heads", "attention_backend": "backend"}  # torch's argument names


class MultiheadAttention(Module):
    """Multi-head attention, batch first: query (B, T, E), key/value (B, S, E) -> (B, T, E).

    Parameters as torch: in_proj_weight (3E, E) packing W_q, W_k, W_v (head j uses rows
    [j*hd, (j+1)*hd) of each), in_proj_bias (3E,), out_proj Linear(E, E).
    out = softmax(Q K^T / sqrt(hd) + mask) V per head, concatenated, through out_proj.
    Self-attention (query is key is value) projects q, k, v with one packed GEMM.

    kdim / vdim (torch's): feature sizes of key and value (default embed_dim). When either
    differs from embed_dim, the projections are three matrices q_proj_weight (E, E),
    k_proj_weight (E, kdim), v_proj_weight (E, vdim) instead of in_proj_weight (torch's keys);
    in_proj_bias stays packed (3E,).
    add_bias_kv (torch's): learned bias_k, bias_v (1, 1, E) appended after the S projected keys
    and values of every row (S + 1 keys); add_zero_attn: then a zero key and value (per head)
    appended too. Like torch, attn_mask and key_padding_mask gain a column per appended key that
    every query may attend to (so a query whose S keys are all masked attends to the appended
    ones), and the returned weights cover S + 1 (+ 1) keys. With is_causal=True and no attn_mask
    the causal mask covers the S keys and the appended ones stay visible (torch needs attn_mask
    with is_causal; given one, it does the same).

    Extras (not in torch): `rotary=True` applies RoPE to q and k (positions from 0, or given
    per row, or from the cache's length in the cached step); `backend` chooses the path of
    F.scaled_dot_product_attention whenever no attention weights are asked for (need_weights=False,
    as inside the Transformer layers): None (flash attention on a GPU where it applies, else naive), "naive",
    "memory_efficient" (blocks of `block_size`; also `memory_efficient=True`) or "flash".

    Grouped-query attention (not in torch.nn.MultiheadAttention): `num_kv_heads=H_kv` (None =
    num_heads; 1 = multi-query; it must divide num_heads) projects keys and values to H_kv heads
    of the same head_dim, each shared by num_heads / H_kv query heads (query head h reads kv head
    h // (num_heads / H_kv), F.scaled_dot_product_attention(enable_gqa=True)). in_proj_weight is
    then ((H + 2 H_kv) hd, E): rows [W_q (H hd); W_k (H_kv hd); W_v (H_kv hd)] (Hugging Face's
    q_proj, k_proj, v_proj stacked), in_proj_bias likewise; k_proj_weight / v_proj_weight are
    (H_kv hd, kdim / vdim), bias_k / bias_v (1, 1, H_kv hd); KV caches hold H_kv heads.

    `config=TransformerConfig(...)` instead of the settings (as the Transformer layers build it:
    d_model, nhead, num_kv_heads, attention_dropout (else dropout), bias (out_proj's) and
    qkv_bias (in_proj's, default: bias), rotary, sliding_window (with is_causal: each query sees
    the last `sliding_window` keys), the attention path, device, dtype); `self.config` holds it
    either way. Masks: see the module docstring. Raises
    TypeError / ValueError naming a bad argument.

    Hook points (npformer.nn.hook_points, docs/hook_points.md): hook_q, hook_k, hook_v (after
    RoPE), hook_attn_scores, hook_pattern, hook_pattern_dropped, hook_z; while one of the scores'
    and patterns' has a hook, S, P and dropout(P) are separate autograd ops (`hooked_heads`).
    """

    def __init__(self, embed_dim: int | None = None, num_heads: int | None = None, dropout: float = 0.0,
                 bias: bool = True, add_bias_kv: bool = False, add_zero_attn: bool = False, kdim: int | None = None,
                 vdim: int | None = None, batch_first: bool = True, device: str | None = None,
                 dtype: DType | None = None, rotary: bool = False, rotary_base: float = 10000.0,
                 memory_efficient: bool = False, block_size: int = 512, backend: str | None = None, *,
                 num_kv_heads: int | None = None, config: TransformerConfig | None = None):
        super().__init__()
        config = TransformerConfig.from_arguments(
            config, "MultiheadAttention", MultiheadAttention.__init__, _NAMES, d_model=embed_dim, nhead=num_heads,
            dropout=dropout, bias=bias, batch_first=batch_first, device=device, dtype=dtype, rotary=rotary,
            rotary_base=rotary_base, memory_efficient=memory_efficient, block_size=block_size,
            attention_backend=backend, num_kv_heads=num_kv_heads)
        self.config = config
        embed_dim, device, dtype = config.d_model, config.device, config.dtype
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, config.nhead, config.kv_heads
        self.head_dim = embed_dim // config.nhead
        self.kv_dim = kv_dim = self.num_kv_heads * self.head_dim    # width of the k and v projections
        self.kdim = embed_dim if kdim is None else check_int(kdim, "kdim", "MultiheadAttention", at_least=1)
        self.vdim = embed_dim if vdim is None else check_int(vdim, "vdim", "MultiheadAttention", at_least=1)
        self.dropout = config.attention_dropout_p   # torch's attribute; may be changed after construction
        self.backend = config.attention_backend     # likewise (F.scaled_dot_product_attention's backend)
        self.batch_first = True
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        # rows of the packed projection: q [0, E), k [E, E + kv_dim), v [E + kv_dim, E + 2 kv_dim)
        self._rows = (0, embed_dim, embed_dim + kv_dim, embed_dim + 2 * kv_dim)
        if self._qkv_same_embed_dim:
            self.in_proj_weight = new_parameter((embed_dim + 2 * kv_dim, embed_dim), device, dtype)
        else:
            self.register_parameter("in_proj_weight", None)
            for name, rows, features in (("q", embed_dim, embed_dim), ("k", kv_dim, self.kdim),
                                         ("v", kv_dim, self.vdim)):
                setattr(self, f"{name}_proj_weight", new_parameter((rows, features), device, dtype))
        if config.qkv_bias_p:
            self.in_proj_bias = new_parameter((embed_dim + 2 * kv_dim,), device, dtype)
        else:
            self.register_parameter("in_proj_bias", None)
        if check_bool(add_bias_kv, "add_bias_kv", "MultiheadAttention"):
            self.bias_k = new_parameter((1, 1, kv_dim), device, dtype)
            self.bias_v = new_parameter((1, 1, kv_dim), device, dtype)
        else:
            self.bias_k = self.bias_v = None
        self.add_zero_attn = check_bool(add_zero_attn, "add_zero_attn", "MultiheadAttention")
        self.out_proj = Linear(embed_dim, embed_dim, bias=config.bias, device=device, dtype=dtype)
        self.rotary_emb = RotaryEmbedding(self.head_dim, config.rotary_base, config.rope_scaling) if config.rotary else None
        add_hook_points(self, *ATTENTION_HOOK_POINTS)
        self._reset_parameters()

    def _reset_parameters(self):
        """torch's: xavier_uniform_ on the projection matrices, zero biases, xavier_normal_ on bias_k/v."""
        if self._qkv_same_embed_dim:
            init.xavier_uniform_(self.in_proj_weight)
        else:
            for w in (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight):
                init.xavier_uniform_(w)
        if self.in_proj_bias is not None:  # torch zeroes both (one `bias` flag); with qkv_bias=True,
            init.zeros_(self.in_proj_bias)  # bias=False out_proj has none
            if self.out_proj.bias is not None:
                init.zeros_(self.out_proj.bias)
        if self.bias_k is not None:
            init.xavier_normal_(self.bias_k)
            init.xavier_normal_(self.bias_v)

    @property
    def rotary(self) -> bool:
        """Whether RoPE rotates q and k (config.rotary)."""
        return self.rotary_emb is not None

    @property
    def grouped(self) -> bool:
        """Whether keys and values have fewer heads than queries (grouped-query attention)."""
        return self.num_kv_heads != self.num_heads

    # -- pieces, shared by forward and the cached decoding step --------------------------
    def _heads(self, x):
        """(B, L, E) -> (B, H, L, hd)."""
        return F.split_heads(x, self.num_heads)

    def _kv_heads(self, x):
        """(B, L, H_kv hd) -> (B, H_kv, L, hd)."""
        return F.split_heads(x, self.num_kv_heads)

    def _weights(self, first, last):
        """Projections first..last (0 = q, 1 = k, 2 = v) as one matrix: W (their rows, in), b or
        None. With separate q/k/v_proj_weight (kdim/vdim != embed_dim): first == last."""
        rows = slice(self._rows[first], self._rows[last + 1])
        b = self.in_proj_bias[rows] if self.in_proj_bias is not None else None
        if self.in_proj_weight is not None:
            return self.in_proj_weight[rows], b
        return getattr(self, "qkv"[first] + "_proj_weight"), b

    def project_qkv(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """query (B, T, E), key (B, S, kdim), value (B, S, vdim) projected and split into heads:
        q (B, H, T, hd), k and v (B, H_kv, S, hd). Self-attention (query is key is value) uses one
        packed GEMM."""
        if query is key and key is value and self.in_proj_weight is not None:  # one packed GEMM (B, T, 3E)
            qkv = F.linear(query, self.in_proj_weight, self.in_proj_bias)              # (B, T, E + 2 kv_dim)
            if not self.grouped:
                return F.split_heads(qkv, self.num_heads, chunks=3)                    # 3 x (B, H, T, hd)
            E = self.embed_dim
            k, v = F.split_heads(qkv[:, :, E:], self.num_kv_heads, chunks=2)           # 2 x (B, H_kv, T, hd)
            return self._heads(qkv[:, :, :E]), k, v
        q = self.project_q(query)
        k, v = self.project_kv(key, value)
        return q, k, v

    def project_q(self, query: Tensor) -> Tensor:
        """query (B, T, E) -> query heads (B, H, T, hd)."""
        return self._heads(F.linear(query, *self._weights(0, 0)))                     # (B, H, T, hd)

    def project_kv(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """key (B, S, kdim), value (B, S, vdim) -> key and value heads (B, H_kv, S, hd); one GEMM
        when key is value (cross-attention)."""
        if key is value and self.in_proj_weight is not None:
            kv = F.linear(key, *self._weights(1, 2))                                   # (B, S, 2 kv_dim)
            return F.split_heads(kv, self.num_kv_heads, chunks=2)                      # 2 x (B, H_kv, S, hd)
        return (self._kv_heads(F.linear(key, *self._weights(1, 1))),
                self._kv_heads(F.linear(value, *self._weights(2, 2))))

    def append_keys(self, k: Tensor, v: Tensor, mask: AttentionMask, tgt_len: int) -> tuple[Tensor, Tensor, AttentionMask]:
        """torch's add_bias_kv and add_zero_attn on heads k, v (B, H_kv, S, hd): bias_k / bias_v
        (split into heads), then zero vectors, appended as keys S (and S + 1) -> (k, v, mask) with
        (B, H, S + n, hd). The mask gains a column per appended key that every query may attend
        to; a causal mask (mask.is_causal) is materialised over the first S keys of the tgt_len
        queries (with the config's sliding window)."""
        B, H, S, hd = k.shape
        extra_k, extra_v = [], []
        if self.bias_k is not None:
            extra_k.append(self._kv_heads(self.bias_k).expand(B, H, 1, hd))            # (B, H_kv, 1, hd)
            extra_v.append(self._kv_heads(self.bias_v).expand(B, H, 1, hd))
        if self.add_zero_attn:
            zeros = Tensor(k.xp.zeros((B, H, 1, hd), dtype=k.dtype))
            extra_k.append(zeros)
            extra_v.append(zeros)
        if not extra_k:
            return k, v, mask
        k, v = concatenate([k] + extra_k, axis=2), concatenate([v] + extra_v, axis=2)  # (B, H, S + n, hd)
        xp, array = k.xp, mask.mask
        if mask.is_causal:  # key j <= query i takes part (top-left aligned, as in SDPA), and j > i - W
            causal = xp.tril(xp.ones((tgt_len, S), dtype=bool))[None, None]            # (1, 1, T, S)
            if self.causal_window(mask) is not None:
                causal = xp.triu(causal, 1 - self.causal_window(mask))
            if array is None:
                array = causal
            elif array.dtype == bool:
                array = array & causal
            else:
                array = array + xp.where(causal, 0.0, -math.inf).astype(array.dtype)
        if array is None:
            return k, v, AttentionMask()
        visible = True if array.dtype == bool else 0.0
        column = xp.full(array.shape[:-1] + (len(extra_k),), visible, dtype=array.dtype)
        if isinstance(array, Tensor):  # a mask that requires grad
            return k, v, AttentionMask(concatenate([array, Tensor(column)], axis=-1))  # (..., T, S + n)
        return k, v, AttentionMask(xp.concatenate([array, column], axis=-1))           # (..., T, S + n)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask = AttentionMask(), *,
               need_weights: bool = False, average_attn_weights: bool = True) -> tuple[Tensor, Tensor | None]:
        """Heads q (B, H, T, hd), k, v (B, H_kv, S, hd) through F.scaled_dot_product_attention (with
        `mask`, dropout when training_active, the config's attention path; enable_gqa when H_kv < H;
        the config's sliding_window when mask.is_causal) and out_proj -> (output (B, T, E),
        weights (B, T, S), or (B, H, T, S) with average_attn_weights=False, or None). While a hook
        point of this module has a hook: `hooked_heads`."""
        B, H, T, hd = q.shape
        heads = self.hooked_heads if self.hooks_active else self.fused_heads
        out, weights = heads(q, k, v, mask, need_weights)                               # (B, H, T, hd)
        out = self.out_proj(out.transpose(1, 2).reshape(B, T, self.embed_dim))        # (B, T, E)
        if weights is not None and average_attn_weights:
            weights = weights.mean(axis=1)                                             # (B, T, S)
        return out, weights

    def fused_heads(self, q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask,
                    need_weights: bool) -> tuple[Tensor, Tensor | None]:
        """The heads' outputs (B, H, T, hd) of F.scaled_dot_product_attention (see `attend`), and
        the (dropped-out) weights (B, H, T, S) when need_weights, else None."""
        # the memory-efficient and flash paths never form the weights: they run when none are asked for
        result = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask.mask, dropout_p=self.dropout if self.training_active else 0.0,
            is_causal=mask.is_causal, enable_gqa=self.grouped, sliding_window=self.causal_window(mask),
            return_weights=need_weights, memory_efficient=self.config.memory_efficient and not need_weights,
            block_size=self.config.block_size, backend=None if need_weights else self.backend)
        return result if need_weights else (result, None)

    def attention_scores(self, q: Tensor, k: Tensor, mask: AttentionMask) -> Tensor:
        """S = q k^T / sqrt(hd) + mask (B, H, T, S), -inf where a key is hidden (the mask's False
        entries, causality, the sliding window), as autograd ops (the functional attention's
        graph_scores); grouped-query attention reads each kv head for its group of query heads."""
        additive = blocked = None
        if mask.mask is not None and (isinstance(mask.mask, Tensor) or mask.mask.dtype != bool):
            additive = mask.mask                                     # a float mask is added
        elif mask.mask is not None:
            blocked = ~mask.mask                                     # a bool mask: True = takes part
        return graph_scores(q, repeat_kv_heads(k, q.shape[1]), additive, blocked, mask.is_causal,
                            1.0 / math.sqrt(q.shape[-1]), self.causal_window(mask))

    def hooked_heads(self, q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask,
                     need_weights: bool) -> tuple[Tensor, Tensor | None]:
        """`fused_heads` through the hook points: while hook_attn_scores, hook_pattern or
        hook_pattern_dropped has a hook, S, P = softmax(S) and Pd = dropout(P) are separate
        autograd ops (the dropout masks those of the fused op: the same draws), their output
        Pd V; else the fused op. Then hook_z on the heads' outputs (B, H, T, hd)."""
        if self.hook_attn_scores.active or self.hook_pattern.active or self.hook_pattern_dropped.active:
            scores = self.hook_attn_scores(self.attention_scores(q, k, mask))          # (B, H, T, S)
            probs = self.hook_pattern(F.softmax(scores, dim=-1))                       # P
            dropped = self.hook_pattern_dropped(F.dropout(probs, self.dropout, self.training_active))  # Pd
            out = dropped @ repeat_kv_heads(v, q.shape[1])                             # (B, H, T, hd)
            weights = dropped if need_weights else None
        else:
            out, weights = self.fused_heads(q, k, v, mask, need_weights)
        return self.hook_z(out), weights

    def hooked_qkv(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v (after RoPE) through hook_q, hook_k, hook_v."""
        return self.hook_q(q), self.hook_k(k), self.hook_v(v)

    def causal_window(self, mask: AttentionMask) -> int | None:
        """The sliding window SDPA applies for `mask`: config.sliding_window when the mask is
        the causal one alone (mask.is_causal), else None (a materialised mask has it folded in)."""
        return self.config.sliding_window if mask.is_causal else None

    # -- public API ------------------------------------------------------------------------
    def check_inputs(self, query: Tensor, key: Tensor, value: Tensor) -> None:
        """TypeError unless query, key, value are Tensors; ValueError unless they are (B, T, E),
        (B, S, kdim), (B, S, vdim) with one batch size and S >= 1."""
        for name, x, features in (("query", query, self.embed_dim), ("key", key, self.kdim),
                                  ("value", value, self.vdim)):
            if not isinstance(x, Tensor):
                raise TypeError(f"MultiheadAttention: {name} must be an autograd.Tensor, got {type(x).__name__}")
            if x.ndim != 3 or x.shape[-1] != features:
                raise ValueError(f"MultiheadAttention: {name} must be (batch, seq, {features}), got {x.shape}")
        if not query.shape[0] == key.shape[0] == value.shape[0]:
            raise ValueError(f"MultiheadAttention: batch sizes differ: query {query.shape[0]}, "
                             f"key {key.shape[0]}, value {value.shape[0]}")
        if key.shape[1] != value.shape[1]:
            raise ValueError(f"MultiheadAttention: key and value lengths differ: {key.shape[1]} vs {value.shape[1]}")
        if key.shape[1] == 0:
            raise ValueError(f"MultiheadAttention: key and value must have at least one position (S >= 1), "
                             f"got shape {key.shape}")

    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: ArrayLike | None = None,
                need_weights: bool = True, attn_mask: ArrayLike | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[Tensor, Tensor | None]:
        """Attention of query (B, T, E) over key (B, S, kdim) / value (B, S, vdim): per head
        softmax(q k^T / sqrt(hd) + mask) v, heads joined, through out_proj.

        Returns (output (B, T, E), weights): weights (B, T, S) averaged over heads, or
        (B, H, T, S) with average_attn_weights=False, or None when need_weights=False.
        Masks in torch.nn's convention (module docstring), converted here once. Unlike torch,
        is_causal=True without attn_mask applies the causal mask itself; with the config's
        sliding_window W, is_causal=True also hides keys j <= i - W. A query whose keys are
        all masked gets output out_proj.bias (attention 0), like torch's SDPA path."""
        self.check_inputs(query, key, value)
        need_weights = check_bool(need_weights, "need_weights", "MultiheadAttention")
        average_attn_weights = check_bool(average_attn_weights, "average_attn_weights", "MultiheadAttention")
        is_causal = check_bool(is_causal, "is_causal", "MultiheadAttention")
        B, T, S = query.shape[0], query.shape[1], key.shape[1]
        mask = attention_mask(attn_mask, key_padding_mask, query.data, (B, self.num_heads, T, S), is_causal,
                              sliding_window=self.config.sliding_window)
        return self.forward_masked(query, key, value, mask, need_weights=need_weights,
                                   average_attn_weights=average_attn_weights)

    def forward_masked(self, query: Tensor, key: Tensor, value: Tensor, mask: AttentionMask = AttentionMask(), *,
                       need_weights: bool = False, average_attn_weights: bool = True,
                       position_ids: ArrayLike | None = None) -> tuple[Tensor, Tensor | None]:
        """forward() with the mask already converted (an AttentionMask, SDPA convention); RoPE's
        positions are 0 .. T-1, or position_ids (B, T) or (T,) (self-attention: the queries' and
        keys' positions). -> (output (B, T, E), weights or None)."""
        q, k, v = self.project_qkv(query, key, value)
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(q, position_ids=position_ids), self.rotary_emb(k, position_ids=position_ids)
        if self.hooks_active:
            q, k, v = self.hooked_qkv(q, k, v)
        k, v, mask = self.append_keys(k, v, mask, q.shape[2])
        return self.attend(q, k, v, mask, need_weights=need_weights, average_attn_weights=average_attn_weights)

    def extra_repr(self) -> str:
        """embed_dim, num_heads, dropout, and the options that differ from their defaults."""
        extra = "".join(f", {name}={value}" for name, value, default in (
            ("kdim", self.kdim, self.embed_dim), ("vdim", self.vdim, self.embed_dim),
            ("num_kv_heads", self.num_kv_heads, self.num_heads),
            ("add_bias_kv", self.bias_k is not None, False), ("add_zero_attn", self.add_zero_attn, False),
            ("rotary", self.rotary, False), ("sliding_window", self.config.sliding_window, None)) if value != default)
        extra += f", backend={self.backend!r}" if self.backend else ""
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, dropout={self.dropout}{extra}"
