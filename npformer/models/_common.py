"""Pieces shared by the models: argument checks, token ids, padding masks, positions, the encoder trunk."""
from __future__ import annotations

import dataclasses
import math

from autograd import Tensor, backend, raw_computation
from autograd.backend import Array, ArrayLike
from autograd.checks import as_array, check_bool, check_int, check_optional_int, check_real

from .. import nn
from ..functional._common import check_index_range
from ..functional.rotary import check_rope_scaling
from ..nn import LearnedPositionalEmbedding, SinusoidalPositionalEncoding, init
from ..nn.layers import as_ids
from ..nn.config import NORMS, TransformerConfig, check_d_model_nhead, check_num_kv_heads
from ..nn.hook_points import HookedModel

POSITIONAL = ("sinusoidal", "learned", "rope", "none")
ACTIVATIONS = ("relu", "gelu", "gelu_tanh")
CAUSAL_ACTIVATIONS = ACTIVATIONS + ("silu", "swiglu")  # CausalLM's (swiglu: a gated feed-forward, linear3)
RESIDUAL_INITS = ("normal", "gpt2")
# the layer options of a model's config beyond the original ones (CausalLM's), passed on to
# TransformerConfig under these names: {name: its default there}
LAYER_OPTIONS = {f.name: f.default for f in dataclasses.fields(TransformerConfig)
                 if f.name in ("bias", "norm", "num_kv_heads", "sliding_window", "qkv_bias", "rotary_base",
                               "rope_scaling")}


def check_choice(value, choices, name, owner):
    if value not in choices:
        raise ValueError(f"{owner}: {name} must be one of {choices}, got {value!r}")
    return value


_SIZES = ("vocab_size", "src_vocab_size", "tgt_vocab_size", "num_classes", "d_model", "nhead", "num_layers",
          "num_encoder_layers", "num_decoder_layers", "dim_feedforward", "max_len")
_RATES = ("attention_dropout", "activation_dropout", "classifier_dropout")  # optional (None: `dropout`)
_FLAGS = ("norm_first", "tie_weights", "share_embeddings", "embed_norm", "final_norm", "pooler")


def check_config(config, owner):
    """A model's constructor arguments with every number checked and made a plain int or float
    (so the config stays JSON-serialisable): sizes integers >= 1, type_vocab_size >= 0,
    dropout rates in [0, 1], layer_norm_eps > 0, pad_idx None or an id of every vocabulary,
    flags (norm_first, tie_weights, ...) True or False (plain bools)."""
    config = dict(config)
    for name in _SIZES:
        if name in config:
            config[name] = check_int(config[name], name, owner, at_least=1)
    for name in _FLAGS:
        if name in config:
            config[name] = check_bool(config[name], name, owner)
    if "type_vocab_size" in config:
        config["type_vocab_size"] = _type_vocab_size(config, owner)
    for name in ("dropout",) + _RATES:
        if config.get(name) is not None:
            config[name] = check_real(config[name], name, owner, at_least=0, at_most=1)
    config["layer_norm_eps"] = check_real(config["layer_norm_eps"], "layer_norm_eps", owner, above=0)
    config.update(check_layer_options(config, owner))
    vocab = min(config[name] for name in ("vocab_size", "src_vocab_size", "tgt_vocab_size") if name in config)
    config["pad_idx"] = check_optional_int(config["pad_idx"], "pad_idx", owner, at_least=0, at_most=vocab - 1)
    return config


