"""Pieces shared by the models: argument checks, token ids, padding masks, positions."""
from autograd import Tensor, backend

from .. import nn
from ..nn import LearnedPositionalEmbedding, SinusoidalPositionalEncoding, init
from ..nn.layers import as_ids, check_positive_int
from ..nn.transformer import check_d_model_nhead

POSITIONAL = ("sinusoidal", "learned", "rope", "none")


def check_choice(value, choices, name, owner):
    if value not in choices:
        raise ValueError(f"{owner}: {name} must be one of {choices}, got {value!r}")
    return value


def additive_positions(positional, d_model, max_len):
    """The module adding positions to embeddings: sinusoidal (no state_dict entries), learned
    (one weight (max_len, d_model)), or None for "rope" (applied inside attention) and "none"."""
    if positional == "sinusoidal":
        return SinusoidalPositionalEncoding(d_model, max_len)
    if positional == "learned":
        return LearnedPositionalEmbedding(max_len, d_model)
    return None


# -- state_dict shapes from a config, without building anything (load_model checks a file with them) --
def dims(config, names, owner):
    """config[name] for each name, each checked to be a positive int."""
    return [check_positive_int(config[name], name, owner) for name in names]


def layer_norm_shapes(prefix, d_model):
    return {f"{prefix}.weight": (d_model,), f"{prefix}.bias": (d_model,)}


def linear_shapes(prefix, in_features, out_features, bias=True):
    shapes = {f"{prefix}.weight": (out_features, in_features)}
    if bias:
        shapes[f"{prefix}.bias"] = (out_features,)
    return shapes


def stack_shapes(prefix, num_layers, d_model, dim_feedforward, cross_attention):
    """nn.TransformerEncoder (cross_attention=False) or nn.TransformerDecoder with its final norm."""
    shapes = {}
    for i in range(num_layers):
        layer = f"{prefix}.layers.{i}"
        for attention in ("self_attn", "multihead_attn") if cross_attention else ("self_attn",):
            shapes[f"{layer}.{attention}.in_proj_weight"] = (3 * d_model, d_model)
            shapes[f"{layer}.{attention}.in_proj_bias"] = (3 * d_model,)
            shapes.update(linear_shapes(f"{layer}.{attention}.out_proj", d_model, d_model))
        shapes.update(linear_shapes(f"{layer}.linear1", d_model, dim_feedforward))
        shapes.update(linear_shapes(f"{layer}.linear2", dim_feedforward, d_model))
        for norm in ("norm1", "norm2", "norm3") if cross_attention else ("norm1", "norm2"):
            shapes.update(layer_norm_shapes(f"{layer}.{norm}", d_model))
    shapes.update(layer_norm_shapes(f"{prefix}.norm", d_model))
    return shapes


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
    mask = backend.to_device(mask if backend.is_array(mask) else xp.asarray(mask), backend.device_of(ids))
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
        check_d_model_nhead(d_model, nhead, owner)
        self.d_model, self.pad_idx, self.positional_kind = d_model, pad_idx, positional
        self.tok_embed = nn.Embedding(vocab_size, d_model, padding_idx=pad_idx)
        positions = additive_positions(positional, d_model, max_len)
        if positions is not None:
            setattr(self, "pos_embed" if positional == "learned" else "positional", positions)
        self.dropout = nn.Dropout(dropout)
        layer = nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward, dropout, activation, layer_norm_eps,
                                           norm_first=norm_first, rotary=positional == "rope")
        self.encoder = nn.TransformerEncoder(layer, num_layers, nn.LayerNorm(d_model, eps=layer_norm_eps))

    @staticmethod
    def _trunk_shapes(config, owner, persistent):
        """state_dict shapes of the trunk built by _build_trunk from `config` (with
        persistent=False also the sinusoidal table, a non-persistent buffer)."""
        check_choice(config["positional"], POSITIONAL, "positional", owner)
        check_d_model_nhead(config["d_model"], config["nhead"], owner)
        vocab_size, max_len, num_layers, dim_feedforward = dims(
            config, ("vocab_size", "max_len", "num_layers", "dim_feedforward"), owner)
        d_model = config["d_model"]
        shapes = {"tok_embed.weight": (vocab_size, d_model)}
        if config["positional"] == "learned":
            shapes["pos_embed.weight"] = (max_len, d_model)
        elif config["positional"] == "sinusoidal" and not persistent:
            shapes["positional.pe"] = (max_len, d_model)
        shapes.update(stack_shapes("encoder", num_layers, d_model, dim_feedforward, cross_attention=False))
        return shapes

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
