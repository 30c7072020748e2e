"""MultiheadAttention with torch's packed weights and torch.nn's mask convention.

torch.nn masks (bool True = may NOT attend, float = added to the scores) are converted once
into the convention of F.scaled_dot_product_attention (bool True = takes part, float =
added), broadcastable to (B, H, T, S), and the heads go through one SDPA call.
"""
import math

import npformer.functional as F
from autograd import Tensor, backend, concatenate
from autograd.checks import as_array, check_int, check_real

from . import init
from .layers import Linear, new_parameter
from .module import Module
from .positional import RotaryEmbedding


def _mask_array(mask, name, like):
    """A user mask (array, list or Tensor) as a bool or floating array on the device of `like`
    (floating masks cast to like's dtype)."""
    if isinstance(mask, Tensor):
        mask = mask.data
    if not backend.is_array(mask):
        mask = as_array(mask, name, None, backend.get_array_module(like))
    if mask.dtype.kind == "f":
        mask = mask.astype(like.dtype, copy=False)
    elif mask.dtype != bool:
        raise TypeError(f"{name} must be a bool or floating mask, got dtype {mask.dtype}")
    return backend.to_device(mask, backend.device_of(like))


def attention_mask(attn_mask, key_padding_mask, batch, heads, tgt_len, src_len, like, is_causal=False,
                   names=("attn_mask", "key_padding_mask")):
    """Merge torch.nn-convention masks into one SDPA-convention mask.

    attn_mask: (T, S) or (B*H, T, S), bool True = may not attend, or float added.
    key_padding_mask: (B, S), bool True = padding, or float added.
    is_causal: used only when attn_mask is None: key j > query i may not attend.
    Returns (mask, is_causal): mask None, or a bool (True = takes part) or float (added) array
    broadcastable to (B, H, T, S); is_causal True only when no mask is needed besides causality
    (SDPA applies it without materialising a mask).
    """
    attn_name, padding_name = names
    parts = []
    if attn_mask is not None:
        mask = _mask_array(attn_mask, attn_name, like)
        if mask.ndim == 2 and mask.shape == (tgt_len, src_len):
            parts.append(mask[None, None])                                    # (1, 1, T, S)
        elif mask.ndim == 3 and mask.shape == (batch * heads, tgt_len, src_len):
            parts.append(mask.reshape(batch, heads, tgt_len, src_len))        # (B, H, T, S)
        else:
            raise ValueError(f"{attn_name} must have shape {(tgt_len, src_len)} or "
                             f"{(batch * heads, tgt_len, src_len)} (batch*heads, T, S), got {mask.shape}")
    if key_padding_mask is not None:
        mask = _mask_array(key_padding_mask, padding_name, like)
        if mask.shape != (batch, src_len):
            raise ValueError(f"{padding_name} must have shape (batch, S) = {(batch, src_len)}, got {mask.shape}")
        parts.append(mask[:, None, None, :])                                   # (B, 1, 1, S)
    if not parts:
        return None, bool(is_causal)
    if is_causal and attn_mask is None:
        xp = backend.get_array_module(parts[0])
        parts.append(xp.triu(xp.ones((tgt_len, src_len), dtype=bool), 1)[None, None])  # (1, 1, T, S)
    if all(p.dtype == bool for p in parts):
        blocked = parts[0]
        for p in parts[1:]:
            blocked = blocked | p
        return ~blocked, False
    xp = backend.get_array_module(parts[0])
    added = None
    for p in parts:
        if p.dtype == bool:  # True = blocked -> -inf, like torch's _canonical_mask
            p = xp.where(p, -math.inf, 0.0).astype(like.dtype)
        added = p if added is None else added + p
    return added, False


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

    Extras (not in torch): `rotary=True` applies RoPE to q and k (positions from 0, or from
    `offset` in the cached step); `backend` chooses the path of F.scaled_dot_product_attention
    whenever no attention weights are asked for (need_weights=False, as inside the Transformer
    layers): None (flash attention on a GPU where it applies, else naive), "naive",
    "memory_efficient" (blocks of `block_size`; also `memory_efficient=True`) or "flash".
    """

    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False, add_zero_attn=False,
                 kdim=None, vdim=None, batch_first=True, device=None, dtype=None, rotary=False,
                 rotary_base=10000.0, memory_efficient=False, block_size=512, backend=None):
        super().__init__()
        embed_dim = check_int(embed_dim, "embed_dim", "MultiheadAttention", at_least=1)
        num_heads = check_int(num_heads, "num_heads", "MultiheadAttention", at_least=1)
        self.kdim = embed_dim if kdim is None else check_int(kdim, "kdim", "MultiheadAttention", at_least=1)
        self.vdim = embed_dim if vdim is None else check_int(vdim, "vdim", "MultiheadAttention", at_least=1)
        if embed_dim % num_heads:
            raise ValueError(f"MultiheadAttention: embed_dim={embed_dim} must be divisible by "
                             f"num_heads={num_heads} (head_dim = embed_dim / num_heads)")
        if batch_first is not True:
            raise ValueError("MultiheadAttention: npformer is batch-first only; pass batch_first=True "
                             "and inputs shaped (batch, seq, feature)")
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.dropout = check_real(dropout, "dropout", "MultiheadAttention", at_least=0, at_most=1)
        self.batch_first = True
        self.memory_efficient = bool(memory_efficient)
        self.block_size = check_int(block_size, "block_size", "MultiheadAttention", at_least=1)
        if backend is not None and backend not in F.attention.BACKENDS:
            raise ValueError(f"MultiheadAttention: backend must be None or one of {F.attention.BACKENDS}, "
                             f"got {backend!r}")
        self.backend = backend
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        if self._qkv_same_embed_dim:
            self.in_proj_weight = new_parameter((3 * embed_dim, embed_dim), device, dtype)
        else:
            self.register_parameter("in_proj_weight", None)
            for name, features in (("q", embed_dim), ("k", self.kdim), ("v", self.vdim)):
                setattr(self, f"{name}_proj_weight", new_parameter((embed_dim, features), device, dtype))
        if bias:
            self.in_proj_bias = new_parameter((3 * embed_dim,), device, dtype)
        else:
            self.register_parameter("in_proj_bias", None)
        if add_bias_kv:
            self.bias_k = new_parameter((1, 1, embed_dim), device, dtype)
            self.bias_v = new_parameter((1, 1, embed_dim), device, dtype)
        else:
            self.bias_k = self.bias_v = None
        self.add_zero_attn = bool(add_zero_attn)
        self.out_proj = Linear(embed_dim, embed_dim, bias=bias, device=device, dtype=dtype)
        self.rotary_emb = RotaryEmbedding(self.head_dim, rotary_base) if rotary else None
        self._reset_parameters()

    def _reset_parameters(self):
        """torch's: xavier_uniform_ on the projection matrices, zero biases, xavier_normal_ on bias_k/v."""
        if self._qkv_same_embed_dim:
            init.xavier_uniform_(self.in_proj_weight)
        else:
            for w in (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight):
                init.xavier_uniform_(w)
        if self.in_proj_bias is not None:
            init.zeros_(self.in_proj_bias)
            init.zeros_(self.out_proj.bias)
        if self.bias_k is not None:
            init.xavier_normal_(self.bias_k)
            init.xavier_normal_(self.bias_v)

    @property
    def rotary(self):
        return self.rotary_emb is not None

    # -- pieces, shared by forward and the cached decoding step --------------------------
    def _heads(self, x):
        """(B, L, E) -> (B, H, L, hd)."""
        return F.split_heads(x, self.num_heads)

    def _weights(self, first, last):
        """Projections first..last (0 = q, 1 = k, 2 = v) as one matrix: W ((last-first+1) E, in),
        b or None. With separate q/k/v_proj_weight (kdim/vdim != embed_dim): first == last."""
        E = self.embed_dim
        rows = slice(first * E, (last + 1) * E)
        b = self.in_proj_bias[rows] if self.in_proj_bias is not None else None
        if self.in_proj_weight is not None:
            return self.in_proj_weight[rows], b
        return getattr(self, "qkv"[first] + "_proj_weight"), b

    def project_qkv(self, query, key, value):
        """Query, key, value projected and split into heads, each (B, H, L, hd)."""
        if query is key and key is value and self.in_proj_weight is not None:  # one packed GEMM (B, T, 3E)
            qkv = F.linear(query, self.in_proj_weight, self.in_proj_bias)              # (B, T, 3E)
            return F.split_heads(qkv, self.num_heads, chunks=3)                        # 3 x (B, H, T, hd)
        q = self.project_q(query)
        k, v = self.project_kv(key, value)
        return q, k, v

    def project_q(self, query):
        return self._heads(F.linear(query, *self._weights(0, 0)))                     # (B, H, T, hd)

    def project_kv(self, key, value):
        """Key and value heads (B, H, S, hd); one GEMM when key is value (cross-attention)."""
        if key is value and self.in_proj_weight is not None:
            kv = F.linear(key, *self._weights(1, 2))                                   # (B, S, 2E)
            return F.split_heads(kv, self.num_heads, chunks=2)                         # 2 x (B, H, S, hd)
        return (self._heads(F.linear(key, *self._weights(1, 1))),
                self._heads(F.linear(value, *self._weights(2, 2))))

    def append_keys(self, k, v, mask, is_causal, tgt_len):
        """torch's add_bias_kv and add_zero_attn on heads k, v (B, H, S, hd): bias_k / bias_v
        (split into heads), then zero vectors, appended as keys S (and S + 1). The SDPA-convention
        mask (None, bool True = takes part, or float added) gains a column per appended key that
        every query may attend to; a causal mask (is_causal) is materialised over the first S keys
        of the tgt_len queries. -> (k, v, mask, is_causal)."""
        B, H, S, hd = k.shape
        extra_k, extra_v = [], []
        if self.bias_k is not None:
            extra_k.append(self._heads(self.bias_k).expand(B, H, 1, hd))               # (B, H, 1, hd)
            extra_v.append(self._heads(self.bias_v).expand(B, H, 1, hd))
        if self.add_zero_attn:
            zeros = Tensor(k.xp.zeros((B, H, 1, hd), dtype=k.dtype))
            extra_k.append(zeros)
            extra_v.append(zeros)
        if not extra_k:
            return k, v, mask, is_causal
        k, v = concatenate([k] + extra_k, axis=2), concatenate([v] + extra_v, axis=2)  # (B, H, S + n, hd)
        xp = k.xp
        if is_causal:  # key j <= query i takes part (top-left aligned, as in SDPA)
            causal = xp.tril(xp.ones((tgt_len, S), dtype=bool))[None, None]            # (1, 1, T, S)
            if mask is None:
                mask = causal
            elif mask.dtype == bool:
                mask = mask & causal
            else:
                mask = mask + xp.where(causal, 0.0, -math.inf).astype(mask.dtype)
        if mask is None:
            return k, v, None, False
        visible = True if mask.dtype == bool else 0.0
        column = xp.full(mask.shape[:-1] + (len(extra_k),), visible, dtype=mask.dtype)
        return k, v, xp.concatenate([mask, column], axis=-1), False                    # (..., T, S + n)

    def attend(self, q, k, v, mask=None, is_causal=False, need_weights=False, average_attn_weights=True):
        """SDPA over heads (mask in SDPA convention) then out_proj: (B, T, E), weights or None."""
        B, H, T, hd = q.shape
        # the memory-efficient and flash paths never form the weights: they run when none are asked for
        result = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0, is_causal=is_causal,
            return_weights=need_weights, memory_efficient=self.memory_efficient and not need_weights,
            block_size=self.block_size, backend=None if need_weights else self.backend)
        out, weights = result if need_weights else (result, None)                      # (B, H, T, hd)
        out = self.out_proj(out.transpose(1, 2).reshape(B, T, self.embed_dim))        # (B, T, E)
        if weights is not None and average_attn_weights:
            weights = weights.mean(axis=1)                                             # (B, T, S)
        return out, weights

    # -- public API ------------------------------------------------------------------------
    def check_inputs(self, query, key, value):
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

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        """Returns (output (B, T, E), weights): weights (B, T, S) averaged over heads, or
        (B, H, T, S) with average_attn_weights=False, or None when need_weights=False.
        Masks in torch.nn's convention (see `attention_mask`). Unlike torch, is_causal=True
        without attn_mask applies the causal mask itself. A query whose keys are all masked
        gets output out_proj.bias (attention 0), like torch's SDPA path."""
        self.check_inputs(query, key, value)
        B, T, S = query.shape[0], query.shape[1], key.shape[1]
        mask, causal = attention_mask(attn_mask, key_padding_mask, B, self.num_heads, T, S, query.data, is_causal)
        return self.forward_masked(query, key, value, mask, causal, need_weights, average_attn_weights)

    def forward_masked(self, query, key, value, mask, is_causal=False, need_weights=False,
                       average_attn_weights=True, offset=0):
        """forward() with a mask already in SDPA convention (see `attention_mask`)."""
        q, k, v = self.project_qkv(query, key, value)
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(q, offset), self.rotary_emb(k, offset)
        k, v, mask, is_causal = self.append_keys(k, v, mask, is_causal, q.shape[2])
        return self.attend(q, k, v, mask, is_causal, need_weights, average_attn_weights)

    def extra_repr(self):
        extra = "".join(f", {name}={value}" for name, value, default in (
            ("kdim", self.kdim, self.embed_dim), ("vdim", self.vdim, self.embed_dim),
            ("add_bias_kv", self.bias_k is not None, False), ("add_zero_attn", self.add_zero_attn, False),
            ("rotary", self.rotary, False)) if value != default)
        extra += f", backend={self.backend!r}" if self.backend else ""
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, dropout={self.dropout}{extra}"
