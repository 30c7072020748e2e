"""Transformer layers and stacks with torch.nn.Transformer's names, math and state_dict.

Post-LN (norm_first=False):  x = norm1(x + SA(x));  x = norm2(x + FF(x))
Pre-LN  (norm_first=True):   x = x + SA(norm1(x));  x = x + FF(norm2(x))
(the decoder adds cross-attention with norm2, and its feed-forward uses norm3).
FF(x) = linear2(dropout(activation(linear1(x)))), or with activation="swiglu" the gated
FF(x) = linear2(dropout(silu(linear1(x)) * linear3(x))) (Llama's); each sublayer output goes through its own
dropout before the residual add (one fused op, F.dropout_add; a named activation runs fused with
linear1's bias, F.linear(..., activation=...)). Every layer and attention module is built from
one TransformerConfig (npformer.nn.config), passed down whole; its `norm` picks LayerNorm or
RMSNorm for every norm (`make_norm`). Masks: torch.nn's convention at each forward, converted
once into the internal one (see npformer.nn.attention's docstring); with the config's
sliding_window W, causal self-attention (is_causal=True) sees the last W positions only.

Cached decoding: `TransformerDecoder.init_cache(memory)` projects the cross-attention keys
and values of every layer once; `TransformerDecoder.step(x, cache)` runs one new target
position through every layer, reusing and extending each layer's self-attention K/V.
`TransformerEncoder.init_cache()` / `step(x, cache, key_padding_mask)` do the same for a
causal encoder stack (a GPT-style decoder-only model): new positions, one or a whole prompt
at a time, attend causally to the cached ones and to each other. The caches hold the
num_kv_heads key/value heads of grouped-query attention; with a sliding window W they keep only
the last W - 1 positions of each layer after every step (all that later queries can see), so
decoding memory is bounded by W however long the sequence grows (positions, e.g. RoPE's, keep
counting from the start: `len(cache)` is every position decoded).
"""
from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable

import npformer.functional as F
from autograd import Tensor, backend, concatenate
from autograd.backend import Array, ArrayLike, DType
from autograd.checks import as_array, check_bool, check_int
from npformer.functional._common import check_index_range

from . import init, module_hooks
from .attention import AttentionMask, MultiheadAttention, attention_mask
from .config import TransformerConfig
from .hook_points import HookedModel, add_hook_points
from .layers import Dropout, LayerNorm, Linear, RMSNorm
from .module import Module, ModuleList

# activations by name: F.linear runs these fused with linear1's bias (activation=name); "silu" is
# applied after linear1; "swiglu" is the gated feed-forward (linear3 too)
_FUSED = {"relu": F.relu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}
_PLAIN = {"silu": F.silu, "swiglu": F.swiglu}


def make_norm(config: TransformerConfig) -> Module:
    """The norm of config.norm over config.d_model features, as every layer and stack of `config`
    builds it (models call it for their final norms): "layernorm" -> LayerNorm(d_model,
    eps=layer_norm_eps, bias=bias); "rmsnorm" -> RMSNorm(d_model, eps=layer_norm_eps) (a weight,
    no bias); on config.device, in config.dtype."""
    if not isinstance(config, TransformerConfig):
        raise TypeError(f"make_norm: config must be a TransformerConfig, got {type(config).__name__}")
    if config.norm == "rmsnorm":
        return RMSNorm(config.d_model, eps=config.layer_norm_eps, device=config.device, dtype=config.dtype)
    return LayerNorm(config.d_model, eps=config.layer_norm_eps, bias=config.bias, device=config.device,
                     dtype=config.dtype)


