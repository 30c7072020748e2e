"""torch compositions of npformer's models: the independent reference `to_torch` builds.

`torch_model_classes()` gives, by our class name, a torch.nn.Module with the same constructor
arguments (the model's `config`), the same state_dict keys (in the same order) and the same
forward math, written with torch.nn.Transformer / TransformerEncoder, so tests compare our
hand-derived forward and backward with torch's autograd on equal weights.
torch is imported when the classes are first asked for, never by npformer itself.
"""
from __future__ import annotations

import functools
import math
from typing import Any

from ..models.seq2seq import sharing


def _arguments(local_variables, function):
    """The arguments of `function` (a constructor) from its locals(), keyword-only ones included."""
    code = function.__code__
    count = code.co_argcount + code.co_kwonlyargcount
    return {name: local_variables[name] for name in code.co_varnames[1:count]}


def torch_unsupported(config: dict) -> str | None:
    """The first option of a model's config that torch.nn's Transformer layers cannot express,
    as "name=value" (None when every one can): RMSNorm layers, the SwiGLU feed-forward,
    grouped-query attention (num_kv_heads < nhead), sliding windows, q/k/v biases that differ
    from the other biases, and rotary positions (torch.nn has no RoPE)."""
    nhead = config.get("nhead")
    qkv_bias = config.get("qkv_bias")
    for name, supported in (("positional", config.get("positional") != "rope"),
                            ("norm", config.get("norm", "layernorm") == "layernorm"),
                            ("activation", config.get("activation") != "swiglu"),
                            ("num_kv_heads", config.get("num_kv_heads") in (None, nhead)),
                            ("sliding_window", config.get("sliding_window") is None),
                            ("qkv_bias", qkv_bias is None or qkv_bias == config.get("bias", True))):
        if not supported:
            return f"{name}={config[name]!r}"
    return None


