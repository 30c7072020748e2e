"""Transformer layers and stacks with torch.nn.Transformer's names, math and state_dict.

Post-LN (norm_first=False):  x = norm1(x + SA(x));  x = norm2(x + FF(x))
Pre-LN  (norm_first=True):   x = x + SA(norm1(x));  x = x + FF(norm2(x))
(the decoder adds cross-attention with norm2, and its feed-forward uses norm3).
FF(x) = linear2(dropout(activation(linear1(x)))); each sublayer output goes through its own
dropout before the residual add (one fused op, F.dropout_add; a named activation runs fused with
linear1's bias, F.linear(..., activation=...)). Masks use torch.nn's convention (bool True = may NOT attend).

Cached decoding: `TransformerDecoder.init_cache(memory)` projects the cross-attention keys
and values of every layer once; `TransformerDecoder.step(x, cache)` runs one new target
position through every layer, reusing and extending each layer's self-attention K/V.
`TransformerEncoder.init_cache()` / `step(x, cache, key_padding_mask)` do the same for a
causal encoder stack (a GPT-style decoder-only model): new positions, one or a whole prompt
at a time, attend causally to the cached ones and to each other.
"""
from __future__ import annotations

import copy
import math
from collections.abc import Callable

import npformer.functional as F
from autograd import Tensor, backend, concatenate
from autograd.backend import Array, ArrayLike, DType
from autograd.checks import as_array, check_int, check_real
from npformer.functional._common import check_index_range

from . import init
from .attention import MultiheadAttention, attention_mask
from .layers import GELU, Dropout, LayerNorm, Linear
from .module import Module, ModuleList

_ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu}


def _activation(activation, owner):
    if callable(activation):
        return activation
    if activation not in _ACTIVATIONS:
        raise ValueError(f"{owner}: activation must be 'relu', 'gelu' or a callable, got {activation!r}")
    return _ACTIVATIONS[activation]


def check_d_model_nhead(d_model, nhead, owner):
    """(d_model, nhead) as ints >= 1, d_model divisible by nhead."""
    d_model = check_int(d_model, "d_model", owner, at_least=1)
    nhead = check_int(nhead, "nhead", owner, at_least=1)
    if d_model % nhead:
        raise ValueError(f"{owner}: d_model={d_model} is not divisible by nhead={nhead}; each head gets "
                         f"d_model / nhead features, so choose e.g. nhead in "
                         f"{[h for h in range(1, min(d_model, 64) + 1) if d_model % h == 0]}")
    return d_model, nhead


def check_layer_options(dim_feedforward, dropout, layer_norm_eps, owner):
    """(dim_feedforward, dropout, layer_norm_eps) as an int >= 1, a probability and a float > 0."""
    return (check_int(dim_feedforward, "dim_feedforward", owner, at_least=1),
            check_real(dropout, "dropout", owner, at_least=0, at_most=1),
            check_real(layer_norm_eps, "layer_norm_eps", owner, above=0))


def check_sequence(x, d_model, owner, name):
    if not isinstance(x, Tensor):
        raise TypeError(f"{owner}: {name} must be an autograd.Tensor, got {type(x).__name__}")
    if x.ndim != 3 or x.shape[-1] != d_model:
        raise ValueError(f"{owner}: {name} must be (batch, seq, d_model={d_model}), got shape {x.shape}")
    if x.shape[1] == 0:
        raise ValueError(f"{owner}: {name} must have at least one position (seq >= 1), got shape {x.shape}")


def check_same_batch(a, b, owner, names):
    if a.shape[0] != b.shape[0]:
        raise ValueError(f"{owner}: the batch sizes of {names[0]} ({a.shape[0]}) and {names[1]} "
                         f"({b.shape[0]}) must be equal")