def check_sequence(x: Tensor, d_model: int, owner: str, name: str) -> None:
    """TypeError unless x is a Tensor, ValueError unless it is (batch, seq >= 1, d_model)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{owner}: {name} must be an autograd.Tensor, got {type(x).__name__}")
    if x.ndim != 3 or x.shape[-1] != d_model:
        raise ValueError(f"{owner}: {name} must be (batch, seq, d_model={d_model}), got shape {x.shape}")
    if x.shape[1] == 0:
        raise ValueError(f"{owner}: {name} must have at least one position (seq >= 1), got shape {x.shape}")


def causal_flag(value: bool | None, name: str, owner: str) -> bool:
    """An is_causal argument as a bool (None, torch's default in the stacks, is False);
    TypeError for anything else that is not True or False."""
    return False if value is None else check_bool(value, name, owner)


def check_same_batch(a, b, owner, names):
    if a.shape[0] != b.shape[0]:
        raise ValueError(f"{owner}: the batch sizes of {names[0]} ({a.shape[0]}) and {names[1]} "
                         f"({b.shape[0]}) must be equal")


# the TransformerConfig settings that the layers' and nn.Transformer's constructors take as arguments
LAYER_ARGUMENTS = ("d_model", "nhead", "dim_feedforward", "dropout", "activation", "layer_norm_eps", "batch_first",
                   "norm_first", "bias", "device", "dtype", "rotary", "memory_efficient", "block_size",
                   "attention_backend")


def layer_config(config, owner, function, arguments, names=LAYER_ARGUMENTS):
    """The TransformerConfig of a constructor's torch-compatible `arguments` (its locals()), the
    settings `names`; or `config` (see TransformerConfig.from_arguments)."""
    return TransformerConfig.from_arguments(config, owner, function, **{name: arguments[name] for name in names})


class _FeedForwardLayer(Module):
    """Shared parts of the encoder and decoder layers, built from one TransformerConfig: linear1,
    dropout, linear2 (and linear3, the up projection, with activation="swiglu"), activation, `n`
    norms norm1..n (make_norm: LayerNorm or RMSNorm) and residual dropouts dropout1..n."""

    def _build(self, config, n):
        self.config = config
        d_model, device, dtype = config.d_model, config.device, config.dtype
        self.d_model, self.norm_first = d_model, config.norm_first
        self.linear1 = Linear(d_model, config.dim_feedforward, bias=config.bias, device=device, dtype=dtype)
        self.dropout = Dropout(config.activation_dropout_p)
        self.linear2 = Linear(config.dim_feedforward, d_model, bias=config.bias, device=device, dtype=dtype)
        self.activation_name = config.activation if isinstance(config.activation, str) else None
        if self.activation_name == "swiglu":  # the up projection, beside linear1 (the gate)
            self.linear3 = Linear(d_model, config.dim_feedforward, bias=config.bias, device=device, dtype=dtype)
        self.activation = _FUSED.get(self.activation_name) or _PLAIN.get(self.activation_name, config.activation)
        for i in range(1, n + 1):
            setattr(self, f"norm{i}", make_norm(config))
            setattr(self, f"dropout{i}", Dropout(config.dropout))
        mlp = ("hook_mlp_pre", "hook_mlp_pre_linear") if self.activation_name == "swiglu" else ("hook_mlp_pre",)
        cross = ("hook_cross_attn_out", "hook_resid_mid_cross") if n == 3 else ()
        add_hook_points(self, "hook_resid_pre", "hook_attn_out", "hook_resid_mid", *cross, *mlp, "hook_mlp_post",
                        "hook_mlp_out", "hook_resid_post")

    def _ff_block(self, x):
        """linear2(dropout(activation(linear1(x)))), before the last dropout; relu and the gelus run
        fused with linear1's bias (F.linear(..., activation=...)). swiglu: linear2(dropout(
        swiglu(linear1(x), linear3(x)))), swiglu(gate, up) = silu(gate) * up."""
        if self.activation_name == "swiglu":
            return self.linear2(self.dropout(self.activation(self.linear1(x), self.linear3(x))))
        linear1 = self.linear1
        if type(linear1) is Linear and self.activation is _FUSED.get(self.activation_name) and \
                not linear1._module_hooks:  # (a hooked linear1 runs as a module, so that its hooks run)
            hidden = F.linear(x, linear1.weight, linear1.bias, activation=self.activation_name)
        else:
            hidden = self.activation(self.linear1(x))
        return self.linear2(self.dropout(hidden))

    def _ff_block_hooked(self, x):
        """_ff_block through the hook points hook_mlp_pre (linear1's output; with swiglu the gate,
        and hook_mlp_pre_linear linear3's) and hook_mlp_post (the activation's output), then
        hook_mlp_out (linear2's output)."""
        if self.activation_name == "swiglu":
            pre, up = self.hook_mlp_pre(self.linear1(x)), self.hook_mlp_pre_linear(self.linear3(x))
            hidden = self.activation(pre, up)
        else:
            hidden = self.activation(self.hook_mlp_pre(self.linear1(x)))
        return self.hook_mlp_out(self.linear2(self.dropout(self.hook_mlp_post(hidden))))

    @staticmethod
    def _residual(x, dropout, y):
        """x + dropout(y), as one fused op (F.dropout_add: no mask stored) when `dropout` is a Dropout
        without module hooks (a hooked one runs as a module, with F.dropout's mask: the same draws)."""
        if type(dropout) is Dropout and not dropout._module_hooks:
            return F.dropout_add(y, x, dropout.p, dropout.training_active)
        return x + dropout(y)


class TransformerEncoderLayer(_FeedForwardLayer):
    """Self-attention and feed-forward sublayers (torch.nn.TransformerEncoderLayer, batch first).

    d_model must be divisible by nhead; activation "relu", "gelu", "gelu_tanh", "silu",
    "swiglu" (a gated feed-forward with linear3) or a callable; norm_first=True is pre-LN.
    Extras beyond torch: rotary=True applies RoPE in self-attention, memory_efficient=True uses
    the blockwise attention kernel (blocks of block_size keys), attention_backend chooses
    F.scaled_dot_product_attention's path; `config=TransformerConfig(...)` instead of the
    settings gives every other option too (attention and activation dropout; norm="rmsnorm",
    num_kv_heads, sliding_window, qkv_bias: see TransformerConfig).
    `self.config` holds the config either way. Raises TypeError / ValueError naming a bad argument."""

    def __init__(self, d_model: int | None = None, nhead: int | None = None, dim_feedforward: int = 2048,
                 dropout: float = 0.1, activation: str | Callable[[Tensor], Tensor] = "relu",
                 layer_norm_eps: float = 1e-5, batch_first: bool = True, norm_first: bool = False, bias: bool = True,
                 device: str | None = None, dtype: DType | None = None, rotary: bool = False,
                 memory_efficient: bool = False, *, block_size: int = 512, attention_backend: str | None = None,
                 config: TransformerConfig | None = None):
        super().__init__()
        config = layer_config(config, "TransformerEncoderLayer", TransformerEncoderLayer.__init__, locals())
        self.self_attn = MultiheadAttention(config=config)
        self._build(config, 2)

    def forward(self, src: Tensor, src_mask: ArrayLike | None = None, src_key_padding_mask: ArrayLike | None = None,
                is_causal: bool = False) -> Tensor:
        """src (B, S, d) -> (B, S, d): self-attention then feed-forward, each with its residual
        and LayerNorm. src_mask (S, S) or (B*nhead, S, S); src_key_padding_mask (B, S);
        torch.nn's convention (bool True = may not attend; a float mask is added to the scores),
        converted once here. is_causal=True without src_mask applies the causal mask."""
        check_sequence(src, self.d_model, "TransformerEncoderLayer", "src")
        is_causal = causal_flag(is_causal, "is_causal", "TransformerEncoderLayer")
        return self.forward_masked(src, self.self_attn_mask(src, src_mask, src_key_padding_mask, is_causal))

    def self_attn_mask(self, src: Tensor, src_mask: ArrayLike | None, src_key_padding_mask: ArrayLike | None,
                       is_causal: bool) -> AttentionMask:
        """The AttentionMask for `forward_masked`: torch.nn-convention masks of `src` converted
        once to the convention of F.scaled_dot_product_attention (True = takes part), checked."""
        B, S = src.shape[:2]
        return attention_mask(src_mask, src_key_padding_mask, src.data, (B, self.self_attn.num_heads, S, S),
                              is_causal, names=("src_mask", "src_key_padding_mask"),
                              sliding_window=self.self_attn.config.sliding_window)

    def forward_masked(self, x: Tensor, mask: AttentionMask, position_ids: ArrayLike | None = None) -> Tensor:
        """forward() of x (B, S, d) with the self-attention mask already converted (`self_attn_mask`);
        position_ids (B, S) or (S,): RoPE's positions (rotary=True; default 0 .. S-1)."""
        def self_attention(h):
            if self.self_attn._module_hooks:
                return attention_with_hooks(self.self_attn, h, h, mask, position_ids)
            return self.self_attn.forward_masked(h, h, h, mask, position_ids=position_ids)[0]
        if self.hooks_active:
            return self._forward_hooked(x, self_attention)
        if self.norm_first:
            x = self._residual(x, self.dropout1, self_attention(self.norm1(x)))
            return self._residual(x, self.dropout2, self._ff_block(self.norm2(x)))
        x = self.norm1(self._residual(x, self.dropout1, self_attention(x)))
        return self.norm2(self._residual(x, self.dropout2, self._ff_block(x)))

    def _forward_hooked(self, x, self_attention):
        """forward_masked's sublayers through the layer's hook points: hook_resid_pre (the input),
        hook_attn_out (self-attention's output, before its dropout), hook_resid_mid (the stream
        entering the feed-forward sublayer: after norm1 in post-LN), the MLP's, hook_resid_post."""
        x = self.hook_resid_pre(x)
        if self.norm_first:
            x = self.hook_resid_mid(self._residual(x, self.dropout1, self.hook_attn_out(self_attention(self.norm1(x)))))
            return self.hook_resid_post(self._residual(x, self.dropout2, self._ff_block_hooked(self.norm2(x))))
        x = self.hook_resid_mid(self.norm1(self._residual(x, self.dropout1, self.hook_attn_out(self_attention(x)))))
        return self.hook_resid_post(self.norm2(self._residual(x, self.dropout2, self._ff_block_hooked(x))))

    def forward_step(self, x: Tensor, layer_cache: LayerCache, mask: AttentionMask, position: int,
                     position_ids: ArrayLike | None = None) -> Tensor:
        """New positions x (B, L, d), the first at `position` (or at position_ids (B, L) per row,
        for RoPE), attending to the cached self-attention keys and values (extended in place with
        theirs) -> (B, L, d); `mask` (SDPA convention) covers cached + new keys."""
        def self_attention(h):
            if self.self_attn._module_hooks:
                return step_attention_with_hooks(self.self_attn, h, h, lambda query, key, value: cached_self_attention(
                    self.self_attn, query, layer_cache, mask, position, position_ids, key, value))
            return cached_self_attention(self.self_attn, h, layer_cache, mask, position, position_ids)
        if self.norm_first:
            x = self._residual(x, self.dropout1, self_attention(self.norm1(x)))
            return self._residual(x, self.dropout2, self._ff_block(self.norm2(x)))
        x = self.norm1(self._residual(x, self.dropout1, self_attention(x)))
        return self.norm2(self._residual(x, self.dropout2, self._ff_block(x)))


def attention_with_hooks(attn: MultiheadAttention, h: Tensor, memory: Tensor, mask: AttentionMask,
                     position_ids: ArrayLike | None = None) -> Tensor:
    """A layer's attention output (B, T, E) of queries h over keys and values memory (h itself in
    self-attention) when `attn` has module hooks: `attn.forward_masked` with the hooks around it,
    seeing torch's arguments (h, memory, memory) and output (attn_output, None), as torch's layer
    calls its attention module (their kwargs: forward_masked's, the mask already converted)."""
    return module_hooks.call_with_hooks(attn, (h, memory, memory), {"mask": mask, "position_ids": position_ids},
                                        forward=attn.forward_masked)[0]


def step_attention_with_hooks(attn: MultiheadAttention, h: Tensor, memory: Tensor | None,
                              step: Callable[[Tensor, Tensor, Tensor], Tensor]) -> Tensor:
    """In cached decoding, when `attn` has module hooks: step(query, key, value), the attention
    output (B, L, E) of the new positions h, with the hooks around it, seeing the arguments (h,
    memory, memory) (memory: h itself in self-attention; the decoder's memory, whose keys and
    values the cache holds, in cross-attention) and the output (attn_output, None)."""
    return module_hooks.call_with_hooks(attn, (h, memory, memory), {},
                                        forward=lambda query, key, value: (step(query, key, value), None))[0]


def cached_self_attention(attn, h, layer_cache, mask, position, position_ids=None, key=None, value=None):
    """Self-attention of new positions h (B, L, E), the first at `position` (RoPE; or at
    position_ids (B, L) per row), over the keys and values of `layer_cache` (self_k, self_v
    (B, H, t, hd)) and their own, which are appended to the cache. -> (B, L, E). key, value: the
    Tensors to project into keys and values when they are not h (a module hook's inputs)."""
    q, k, v = attn.project_qkv(h, h if key is None else key, h if value is None else value)  # (B, H, L, hd)
    if attn.rotary_emb is not None:
        q, k = attn.rotary_emb(q, position, position_ids), attn.rotary_emb(k, position, position_ids)
    if attn.hooks_active:
        q, k, v = attn.hooked_qkv(q, k, v)
    k, v = layer_cache.append_self(k, v)                                         # (B, H, t+L, hd)
    return attn.attend(q, k, v, mask)[0]


class TransformerDecoderLayer(_FeedForwardLayer):
    """Masked self-attention, cross-attention over memory, feed-forward
    (torch.nn.TransformerDecoderLayer, batch first).

    d_model must be divisible by nhead; activation "relu", "gelu", "gelu_tanh", "silu",
    "swiglu" or a callable; norm_first=True is pre-LN. Extras beyond torch: rotary=True applies
    RoPE in self-attention (not cross-attention, nor does the config's sliding_window),
    memory_efficient=True uses the blockwise attention kernel;
    `config=TransformerConfig(...)` instead of the settings (see TransformerEncoderLayer).
    Raises TypeError / ValueError naming a bad argument."""

    def __init__(self, d_model: int | None = None, nhead: int | None = None, dim_feedforward: int = 2048,
                 dropout: float = 0.1, activation: str | Callable[[Tensor], Tensor] = "relu",
                 layer_norm_eps: float = 1e-5, batch_first: bool = True, norm_first: bool = False, bias: bool = True,
                 device: str | None = None, dtype: DType | None = None, rotary: bool = False,
                 memory_efficient: bool = False, *, block_size: int = 512, attention_backend: str | None = None,
                 config: TransformerConfig | None = None):
        super().__init__()
        config = layer_config(config, "TransformerDecoderLayer", TransformerDecoderLayer.__init__, locals())
        self.self_attn = MultiheadAttention(config=config)
        # cross-attention: no RoPE, no sliding window (both are about positions within one sequence)
        self.multihead_attn = MultiheadAttention(config=dataclasses.replace(config, rotary=False, sliding_window=None))
        self._build(config, 3)

    def forward(self, tgt: Tensor, memory: Tensor, tgt_mask: ArrayLike | None = None,
                memory_mask: ArrayLike | None = None, tgt_key_padding_mask: ArrayLike | None = None,
                memory_key_padding_mask: ArrayLike | None = None, tgt_is_causal: bool = False,
                memory_is_causal: bool = False) -> Tensor:
        """tgt (B, T, d), memory (B, S, d) -> (B, T, d): self-attention, cross-attention over
        memory, feed-forward. tgt_mask (T, T) or (B*nhead, T, T), memory_mask (T, S) or
        (B*nhead, T, S), key padding masks (B, T) and (B, S), in torch.nn's convention (True =
        may not attend), converted once here. tgt_is_causal=True without tgt_mask applies the causal mask."""
        check_sequence(tgt, self.d_model, "TransformerDecoderLayer", "tgt")
        check_sequence(memory, self.d_model, "TransformerDecoderLayer", "memory")
        check_same_batch(tgt, memory, "TransformerDecoderLayer", ("tgt", "memory"))
        masks = decoder_masks(tgt, memory, self.self_attn.num_heads, tgt_mask, memory_mask, tgt_key_padding_mask,
                              memory_key_padding_mask, tgt_is_causal, memory_is_causal, "TransformerDecoderLayer",
                              self.self_attn.config.sliding_window)
        return self.forward_masked(tgt, memory, *masks)

    def forward_masked(self, x: Tensor, memory: Tensor, self_mask: AttentionMask, cross_mask: AttentionMask) -> Tensor:
        """forward() with both masks already converted (SDPA convention)."""
        def self_attention(h):
            if self.self_attn._module_hooks:
                return attention_with_hooks(self.self_attn, h, h, self_mask)
            return self.self_attn.forward_masked(h, h, h, self_mask)[0]

        def cross_attention(h):
            if self.multihead_attn._module_hooks:
                return attention_with_hooks(self.multihead_attn, h, memory, cross_mask)
            return self.multihead_attn.forward_masked(h, memory, memory, cross_mask)[0]
        return self._sublayers(x, self_attention, cross_attention)

    def _sublayers(self, x, self_attention, cross_attention):
        if self.hooks_active:
            return self._sublayers_hooked(x, self_attention, cross_attention)
        if self.norm_first:
            x = self._residual(x, self.dropout1, self_attention(self.norm1(x)))
            x = self._residual(x, self.dropout2, cross_attention(self.norm2(x)))
            return self._residual(x, self.dropout3, self._ff_block(self.norm3(x)))
        x = self.norm1(self._residual(x, self.dropout1, self_attention(x)))
        x = self.norm2(self._residual(x, self.dropout2, cross_attention(x)))
        return self.norm3(self._residual(x, self.dropout3, self._ff_block(x)))

    def _sublayers_hooked(self, x, self_attention, cross_attention):
        """_sublayers through the layer's hook points (as the encoder layer's, plus
        hook_cross_attn_out and hook_resid_mid_cross, the stream entering the feed-forward)."""
        x = self.hook_resid_pre(x)
        if self.norm_first:
            x = self.hook_resid_mid(self._residual(x, self.dropout1, self.hook_attn_out(self_attention(self.norm1(x)))))
            x = self.hook_resid_mid_cross(self._residual(x, self.dropout2,
                                                         self.hook_cross_attn_out(cross_attention(self.norm2(x)))))
            return self.hook_resid_post(self._residual(x, self.dropout3, self._ff_block_hooked(self.norm3(x))))
        x = self.hook_resid_mid(self.norm1(self._residual(x, self.dropout1, self.hook_attn_out(self_attention(x)))))
        x = self.hook_resid_mid_cross(self.norm2(self._residual(x, self.dropout2,
                                                                self.hook_cross_attn_out(cross_attention(x)))))
        return self.hook_resid_post(self.norm3(self._residual(x, self.dropout3, self._ff_block_hooked(x))))

    def forward_step(self, x: Tensor, layer_cache: LayerCache, cross_mask: AttentionMask, position: int,
                     memory: Tensor | None = None) -> Tensor:
        """One new target position x (B, 1, d) attending to the cached self-attention keys and
        values (extended in place with this position's) and to the cached memory keys/values;
        `position` is x's index in the target (for RoPE). Returns (B, 1, d). memory: what the
        cross-attention's module hooks see as its key and value (the cache holds their projections)."""
        def self_attention(h):
            if self.self_attn._module_hooks:
                return step_attention_with_hooks(self.self_attn, h, h, lambda query, key, value: cached_self_attention(
                    self.self_attn, query, layer_cache, AttentionMask(), position, key=key, value=value))
            return cached_self_attention(self.self_attn, h, layer_cache, AttentionMask(), position)

        def cross_attention(h):
            if self.multihead_attn._module_hooks:
                return step_attention_with_hooks(self.multihead_attn, h, memory,
                                                  lambda query, key, value: cached_cross(query))
            return cached_cross(h)

        def cached_cross(h):
            q = self.multihead_attn.project_q(h)                                 # (B, H, 1, hd)
            return self.multihead_attn.attend(q, layer_cache.cross_k, layer_cache.cross_v, cross_mask)[0]
        return self._sublayers(x, self_attention, cross_attention)


def decoder_masks(tgt, memory, nhead, tgt_mask, memory_mask, tgt_key_padding_mask, memory_key_padding_mask,
                  tgt_is_causal, memory_is_causal, owner, sliding_window=None):
    """(self_mask, cross_mask): the decoder's torch.nn-convention masks as AttentionMasks
    (errors name `owner`); sliding_window: the self-attention's (with tgt_is_causal)."""
    B, T, S = tgt.shape[0], tgt.shape[1], memory.shape[1]
    tgt_is_causal = causal_flag(tgt_is_causal, "tgt_is_causal", owner)
    memory_is_causal = causal_flag(memory_is_causal, "memory_is_causal", owner)
    self_mask = attention_mask(tgt_mask, tgt_key_padding_mask, tgt.data, (B, nhead, T, T), tgt_is_causal,
                               names=("tgt_mask", "tgt_key_padding_mask"), sliding_window=sliding_window)
    cross_mask = attention_mask(memory_mask, memory_key_padding_mask, tgt.data, (B, nhead, T, S), memory_is_causal,
                                names=("memory_mask", "memory_key_padding_mask"))
    return self_mask, cross_mask


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

    @property
    def config(self) -> TransformerConfig:
        """The TransformerConfig every layer of the stack shares."""
        return self.layers[0].config

    def _final_norm(self, x):
        return self.norm(x) if self.norm is not None else x


class TransformerEncoder(_LayerStack):
    """A stack of `num_layers` deep copies of `encoder_layer`, then the optional final `norm`
    (torch.nn.TransformerEncoder). TypeError unless encoder_layer is a TransformerEncoderLayer."""

    layer_type = TransformerEncoderLayer

    def __init__(self, encoder_layer: TransformerEncoderLayer, num_layers: int, norm: Module | None = None):
        super().__init__(encoder_layer, num_layers, norm)

    def forward(self, src: Tensor, mask: ArrayLike | None = None, src_key_padding_mask: ArrayLike | None = None,
                is_causal: bool | None = None, position_ids: ArrayLike | None = None) -> Tensor:
        """src (B, S, d) -> (B, S, d); masks as in TransformerEncoderLayer, converted once.
        position_ids (B, S) or (S,) (extra, not in torch): RoPE's positions for layers built with
        rotary=True (default 0 .. S-1); ValueError for layers without RoPE."""
        first = self.layers[0]
        check_sequence(src, first.d_model, "TransformerEncoder", "src")
        _check_rotary(first, position_ids, "TransformerEncoder")
        prepared = first.self_attn_mask(src, mask, src_key_padding_mask,
                                        causal_flag(is_causal, "is_causal", "TransformerEncoder"))
        x = src
        for layer in self.layers:
            if layer._module_hooks:  # its hooks around forward_masked, seeing torch's args (src,)
                x = module_hooks.call_with_hooks(layer, (x,), {"mask": prepared, "position_ids": position_ids},
                                                 forward=layer.forward_masked)
            else:
                x = layer.forward_masked(x, prepared, position_ids)
        return self._final_norm(x)

    # -- cached causal decoding (decoder-only models) --------------------------------------------
    def init_cache(self) -> DecoderCache:
        """An empty DecoderCache (self-attention keys/values of every layer, no memory) for `step`."""
        window = self.layers[0].self_attn.config.sliding_window
        return DecoderCache([LayerCache(window=window) for _ in self.layers], window=window)

    def step(self, x: Tensor, cache: DecoderCache, key_padding_mask: ArrayLike | None = None,
             position_ids: ArrayLike | None = None) -> Tensor:
        """x (B, L, d): L new embedded positions (a prompt, or the newest token) -> (B, L, d)
        after the final norm. Causal: new position i attends to every cached position and to new
        positions <= i. key_padding_mask (B, L) bool, True = padding, marks new positions that no
        later query attends to (left padding); it is kept in `cache` for the later steps.
        position_ids (B, L): RoPE's positions of the new tokens per row (rotary layers; default
        len(cache) .. len(cache) + L - 1). Appends this step's keys/values to `cache` (with a
        sliding window W, each layer then keeps the last W - 1); equals forward(prefix,
        is_causal=True) on the whole prefix for the real positions."""
        if not isinstance(cache, DecoderCache):
            raise TypeError(f"TransformerEncoder.step: cache must come from init_cache, got {type(cache).__name__}")
        check_sequence(x, self.layers[0].d_model, "TransformerEncoder.step", "x")
        _check_rotary(self.layers[0], position_ids, "TransformerEncoder.step")
        B, L = x.shape[:2]
        if cache.length and x.shape[0] != cache.batch_size:
            raise ValueError(f"TransformerEncoder.step: x must have the cache's batch size {cache.batch_size}, "
                             f"got shape {x.shape}")
        mask = cache.extend_padding(key_padding_mask, B, L, x.data)
        for layer, layer_cache in zip(self.layers, cache.layers):
            if layer._module_hooks:  # its hooks around forward_step, seeing the args (x,) of the new positions
                x = module_hooks.call_with_hooks(layer, (x,), {"layer_cache": layer_cache, "mask": mask, "position":
                                                               cache.length, "position_ids": position_ids},
                                                 forward=layer.forward_step)
            else:
                x = layer.forward_step(x, layer_cache, mask, cache.length, position_ids)
        cache.length += L
        return self._final_norm(x)


def _check_rotary(layer, position_ids, owner):
    """ValueError for position_ids given to a stack whose self-attention has no RoPE (they would be ignored)."""
    if position_ids is not None and not layer.self_attn.rotary:
        raise ValueError(f"{owner}: position_ids are RoPE's positions, but the layers were built with rotary=False")


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
                              tgt_key_padding_mask, memory_key_padding_mask, tgt_is_causal, memory_is_causal,
                              "TransformerDecoder", self.layers[0].self_attn.config.sliding_window)
        x = tgt
        for layer in self.layers:
            if layer._module_hooks:  # its hooks around forward_masked, seeing torch's args (tgt, memory)
                x = module_hooks.call_with_hooks(layer, (x, memory), {"self_mask": masks[0], "cross_mask": masks[1]},
                                                 forward=layer.forward_masked)
            else:
                x = layer.forward_masked(x, memory, *masks)
        return self._final_norm(x)

    # -- cached step-wise decoding --------------------------------------------------------------
    def init_cache(self, memory: Tensor, memory_key_padding_mask: ArrayLike | None = None) -> DecoderCache:
        """A DecoderCache holding every layer's cross-attention keys/values of `memory` (B, S, d)."""
        check_sequence(memory, self.layers[0].d_model, "TransformerDecoder.init_cache", "memory")
        B, S = memory.shape[:2]
        cross_mask = attention_mask(None, memory_key_padding_mask, memory.data, (B, 1, 1, S),
                                    names=("memory_mask", "memory_key_padding_mask"))
        window = self.layers[0].self_attn.config.sliding_window
        layers = [LayerCache(*layer.multihead_attn.project_kv(memory, memory), window=window) for layer in self.layers]
        return DecoderCache(layers, cross_mask, window, memory)

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
            if layer._module_hooks:  # its hooks around forward_step, seeing the args (x, memory)
                x = module_hooks.call_with_hooks(
                    layer, (x, cache.memory), {"layer_cache": layer_cache, "cross_mask": cache.cross_mask,
                                               "position": cache.length}, forward=_decoder_layer_step(layer))
            else:
                x = layer.forward_step(x, layer_cache, cache.cross_mask, cache.length)
        cache.length += 1
        return self._final_norm(x)