@functools.lru_cache(maxsize=None)
def torch_model_classes() -> dict[str, Any]:
    """{"Seq2SeqTransformer": ..., "CausalLM": ..., "BidirectionalEncoder": ...,
    "EncoderClassifier": ...}: torch twins of npformer.models (see the module docstring), torch.nn.Module
    classes built on first use (torch is imported then) and cached."""
    import torch  # a dev/test dependency: only imported when interop is used
    tnn, tF = torch.nn, torch.nn.functional

    class SinusoidalPositionalEncoding(tnn.Module):
        def __init__(self, d_model, max_len):
            super().__init__()
            position = torch.arange(max_len, dtype=torch.float64)[:, None]
            inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float64) * (-math.log(10000.0) / d_model))
            pe = torch.zeros(max_len, d_model, dtype=torch.float64)
            pe[:, 0::2] = torch.sin(position * inv_freq)
            pe[:, 1::2] = torch.cos(position * inv_freq)[:, : d_model // 2]
            self.register_buffer("pe", pe, persistent=False)  # cast by .to(dtype) like ours

        def forward(self, x, offset=0):
            return x + self.pe[offset: offset + x.size(1)]

    class LearnedPositionalEmbedding(tnn.Module):
        def __init__(self, max_len, d_model):
            super().__init__()
            self.weight = tnn.Parameter(torch.zeros(max_len, d_model))

        def forward(self, x, offset=0):
            return x + self.weight[offset: offset + x.size(1)]

    def positions(kind, d_model, max_len):
        if kind == "rope":
            raise NotImplementedError("to_torch: positional='rope' has no torch.nn counterpart")
        if kind == "sinusoidal":
            return SinusoidalPositionalEncoding(d_model, max_len)
        return LearnedPositionalEmbedding(max_len, d_model) if kind == "learned" else None

    def activation_of(name):
        if name == "silu":
            return tF.silu
        return tnn.GELU(approximate="tanh") if name == "gelu_tanh" else name

    def causal_mask(length, device):
        return torch.ones(length, length, dtype=torch.bool, device=device).triu(1)  # True = may not attend

    def padding(ids, pad_idx, mask):
        if mask is not None:
            return torch.as_tensor(mask)
        return ids == pad_idx if pad_idx is not None else None

    class Seq2SeqTransformer(tnn.Module):
        def __init__(self, src_vocab_size, tgt_vocab_size, d_model=512, nhead=8, num_encoder_layers=6,
                     num_decoder_layers=6, dim_feedforward=2048, dropout=0.1, max_len=5000, activation="relu",
                     norm_first=False, pad_idx=None, tie_weights=None, positional="sinusoidal",
                     layer_norm_eps=1e-5, *, share_embeddings=False):
            super().__init__()
            self.config = _arguments(locals(), type(self).__init__)
            tie_weights, share_embeddings = sharing(tie_weights, share_embeddings, "Seq2SeqTransformer")
            self.config.update(tie_weights=tie_weights, share_embeddings=share_embeddings)  # normalised like ours
            self.d_model, self.pad_idx, self.tie_weights, self.positional_kind = d_model, pad_idx, tie_weights, positional
            self.share_embeddings = share_embeddings
            if not share_embeddings:  # shared: tgt_embed is the source embedding too (one state_dict key)
                self.src_embed = tnn.Embedding(src_vocab_size, d_model, padding_idx=pad_idx)
            self.tgt_embed = tnn.Embedding(tgt_vocab_size, d_model, padding_idx=pad_idx)
            if positional == "learned":
                self.src_pos_embed = positions(positional, d_model, max_len)
                self.tgt_pos_embed = positions(positional, d_model, max_len)
            else:
                self.positional = positions(positional, d_model, max_len)
            self.dropout = tnn.Dropout(dropout)
            self.transformer = tnn.Transformer(d_model, nhead, num_encoder_layers, num_decoder_layers,
                                               dim_feedforward, dropout, activation, layer_norm_eps=layer_norm_eps,
                                               batch_first=True, norm_first=norm_first)
            if tie_weights:
                self.generator = tnn.Module()
                self.generator.bias = tnn.Parameter(torch.zeros(tgt_vocab_size))
            else:
                self.generator = tnn.Linear(d_model, tgt_vocab_size)

        def _embed(self, ids, side):
            table = self.tgt_embed if side == "tgt" or self.share_embeddings else self.src_embed
            x = table(ids) * math.sqrt(self.d_model)
            pos = getattr(self, f"{side}_pos_embed") if self.positional_kind == "learned" else self.positional
            return self.dropout(pos(x) if pos is not None else x)

        def encode(self, src, src_key_padding_mask=None):
            mask = padding(src, self.pad_idx, src_key_padding_mask)
            return self.transformer.encoder(self._embed(src, "src"), src_key_padding_mask=mask)

        def decode(self, tgt, memory, memory_key_padding_mask=None, tgt_key_padding_mask=None):
            mask = padding(tgt, self.pad_idx, tgt_key_padding_mask)
            hidden = self.transformer.decoder(self._embed(tgt, "tgt"), memory,
                                              tgt_mask=causal_mask(tgt.size(1), tgt.device),
                                              tgt_key_padding_mask=mask,
                                              memory_key_padding_mask=memory_key_padding_mask)
            weight = self.tgt_embed.weight if self.tie_weights else self.generator.weight
            return tF.linear(hidden, weight, self.generator.bias)

        def forward(self, src, tgt, src_key_padding_mask=None, tgt_key_padding_mask=None):
            src_mask = padding(src, self.pad_idx, src_key_padding_mask)
            memory = self.encode(src, src_mask)
            return self.decode(tgt, memory, memory_key_padding_mask=src_mask, tgt_key_padding_mask=tgt_key_padding_mask)

    class EncoderOnly(tnn.Module):
        """The trunk of npformer.models' EncoderOnlyModel, from the same config dict."""

        def _build_trunk(self, c):
            d_model, eps = c["d_model"], c["layer_norm_eps"]
            self.pad_idx = c["pad_idx"]
            self.tok_embed = tnn.Embedding(c["vocab_size"], d_model, padding_idx=c["pad_idx"])
            pos = positions(c["positional"], d_model, c["max_len"])
            if pos is not None:
                setattr(self, "pos_embed" if c["positional"] == "learned" else "positional", pos)
            if c.get("type_vocab_size"):
                self.type_embed = tnn.Embedding(c["type_vocab_size"], d_model)
            if c.get("embed_norm"):
                self.embed_norm = tnn.LayerNorm(d_model, eps=eps)
            self.dropout = tnn.Dropout(c["dropout"])
            bias = c.get("bias", True)
            layer = tnn.TransformerEncoderLayer(d_model, c["nhead"], c["dim_feedforward"], c["dropout"],
                                                activation_of(c["activation"]), eps, batch_first=True,
                                                norm_first=c["norm_first"], bias=bias)
            def rate(name):  # None: the model's dropout
                return c["dropout"] if c.get(name) is None else c[name]
            layer.self_attn.dropout = rate("attention_dropout")
            layer.dropout = tnn.Dropout(rate("activation_dropout"))
            norm = tnn.LayerNorm(d_model, eps=eps, bias=bias) if c.get("final_norm", True) else None
            self.encoder = tnn.TransformerEncoder(layer, c["num_layers"], norm, enable_nested_tensor=False)

        def _build_pooled_encoder(self, c):
            self._build_trunk(c)
            self.pooling = c["pooling"]
            if c["pooler"]:
                self.pooler = tnn.Linear(c["d_model"], c["d_model"])

        def hidden_states(self, ids, mask, causal, token_type_ids=None):
            x = self.tok_embed(ids)
            if hasattr(self, "type_embed"):
                x = x + self.type_embed(torch.zeros_like(ids) if token_type_ids is None
                                        else torch.as_tensor(token_type_ids))
            pos = getattr(self, "pos_embed", None) or getattr(self, "positional", None)
            x = pos(x) if pos is not None else x
            if hasattr(self, "embed_norm"):
                x = self.embed_norm(x)
            return self.encoder(self.dropout(x), mask=causal_mask(ids.size(1), ids.device) if causal else None,
                                src_key_padding_mask=mask)

        def encode(self, input_ids, key_padding_mask=None, token_type_ids=None):
            mask = padding(input_ids, self.pad_idx, key_padding_mask)
            hidden = self.hidden_states(input_ids, mask, causal=False, token_type_ids=token_type_ids)
            if self.pooling == "first":
                pooled = hidden[:, 0]
            else:
                valid = torch.ones_like(input_ids, dtype=hidden.dtype) if mask is None else (~mask).to(hidden.dtype)
                counts = valid.sum(1, keepdim=True).clamp(min=1)
                pooled = (hidden * valid[:, :, None]).sum(1) / counts
            return hidden, torch.tanh(self.pooler(pooled)) if hasattr(self, "pooler") else pooled

    class CausalLM(EncoderOnly):
        def __init__(self, vocab_size, d_model=512, nhead=8, num_layers=6, dim_feedforward=2048, dropout=0.1,
                     max_len=1024, norm_first=True, activation="gelu", positional="learned", tie_weights=False,
                     pad_idx=None, layer_norm_eps=1e-5, *, attention_dropout=None, activation_dropout=None,
                     bias=True, norm="layernorm", num_kv_heads=None, sliding_window=None, qkv_bias=None,
                     rotary_base=10000.0, rope_scaling=None, residual_init="normal"):
            super().__init__()
            self.config = _arguments(locals(), type(self).__init__)
            unsupported = torch_unsupported(self.config)
            if unsupported:
                raise NotImplementedError(f"CausalLM({unsupported}) has no torch.nn counterpart")
            self._build_trunk(self.config)
            self.tie_weights = tie_weights
            if not tie_weights:
                self.lm_head = tnn.Linear(d_model, vocab_size, bias=False)

        def forward(self, input_ids, key_padding_mask=None):
            hidden = self.hidden_states(input_ids, padding(input_ids, self.pad_idx, key_padding_mask), causal=True)
            return tF.linear(hidden, self.tok_embed.weight if self.tie_weights else self.lm_head.weight)

    class BidirectionalEncoder(EncoderOnly):
        def __init__(self, vocab_size, d_model=512, nhead=8, num_layers=6, dim_feedforward=2048, dropout=0.1,
                     max_len=512, norm_first=False, activation="gelu", pooling="mean", positional="learned",
                     pad_idx=None, layer_norm_eps=1e-5, *, attention_dropout=None, activation_dropout=None,
                     type_vocab_size=0, embed_norm=False, final_norm=True, pooler=False):
            super().__init__()
            self.config = _arguments(locals(), type(self).__init__)
            self._build_pooled_encoder(self.config)

        def forward(self, input_ids, key_padding_mask=None, token_type_ids=None):
            return self.encode(input_ids, key_padding_mask, token_type_ids)

    class EncoderClassifier(EncoderOnly):
        def __init__(self, vocab_size, num_classes, d_model=512, nhead=8, num_layers=6, dim_feedforward=2048,
                     dropout=0.1, max_len=512, norm_first=False, activation="gelu", pooling="mean",
                     positional="learned", pad_idx=None, layer_norm_eps=1e-5, *, attention_dropout=None,
                     activation_dropout=None, type_vocab_size=0, embed_norm=False, final_norm=True, pooler=False,
                     classifier_dropout=0.0):
            super().__init__()
            self.config = _arguments(locals(), type(self).__init__)
            self._build_pooled_encoder(self.config)
            self.head_dropout = tnn.Dropout(classifier_dropout)
            self.classifier = tnn.Linear(d_model, num_classes)

        def forward(self, input_ids, key_padding_mask=None, token_type_ids=None):
            return self.classifier(self.head_dropout(self.encode(input_ids, key_padding_mask, token_type_ids)[1]))

    return {cls.__name__: cls for cls in (Seq2SeqTransformer, CausalLM, BidirectionalEncoder, EncoderClassifier)}