class _FeedForwardLayer(Module):
    """Shared parts of the encoder and decoder layers: linear1, dropout, linear2, activation."""

    def _build_feedforward(self, d_model, dim_feedforward, dropout, activation, bias, device, dtype):
        self.linear1 = Linear(d_model, dim_feedforward, bias=bias, device=device, dtype=dtype)
        self.dropout = Dropout(dropout)
        self.linear2 = Linear(dim_feedforward, d_model, bias=bias, device=device, dtype=dtype)
        self.activation_name = activation if isinstance(activation, str) else None
        self.activation = _activation(activation, type(self).__name__)

    def _ff_block(self, x):
        """linear2(dropout(activation(linear1(x)))), before the last dropout; a named activation runs
        fused with linear1's bias (F.linear(..., activation=...))."""
        fused = self.activation_name if self.activation is _ACTIVATIONS.get(self.activation_name) else None
        if type(self.activation) is GELU:  # a GELU module (GPT-2's tanh form) fuses like a named one
            fused = "gelu_tanh" if self.activation.approximate == "tanh" else "gelu"
        if type(self.linear1) is Linear and fused is not None:
            hidden = F.linear(x, self.linear1.weight, self.linear1.bias, activation=fused)
        else:
            hidden = self.activation(self.linear1(x))
        return self.linear2(self.dropout(hidden))

    @staticmethod
    def _residual(x, dropout, y):
        """x + dropout(y), as one fused op (F.dropout_add: no mask stored) when `dropout` is a Dropout."""
        if type(dropout) is Dropout:
            return F.dropout_add(y, x, dropout.p, dropout.training)
        return x + dropout(y)


class TransformerEncoderLayer(_FeedForwardLayer):
    """Self-attention and feed-forward sublayers (torch.nn.TransformerEncoderLayer, batch first).

    d_model must be divisible by nhead; activation "relu", "gelu" or a callable; norm_first=True
    is pre-LN. Extras beyond torch: rotary=True applies RoPE in self-attention, memory_efficient=True
    uses the blockwise attention kernel. Raises TypeError / ValueError naming a bad argument."""

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int = 2048, dropout: float = 0.1,
                 activation: str | Callable[[Tensor], Tensor] = "relu", layer_norm_eps: float = 1e-5,
                 batch_first: bool = True, norm_first: bool = False, bias: bool = True, device: str | None = None,
                 dtype: DType | None = None, rotary: bool = False, memory_efficient: bool = False):
        super().__init__()
        d_model, nhead = check_d_model_nhead(d_model, nhead, "TransformerEncoderLayer")
        dim_feedforward, dropout, layer_norm_eps = check_layer_options(dim_feedforward, dropout, layer_norm_eps,
                                                                       "TransformerEncoderLayer")
        self.d_model, self.norm_first = d_model, bool(norm_first)
        self.self_attn = MultiheadAttention(d_model, nhead, dropout=dropout, bias=bias, batch_first=batch_first,
                                            device=device, dtype=dtype, rotary=rotary,
                                            memory_efficient=memory_efficient)
        self._build_feedforward(d_model, dim_feedforward, dropout, activation, bias, device, dtype)
        self.norm1 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, device=device, dtype=dtype)
        self.norm2 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, device=device, dtype=dtype)
        self.dropout1 = Dropout(dropout)
        self.dropout2 = Dropout(dropout)

    def forward(self, src: Tensor, src_mask: ArrayLike | None = None, src_key_padding_mask: ArrayLike | None = None,
                is_causal: bool = False) -> Tensor:
        """src (B, S, d) -> (B, S, d). src_mask (S, S) or (B*nhead, S, S); src_key_padding_mask (B, S);
        torch.nn's convention (bool True = may not attend; a float mask is added to the scores).
        is_causal=True without src_mask applies the causal mask."""
        check_sequence(src, self.d_model, "TransformerEncoderLayer", "src")
        mask = self.self_attn_mask(src, src_mask, src_key_padding_mask, is_causal)
        return self.forward_masked(src, *mask)

    def self_attn_mask(self, src: Tensor, src_mask: ArrayLike | None, src_key_padding_mask: ArrayLike | None,
                       is_causal: bool) -> tuple[Array | None, bool]:
        """(mask, is_causal) for `forward_masked`: torch.nn-convention masks of `src` converted once
        to the convention of F.scaled_dot_product_attention (True = takes part), checked."""
        B, S = src.shape[:2]
        return attention_mask(src_mask, src_key_padding_mask, B, self.self_attn.num_heads, S, S, src.data,
                              is_causal, names=("src_mask", "src_key_padding_mask"))

    def forward_masked(self, x: Tensor, mask: Array | None, is_causal: bool) -> Tensor:
        """forward() with the self-attention mask already in SDPA convention (`self_attn_mask`)."""
        def self_attention(h):
            return self.self_attn.forward_masked(h, h, h, mask, is_causal)[0]
        if self.norm_first:
            x = self._residual(x, self.dropout1, self_attention(self.norm1(x)))
            return self._residual(x, self.dropout2, self._ff_block(self.norm2(x)))
        x = self.norm1(self._residual(x, self.dropout1, self_attention(x)))
        return self.norm2(self._residual(x, self.dropout2, self._ff_block(x)))

    def forward_step(self, x, layer_cache, mask, is_causal, position):
        """New positions x (B, L, d) attending to the cached self-attention keys and values
        (extended in place with theirs); mask (SDPA convention) covers cached + new keys."""
        def self_attention(h):
            return cached_self_attention(self.self_attn, h, layer_cache, mask, is_causal, position)
        if self.norm_first:
            x = x + self.dropout1(self_attention(self.norm1(x)))
            return x + self._ff_block(self.norm2(x))
        x = self.norm1(x + self.dropout1(self_attention(x)))
        return self.norm2(x + self._ff_block(x))


