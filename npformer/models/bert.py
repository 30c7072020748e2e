"""Encoder-only (BERT-style) models: a bidirectional encoder with a pooled output, and a
sequence classifier on top of it."""
from __future__ import annotations

from typing import Any

from autograd import Tensor
from autograd.backend import ArrayLike

from .. import nn
from ._common import (EncoderOnlyModel, attention_settings, check_choice, dims, linear_shapes, padding_mask_from_ids,
                      valid_positions)


class PooledEncoder(EncoderOnlyModel):
    """The trunk (see EncoderOnlyModel) plus pooling: what BidirectionalEncoder and
    EncoderClassifier share."""

    def _build_pooled_encoder(self, config, attention):
        check_choice(config["pooling"], ("mean", "first"), "pooling", type(self).__name__)
        self._build_trunk(config, attention)
        self.pooling = config["pooling"]
        if config["pooler"]:
            self.pooler = nn.Linear(config["d_model"], config["d_model"])

    @classmethod
    def state_shapes(cls, config: dict[str, Any], persistent: bool = True) -> dict[str, tuple[int, ...]]:
        """{name: shape} of `cls(**config).state_dict()` from the config alone (config holds every
        constructor argument), building nothing; persistent=False adds the non-persistent
        buffers (named as in named_buffers)."""
        shapes = cls._trunk_shapes(config, cls.__name__, persistent)
        if config["pooler"]:
            shapes.update(linear_shapes("pooler", config["d_model"], config["d_model"]))
        return shapes

    def encode(self, input_ids: ArrayLike, key_padding_mask: ArrayLike | None = None,
               token_type_ids: ArrayLike | None = None) -> tuple[Tensor, Tensor]:
        """input_ids (B, T) ints; key_padding_mask (B, T) bool, True = padding (derived from
        pad_idx when not given); token_type_ids (B, T) ints (zeros when not given, needs
        type_vocab_size > 0) -> (hidden (B, T, d), pooled (B, d)). Raises TypeError for ids that
        are not integers, IndexError for ids outside the vocabulary, ValueError for sequences
        longer than max_len or token_type_ids without a token-type embedding."""
        ids = self._ids(input_ids)
        mask = padding_mask_from_ids(ids, self.pad_idx, key_padding_mask)
        hidden = self.hidden_states(ids, mask, token_type_ids=token_type_ids)        # (B, T, d)
        if self.pooling == "first":
            pooled = hidden[:, 0]                                                   # (B, d)
        else:
            valid = valid_positions(mask, ids, hidden.dtype)                        # (B, T)
            counts = valid.sum(axis=1, keepdims=True)                               # (B, 1)
            counts[counts == 0] = 1  # an all-padding row pools to 0, not NaN
            pooled = (hidden * valid[:, :, None]).sum(axis=1) / counts              # (B, d)
        pooler = getattr(self, "pooler", None)
        return hidden, (pooler(pooled).tanh() if pooler is not None else pooled)


class BidirectionalEncoder(PooledEncoder):
    """ids (B, T) -> (hidden states (B, T, d_model), pooled (B, d_model)): BERT's BertModel.

    hidden = encoder(dropout(embed_norm(tok_embed(ids) + type_embed(types) + positions)))
    (bidirectional, padding masked; embed_norm and type_embed when enabled; the encoder's
    final LayerNorm unless final_norm=False); pooled = mean of hidden over non-padding
    positions (pooling="mean") or hidden[:, 0] (pooling="first", a CLS token), then
    tanh(pooler(.)) with pooler=True.
    BERT is BidirectionalEncoder(pooling="first", pooler=True, type_vocab_size=2,
    embed_norm=True, final_norm=False, layer_norm_eps=1e-12, activation_dropout=0.0):
    npformer.interop.from_hf / to_hf and npformer.models.load_pretrained convert its weights.

    positional: "learned" (default), "sinusoidal", "rope" or "none"; activation: "gelu"
    (default, exact), "gelu_tanh" or "relu"; attention_dropout and activation_dropout default
    to `dropout`. Every argument is checked (TypeError / ValueError naming it); `config` holds
    them all but the attention path (memory_efficient, block_size, attention_backend: how
    attention runs, as in nn.TransformerConfig, shared by every layer in `transformer_config`),
    and `state_shapes(config)` gives the state_dict's shapes without building.
    """

    def __init__(self, vocab_size: int, d_model: int = 512, nhead: int = 8, num_layers: int = 6,
                 dim_feedforward: int = 2048, dropout: float = 0.1, max_len: int = 512, norm_first: bool = False,
                 activation: str = "gelu", pooling: str = "mean", positional: str = "learned",
                 pad_idx: int | None = None, layer_norm_eps: float = 1e-5, *, attention_dropout: float | None = None,
                 activation_dropout: float | None = None, type_vocab_size: int = 0, embed_norm: bool = False,
                 final_norm: bool = True, pooler: bool = False, memory_efficient: bool = False, block_size: int = 512,
                 attention_backend: str | None = None):
        super().__init__()
        self.config = dict(vocab_size=vocab_size, d_model=d_model, nhead=nhead, num_layers=num_layers,
                           dim_feedforward=dim_feedforward, dropout=dropout, max_len=max_len,
                           norm_first=norm_first, activation=activation, pooling=pooling, positional=positional,
                           pad_idx=pad_idx, layer_norm_eps=layer_norm_eps, attention_dropout=attention_dropout,
                           activation_dropout=activation_dropout, type_vocab_size=type_vocab_size,
                           embed_norm=embed_norm, final_norm=final_norm, pooler=pooler)
        self._build_pooled_encoder(self.config, attention_settings(memory_efficient, block_size, attention_backend))
        self._reset_parameters()

    def forward(self, input_ids: ArrayLike, key_padding_mask: ArrayLike | None = None,
                token_type_ids: ArrayLike | None = None) -> tuple[Tensor, Tensor]:
        """input_ids (B, T) -> (hidden (B, T, d_model), pooled (B, d_model)); see `encode`."""
        return self.encode(input_ids, key_padding_mask, token_type_ids)