def check_layer_options(config, owner):
    """{option: checked value} of the layer options in `config` (those of LAYER_OPTIONS,
    rope_scaling and residual_init that it holds; absent ones stay absent): bias a bool, norm
    in NORMS, num_kv_heads None or an int >= 1 dividing nhead, sliding_window None or an int
    >= 1, qkv_bias None or a bool, rotary_base > 0, rope_scaling None or a dict
    (functional.rotary.check_rope_scaling), residual_init in RESIDUAL_INITS. rotary_base and
    rope_scaling only act on positional="rope": set for other positions they are refused
    rather than ignored."""
    out = {}
    if "bias" in config:
        out["bias"] = check_bool(config["bias"], "bias", owner)
    if "qkv_bias" in config and config["qkv_bias"] is not None:
        out["qkv_bias"] = check_bool(config["qkv_bias"], "qkv_bias (None: the value of bias)", owner)
    if "norm" in config:
        out["norm"] = check_choice(config["norm"], NORMS, "norm", owner)
    if "residual_init" in config:
        out["residual_init"] = check_choice(config["residual_init"], RESIDUAL_INITS, "residual_init", owner)
    if "sliding_window" in config:
        out["sliding_window"] = check_optional_int(config["sliding_window"], "sliding_window", owner, at_least=1)
    if config.get("num_kv_heads") is not None:
        nhead = check_int(config["nhead"], "nhead", owner, at_least=1)
        out["num_kv_heads"] = check_num_kv_heads(nhead, config["num_kv_heads"], owner)
    if "rotary_base" in config:
        out["rotary_base"] = check_real(config["rotary_base"], "rotary_base", owner, above=0)
    if "rope_scaling" in config:
        out["rope_scaling"] = check_rope_scaling(config["rope_scaling"], owner)
    if config.get("positional") != "rope":
        for name in ("rotary_base", "rope_scaling"):
            default = LAYER_OPTIONS[name]
            if out.get(name, default) != default:
                raise ValueError(f"{owner}: {name}={out[name]!r} only acts on rotary positions, but "
                                 f"positional={config.get('positional')!r}; use positional='rope' or leave {name} "
                                 f"at {default!r}")
    return out


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
    """config[name] for each name, each checked to be an integer >= 1."""
    return [check_int(config[name], name, owner, at_least=1) for name in names]


def layer_norm_shapes(prefix, d_model, bias=True, norm="layernorm"):
    """A LayerNorm's weight and bias (none with bias=False), or an RMSNorm's weight (norm="rmsnorm")."""
    shapes = {f"{prefix}.weight": (d_model,)}
    if bias and norm == "layernorm":
        shapes[f"{prefix}.bias"] = (d_model,)
    return shapes


def linear_shapes(prefix, in_features, out_features, bias=True):
    shapes = {f"{prefix}.weight": (out_features, in_features)}
    if bias:
        shapes[f"{prefix}.bias"] = (out_features,)
    return shapes


def stack_shapes(prefix, num_layers, d_model, dim_feedforward, cross_attention, final_norm=True, *, nhead=1,
                 bias=True, norm="layernorm", num_kv_heads=None, qkv_bias=None, gated=False):
    """nn.TransformerEncoder (cross_attention=False) or nn.TransformerDecoder, with its final
    norm when final_norm. bias: the linears' and LayerNorms' biases (qkv_bias, None = bias: the
    packed in_proj's); norm: "layernorm" or "rmsnorm" (no bias); num_kv_heads (None = nhead):
    in_proj packs nhead query heads and num_kv_heads key and value heads of d_model / nhead;
    gated: a SwiGLU feed-forward (linear3 beside linear1)."""
    shapes = {}
    qkv_bias = bias if qkv_bias is None else qkv_bias
    head_dim = d_model // nhead
    packed = (nhead + 2 * (nhead if num_kv_heads is None else num_kv_heads)) * head_dim
    for i in range(num_layers):
        layer = f"{prefix}.layers.{i}"
        for attention in ("self_attn", "multihead_attn") if cross_attention else ("self_attn",):
            shapes[f"{layer}.{attention}.in_proj_weight"] = (packed, d_model)
            if qkv_bias:
                shapes[f"{layer}.{attention}.in_proj_bias"] = (packed,)
            shapes.update(linear_shapes(f"{layer}.{attention}.out_proj", d_model, d_model, bias))
        shapes.update(linear_shapes(f"{layer}.linear1", d_model, dim_feedforward, bias))
        if gated:
            shapes.update(linear_shapes(f"{layer}.linear3", d_model, dim_feedforward, bias))
        shapes.update(linear_shapes(f"{layer}.linear2", dim_feedforward, d_model, bias))
        for name in ("norm1", "norm2", "norm3") if cross_attention else ("norm1", "norm2"):
            shapes.update(layer_norm_shapes(f"{layer}.{name}", d_model, bias, norm))
    if final_norm:
        shapes.update(layer_norm_shapes(f"{prefix}.norm", d_model, bias, norm))
    return shapes