def cached_self_attention(attn, h, layer_cache, mask, is_causal, position):
    """Self-attention of new positions h (B, L, E), the first at `position`, over the keys and
    values of `layer_cache` (self_k, self_v (B, H, t, hd)) and their own, which are appended to
    the cache. -> (B, L, E)."""
    q, k, v = attn.project_qkv(h, h, h)                                          # (B, H, L, hd)
    if attn.rotary_emb is not None:
        q, k = attn.rotary_emb(q, position), attn.rotary_emb(k, position)
    k, v = layer_cache.append_self(k, v)                                         # (B, H, t+L, hd)
    return attn.attend(q, k, v, mask, is_causal)[0]


class TransformerDecoderLayer(_FeedForwardLayer):
    """Masked self-attention, cross-attention over memory, feed-forward
    (torch.nn.TransformerDecoderLayer, batch first).

    d_model must be divisible by nhead; activation "relu", "gelu" or a callable; norm_first=True
    is pre-LN. Extras beyond torch: rotary=True applies RoPE in self-attention (not cross-attention), memory_efficient=True
    uses the blockwise attention kernel. Raises TypeError / ValueError naming a bad argument."""

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int = 2048, dropout: float = 0.1,
                 activation: str | Callable[[Tensor], Tensor] = "relu", layer_norm_eps: float = 1e-5,
                 batch_first: bool = True, norm_first: bool = False, bias: bool = True, device: str | None = None,
                 dtype: DType | None = None, rotary: bool = False, memory_efficient: bool = False):
        super().__init__()
        d_model, nhead = check_d_model_nhead(d_model, nhead, "TransformerDecoderLayer")
        dim_feedforward, dropout, layer_norm_eps = check_layer_options(dim_feedforward, dropout, layer_norm_eps,
                                                                       "TransformerDecoderLayer")
        self.d_model, self.norm_first = d_model, bool(norm_first)
        options = dict(dropout=dropout, bias=bias, batch_first=batch_first, device=device, dtype=dtype,
                       memory_efficient=memory_efficient)
        self.self_attn = MultiheadAttention(d_model, nhead, rotary=rotary, **options)
        self.multihead_attn = MultiheadAttention(d_model, nhead, **options)
        self._build_feedforward(d_model, dim_feedforward, dropout, activation, bias, device, dtype)
        for i in (1, 2, 3):
            setattr(self, f"norm{i}", LayerNorm(d_model, eps=layer_norm_eps, bias=bias, device=device, dtype=dtype))
        for i in (1, 2, 3):
            setattr(self, f"dropout{i}", Dropout(dropout))

    def forward(self, tgt: Tensor, memory: Tensor, tgt_mask: ArrayLike | None = None,
                memory_mask: ArrayLike | None = None, tgt_key_padding_mask: ArrayLike | None = None,
                memory_key_padding_mask: ArrayLike | None = None, tgt_is_causal: bool = False,
                memory_is_causal: bool = False) -> Tensor:
        """tgt (B, T, d), memory (B, S, d) -> (B, T, d). tgt_mask (T, T) or (B*nhead, T, T),
        memory_mask (T, S) or (B*nhead, T, S), key padding masks (B, T) and (B, S), in torch.nn's
        convention (True = may not attend). tgt_is_causal=True without tgt_mask applies the causal mask."""
        check_sequence(tgt, self.d_model, "TransformerDecoderLayer", "tgt")
        check_sequence(memory, self.d_model, "TransformerDecoderLayer", "memory")
        check_same_batch(tgt, memory, "TransformerDecoderLayer", ("tgt", "memory"))
        masks = decoder_masks(tgt, memory, self.self_attn.num_heads, tgt_mask, memory_mask, tgt_key_padding_mask,
                              memory_key_padding_mask, tgt_is_causal, memory_is_causal)
        return self.forward_masked(tgt, memory, *masks)

    def forward_masked(self, x: Tensor, memory: Tensor, self_mask: Array | None, self_causal: bool,
                       cross_mask: Array | None, cross_causal: bool) -> Tensor:
        """forward() with both masks already in SDPA convention."""
        def self_attention(h):
            return self.self_attn.forward_masked(h, h, h, self_mask, self_causal)[0]

        def cross_attention(h):
            return self.multihead_attn.forward_masked(h, memory, memory, cross_mask, cross_causal)[0]
        return self._sublayers(x, self_attention, cross_attention)

    def _sublayers(self, x, self_attention, cross_attention):
        if self.norm_first:
            x = self._residual(x, self.dropout1, self_attention(self.norm1(x)))
            x = self._residual(x, self.dropout2, cross_attention(self.norm2(x)))
            return self._residual(x, self.dropout3, self._ff_block(self.norm3(x)))
        x = self.norm1(self._residual(x, self.dropout1, self_attention(x)))
        x = self.norm2(self._residual(x, self.dropout2, cross_attention(x)))
        return self.norm3(self._residual(x, self.dropout3, self._ff_block(x)))

    def forward_step(self, x: Tensor, layer_cache: LayerCache, cross_mask: Array | None, position: int) -> Tensor:
        """One new target position x (B, 1, d) attending to the cached self-attention keys and
        values (extended in place with this position's) and to the cached memory keys/values;
        `position` is x's index in the target (for RoPE). Returns (B, 1, d)."""
        def self_attention(h):
            return cached_self_attention(self.self_attn, h, layer_cache, None, False, position)

        def cross_attention(h):
            q = self.multihead_attn.project_q(h)                                 # (B, H, 1, hd)
            return self.multihead_attn.attend(q, layer_cache.cross_k, layer_cache.cross_v, cross_mask)[0]
        return self._sublayers(x, self_attention, cross_attention)


