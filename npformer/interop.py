"""Move modules between npformer and PyTorch with the same weights and the same numbers.

`to_torch(module)` builds the equivalent torch module (same dtype, training mode and
state_dict) and `from_torch(torch_module)` builds ours. Supported: nn.Transformer,
TransformerEncoder/DecoderLayer, TransformerEncoder/Decoder, MultiheadAttention, Linear,
LayerNorm, Embedding, and the models Seq2SeqTransformer, CausalLM and EncoderClassifier,
whose torch counterparts are compositions of torch.nn modules defined here
(`torch_model_classes()`), with identical state_dict keys and forward math.
torch is imported inside these functions only: npformer itself never needs it.
"""
import functools
import math
import warnings

from . import models, nn


def _torch():
    import torch  # a dev/test dependency: only imported when interop is used
    return torch


def _torch_dtype(module):
    torch = _torch()
    dtypes = {str(p.dtype) for p in module.parameters()}
    if not dtypes:
        return None  # nothing to convert (e.g. LayerNorm without affine parameters)
    if len(dtypes) != 1:
        raise TypeError(f"to_torch: expected one parameter dtype, got {sorted(dtypes)}")
    return {"float32": torch.float32, "float64": torch.float64}[dtypes.pop()]


def _our_dtype(torch_module):
    dtypes = {str(p.dtype).replace("torch.", "") for p in torch_module.parameters()}
    if not dtypes:
        return None
    if len(dtypes) != 1 or not dtypes <= {"float32", "float64"}:
        raise TypeError(f"from_torch: expected float32 or float64 parameters of one dtype, got {sorted(dtypes)}")
    return dtypes.pop()


def _activation_name(layer):
    name = layer.activation_name
    if name is None:
        raise ValueError("to_torch: only activation 'relu' or 'gelu' (given by name) can be converted")
    return name


def _no_rotary(module):
    for m in module.modules():
        if isinstance(m, nn.MultiheadAttention) and m.rotary:
            raise NotImplementedError("to_torch: rotary position embeddings (RoPE) have no torch.nn "
                                      "counterpart; only sinusoidal, learned or no positions convert")


def _layer_options(layer):
    """Constructor arguments shared by our encoder and decoder layers, read off the layer."""
    return dict(d_model=layer.d_model, nhead=layer.self_attn.num_heads, dim_feedforward=layer.linear1.out_features,
                dropout=layer.dropout.p, activation=_activation_name(layer), layer_norm_eps=layer.norm1.eps,
                norm_first=layer.norm_first, bias=layer.linear1.bias is not None)


def _torch_layer_options(layer):
    """The same arguments read off a torch.nn.TransformerEncoderLayer/DecoderLayer."""
    tnn, tF = _torch().nn, _torch().nn.functional
    act = layer.activation
    if act is tF.relu or isinstance(act, tnn.ReLU):
        activation = "relu"
    elif act is tF.gelu or (isinstance(act, tnn.GELU) and act.approximate == "none"):
        activation = "gelu"
    else:
        raise ValueError("from_torch: only layers with activation relu or gelu (exact) can be converted")
    return dict(d_model=layer.self_attn.embed_dim, nhead=layer.self_attn.num_heads,
                dim_feedforward=layer.linear1.out_features, dropout=layer.dropout.p,
                activation=activation, layer_norm_eps=layer.norm1.eps,
                norm_first=layer.norm_first, bias=layer.linear1.bias is not None)


def _torch_layer(layer, dtype):
    torch = _torch()
    options = _layer_options(layer)
    cls = (torch.nn.TransformerEncoderLayer if isinstance(layer, nn.TransformerEncoderLayer)
           else torch.nn.TransformerDecoderLayer)
    return cls(options.pop("d_model"), options.pop("nhead"), batch_first=True, dtype=dtype, **options)


def _norm_options(norm):
    """LayerNorm arguments, read off ours or torch's (same attribute names)."""
    return dict(eps=norm.eps, elementwise_affine=norm.weight is not None, bias=norm.bias is not None)


