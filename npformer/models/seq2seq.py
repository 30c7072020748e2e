"""The paper's encoder-decoder translation model: embeddings, positions, nn.Transformer, generator."""
from __future__ import annotations

import math
from typing import Any

import npformer.functional as F
from autograd import Tensor
from autograd.backend import ArrayLike
from autograd.checks import check_bool

from .. import nn
from ..nn import init, module_hooks
from ..nn.config import check_d_model_nhead
from ..nn.hook_points import HookedModel
from ..nn.layers import as_ids
from ._common import (POSITIONAL, additive_positions, attention_settings, check_choice, check_config, dims,
                      padding_mask_from_ids, stack_shapes, token_ids, transformer_config)


def sharing(tie_weights, share_embeddings, owner):
    """(tie_weights, share_embeddings) as two bools from the constructor's arguments:
    tie_weights None (the default) follows share_embeddings; "all" means share_embeddings=True."""
    if isinstance(tie_weights, str) and tie_weights == "all":
        tie_weights, share_embeddings = True, True
    share_embeddings = check_bool(share_embeddings, "share_embeddings", owner)
    tie_weights = share_embeddings if tie_weights is None else check_bool(tie_weights, "tie_weights", owner)
    if share_embeddings and not tie_weights:
        raise ValueError(f"{owner}: share_embeddings=True shares the embedding with the generator too, which "
                         f"tie_weights=False contradicts (leave tie_weights out)")
    return tie_weights, share_embeddings