def decoder_masks(tgt, memory, nhead, tgt_mask, memory_mask, tgt_key_padding_mask, memory_key_padding_mask,
                  tgt_is_causal, memory_is_causal):
    """(self_mask, self_causal, cross_mask, cross_causal) in SDPA convention."""
    B, T, S = tgt.shape[0], tgt.shape[1], memory.shape[1]
    self_mask = attention_mask(tgt_mask, tgt_key_padding_mask, B, nhead, T, T, tgt.data, tgt_is_causal,
                               names=("tgt_mask", "tgt_key_padding_mask"))
    cross_mask = attention_mask(memory_mask, memory_key_padding_mask, B, nhead, T, S, tgt.data, memory_is_causal,
                                names=("memory_mask", "memory_key_padding_mask"))
    return self_mask + cross_mask


class _LayerStack(Module):
    """`num_layers` deep copies of one layer (all starting equal, like torch's _get_clones),
    then the optional final `norm`."""

    layer_type = None

    def __init__(self, layer, num_layers, norm=None):
        super().__init__()
        owner = type(self).__name__
        if not isinstance(layer, self.layer_type):
            raise TypeError(f"{owner}: expected a {self.layer_type.__name__} to copy, got {type(layer).__name__}")
        num_layers = check_int(num_layers, "num_layers", owner, at_least=1)
        self.layers = ModuleList([copy.deepcopy(layer) for _ in range(num_layers)])
        self.num_layers = num_layers
        self.norm = norm

    def _final_norm(self, x):
        return self.norm(x) if self.norm is not None else x


