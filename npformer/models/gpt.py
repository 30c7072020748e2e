"""A decoder-only (GPT-style) causal language model built from the encoder layers plus a causal mask."""
import npformer.functional as F

from .. import nn
from ._common import EncoderOnlyModel, padding_mask_from_ids


class CausalLM(EncoderOnlyModel):
    """ids (B, T) -> next-token logits (B, T, vocab_size); position t sees positions <= t.

    h = encoder(dropout(tok_embed(ids) + positions), causal mask) with a final LayerNorm,
    logits = lm_head(h) (no bias), or h tok_embed.weight^T with tie_weights=True (then no
    lm_head key). Pre-LN by default (norm_first=True), GELU, learned positions.
    activation: "relu", "gelu" (exact) or "gelu_tanh" (GPT-2's "gelu_new"). attention_dropout
    and activation_dropout default to `dropout` (see EncoderOnlyModel).
    GPT-2 is CausalLM(activation="gelu_tanh", tie_weights=True, activation_dropout=0.0):
    npformer.interop.from_hf / to_hf and npformer.models.load_pretrained convert its weights.
    Equivalent torch composition: npformer.interop.to_torch(model).
    """

    def __init__(self, vocab_size, d_model=512, nhead=8, num_layers=6, dim_feedforward=2048, dropout=0.1,
                 max_len=1024, norm_first=True, activation="gelu", positional="learned", tie_weights=False,
                 pad_idx=None, layer_norm_eps=1e-5, *, attention_dropout=None, activation_dropout=None):
        super().__init__()
        self.config = dict(vocab_size=vocab_size, d_model=d_model, nhead=nhead, num_layers=num_layers,
                           dim_feedforward=dim_feedforward, dropout=dropout, max_len=max_len,
                           norm_first=norm_first, activation=activation, positional=positional,
                           tie_weights=bool(tie_weights), pad_idx=pad_idx, layer_norm_eps=layer_norm_eps,
                           attention_dropout=attention_dropout, activation_dropout=activation_dropout)
        self._build_trunk(self.config)
        self.tie_weights = bool(tie_weights)
        if not self.tie_weights:
            self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self._reset_parameters()

    @classmethod
    def state_shapes(cls, config, persistent=True):
        """{name: shape} of `CausalLM(**config).state_dict()` from the config alone (config holds
        every constructor argument), building nothing; persistent=False adds the non-persistent
        buffers (named as in named_buffers)."""
        shapes = cls._trunk_shapes(config, cls.__name__, persistent)
        if not config["tie_weights"]:
            shapes["lm_head.weight"] = shapes["tok_embed.weight"]
        return shapes

    def forward(self, input_ids, key_padding_mask=None):
        """input_ids (B, T) ints; key_padding_mask (B, T) bool, True = padding (derived from
        pad_idx when not given) -> logits (B, T, vocab_size)."""
        ids = self._ids(input_ids)
        hidden = self.hidden_states(ids, padding_mask_from_ids(ids, self.pad_idx, key_padding_mask), is_causal=True)
        weight = self.tok_embed.weight if self.tie_weights else self.lm_head.weight
        return F.linear(hidden, weight)