def _decoder_layer_step(layer):
    """layer.forward_step taking (x, memory, **its other arguments), as a decoder layer's hooks see it."""
    return lambda x, memory, **kwargs: layer.forward_step(x, memory=memory, **kwargs)


class LayerCache:
    """Keys/values of one layer: cross_k, cross_v (B, H_kv, S, hd) fixed (None without a memory);
    self_k, self_v (B, H_kv, t, hd) growing with every step (None before the first). With a
    sliding `window` W (the self-attention's), self_k / self_v keep only the last W - 1
    positions after each step: the next query (at the next position) sees those and itself."""

    def __init__(self, cross_k=None, cross_v=None, *, window=None):
        self.cross_k, self.cross_v = cross_k, cross_v
        self.self_k = self.self_v = None
        self.keep = None if window is None else window - 1  # positions kept after each step (None: all)
        self.buffers = None  # (keys, values) arrays (B, H_kv, capacity, hd) that self_k/self_v view
        self.start = 0       # self_k is buffers[0][:, :, start:start + t]

    def tensors(self):
        return {name: getattr(self, name) for name in ("cross_k", "cross_v", "self_k", "self_v")}

    def append_self(self, k, v):
        """Append new self-attention keys/values (B, H_kv, L, hd); returns the cached ones and
        them, (B, H_kv, t+L, hd), for this step's queries; keeps the last `keep` of those (all
        without a window). When nothing needs a gradient they go into buffers (doubling capacity
        without a window, at most about 2 (W - 1 + L) positions with one: no copy of the cached
        positions per step, and a long prompt's keys are not held past its step); otherwise
        through autograd's concatenate (and slicing)."""
        grad = k.requires_grad or v.requires_grad or (
            self.self_k is not None and (self.self_k.requires_grad or self.self_v.requires_grad))
        if self.self_k is None and (self.keep is None or grad):
            self.buffers = None
            self.self_k, self.self_v = self._kept(k), self._kept(v)
            return k, v
        if grad:
            self.buffers = None
            keys, values = concatenate([self.self_k, k], axis=2), concatenate([self.self_v, v], axis=2)
            self.self_k, self.self_v = self._kept(keys), self._kept(values)
            return keys, values
        if self.self_k is None:  # a window's first step: its keys, and a copy of the last W - 1 of them
            keys, values = k, v
            kept = min(k.shape[2], self.keep)
            self._store(k.data, v.data, kept, kept + 1)
            return keys, values
        t, new = self.self_k.shape[2], k.shape[2]
        if self.buffers is None or self.buffers[0].shape[2] < self.start + t + new:
            self._store(self.self_k.data, self.self_v.data, t, t + new)
        keys, values = self.buffers
        end = self.start + t
        keys[:, :, end:end + new], values[:, :, end:end + new] = k.data, v.data
        everything = (Tensor(keys[:, :, self.start:end + new]), Tensor(values[:, :, self.start:end + new]))
        kept = t + new if self.keep is None else min(t + new, self.keep)
        self.start = end + new - kept
        self.self_k, self.self_v = Tensor(keys[:, :, self.start:end + new]), Tensor(values[:, :, self.start:end + new])
        return everything

    def _kept(self, x):
        """The positions of x (B, H_kv, n, hd) to keep: all, or the last `keep`."""
        if self.keep is None or x.shape[2] <= self.keep:
            return x
        return x[:, :, x.shape[2] - self.keep:]

    def _store(self, keys, values, kept, room):
        """New buffers of capacity max(2 room, 16) positions holding the last `kept` positions of
        keys / values (arrays (B, H_kv, n, hd)) at their start; self_k / self_v view those."""
        xp, shape = backend.get_array_module(keys), keys.shape
        capacity = max(2 * room, 16)
        self.buffers = tuple(xp.empty(shape[:2] + (capacity,) + shape[3:], dtype=keys.dtype) for _ in range(2))
        n = keys.shape[2]
        self.buffers[0][:, :, :kept], self.buffers[1][:, :, :kept] = keys[:, :, n - kept:], values[:, :, n - kept:]
        self.start = 0
        self.self_k, self.self_v = Tensor(self.buffers[0][:, :, :kept]), Tensor(self.buffers[1][:, :, :kept])