class TransformerEncoder(_LayerStack):
    """A stack of `num_layers` deep copies of `encoder_layer`, then the optional final `norm`
    (torch.nn.TransformerEncoder). TypeError unless encoder_layer is a TransformerEncoderLayer."""

    layer_type = TransformerEncoderLayer

    def __init__(self, encoder_layer: TransformerEncoderLayer, num_layers: int, norm: Module | None = None):
        super().__init__(encoder_layer, num_layers, norm)

    def forward(self, src: Tensor, mask: ArrayLike | None = None, src_key_padding_mask: ArrayLike | None = None,
                is_causal: bool | None = None) -> Tensor:
        """src (B, S, d) -> (B, S, d); masks as in TransformerEncoderLayer, converted once."""
        first = self.layers[0]
        check_sequence(src, first.d_model, "TransformerEncoder", "src")
        prepared = first.self_attn_mask(src, mask, src_key_padding_mask, bool(is_causal))
        x = src
        for layer in self.layers:
            x = layer.forward_masked(x, *prepared)
        return self._final_norm(x)

    # -- cached causal decoding (decoder-only models) --------------------------------------------
    def init_cache(self):
        """An empty DecoderCache (self-attention keys/values of every layer, no memory) for `step`."""
        return DecoderCache([LayerCache() for _ in self.layers])

    def step(self, x, cache, key_padding_mask=None):
        """x (B, L, d): L new embedded positions (a prompt, or the newest token) -> (B, L, d)
        after the final norm. Causal: new position i attends to every cached position and to new
        positions <= i. key_padding_mask (B, L) bool, True = padding, marks new positions that no
        later query attends to (left padding); it is kept in `cache` for the later steps.
        Appends this step's keys/values to `cache`; equals forward(prefix, is_causal=True) on the
        whole prefix for the real positions."""
        if not isinstance(cache, DecoderCache):
            raise TypeError(f"TransformerEncoder.step: cache must come from init_cache, got {type(cache).__name__}")
        check_sequence(x, self.layers[0].d_model, "TransformerEncoder.step", "x")
        B, L = x.shape[:2]
        if cache.length and x.shape[0] != cache.batch_size:
            raise ValueError(f"TransformerEncoder.step: x must have the cache's batch size {cache.batch_size}, "
                             f"got shape {x.shape}")
        mask, is_causal = cache.extend_padding(key_padding_mask, B, L, x.data)
        for layer, layer_cache in zip(self.layers, cache.layers):
            x = layer.forward_step(x, layer_cache, mask, is_causal, cache.length)
        cache.length += L
        return self._final_norm(x)


class TransformerDecoder(_LayerStack):
    """A stack of `num_layers` deep copies of `decoder_layer`, then the optional final `norm`
    (torch.nn.TransformerDecoder), with cached step-by-step decoding (`init_cache`, `step`).
    TypeError unless decoder_layer is a TransformerDecoderLayer."""

    layer_type = TransformerDecoderLayer

    def __init__(self, decoder_layer: TransformerDecoderLayer, num_layers: int, norm: Module | None = None):
        super().__init__(decoder_layer, num_layers, norm)

    def forward(self, tgt: Tensor, memory: Tensor, tgt_mask: ArrayLike | None = None,
                memory_mask: ArrayLike | None = None, tgt_key_padding_mask: ArrayLike | None = None,
                memory_key_padding_mask: ArrayLike | None = None, tgt_is_causal: bool | None = None,
                memory_is_causal: bool = False) -> Tensor:
        """tgt (B, T, d), memory (B, S, d) -> (B, T, d); masks as in TransformerDecoderLayer."""
        d_model = self.layers[0].d_model
        check_sequence(tgt, d_model, "TransformerDecoder", "tgt")
        check_sequence(memory, d_model, "TransformerDecoder", "memory")
        check_same_batch(tgt, memory, "TransformerDecoder", ("tgt", "memory"))
        masks = decoder_masks(tgt, memory, self.layers[0].self_attn.num_heads, tgt_mask, memory_mask,
                              tgt_key_padding_mask, memory_key_padding_mask, bool(tgt_is_causal), memory_is_causal)
        x = tgt
        for layer in self.layers:
            x = layer.forward_masked(x, memory, *masks)
        return self._final_norm(x)

    # -- cached step-wise decoding --------------------------------------------------------------
    def init_cache(self, memory: Tensor, memory_key_padding_mask: ArrayLike | None = None) -> DecoderCache:
        """A DecoderCache holding every layer's cross-attention keys/values of `memory` (B, S, d)."""
        check_sequence(memory, self.layers[0].d_model, "TransformerDecoder.init_cache", "memory")
        B, S = memory.shape[:2]
        cross_mask, _ = attention_mask(None, memory_key_padding_mask, B, 1, 1, S, memory.data,
                                       names=("memory_mask", "memory_key_padding_mask"))
        layers = [LayerCache(*layer.multihead_attn.project_kv(memory, memory)) for layer in self.layers]
        return DecoderCache(layers, cross_mask)

    def step(self, x: Tensor, cache: DecoderCache) -> Tensor:
        """x (B, 1, d): the embedded newest target position -> (B, 1, d) decoder output for it
        (after the final norm); appends this position's self-attention K/V to `cache`.
        TypeError for a cache not made by init_cache, ValueError for another shape of x."""
        if not isinstance(cache, DecoderCache):
            raise TypeError(f"TransformerDecoder.step: cache must come from init_cache, got {type(cache).__name__}")
        check_sequence(x, self.layers[0].d_model, "TransformerDecoder.step", "x")
        if x.shape[1] != 1 or x.shape[0] != cache.batch_size:
            raise ValueError(f"TransformerDecoder.step: x must be (batch={cache.batch_size}, 1, d), got {x.shape}")
        for layer, layer_cache in zip(self.layers, cache.layers):
            x = layer.forward_step(x, layer_cache, cache.cross_mask, cache.length)
        cache.length += 1
        return self._final_norm(x)


