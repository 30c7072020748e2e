"""Pieces shared by the models: argument checks, token ids, padding masks, positions."""
from autograd import Tensor, backend
from autograd.checks import as_array, check_int, check_optional_int, check_real

from .. import nn
from ..nn import LearnedPositionalEmbedding, SinusoidalPositionalEncoding, init
from ..nn.layers import as_ids
from ..nn.transformer import check_d_model_nhead

POSITIONAL = ("sinusoidal", "learned", "rope", "none")


def check_choice(value, choices, name, owner):
    if value not in choices:
        raise ValueError(f"{owner}: {name} must be one of {choices}, got {value!r}")
    return value


_SIZES = ("vocab_size", "src_vocab_size", "tgt_vocab_size", "num_classes", "d_model", "nhead", "num_layers",
          "num_encoder_layers", "num_decoder_layers", "dim_feedforward", "max_len")


def check_config(config, owner):
    """A model's constructor arguments with every number checked and made a plain int or float
    (so the config stays JSON-serialisable): sizes integers >= 1, dropout in [0, 1],
    layer_norm_eps > 0, pad_idx None or an id of every vocabulary."""
    config = dict(config)
    for name in _SIZES:
        if name in config:
            config[name] = check_int(config[name], name, owner, at_least=1)
    config["dropout"] = check_real(config["dropout"], "dropout", owner, at_least=0, at_most=1)
    config["layer_norm_eps"] = check_real(config["layer_norm_eps"], "layer_norm_eps", owner, above=0)
    vocab = min(config[name] for name in ("vocab_size", "src_vocab_size", "tgt_vocab_size") if name in config)
    config["pad_idx"] = check_optional_int(config["pad_idx"], "pad_idx", owner, at_least=0, at_most=vocab - 1)
    return config


def additive_positions(positional, d_model, max_len):
    """The module adding positions to embeddings: sinusoidal (no state_dict entries), learned
    (one weight (max_len, d_model)), or None for "rope" (applied inside attention) and "none"."""
    if positional == "sinusoidal":
        return SinusoidalPositionalEncoding(d_model, max_len)
    if positional == "learned":
        return LearnedPositionalEmbedding(max_len, d_model)
    return None


def token_ids(ids, embedding, owner, name, max_len=None):
    """Integer ids (B, T) (numpy/cupy array, list or Tensor) on the device of `embedding`, checked
    against its vocabulary and, when given, the length of the positional table."""
    ids = as_ids(ids, embedding.weight.data, owner, name)
    if ids.ndim != 2 or 0 in ids.shape:
        raise ValueError(f"{owner}: {name} must be a non-empty (batch, seq) array of token ids, got shape {ids.shape}")
    vocab = embedding.num_embeddings
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab:
        raise IndexError(f"{owner}: {name} token ids must be in [0, {vocab - 1}] (vocabulary size {vocab}), "
                         f"got min {lo} and max {hi}")
    if max_len is not None and ids.shape[1] > max_len:
        raise ValueError(f"{owner}: {name} has {ids.shape[1]} positions but max_len={max_len}; shorten it or "
                         f"build the model with a larger max_len")
    return ids


def padding_mask_from_ids(ids, pad_idx, mask):
    """`mask` when given, else ids == pad_idx (True = padding) when pad_idx is set, else None."""
    if mask is not None or pad_idx is None:
        return mask
    return ids == pad_idx


def valid_positions(mask, ids, dtype):
    """(B, T) array, 1 where a position is not padding (from a bool key padding mask), in `dtype`."""
    xp = backend.get_array_module(ids)
    if mask is None:
        return xp.ones(ids.shape, dtype=dtype)
    mask = mask.data if isinstance(mask, Tensor) else mask
    mask = mask if backend.is_array(mask) else as_array(mask, "key_padding_mask", "EncoderClassifier", xp)
    mask = backend.to_device(mask, backend.device_of(ids))
    if mask.dtype != bool or mask.shape != ids.shape:
        raise ValueError(f"key_padding_mask must be a bool array of shape {ids.shape} for pooling, "
                         f"got {mask.dtype} {mask.shape}")
    return (~mask).astype(dtype)


class EncoderOnlyModel(nn.Module):
    """Token embedding + positions + dropout + a TransformerEncoder with a final LayerNorm:
    the trunk of CausalLM and EncoderClassifier. state_dict keys: tok_embed.weight,
    pos_embed.weight (positional="learned" only), encoder.layers.{i}.*, encoder.norm.*.
    Init: N(0, 0.02^2) on every parameter matrix, other biases zero, LayerNorm 1/0,
    the padding row zero."""

    def _build_trunk(self, vocab_size, d_model, nhead, num_layers, dim_feedforward, dropout, max_len, activation,
                     norm_first, positional, pad_idx, layer_norm_eps):
        owner = type(self).__name__
        check_choice(positional, POSITIONAL, "positional", owner)
        check_choice(activation, ("relu", "gelu"), "activation", owner)
        d_model, nhead = check_d_model_nhead(d_model, nhead, owner)
        self.d_model, self.pad_idx, self.positional_kind = d_model, pad_idx, positional
        self.tok_embed = nn.Embedding(vocab_size, d_model, padding_idx=pad_idx)
        positions = additive_positions(positional, d_model, max_len)
        if positions is not None:
            setattr(self, "pos_embed" if positional == "learned" else "positional", positions)
        self.dropout = nn.Dropout(dropout)
        layer = nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward, dropout, activation, layer_norm_eps,
                                           norm_first=norm_first, rotary=positional == "rope")
        self.encoder = nn.TransformerEncoder(layer, num_layers, nn.LayerNorm(d_model, eps=layer_norm_eps))

    def _reset_parameters(self):
        for name, p in self.named_parameters():
            if p.ndim > 1:
                init.normal_(p, std=0.02)
            elif name.endswith("bias"):
                init.zeros_(p)
        self.tok_embed.zero_padding_row()

    def _ids(self, ids, name="input_ids"):
        positions = getattr(self, "pos_embed", None) or getattr(self, "positional", None)
        return token_ids(ids, self.tok_embed, type(self).__name__, name, getattr(positions, "max_len", None))

    def hidden_states(self, ids, key_padding_mask=None, is_causal=False):
        """ids (B, T) integer array -> (B, T, d_model) after the final LayerNorm."""
        x = self.tok_embed(ids)
        positions = getattr(self, "pos_embed", None) or getattr(self, "positional", None)
        if positions is not None:
            x = positions(x)
        return self.encoder(self.dropout(x), src_key_padding_mask=key_padding_mask, is_causal=is_causal)