def token_ids(ids, embedding, owner, name, max_len=None):
    """Integer ids (B, T) (numpy/cupy array, list or Tensor) on the device of `embedding`, checked
    against its vocabulary (host ids before their copy to the device, device ids on the device:
    npformer.runtime.deferred) and, when given, the length of the positional table."""
    raw = ids.data if isinstance(ids, Tensor) else ids
    host = backend.module_for("cpu").empty(0)
    raw = as_ids(raw, raw if backend.is_array(raw) else host, owner, name)  # integer ids where they are (lists: host)
    if raw.ndim != 2 or 0 in raw.shape:
        raise ValueError(f"{owner}: {name} must be a non-empty (batch, seq) array of token ids, got shape {raw.shape}")
    vocab = embedding.num_embeddings
    check_index_range(raw, vocab, lambda lo, hi: IndexError(
        f"{owner}: {name} token ids must be in [0, {vocab - 1}] (vocabulary size {vocab}), got min {lo} and max {hi}"))
    if max_len is not None and raw.shape[1] > max_len:
        raise ValueError(f"{owner}: {name} has {raw.shape[1]} positions but max_len={max_len}; shorten it or "
                         f"build the model with a larger max_len")
    return backend.to_device(raw, backend.device_of(embedding.weight.data))


def padding_mask_from_ids(ids, pad_idx, mask):
    """`mask` when given, else ids == pad_idx (True = padding) when pad_idx is set, else None."""
    if mask is not None or pad_idx is None:
        return mask
    return raw_computation(backend.get_array_module(ids).equal, ids, pad_idx)  # again at each replay


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


def attention_settings(memory_efficient, block_size, attention_backend):
    """A model's keyword arguments on how attention runs (not stored in the model's config: like
    Hugging Face's attn_implementation) as the dict `attention` of transformer_config, which checks them."""
    return dict(memory_efficient=memory_efficient, block_size=block_size, attention_backend=attention_backend)


def transformer_config(config, owner, attention, **layers):
    """The TransformerConfig of a model: its config dict's architecture settings (checked by
    check_config), `layers` (num_encoder_layers / num_decoder_layers) and `attention`, the
    model's keyword arguments memory_efficient, block_size and attention_backend (how attention
    runs, not stored in the model's config: like Hugging Face's attn_implementation), as
    attention_settings gives them."""
    c = config
    # LAYER_OPTIONS the config sets to other than TransformerConfig's defaults (a default is the default)
    options = {name: c[name] for name, default in LAYER_OPTIONS.items() if c.get(name, default) != default}
    return TransformerConfig.from_arguments(
        None, owner, d_model=c["d_model"], nhead=c["nhead"], dim_feedforward=c["dim_feedforward"],
        dropout=c["dropout"], attention_dropout=c.get("attention_dropout"),
        activation_dropout=c.get("activation_dropout"), activation=c["activation"],
        layer_norm_eps=c["layer_norm_eps"], norm_first=c["norm_first"], rotary=c["positional"] == "rope",
        **options, **layers, **attention)


def _type_vocab_size(config, owner):
    """config's type_vocab_size (default 0: no token types) as an integer >= 0."""
    return check_int(config.get("type_vocab_size", 0), "type_vocab_size (0: no token types)", owner, at_least=0)