def _build_torch(module, dtype):
    torch = _torch()
    tnn = torch.nn
    if isinstance(module, (models.Seq2SeqTransformer, models.CausalLM, models.EncoderClassifier)):
        return torch_model_classes()[type(module).__name__](**module.config).to(dtype)
    if isinstance(module, nn.Transformer):
        layer = module.encoder.layers[0]
        options = _layer_options(layer)
        return tnn.Transformer(num_encoder_layers=len(module.encoder.layers),
                               num_decoder_layers=len(module.decoder.layers), batch_first=True, dtype=dtype,
                               **options)
    if isinstance(module, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
        return _torch_layer(module, dtype)
    if isinstance(module, (nn.TransformerEncoder, nn.TransformerDecoder)):
        norm = module.norm and tnn.LayerNorm(module.norm.normalized_shape, dtype=dtype, **_norm_options(module.norm))
        if isinstance(module, nn.TransformerEncoder):
            return tnn.TransformerEncoder(_torch_layer(module.layers[0], dtype), len(module.layers), norm,
                                          enable_nested_tensor=False)
        return tnn.TransformerDecoder(_torch_layer(module.layers[0], dtype), len(module.layers), norm)
    if isinstance(module, nn.MultiheadAttention):
        return tnn.MultiheadAttention(module.embed_dim, module.num_heads, dropout=module.dropout,
                                      bias=module.in_proj_bias is not None, batch_first=True, dtype=dtype)
    if isinstance(module, nn.Linear):
        return tnn.Linear(module.in_features, module.out_features, bias=module.bias is not None, dtype=dtype)
    if isinstance(module, nn.LayerNorm):
        return tnn.LayerNorm(module.normalized_shape, dtype=dtype, **_norm_options(module))
    if isinstance(module, nn.Embedding):
        return tnn.Embedding(module.num_embeddings, module.embedding_dim, padding_idx=module.padding_idx, dtype=dtype)
    raise TypeError(f"to_torch: no torch counterpart for {type(module).__name__}")


def to_torch(module):
    """The equivalent torch module with `module`'s weights (copied), dtype and training mode."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"to_torch: expected an npformer nn.Module, got {type(module).__name__}")
    _no_rotary(module)
    torch = _torch()
    with warnings.catch_warnings():  # torch warns that norm_first disables its nested-tensor fast path
        warnings.filterwarnings("ignore", message="enable_nested_tensor is True")
        target = _build_torch(module, _torch_dtype(module))
    target.load_state_dict({name: torch.from_numpy(array) for name, array in module.state_dict().items()})
    return target.train(module.training)


def _build_ours(module):
    torch = _torch()
    tnn = torch.nn
    classes = torch_model_classes()
    for name, cls in classes.items():
        if isinstance(module, cls):
            return getattr(models, name)(**module.config)
    if isinstance(module, tnn.Transformer):
        options = _torch_layer_options(module.encoder.layers[0])
        return nn.Transformer(num_encoder_layers=len(module.encoder.layers),
                              num_decoder_layers=len(module.decoder.layers), **options)
    if isinstance(module, (tnn.TransformerEncoderLayer, tnn.TransformerDecoderLayer)):
        return _our_layer(module)
    if isinstance(module, (tnn.TransformerEncoder, tnn.TransformerDecoder)):
        norm = module.norm and nn.LayerNorm(module.norm.normalized_shape, **_norm_options(module.norm))
        if isinstance(module, tnn.TransformerEncoder):
            return nn.TransformerEncoder(_our_layer(module.layers[0]), len(module.layers), norm)
        return nn.TransformerDecoder(_our_layer(module.layers[0]), len(module.layers), norm)
    if isinstance(module, tnn.MultiheadAttention):
        if not (module._qkv_same_embed_dim and module.batch_first and module.bias_k is None and not module.add_zero_attn):
            raise ValueError("from_torch: only MultiheadAttention(batch_first=True) with one embed_dim for q, k, v, "
                             "no add_bias_kv and no add_zero_attn can be converted")
        return nn.MultiheadAttention(module.embed_dim, module.num_heads, dropout=module.dropout,
                                     bias=module.in_proj_bias is not None)
    if isinstance(module, tnn.Linear):
        return nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
    if isinstance(module, tnn.LayerNorm):
        return nn.LayerNorm(module.normalized_shape, **_norm_options(module))
    if isinstance(module, tnn.Embedding):
        return nn.Embedding(module.num_embeddings, module.embedding_dim, padding_idx=module.padding_idx)
    raise TypeError(f"from_torch: no npformer counterpart for {type(module).__name__}")


def _our_layer(layer):
    torch = _torch()
    options = _torch_layer_options(layer)
    cls = nn.TransformerEncoderLayer if isinstance(layer, torch.nn.TransformerEncoderLayer) else nn.TransformerDecoderLayer
    return cls(options.pop("d_model"), options.pop("nhead"), **options)


def from_torch(torch_module):
    """Our module equivalent to `torch_module`, with its weights (copied), dtype and training
    mode. A torch.nn.Transformer built with batch_first=False converts too (the weights do not
    depend on the layout), but ours always takes (batch, seq, feature) inputs."""
    torch = _torch()
    if not isinstance(torch_module, torch.nn.Module):
        raise TypeError(f"from_torch: expected a torch.nn.Module, got {type(torch_module).__name__}")
    dtype = _our_dtype(torch_module)
    ours = _build_ours(torch_module).to(dtype=dtype)
    ours.load_state_dict({name: t.detach().cpu().numpy() for name, t in torch_module.state_dict().items()})
    return ours.train(torch_module.training)


def _arguments(local_variables, function):
    """The arguments of `function` (a constructor) from its locals()."""
    code = function.__code__
    return {name: local_variables[name] for name in code.co_varnames[1:code.co_argcount]}


@functools.lru_cache(maxsize=None)
def torch_model_classes():
    """torch compositions of our models, by our class name: same constructor arguments (the
    model's `config`), the same state_dict keys and the same forward math, written with
    torch.nn.Transformer / TransformerEncoder so they serve as an independent reference."""
    torch = _torch()
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

    def causal_mask(length, device):
        return torch.ones(length, length, dtype=torch.bool, device=device).triu(1)  # True = may not attend

    def padding(ids, pad_idx, mask):
        if mask is not None:
            return torch.as_tensor(mask)
        return ids == pad_idx if pad_idx is not None else None

    class Seq2SeqTransformer(tnn.Module):
        def __init__(self, src_vocab_size, tgt_vocab_size, d_model=512, nhead=8, num_encoder_layers=6,
                     num_decoder_layers=6, dim_feedforward=2048, dropout=0.1, max_len=5000, activation="relu",
                     norm_first=False, pad_idx=None, tie_weights=False, positional="sinusoidal",
                     layer_norm_eps=1e-5):
            super().__init__()
            self.config = _arguments(locals(), type(self).__init__)
            self.d_model, self.pad_idx, self.tie_weights, self.positional_kind = d_model, pad_idx, tie_weights, positional
            if tie_weights != "all":
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
            table = self.tgt_embed if side == "tgt" or self.tie_weights == "all" else self.src_embed
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
        def _build_trunk(self, vocab_size, d_model, nhead, num_layers, dim_feedforward, dropout, max_len, activation,
                         norm_first, positional, pad_idx, layer_norm_eps):
            self.pad_idx = pad_idx
            self.tok_embed = tnn.Embedding(vocab_size, d_model, padding_idx=pad_idx)
            pos = positions(positional, d_model, max_len)
            if pos is not None:
                setattr(self, "pos_embed" if positional == "learned" else "positional", pos)
            self.dropout = tnn.Dropout(dropout)
            layer = tnn.TransformerEncoderLayer(d_model, nhead, dim_feedforward, dropout, activation, layer_norm_eps,
                                                batch_first=True, norm_first=norm_first)
            self.encoder = tnn.TransformerEncoder(layer, num_layers, tnn.LayerNorm(d_model, eps=layer_norm_eps),
                                                  enable_nested_tensor=False)

        def hidden_states(self, ids, mask, causal):
            x = self.tok_embed(ids)
            pos = getattr(self, "pos_embed", None) or getattr(self, "positional", None)
            x = self.dropout(pos(x) if pos is not None else x)
            return self.encoder(x, mask=causal_mask(ids.size(1), ids.device) if causal else None,
                                src_key_padding_mask=mask)

    class CausalLM(EncoderOnly):
        def __init__(self, vocab_size, d_model=512, nhead=8, num_layers=6, dim_feedforward=2048, dropout=0.1,
                     max_len=1024, norm_first=True, activation="gelu", positional="learned", tie_weights=False,
                     pad_idx=None, layer_norm_eps=1e-5):
            super().__init__()
            self.config = _arguments(locals(), type(self).__init__)
            self._build_trunk(vocab_size, d_model, nhead, num_layers, dim_feedforward, dropout, max_len, activation,
                              norm_first, positional, pad_idx, layer_norm_eps)
            self.tie_weights = tie_weights
            if not tie_weights:
                self.lm_head = tnn.Linear(d_model, vocab_size, bias=False)

        def forward(self, input_ids, key_padding_mask=None):
            hidden = self.hidden_states(input_ids, padding(input_ids, self.pad_idx, key_padding_mask), causal=True)
            return tF.linear(hidden, self.tok_embed.weight if self.tie_weights else self.lm_head.weight)

    class EncoderClassifier(EncoderOnly):
        def __init__(self, vocab_size, num_classes, d_model=512, nhead=8, num_layers=6, dim_feedforward=2048,
                     dropout=0.1, max_len=512, norm_first=False, activation="gelu", pooling="mean",
                     positional="learned", pad_idx=None, layer_norm_eps=1e-5):
            super().__init__()
            self.config = _arguments(locals(), type(self).__init__)
            self._build_trunk(vocab_size, d_model, nhead, num_layers, dim_feedforward, dropout, max_len, activation,
                              norm_first, positional, pad_idx, layer_norm_eps)
            self.pooling = pooling
            self.classifier = tnn.Linear(d_model, num_classes)

        def forward(self, input_ids, key_padding_mask=None):
            mask = padding(input_ids, self.pad_idx, key_padding_mask)
            hidden = self.hidden_states(input_ids, mask, causal=False)
            if self.pooling == "first":
                return self.classifier(hidden[:, 0])
            valid = torch.ones_like(input_ids, dtype=hidden.dtype) if mask is None else (~mask).to(hidden.dtype)
            counts = valid.sum(1, keepdim=True).clamp(min=1)
            return self.classifier((hidden * valid[:, :, None]).sum(1) / counts)

    return {"Seq2SeqTransformer": Seq2SeqTransformer, "CausalLM": CausalLM, "EncoderClassifier": EncoderClassifier}