class Seq2SeqTransformer(nn.Module, HookedModel):
    """src ids (B, S), tgt ids (B, T) -> next-token logits (B, T, tgt_vocab_size).

    x = dropout(embed(ids) * sqrt(d_model) + positions); memory = encoder(x_src);
    logits = generator(decoder(x_tgt, memory)) with the causal target mask applied
    automatically and the source padding mask used for the memory.

    state_dict keys: src_embed.weight, tgt_embed.weight, transformer.* (exactly
    torch.nn.Transformer(batch_first=True)'s), generator.weight, generator.bias, plus
    src_pos_embed.weight / tgt_pos_embed.weight with positional="learned". Sinusoidal
    positions are a non-persistent buffer (no key); "rope" rotates q and k in every
    self-attention (no key); "none" adds no positions.

    Weight sharing:
    - tie_weights=True: the generator uses tgt_embed.weight (no generator.weight key).
    - share_embeddings=True: the paper's model (section 3.4): ONE matrix is the source
      embedding, the target embedding and the pre-softmax projection (src_embed is tgt_embed;
      implies tie_weights; needs src_vocab_size == tgt_vocab_size, a shared vocabulary; only the
      tgt_embed.weight key remains; fairseq's --share-all-embeddings). The base model
      Seq2SeqTransformer(37000, 37000, share_embeddings=True) has 63,121,544 parameters:
      docs/paper_model.md adds them up and compares them with the paper's "65M".
    - tie_weights="all": the older spelling of share_embeddings=True (still accepted).
    `config` stores the normalised pair (tie_weights: bool, share_embeddings: bool).
    pad_idx: padding id of both vocabularies: its embedding rows stay zero with zero gradient,
    and when a key padding mask is not given it is derived from the ids (True = pad).
    Init: xavier_uniform_ on every parameter matrix (embeddings and generator included),
    padding rows zeroed. `config` holds the constructor arguments: Seq2SeqTransformer(**m.config).

    Named hook points (run_with_cache, run_with_hooks; docs/hook_points.md): every layer's
    residual stream, attention (q, k, v, scores, P, dropped P, z), norms and MLP hidden.

    Cached decoding: cache = init_cache(memory, memory_key_padding_mask) once, then
    logits = decode_step(tokens, cache) per new token (see the methods).
    How attention runs (not stored in `config`, like Hugging Face's attn_implementation):
    memory_efficient, block_size and attention_backend, as in nn.TransformerConfig; the
    nn.Transformer and every layer share `transformer_config`. Raises TypeError / ValueError
    naming a bad argument.
    """

    def __init__(self, src_vocab_size: int, tgt_vocab_size: int, d_model: int = 512, nhead: int = 8,
                 num_encoder_layers: int = 6, num_decoder_layers: int = 6, dim_feedforward: int = 2048,
                 dropout: float = 0.1, max_len: int = 5000, activation: str = "relu", norm_first: bool = False,
                 pad_idx: int | None = None, tie_weights: bool | str | None = None, positional: str = "sinusoidal",
                 layer_norm_eps: float = 1e-5, *, share_embeddings: bool = False, memory_efficient: bool = False,
                 block_size: int = 512, attention_backend: str | None = None):
        super().__init__()
        owner = "Seq2SeqTransformer"
        check_choice(positional, POSITIONAL, "positional", owner)
        check_choice(activation, ("relu", "gelu"), "activation", owner)
        d_model, nhead = check_d_model_nhead(d_model, nhead, owner)
        tie_weights, share_embeddings = sharing(tie_weights, share_embeddings, owner)
        self.config = dict(src_vocab_size=src_vocab_size, tgt_vocab_size=tgt_vocab_size, d_model=d_model,
                           nhead=nhead, num_encoder_layers=num_encoder_layers,
                           num_decoder_layers=num_decoder_layers, dim_feedforward=dim_feedforward,
                           dropout=dropout, max_len=max_len, activation=activation, norm_first=norm_first,
                           pad_idx=pad_idx, tie_weights=tie_weights, positional=positional,
                           layer_norm_eps=layer_norm_eps, share_embeddings=share_embeddings)
        self.config = check_config(self.config, owner)
        if share_embeddings and self.config["src_vocab_size"] != self.config["tgt_vocab_size"]:
            raise ValueError(f"{owner}: share_embeddings=True shares one matrix between both embeddings and the "
                             f"generator (a shared vocabulary), so src_vocab_size ({src_vocab_size}) must equal "
                             f"tgt_vocab_size ({tgt_vocab_size})")
        self.d_model, self.pad_idx, self.tie_weights = d_model, self.config["pad_idx"], tie_weights
        self.share_embeddings = share_embeddings
        self.positional_kind = positional
        if share_embeddings:
            self.tgt_embed = nn.Embedding(tgt_vocab_size, d_model, padding_idx=pad_idx)
            self.src_embed = self.tgt_embed  # registered second: state_dict lists tgt_embed.weight only
        else:
            self.src_embed = nn.Embedding(src_vocab_size, d_model, padding_idx=pad_idx)
            self.tgt_embed = nn.Embedding(tgt_vocab_size, d_model, padding_idx=pad_idx)
        if positional == "learned":
            self.src_pos_embed = additive_positions(positional, d_model, max_len)
            self.tgt_pos_embed = additive_positions(positional, d_model, max_len)
        elif positional == "sinusoidal":
            self.positional = additive_positions(positional, d_model, max_len)
        self.dropout = nn.Dropout(dropout)
        c = self.config
        self.transformer_config = transformer_config(
            c, owner, attention_settings(memory_efficient, block_size, attention_backend),
            num_encoder_layers=c["num_encoder_layers"], num_decoder_layers=c["num_decoder_layers"])
        self.transformer = nn.Transformer(config=self.transformer_config)
        self.generator = nn.Linear(d_model, tgt_vocab_size)
        if tie_weights:
            self.generator.weight = None  # logits use tgt_embed.weight
        self._reset_parameters()

    @classmethod
    def state_shapes(cls, config: dict[str, Any], persistent: bool = True) -> dict[str, tuple[int, ...]]:
        """{name: shape} of `Seq2SeqTransformer(**config).state_dict()` from the config alone
        (config holds every constructor argument), building nothing; persistent=False adds the
        non-persistent buffers (named as in named_buffers)."""
        owner = cls.__name__
        check_choice(config["positional"], POSITIONAL, "positional", owner)
        tie, shared = sharing(config.get("tie_weights"), config.get("share_embeddings", False), owner)
        check_d_model_nhead(config["d_model"], config["nhead"], owner)
        src_vocab, tgt_vocab, max_len, encoder_layers, decoder_layers, dim_feedforward = dims(
            config, ("src_vocab_size", "tgt_vocab_size", "max_len", "num_encoder_layers", "num_decoder_layers",
                     "dim_feedforward"), owner)
        d_model, positional = config["d_model"], config["positional"]
        shapes = {} if shared else {"src_embed.weight": (src_vocab, d_model)}
        shapes["tgt_embed.weight"] = (tgt_vocab, d_model)
        if positional == "learned":
            shapes["src_pos_embed.weight"] = shapes["tgt_pos_embed.weight"] = (max_len, d_model)
        elif positional == "sinusoidal" and not persistent:
            shapes["positional.pe"] = (max_len, d_model)
        shapes.update(stack_shapes("transformer.encoder", encoder_layers, d_model, dim_feedforward, False))
        shapes.update(stack_shapes("transformer.decoder", decoder_layers, d_model, dim_feedforward, True))
        if not tie:
            shapes["generator.weight"] = (tgt_vocab, d_model)
        shapes["generator.bias"] = (tgt_vocab,)
        return shapes

    def _reset_parameters(self):
        for p in self.parameters():
            if p.ndim > 1:
                init.xavier_uniform_(p)
        for embed in (self.src_embed, self.tgt_embed):
            embed.zero_padding_row()

    def _positions(self, side):
        """The additive position module of "src" or "tgt" (None for rope/none)."""
        if self.positional_kind == "learned":
            return getattr(self, f"{side}_pos_embed")
        return getattr(self, "positional", None)

    def _embed(self, ids, side, offset=0):
        """dropout(embed(ids) * sqrt(d_model) + positions[offset:offset+T]) -> (B, T, d)."""
        x = getattr(self, f"{side}_embed")(ids) * math.sqrt(self.d_model)
        positions = self._positions(side)
        if positions is not None:
            x = positions(x, offset)
        return self.dropout(x)

    def project(self, hidden: Tensor) -> Tensor:
        """Decoder output (..., d) -> logits (..., tgt_vocab_size)."""
        weight = self.tgt_embed.weight if self.tie_weights else self.generator.weight
        if self.generator._module_hooks:  # its hooks around the projection (tied: with tgt_embed's weight)
            return module_hooks.call_with_hooks(self.generator, (hidden,), {},
                                                forward=lambda x: F.linear(x, weight, self.generator.bias))
        return F.linear(hidden, weight, self.generator.bias)

    def _ids(self, ids, side):
        """`side` ("src" or "tgt") ids checked against that side's vocabulary and positional table."""
        max_len = getattr(self._positions(side), "max_len", None)
        return token_ids(ids, getattr(self, f"{side}_embed"), type(self).__name__, side, max_len)

    def forward(self, src: ArrayLike, tgt: ArrayLike, src_key_padding_mask: ArrayLike | None = None,
                tgt_key_padding_mask: ArrayLike | None = None) -> Tensor:
        """src (B, S), tgt (B, T) integer ids -> next-token logits (B, T, tgt_vocab_size): the
        encoder over src, the causal decoder over tgt and the memory, the generator. Masks (B, S),
        (B, T) bool with True = padding (derived from pad_idx when not given)."""
        src, tgt = self._ids(src, "src"), self._ids(tgt, "tgt")
        if src.shape[0] != tgt.shape[0]:
            raise ValueError(f"Seq2SeqTransformer: src and tgt batch sizes differ: {src.shape[0]} vs {tgt.shape[0]}")
        src_key_padding_mask = padding_mask_from_ids(src, self.pad_idx, src_key_padding_mask)
        if self.transformer._module_hooks:  # the nn.Transformer called as a module, so that its hooks run
            tgt_key_padding_mask = padding_mask_from_ids(tgt, self.pad_idx, tgt_key_padding_mask)
            return self.project(self.transformer(
                self._embed(src, "src"), self._embed(tgt, "tgt"), src_key_padding_mask=src_key_padding_mask,
                tgt_key_padding_mask=tgt_key_padding_mask, memory_key_padding_mask=src_key_padding_mask,
                tgt_is_causal=True))
        memory = self.encode(src, src_key_padding_mask)
        return self.decode(tgt, memory, memory_key_padding_mask=src_key_padding_mask,
                           tgt_key_padding_mask=tgt_key_padding_mask)

    def encode(self, src: ArrayLike, src_key_padding_mask: ArrayLike | None = None) -> Tensor:
        """src ids (B, S) -> memory (B, S, d_model) (after the encoder's final norm)."""
        src = self._ids(src, "src")
        src_key_padding_mask = padding_mask_from_ids(src, self.pad_idx, src_key_padding_mask)
        return self.transformer.encoder(self._embed(src, "src"), src_key_padding_mask=src_key_padding_mask)

    def decode(self, tgt: ArrayLike, memory: Tensor, memory_key_padding_mask: ArrayLike | None = None,
               tgt_key_padding_mask: ArrayLike | None = None) -> Tensor:
        """tgt ids (B, T), memory (B, S, d) -> logits (B, T, V), causal. The memory padding mask
        (B, S) cannot be derived here: pass the source padding mask."""
        tgt = self._ids(tgt, "tgt")
        tgt_key_padding_mask = padding_mask_from_ids(tgt, self.pad_idx, tgt_key_padding_mask)
        hidden = self.transformer.decoder(self._embed(tgt, "tgt"), memory, tgt_key_padding_mask=tgt_key_padding_mask,
                                          memory_key_padding_mask=memory_key_padding_mask, tgt_is_causal=True)
        return self.project(hidden)

    # -- cached step-wise decoding ------------------------------------------------------------------
    def init_cache(self, memory: Tensor, memory_key_padding_mask: ArrayLike | None = None) -> nn.DecoderCache:
        """An `nn.DecoderCache` for `memory` (B, S, d): every decoder layer's cross-attention keys
        and values are projected here, once. memory_key_padding_mask (B, S), True = padding."""
        return self.transformer.decoder.init_cache(memory, memory_key_padding_mask)

    def decode_step(self, tokens: ArrayLike, cache: nn.DecoderCache) -> Tensor:
        """tokens (B,) ints: the newest target token of each row (the first call gets BOS) ->
        logits (B, tgt_vocab_size) for the next token. Appends this position's self-attention
        keys/values to `cache`; equals decode(prefix, memory)[:, -1] on the whole prefix, with
        every prefix token a token (an id equal to pad_idx too: pass decode an all-False
        tgt_key_padding_mask to compare)."""
        owner = "Seq2SeqTransformer.decode_step"
        if not isinstance(cache, nn.DecoderCache):
            raise TypeError(f"{owner}: cache must come from init_cache, got {type(cache).__name__}")
        ids = as_ids(tokens, self.tgt_embed.weight.data, owner, "tokens")
        if ids.ndim != 1:
            raise ValueError(f"{owner}: tokens must be a 1-D array (batch,) of ids, got shape {ids.shape}")
        ids = token_ids(ids.reshape(-1, 1), self.tgt_embed, owner, "tokens")           # (B, 1)
        decoder, x = self.transformer.decoder, self._embed(ids, "tgt", offset=cache.length)
        if decoder._module_hooks:  # its hooks around step, seeing the args (tgt, memory) of the new position
            hidden = module_hooks.call_with_hooks(decoder, (x, cache.memory), {"cache": cache},
                                                  forward=lambda tgt, memory, cache: decoder.step(tgt, cache))
        else:
            hidden = decoder.step(x, cache)
        return self.project(hidden).reshape(ids.shape[0], -1)                       # (B, V)