class LayerCache:
    """Keys/values of one layer: cross_k, cross_v (B, H, S, hd) fixed (None without a memory);
    self_k, self_v (B, H, t, hd) growing with every step (None before the first)."""

    def __init__(self, cross_k=None, cross_v=None):
        self.cross_k, self.cross_v = cross_k, cross_v
        self.self_k = self.self_v = None
        self.buffers = None  # (keys, values) arrays (B, H, capacity, hd) that self_k/self_v view

    def tensors(self):
        return {name: getattr(self, name) for name in ("cross_k", "cross_v", "self_k", "self_v")}

    def append_self(self, k, v):
        """Append new self-attention keys/values (B, H, L, hd); returns all of them (B, H, t+L, hd).
        When nothing needs a gradient they go into buffers of doubling capacity (no copy of the
        cached positions per step); otherwise through autograd's concatenate."""
        if self.self_k is None:
            self.self_k, self.self_v = k, v
            return k, v
        if k.requires_grad or v.requires_grad or self.self_k.requires_grad or self.self_v.requires_grad:
            self.buffers = None
            self.self_k = concatenate([self.self_k, k], axis=2)
            self.self_v = concatenate([self.self_v, v], axis=2)
            return self.self_k, self.self_v
        t, new = self.self_k.shape[2], k.shape[2]
        if self.buffers is None or self.buffers[0].shape[2] < t + new:
            xp, shape = k.xp, self.self_k.shape
            capacity = max(2 * (t + new), 16)
            self.buffers = tuple(xp.empty(shape[:2] + (capacity,) + shape[3:], dtype=k.dtype) for _ in range(2))
            self.buffers[0][:, :, :t], self.buffers[1][:, :, :t] = self.self_k.data, self.self_v.data
        keys, values = self.buffers
        keys[:, :, t:t + new], values[:, :, t:t + new] = k.data, v.data
        self.self_k, self.self_v = Tensor(keys[:, :, :t + new]), Tensor(values[:, :, :t + new])
        return self.self_k, self.self_v


