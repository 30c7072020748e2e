"""A decoder-only (GPT-style) causal language model built from the encoder layers plus a causal mask."""
from __future__ import annotations

from typing import Any

import npformer.functional as F
from autograd import Tensor, backend
from autograd.backend import ArrayLike

from .. import nn
from ..nn import module_hooks
from ..nn.positional import check_position_ids
from ._common import (CAUSAL_ACTIVATIONS, EncoderOnlyModel, attention_settings, check_choice, padding_mask_from_ids,
                      token_ids, valid_positions)


class CausalLM(EncoderOnlyModel):
    """ids (B, T) -> next-token logits (B, T, vocab_size); position t sees positions <= t.

    h = encoder(dropout(tok_embed(ids) + positions), causal mask) with a final norm,
    logits = lm_head(h) (no bias), or h tok_embed.weight^T with tie_weights=True (then no
    lm_head key). Pre-LN by default (norm_first=True), GELU, learned positions.
    activation: "relu", "gelu" (exact), "gelu_tanh" (GPT-2's "gelu_new"), "silu", or "swiglu"
    (a gated feed-forward linear2(silu(linear1 x) * linear3 x), Llama's). attention_dropout
    and activation_dropout default to `dropout` (see EncoderOnlyModel).

    Layer options (nn.TransformerConfig's, under the same names): bias (False: no bias in any
    linear or LayerNorm, as nanoGPT's bias=False), qkv_bias (None = bias; Qwen2 has
    bias=False, qkv_bias=True), norm ("layernorm" or "rmsnorm", also the final norm),
    num_kv_heads (None = nhead; fewer: grouped-query attention, 1: multi-query), sliding_window
    (None, or each position attends to the last W positions: Mistral's), rotary_base (RoPE's
    base) and rope_scaling (None, {"rope_type": "linear", "factor": f}: positions divided by f,
    or {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings"}: Llama 3.1's; any other type or key is refused),
    both for positional="rope" only. residual_init: "normal" (N(0, 0.02^2) on every matrix) or
    "gpt2" (the residual projections self_attn.out_proj and linear2 at std
    0.02 / sqrt(2 num_layers), as GPT-2 and nanoGPT).

    GPT-2 is CausalLM(activation="gelu_tanh", tie_weights=True, activation_dropout=0.0):
    npformer.interop.from_hf / to_hf and npformer.models.load_pretrained convert its weights.
    nanoGPT is CausalLM(dim_feedforward=4 d_model, tie_weights=True, activation_dropout=0.0,
    bias=..., residual_init="gpt2"): npformer.interop.from_nanogpt / to_nanogpt.
    A Llama-style model is CausalLM(norm="rmsnorm", activation="swiglu", positional="rope",
    bias=False, tie_weights=False, dropout=0.0, num_kv_heads=...) (Qwen2: qkv_bias=True;
    Mistral: sliding_window=W).
    Equivalent torch composition: npformer.interop.to_torch(model) (torch.nn has no RMSNorm
    transformer layer, SwiGLU, grouped-query or sliding-window attention: those are refused).
    Generation: npformer.decoding.generate(model, ids, max_new_tokens, ...) on the KV cache of
    init_cache() / decode_step() (the seq2seq decoder's machinery: nn.DecoderCache).
    How attention runs (not stored in `config`, like Hugging Face's attn_implementation):
    memory_efficient, block_size and attention_backend, as in nn.TransformerConfig; every layer
    shares `transformer_config`. Every argument is checked (TypeError / ValueError naming it);
    `config` holds the others: CausalLM(**model.config) rebuilds the model.
    """

    activations = CAUSAL_ACTIVATIONS

    def __init__(self, vocab_size: int, d_model: int = 512, nhead: int = 8, num_layers: int = 6,
                 dim_feedforward: int = 2048, dropout: float = 0.1, max_len: int = 1024, norm_first: bool = True,
                 activation: str = "gelu", positional: str = "learned", tie_weights: bool = False,
                 pad_idx: int | None = None, layer_norm_eps: float = 1e-5, *, attention_dropout: float | None = None,
                 activation_dropout: float | None = None, bias: bool = True, norm: str = "layernorm",
                 num_kv_heads: int | None = None, sliding_window: int | None = None, qkv_bias: bool | None = None,
                 rotary_base: float = 10000.0, rope_scaling: dict | None = None, residual_init: str = "normal",
                 memory_efficient: bool = False, block_size: int = 512, attention_backend: str | None = None):
        super().__init__()
        self.config = dict(vocab_size=vocab_size, d_model=d_model, nhead=nhead, num_layers=num_layers,
                           dim_feedforward=dim_feedforward, dropout=dropout, max_len=max_len,
                           norm_first=norm_first, activation=activation, positional=positional,
                           tie_weights=tie_weights, pad_idx=pad_idx, layer_norm_eps=layer_norm_eps,
                           attention_dropout=attention_dropout, activation_dropout=activation_dropout,
                           bias=bias, norm=norm, num_kv_heads=num_kv_heads, sliding_window=sliding_window,
                           qkv_bias=qkv_bias, rotary_base=rotary_base,
                           rope_scaling=rope_scaling,
                           residual_init=residual_init)
        self._build_trunk(self.config, attention_settings(memory_efficient, block_size, attention_backend))
        self.tie_weights = self.config["tie_weights"]
        if not self.tie_weights:
            self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self._reset_parameters()

    @classmethod
    def state_shapes(cls, config: dict[str, Any], persistent: bool = True) -> dict[str, tuple[int, ...]]:
        """{name: shape} of `CausalLM(**config).state_dict()` from the config alone (config holds
        every constructor argument; the options added later may be absent: their defaults),
        building nothing; persistent=False adds the non-persistent buffers (named as in named_buffers)."""
        check_choice(config["activation"], cls.activations, "activation", cls.__name__)
        shapes = cls._trunk_shapes(config, cls.__name__, persistent)
        if not config["tie_weights"]:
            shapes["lm_head.weight"] = shapes["tok_embed.weight"]
        return shapes

    def forward(self, input_ids: ArrayLike, key_padding_mask: ArrayLike | None = None,
                position_ids: ArrayLike | None = None) -> Tensor:
        """input_ids (B, T) ints; key_padding_mask (B, T) bool, True = padding (derived from
        pad_idx when not given); position_ids (B, T) ints (default 0 .. T-1 in every row; e.g.
        cumsum(~key_padding_mask, 1) - 1 for left-padded rows, as Hugging Face's GPT-2 takes
        them, or positions that restart in packed sequences), for every positional kind but
        "none": added from the table, or RoPE's in attention -> logits (B, T, vocab_size)."""
        ids = self._ids(input_ids)
        mask = padding_mask_from_ids(ids, self.pad_idx, key_padding_mask)
        return self.project(self.hidden_states(ids, mask, is_causal=True, position_ids=position_ids))

    def project(self, hidden: Tensor) -> Tensor:
        """Final hidden states (..., d_model) -> logits (..., vocab_size) (lm_head, or the tied embedding)."""
        if not self.tie_weights and self.lm_head._module_hooks:  # lm_head's hooks run around it
            return self.lm_head(hidden)
        return F.linear(hidden, self.tok_embed.weight if self.tie_weights else self.lm_head.weight)

    # -- cached decoding (see npformer.decoding.generate) ------------------------------------------
    def init_cache(self) -> nn.DecoderCache:
        """An empty `nn.DecoderCache`: every layer's self-attention keys/values, filled by `decode_step`."""
        return self.encoder.init_cache()

    def decode_step(self, input_ids: ArrayLike, cache: nn.DecoderCache, key_padding_mask: ArrayLike | None = None,
                    position_ids: ArrayLike | None = None) -> Tensor:
        """input_ids (B, L): the new tokens (the whole prompt at the first call, then the newest
        token of each row) -> next-token logits (B, vocab_size) after the last of them.

        Their keys/values join `cache`, so each call costs only its L new positions; the logits
        equal forward(prefix)[:, -1] on the whole prefix. key_padding_mask (B, L) bool, True =
        padding (derived from pad_idx when not given): left padding of prompts of different
        lengths; no later position attends to it, and positions count the real tokens of each
        row only (a row's first real token is at position 0, as Hugging Face's
        position_ids = cumsum(attention_mask) - 1). position_ids (B, L) or (L,) ints: the new
        tokens' positions instead (e.g. packed sequences whose positions restart); later calls
        without them continue each row after its last given position."""
        owner = "CausalLM.decode_step"
        if not isinstance(cache, nn.DecoderCache):
            raise TypeError(f"{owner}: cache must come from init_cache, got {type(cache).__name__}")
        ids = token_ids(input_ids, self.tok_embed, owner, "input_ids")
        mask = padding_mask_from_ids(ids, self.pad_idx, key_padding_mask)
        positions, next_positions = self._next_positions(ids, mask, cache, position_ids, owner)
        if positions is None:
            x = self.embed(ids, offset=cache.length)                                 # positions t .. t+L-1
        else:
            x = self.embed(ids, position_ids=positions)
        rope_positions = positions if self.positional_kind == "rope" else None
        if self.encoder._module_hooks:  # its hooks around step, seeing the new positions' args (x,)
            hidden = module_hooks.call_with_hooks(self.encoder, (x,), {"cache": cache, "key_padding_mask": mask,
                                                                       "position_ids": rope_positions},
                                                  forward=self.encoder.step)
        else:
            hidden = self.encoder.step(x, cache, key_padding_mask=mask, position_ids=rope_positions)  # (B, L, d)
        cache.next_positions = next_positions
        return self.project(hidden[:, -1])                                          # (B, V)

    def _next_positions(self, ids, mask, cache, position_ids, owner):
        """((B, L) positions of the new tokens, or None when every row's are len(cache) ..
        len(cache) + L - 1; each row's next position (B, 1) after them, or None likewise).
        position_ids when given, else each row continues after its previous position and counts
        only real (non-padding) new tokens (padding gets its row's next position, unused)."""
        xp = backend.get_array_module(ids)
        if position_ids is not None:
            positions = xp.broadcast_to(check_position_ids(position_ids, ids.shape, ids, None, owner), ids.shape)
            return positions, positions[:, -1:] + 1
        if mask is None and cache.next_positions is None:
            return None, None
        real = valid_positions(mask, ids, "int64")                                  # (B, L) 1 = token
        start = cache.length if cache.next_positions is None else cache.next_positions  # int or (B, 1)
        return xp.maximum(start + xp.cumsum(real, axis=1) - 1, 0), start + real.sum(axis=1, keepdims=True)