class EncoderClassifier(PooledEncoder):
    """ids (B, T) -> class logits (B, num_classes): classifier(dropout(pooled)), where pooled is
    BidirectionalEncoder's pooled output (same options) and the dropout has p=classifier_dropout.
    BERT's BertForSequenceClassification is EncoderClassifier with BERT's options (see
    BidirectionalEncoder) and classifier_dropout = its hidden dropout (None: `dropout`, as Hugging
    Face's classifier_dropout=None; `config` stores the number).
    Equivalent torch composition: npformer.interop.to_torch(model). Train it with
    `F.cross_entropy(model(ids), labels)` (or `training.classification_loss()`).
    memory_efficient, block_size, attention_backend: how attention runs (see BidirectionalEncoder).
    """

    def __init__(self, vocab_size: int, num_classes: int, d_model: int = 512, nhead: int = 8, num_layers: int = 6,
                 dim_feedforward: int = 2048, dropout: float = 0.1, max_len: int = 512, norm_first: bool = False,
                 activation: str = "gelu", pooling: str = "mean", positional: str = "learned",
                 pad_idx: int | None = None, layer_norm_eps: float = 1e-5, *, attention_dropout: float | None = None,
                 activation_dropout: float | None = None, type_vocab_size: int = 0, embed_norm: bool = False,
                 final_norm: bool = True, pooler: bool = False, classifier_dropout: float | None = 0.0,
                 memory_efficient: bool = False, block_size: int = 512, attention_backend: str | None = None):
        super().__init__()
        classifier_dropout = dropout if classifier_dropout is None else classifier_dropout
        self.config = dict(vocab_size=vocab_size, num_classes=num_classes, d_model=d_model, nhead=nhead,
                           num_layers=num_layers, dim_feedforward=dim_feedforward, dropout=dropout,
                           max_len=max_len, norm_first=norm_first, activation=activation, pooling=pooling,
                           positional=positional, pad_idx=pad_idx, layer_norm_eps=layer_norm_eps,
                           attention_dropout=attention_dropout, activation_dropout=activation_dropout,
                           type_vocab_size=type_vocab_size, embed_norm=embed_norm,
                           final_norm=final_norm, pooler=pooler, classifier_dropout=classifier_dropout)
        self._build_pooled_encoder(self.config, attention_settings(memory_efficient, block_size, attention_backend))
        self.head_dropout = nn.Dropout(self.config["classifier_dropout"])
        self.classifier = nn.Linear(d_model, num_classes)
        self._reset_parameters()

    @classmethod
    def state_shapes(cls, config: dict[str, Any], persistent: bool = True) -> dict[str, tuple[int, ...]]:
        """{name: shape} of `cls(**config).state_dict()` from the config alone (the encoder's,
        plus the classifier), building nothing; persistent=False adds non-persistent buffers."""
        shapes = super().state_shapes(config, persistent)
        (num_classes,) = dims(config, ("num_classes",), cls.__name__)
        shapes.update(linear_shapes("classifier", config["d_model"], num_classes))
        return shapes

    def forward(self, input_ids: ArrayLike, key_padding_mask: ArrayLike | None = None,
                token_type_ids: ArrayLike | None = None) -> Tensor:
        """input_ids (B, T) ints; key_padding_mask (B, T) bool, True = padding (derived from
        pad_idx when not given); token_type_ids (B, T) (type_vocab_size > 0 only)
        -> logits (B, num_classes)."""
        _, pooled = self.encode(input_ids, key_padding_mask, token_type_ids)
        return self.classifier(self.head_dropout(pooled))