class EncoderOnlyModel(nn.Module, HookedModel):
    """Token embedding (+ token-type embedding) + positions (+ LayerNorm) + dropout + a
    TransformerEncoder (with a final norm unless final_norm=False: LayerNorm, or RMSNorm with
    config norm="rmsnorm", as the layers' own): the trunk of CausalLM,
    BidirectionalEncoder and EncoderClassifier, built from the model's `config` dict.

    state_dict keys: tok_embed.weight, pos_embed.weight (positional="learned" only),
    type_embed.weight (type_vocab_size > 0), embed_norm.* (embed_norm=True),
    encoder.layers.{i}.*, encoder.norm.* (final_norm=True).
    Dropout: `dropout` on the embeddings and on each sublayer's output before the residual
    add; `attention_dropout` on the attention probabilities and `activation_dropout` between
    the feed-forward activation and its second linear (both default to `dropout`, as in
    torch.nn.TransformerEncoderLayer; GPT-2 and BERT have activation_dropout=0).
    Init: N(0, 0.02^2) on every parameter matrix, other biases zero, LayerNorm 1/0,
    the padding row zero.
    `activations`: the activation names the model takes. Named hook points (run_with_cache,
    run_with_hooks; docs/hook_points.md) on every layer and norm."""

    activations = ACTIVATIONS

    def _build_trunk(self, config, attention):
        """Build the trunk from `config` (the model's config dict), whose numbers are checked
        and made plain ints and floats in place first (check_config), and `attention` (the
        model's memory_efficient, block_size, attention_backend: see transformer_config)."""
        owner = type(self).__name__
        config.update(check_config(config, owner))
        c = config
        check_choice(c["positional"], POSITIONAL, "positional", owner)
        check_choice(c["activation"], self.activations, "activation", owner)
        check_d_model_nhead(c["d_model"], c["nhead"], owner)
        type_vocab_size = c.get("type_vocab_size", 0)
        d_model, eps = c["d_model"], c["layer_norm_eps"]
        self.d_model, self.pad_idx, self.positional_kind = d_model, c["pad_idx"], c["positional"]
        self.tok_embed = nn.Embedding(c["vocab_size"], d_model, padding_idx=c["pad_idx"])
        positions = additive_positions(c["positional"], d_model, c["max_len"])
        if positions is not None:
            setattr(self, "pos_embed" if c["positional"] == "learned" else "positional", positions)
        if type_vocab_size:
            self.type_embed = nn.Embedding(type_vocab_size, d_model)
        if c.get("embed_norm", False):
            self.embed_norm = nn.LayerNorm(d_model, eps=eps)
        self.dropout = nn.Dropout(c["dropout"])
        self.transformer_config = transformer_config(c, owner, attention, num_encoder_layers=c["num_layers"],
                                                     num_decoder_layers=0)
        layer = nn.TransformerEncoderLayer(config=self.transformer_config)
        norm = nn.make_norm(self.transformer_config) if c.get("final_norm", True) else None  # follows `norm`
        self.encoder = nn.TransformerEncoder(layer, c["num_layers"], norm)

    @staticmethod
    def _trunk_shapes(config, owner, persistent):
        """state_dict shapes of the trunk that _build_trunk builds from `config` (with
        persistent=False also the sinusoidal table, a non-persistent buffer)."""
        c = dict(config, **check_layer_options(config, owner))
        check_choice(c["positional"], POSITIONAL, "positional", owner)
        check_d_model_nhead(c["d_model"], c["nhead"], owner)
        vocab_size, max_len, num_layers, dim_feedforward = dims(
            c, ("vocab_size", "max_len", "num_layers", "dim_feedforward"), owner)
        d_model, type_vocab_size = c["d_model"], _type_vocab_size(c, owner)
        shapes = {"tok_embed.weight": (vocab_size, d_model)}
        if c["positional"] == "learned":
            shapes["pos_embed.weight"] = (max_len, d_model)
        elif c["positional"] == "sinusoidal" and not persistent:
            shapes["positional.pe"] = (max_len, d_model)
        if type_vocab_size:
            shapes["type_embed.weight"] = (type_vocab_size, d_model)
        if c.get("embed_norm", False):
            shapes.update(layer_norm_shapes("embed_norm", d_model))
        shapes.update(stack_shapes("encoder", num_layers, d_model, dim_feedforward, cross_attention=False,
                                   final_norm=c.get("final_norm", True), nhead=c["nhead"],
                                   bias=c.get("bias", True), norm=c.get("norm", "layernorm"),
                                   num_kv_heads=c.get("num_kv_heads"), qkv_bias=c.get("qkv_bias"),
                                   gated=c["activation"] == "swiglu"))
        return shapes

    def _reset_parameters(self):
        """N(0, 0.02^2) on every matrix, zero biases (norms keep their ones); with
        config residual_init="gpt2" each layer's residual projections (self_attn.out_proj.weight
        and linear2.weight) at std 0.02 / sqrt(2 num_layers), as GPT-2 and nanoGPT."""
        residual_std = None
        if self.config.get("residual_init", "normal") == "gpt2":
            residual_std = 0.02 / math.sqrt(2 * self.config["num_layers"])
        for name, p in self.named_parameters():
            if p.ndim > 1:
                residual = name.endswith((".self_attn.out_proj.weight", ".linear2.weight"))
                init.normal_(p, std=residual_std if residual and residual_std is not None else 0.02)
            elif name.endswith("bias"):
                init.zeros_(p)
        self.tok_embed.zero_padding_row()

    def _positions(self):
        return getattr(self, "pos_embed", None) or getattr(self, "positional", None)

    def _ids(self, ids, name="input_ids"):
        return token_ids(ids, self.tok_embed, type(self).__name__, name, getattr(self._positions(), "max_len", None))

    def _type_ids(self, token_type_ids, ids):
        """token_type_ids (B, T) checked against ids and the token-type vocabulary; zeros when None."""
        type_embed = getattr(self, "type_embed", None)
        owner = type(self).__name__
        if type_embed is None:
            if token_type_ids is not None:
                raise ValueError(f"{owner}: token_type_ids given but the model has no token-type embedding "
                                 f"(build it with type_vocab_size > 0)")
            return None
        if token_type_ids is None:
            return backend.get_array_module(ids).zeros(ids.shape, dtype=ids.dtype)
        types = token_ids(token_type_ids, type_embed, owner, "token_type_ids")
        if types.shape != ids.shape:
            raise ValueError(f"{owner}: token_type_ids must have the shape of input_ids {ids.shape}, "
                             f"got {types.shape}")
        return types

    def embed(self, ids: Array, token_type_ids: ArrayLike | None = None, offset: int = 0,
              position_ids: ArrayLike | None = None) -> Tensor:
        """ids (B, T) integer array -> (B, T, d_model): dropout of word (+ token type) + position
        embeddings (+ LayerNorm). Positions offset .. offset + T - 1, or position_ids (B, T)
        (per row, e.g. after left padding); with positional="rope" (or "none") no positions are
        added here: RoPE applies them in attention (hidden_states passes position_ids on)."""
        x = self.tok_embed(ids)                                                     # (B, T, d)
        types = self._type_ids(token_type_ids, ids)
        if types is not None:
            x = x + self.type_embed(types)
        positions = self._positions()
        if positions is not None:
            x = positions(x, offset, position_ids)
        embed_norm = getattr(self, "embed_norm", None)
        if embed_norm is not None:
            x = embed_norm(x)
        return self.dropout(x)

    def hidden_states(self, ids: Array, key_padding_mask: ArrayLike | None = None, is_causal: bool = False,
                      token_type_ids: ArrayLike | None = None, position_ids: ArrayLike | None = None) -> Tensor:
        """ids (B, T) integer array -> (B, T, d_model): `embed`, then the encoder (+ its final
        LayerNorm); position_ids (B, T) or (T,) go to the positional table, or to RoPE in attention."""
        x = self.embed(ids, token_type_ids, position_ids=position_ids)
        rope_positions = position_ids if self.positional_kind == "rope" else None
        return self.encoder(x, src_key_padding_mask=key_padding_mask, is_causal=is_causal,
                            position_ids=rope_positions)