class DecoderCache:
    """State of cached step-wise decoding: `layers` (one LayerCache per layer), `cross_mask`
    (memory padding, an AttentionMask over (B, 1, 1, S)), `length` (positions decoded so
    far), `window` (the self-attention's sliding window W, or None: then the layers keep the
    last W - 1 positions only, `held` of them), `attendable` (B, held) bool in the internal
    (SDPA) convention, True = a cached key later queries may attend to, False = padding (None:
    no padding so far), `next_positions` (B, 1)
    ints, each row's next position when rows' positions differ (padding, or position_ids given
    per row; None: every row continues at `length`), `memory` (B, S, d): the decoder's memory
    (None without one), which the module hooks of its layers and cross-attention see (the
    layers hold its keys and values). `reorder(indices)` selects batch rows (beam search).
    Made by `init_cache`; `len(cache)` is `length`."""

    def __init__(self, layers: list[LayerCache], cross_mask: AttentionMask = AttentionMask(),
                 window: int | None = None, memory: Tensor | None = None):
        self.layers, self.cross_mask, self.length = layers, cross_mask, 0
        self.window = None if window is None else check_int(window, "window", "DecoderCache", at_least=1)
        self.attendable = self.next_positions = None
        self._memory, self._memory_rows = memory, None  # rows: the batch rows reorder kept (taken when read)

    @property
    def memory(self) -> Tensor | None:
        """The memory (B, S, d) of the rows the cache holds (after every reorder), or None."""
        if self._memory is not None and self._memory_rows is not None:
            self._memory, self._memory_rows = self._memory[self._memory_rows], None
        return self._memory

    @property
    def held(self) -> int:
        """How many positions each layer's self-attention cache holds: length, or with a
        window W the last min(length, W - 1)."""
        return self.length if self.window is None else min(self.length, self.window - 1)

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

    def extend_padding(self, key_padding_mask: ArrayLike | None, batch: int, new: int, like: Array) -> AttentionMask:
        """Append the padding of `new` positions (key_padding_mask (batch, new), torch.nn's
        convention True = padding, converted here once; or None) and return the self-attention
        mask of those queries over the cached keys and theirs (batch, 1, new, held + new):
        causal, and within the window (query i sees keys j with i - W < j <= i). `attendable`
        then keeps the columns of the positions the layers keep."""
        xp = backend.get_array_module(like)
        if key_padding_mask is not None:
            padding = key_padding_mask.data if isinstance(key_padding_mask, Tensor) else key_padding_mask
            padding = backend.to_device(padding if backend.is_array(padding) else xp.asarray(padding),
                                        backend.device_of(like))
            if padding.dtype != bool or padding.shape != (batch, new):
                raise ValueError(f"key_padding_mask must be a bool array of shape (batch, new positions) = "
                                 f"{(batch, new)}, got {padding.dtype} {padding.shape}")
            if self.attendable is None:
                self.attendable = xp.ones((batch, self.held), dtype=bool)
            self.attendable = xp.concatenate([self.attendable, ~padding], axis=1)      # (B, t + L)
        elif self.attendable is not None:
            self.attendable = xp.concatenate([self.attendable, xp.ones((batch, new), dtype=bool)], axis=1)
        held = self.held
        causal = _causal_allowed(xp, held, new, self.window)[None, None]             # (1, 1, L, t + L)
        if self.attendable is not None:
            mask = AttentionMask(causal & self.attendable[:, None, None, :])          # (B, 1, L, t + L)
            if self.window is not None:  # the columns of the positions kept after this step
                kept = min(held + new, self.window - 1)
                self.attendable = self.attendable[:, held + new - kept:]
            return mask
        if new == 1:  # one new query sees every cached key (with a window: the last W - 1): no mask
            return AttentionMask()
        return AttentionMask(None, True) if self.length == 0 else AttentionMask(causal)

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
        if self.cross_mask.mask is not None:
            self.cross_mask = AttentionMask(self.cross_mask.mask[idx], self.cross_mask.is_causal)
        if self.attendable is not None:
            self.attendable = self.attendable[idx]
        if self.next_positions is not None:
            self.next_positions = self.next_positions[idx]
        if self._memory is not None:  # composed here, taken when `memory` is read (by a module hook)
            self._memory_rows = idx if self._memory_rows is None else self._memory_rows[idx]
        return self


