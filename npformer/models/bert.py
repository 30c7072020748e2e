"""An encoder-only (BERT-style) sequence classifier with mean or first-token pooling."""
from .. import nn
from ._common import EncoderOnlyModel, check_choice, check_config, padding_mask_from_ids, valid_positions


class EncoderClassifier(EncoderOnlyModel):
    """ids (B, T) -> class logits (B, num_classes).

    h = encoder(dropout(tok_embed(ids) + positions)) with a final LayerNorm (bidirectional,
    padding masked); pooled = mean of h over non-padding positions (pooling="mean") or h[:, 0]
    (pooling="first", e.g. a CLS token); logits = classifier(pooled).
    Equivalent torch composition: npformer.interop.to_torch(model).
    """

    def __init__(self, vocab_size, num_classes, d_model=512, nhead=8, num_layers=6, dim_feedforward=2048,
                 dropout=0.1, max_len=512, norm_first=False, activation="gelu", pooling="mean",
                 positional="learned", pad_idx=None, layer_norm_eps=1e-5):
        super().__init__()
        check_choice(pooling, ("mean", "first"), "pooling", "EncoderClassifier")
        self.config = dict(vocab_size=vocab_size, num_classes=num_classes, d_model=d_model, nhead=nhead,
                           num_layers=num_layers, dim_feedforward=dim_feedforward, dropout=dropout,
                           max_len=max_len, norm_first=norm_first, activation=activation, pooling=pooling,
                           positional=positional, pad_idx=pad_idx, layer_norm_eps=layer_norm_eps)
        self.config = check_config(self.config, "EncoderClassifier")
        self._build_trunk(vocab_size, d_model, nhead, num_layers, dim_feedforward, dropout, max_len, activation,
                          norm_first, positional, pad_idx, layer_norm_eps)
        self.pooling = pooling
        self.classifier = nn.Linear(d_model, num_classes)
        self._reset_parameters()

    def forward(self, input_ids, key_padding_mask=None):
        """input_ids (B, T) ints; key_padding_mask (B, T) bool, True = padding (derived from
        pad_idx when not given) -> logits (B, num_classes)."""
        ids = self._ids(input_ids)
        mask = padding_mask_from_ids(ids, self.pad_idx, key_padding_mask)
        hidden = self.hidden_states(ids, mask)                                      # (B, T, d)
        if self.pooling == "first":
            pooled = hidden[:, 0]                                                   # (B, d)
        else:
            valid = valid_positions(mask, ids, hidden.dtype)                        # (B, T)
            counts = valid.sum(axis=1, keepdims=True)                               # (B, 1)
            counts[counts == 0] = 1  # an all-padding row pools to 0, not NaN
            pooled = (hidden * valid[:, :, None]).sum(axis=1) / counts              # (B, d)
        return self.classifier(pooled)