class DecoderCache:
    """State of cached step-wise decoding: `layers` (one LayerCache per layer), `cross_mask`
    (memory padding, SDPA convention, (B, 1, 1, S) or None), `length` (positions decoded so
    far), `key_padding` (B, length) bool, True = a padding position no query attends to (None:
    none so far). `reorder(indices)` selects batch rows (beam search). Made by
    `init_cache`; `len(cache)` is `length`."""

    def __init__(self, layers: list[LayerCache], cross_mask: Array | None = None):
        self.layers, self.cross_mask, self.length = layers, cross_mask, 0
        self.key_padding = None

    @property
    def batch_size(self) -> int | None:
        """The number of sequences (batch rows) the cache holds; None while it is empty (it
        takes the batch size of its first step)."""
        for layer in self.layers[:1]:
            for t in layer.tensors().values():
                if t is not None:
                    return t.shape[0]
        return None

    def __len__(self):
        return self.length

    def extend_padding(self, key_padding_mask: ArrayLike | None, batch: int, new: int,
                       like: Array) -> tuple[Array | None, bool]:
        """Append the padding of `new` positions (key_padding_mask (batch, new), True = padding,
        or None) and return the self-attention mask of those queries over every key so far:
        (mask in SDPA convention (batch, 1, new, length + new) or None, is_causal)."""
        xp = backend.get_array_module(like)
        if key_padding_mask is not None:
            padding = key_padding_mask.data if isinstance(key_padding_mask, Tensor) else key_padding_mask
            padding = backend.to_device(padding if backend.is_array(padding) else xp.asarray(padding),
                                        backend.device_of(like))
            if padding.dtype != bool or padding.shape != (batch, new):
                raise ValueError(f"key_padding_mask must be a bool array of shape (batch, new positions) = "
                                 f"{(batch, new)}, got {padding.dtype} {padding.shape}")
            if self.key_padding is None:
                self.key_padding = xp.zeros((batch, self.length), dtype=bool)
            self.key_padding = xp.concatenate([self.key_padding, padding], axis=1)     # (B, t + L)
        elif self.key_padding is not None:
            self.key_padding = xp.concatenate([self.key_padding, xp.zeros((batch, new), dtype=bool)], axis=1)
        causal = _causal_allowed(xp, self.length, new)[None, None]                   # (1, 1, L, t + L)
        if self.key_padding is not None:
            return causal & ~self.key_padding[:, None, None, :], False                 # (B, 1, L, t + L)
        if new == 1:  # one new query sees every key: no mask
            return None, False
        return (None, True) if self.length == 0 else (causal, False)

    def reorder(self, indices: ArrayLike) -> DecoderCache:
        """Keep batch rows `indices` (ints in [0, batch), repeats allowed, any length) in that
        order, in every cached tensor and mask; returns self. ValueError for indices that are
        not a 1-D integer array, IndexError for one out of range, ValueError on an empty cache."""
        cached = [t for layer in self.layers for t in layer.tensors().values() if t is not None]
        if not cached:
            raise ValueError("DecoderCache.reorder: the cache is empty (nothing decoded yet)")
        like = cached[0].data
        idx = indices.data if isinstance(indices, Tensor) else indices
        if not backend.is_array(idx):
            idx = as_array(idx, "indices", "DecoderCache.reorder", backend.module_for("cpu"))
        if idx.ndim != 1 or idx.dtype.kind not in "iu":
            raise ValueError(f"DecoderCache.reorder: indices must be a 1-D integer array, got {idx.dtype} {idx.shape}")
        check_index_range(idx, self.batch_size, lambda lo, hi: IndexError(  # host indices now, device ones deferred
            f"DecoderCache.reorder: indices must be in [0, {self.batch_size - 1}], got values in [{lo}, {hi}]"))
        idx = backend.to_device(idx, backend.device_of(like))
        for layer in self.layers:
            layer.buffers = None  # the reordered tensors are new arrays
            for name, t in layer.tensors().items():
                if t is not None:
                    setattr(layer, name, t[idx])
        if self.cross_mask is not None:
            self.cross_mask = self.cross_mask[idx]
        if self.key_padding is not None:
            self.key_padding = self.key_padding[idx]
        return self


def _causal_allowed(xp, cached, new):
    """(new, cached + new) bool, True where new query i (at position cached + i) may attend to key j <= cached + i."""
    return xp.arange(cached + new)[None, :] <= (cached + xp.arange(new))[:, None]