def _causal_allowed(xp, cached, new, window=None):
    """(new, cached + new) bool, True where new query i (at position cached + i) may attend to key
    j <= cached + i (and, with a window W, j > cached + i - W)."""
    keys, queries = xp.arange(cached + new)[None, :], (cached + xp.arange(new))[:, None]
    allowed = keys <= queries
    return allowed if window is None else allowed & (keys > queries - window)


class Transformer(Module, HookedModel):
    """Encoder-decoder Transformer with exactly torch.nn.Transformer(batch_first=True)'s
    parameters, state_dict keys and math, including the final encoder.norm and decoder.norm.

    Init like torch: xavier_uniform_ on every parameter with more than one dimension.
    Extras: rotary=True applies RoPE in the self-attention of every layer; memory_efficient=True
    uses the blockwise attention kernel (blocks of block_size keys); attention_backend chooses
    F.scaled_dot_product_attention's path. The defaults are torch's (the paper's base model);
    batch_first=True is the only layout (npformer is batch-first throughout; interop refuses
    torch modules with batch_first=False). `config=TransformerConfig(...)` instead of the settings
    reaches every option (attention block_size and backend, attention and activation dropout);
    `self.config` holds the TransformerConfig either way, shared by every layer and attention
    module (`config["d_model"]` reads it like the dict it replaces).
    """

    def __init__(self, d_model: int = 512, nhead: int = 8, num_encoder_layers: int = 6, num_decoder_layers: int = 6,
                 dim_feedforward: int = 2048, dropout: float = 0.1,
                 activation: str | Callable[[Tensor], Tensor] = "relu", custom_encoder: Module | None = None,
                 custom_decoder: Module | None = None, layer_norm_eps: float = 1e-5, batch_first: bool = True,
                 norm_first: bool = False, bias: bool = True, device: str | None = None, dtype: DType | None = None,
                 rotary: bool = False, memory_efficient: bool = False, *, block_size: int = 512,
                 attention_backend: str | None = None, config: TransformerConfig | None = None):
        super().__init__()
        config = layer_config(config, "Transformer", Transformer.__init__, locals(),
                              LAYER_ARGUMENTS + ("num_encoder_layers", "num_decoder_layers"))
        for name in ("num_encoder_layers", "num_decoder_layers"):  # both stacks are built
            check_int(config[name], name, "Transformer", at_least=1)
        self.config = config
        if custom_encoder is None:
            custom_encoder = TransformerEncoder(TransformerEncoderLayer(config=config), config.num_encoder_layers,
                                                make_norm(config))
        if custom_decoder is None:
            custom_decoder = TransformerDecoder(TransformerDecoderLayer(config=config), config.num_decoder_layers,
                                                make_norm(config))
        self.encoder, self.decoder = custom_encoder, custom_decoder
        self._reset_parameters()
        self.d_model, self.nhead, self.batch_first = config.d_model, config.nhead, True

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
        for name, flag in (("src_is_causal", src_is_causal), ("tgt_is_causal", tgt_is_causal),
                           ("memory_is_causal", memory_is_causal)):
            causal_flag(flag, name, "Transformer")
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
