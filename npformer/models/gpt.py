"""A decoder-only (GPT-style) causal language model built from the encoder layers plus a causal mask."""
import npformer.functional as F

from .. import nn
from ._common import EncoderOnlyModel, check_config, padding_mask_from_ids


class CausalLM(EncoderOnlyModel):
    """ids (B, T) -> next-token logits (B, T, vocab_size); position t sees positions <= t.

    h = encoder(dropout(tok_embed(ids) + positions), causal mask) with a final LayerNorm,
    logits = lm_head(h) (no bias), or h tok_embed.weight^T with tie_weights=True (then no
    lm_head key). Pre-LN by default (norm_first=True), GELU, learned positions.
    Equivalent torch composition: npformer.interop.to_torch(model).
    """

    def __init__(self, vocab_size, d_model=512, nhead=8, num_layers=6, dim_feedforward=2048, dropout=0.1,
                 max_len=1024, norm_first=True, activation="gelu", positional="learned", tie_weights=False,
                 pad_idx=None, layer_norm_eps=1e-5):
        super().__init__()
        self.config = dict(vocab_size=vocab_size, d_model=d_model, nhead=nhead, num_layers=num_layers,
                           dim_feedforward=dim_feedforward, dropout=dropout, max_len=max_len,
                           norm_first=norm_first, activation=activation, positional=positional,
                           tie_weights=bool(tie_weights), pad_idx=pad_idx, layer_norm_eps=layer_norm_eps)
        self.config = check_config(self.config, "CausalLM")
        self._build_trunk(vocab_size, d_model, nhead, num_layers, dim_feedforward, dropout, max_len, activation,
                          norm_first, positional, pad_idx, layer_norm_eps)
        self.tie_weights = bool(tie_weights)
        if not self.tie_weights:
            self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self._reset_parameters()

    def forward(self, input_ids, key_padding_mask=None):
        """input_ids (B, T) ints; key_padding_mask (B, T) bool, True = padding (derived from
        pad_idx when not given) -> logits (B, T, vocab_size)."""
        ids = self._ids(input_ids)
        hidden = self.hidden_states(ids, padding_mask_from_ids(ids, self.pad_idx, key_padding_mask), is_causal=True)
        weight = self.tok_embed.weight if self.tie_weights else self.lm_head.weight
        return F.linear(hidden, weight)