class Transformer(Module):
    """Encoder-decoder Transformer with exactly torch.nn.Transformer(batch_first=True)'s
    parameters, state_dict keys and math, including the final encoder.norm and decoder.norm.

    Init like torch: xavier_uniform_ on every parameter with more than one dimension.
    Extras: rotary=True applies RoPE in the self-attention of every layer; memory_efficient=True
    uses the blockwise attention kernel. The defaults are torch's (the paper's base model);
    batch_first=True is the only layout (npformer is batch-first throughout; interop refuses
    torch modules with batch_first=False). `config` holds the arguments.
    """

    def __init__(self, d_model: int = 512, nhead: int = 8, num_encoder_layers: int = 6, num_decoder_layers: int = 6,
                 dim_feedforward: int = 2048, dropout: float = 0.1,
                 activation: str | Callable[[Tensor], Tensor] = "relu", custom_encoder: Module | None = None,
                 custom_decoder: Module | None = None, layer_norm_eps: float = 1e-5, batch_first: bool = True,
                 norm_first: bool = False, bias: bool = True, device: str | None = None, dtype: DType | None = None,
                 rotary: bool = False, memory_efficient: bool = False):
        super().__init__()
        d_model, nhead = check_d_model_nhead(d_model, nhead, "Transformer")
        dim_feedforward, dropout, layer_norm_eps = check_layer_options(dim_feedforward, dropout, layer_norm_eps,
                                                                       "Transformer")
        num_encoder_layers = check_int(num_encoder_layers, "num_encoder_layers", "Transformer", at_least=1)
        num_decoder_layers = check_int(num_decoder_layers, "num_decoder_layers", "Transformer", at_least=1)
        layer_options = dict(dim_feedforward=dim_feedforward, dropout=dropout, activation=activation,
                             layer_norm_eps=layer_norm_eps, batch_first=batch_first, norm_first=norm_first,
                             bias=bias, device=device, dtype=dtype, rotary=rotary, memory_efficient=memory_efficient)
        self.config = dict(d_model=d_model, nhead=nhead, num_encoder_layers=num_encoder_layers,
                           num_decoder_layers=num_decoder_layers, dim_feedforward=dim_feedforward,
                           dropout=dropout, activation=activation, layer_norm_eps=layer_norm_eps,
                           norm_first=norm_first, bias=bias, rotary=rotary)

        def final_norm():
            return LayerNorm(d_model, eps=layer_norm_eps, bias=bias, device=device, dtype=dtype)
        if custom_encoder is None:
            custom_encoder = TransformerEncoder(TransformerEncoderLayer(d_model, nhead, **layer_options),
                                                num_encoder_layers, final_norm())
        if custom_decoder is None:
            custom_decoder = TransformerDecoder(TransformerDecoderLayer(d_model, nhead, **layer_options),
                                                num_decoder_layers, final_norm())
        self.encoder, self.decoder = custom_encoder, custom_decoder
        self._reset_parameters()
        self.d_model, self.nhead, self.batch_first = d_model, nhead, True

    def _reset_parameters(self):
        for p in self.parameters():
            if p.ndim > 1:
                init.xavier_uniform_(p)

    def forward(self, src: Tensor, tgt: Tensor, src_mask: ArrayLike | None = None, tgt_mask: ArrayLike | None = None,
                memory_mask: ArrayLike | None = None, src_key_padding_mask: ArrayLike | None = None,
                tgt_key_padding_mask: ArrayLike | None = None, memory_key_padding_mask: ArrayLike | None = None,
                src_is_causal: bool | None = None, tgt_is_causal: bool | None = None,
                memory_is_causal: bool = False) -> Tensor:
        """src (B, S, d), tgt (B, T, d) -> (B, T, d). Masks in torch.nn's convention: src_mask
        (S, S), tgt_mask (T, T), memory_mask (T, S) (or (B*nhead, ., .)), key padding masks
        (B, S), (B, T), (B, S) with True = padding. tgt_is_causal=True without tgt_mask applies
        the causal mask (torch requires the mask itself)."""
        check_sequence(src, self.d_model, "Transformer", "src")
        check_sequence(tgt, self.d_model, "Transformer", "tgt")
        check_same_batch(src, tgt, "Transformer", ("src", "tgt"))
        memory = self.encoder(src, mask=src_mask, src_key_padding_mask=src_key_padding_mask,
                              is_causal=src_is_causal)
        return self.decoder(tgt, memory, tgt_mask=tgt_mask, memory_mask=memory_mask,
                            tgt_key_padding_mask=tgt_key_padding_mask,
                            memory_key_padding_mask=memory_key_padding_mask, tgt_is_causal=tgt_is_causal,
                            memory_is_causal=memory_is_causal)

    @staticmethod
    def generate_square_subsequent_mask(sz: int, device: str | None = None, dtype: DType | None = None) -> Array:
        """(sz, sz) float array (float32 by default, on `device`, default cpu): -inf above the
        diagonal (future positions), 0 elsewhere; torch's static method of the same name."""
        sz = check_int(sz, "sz", "generate_square_subsequent_mask", at_least=1)
        xp = backend.module_for(device or "cpu")
        return xp.triu(xp.full((sz, sz), -math.inf, dtype=dtype or "float32"), 1)
