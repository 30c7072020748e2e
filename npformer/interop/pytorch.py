"""Move modules between npformer and torch.nn with the same weights and the same numbers.

`to_torch(module)` builds the equivalent torch module (same dtype, training mode and
state_dict) and `from_torch(torch_module)` builds ours. Supported: nn.Transformer,
TransformerEncoder/DecoderLayer, TransformerEncoder/Decoder, MultiheadAttention, Linear,
LayerNorm, RMSNorm, Embedding, and npformer's models, whose torch counterparts are the compositions of
torch.nn modules in `torch_modules` (identical state_dict keys and forward math).
npformer is batch-first only: torch modules built with batch_first=False are refused (the
error says how to rebuild them). torch is imported inside these functions only.
"""
from __future__ import annotations

import warnings
from typing import Any

from .. import models, nn
from .torch_modules import torch_model_classes, torch_unsupported

TorchModule = Any  # a torch.nn.Module (for type hints: torch is imported lazily, never at import time)
MODELS = (models.Seq2SeqTransformer, models.CausalLM, models.BidirectionalEncoder, models.EncoderClassifier)


def _torch():
    import torch  # a dev/test dependency: only imported when interop is used
    return torch


def _torch_dtype(module, owner="to_torch"):
    torch = _torch()
    dtypes = {str(p.dtype) for p in module.parameters()}
    if not dtypes:
        return None  # nothing to convert (e.g. LayerNorm without affine parameters)
    if len(dtypes) != 1:
        raise TypeError(f"{owner}: expected one parameter dtype, got {sorted(dtypes)}")
    if not dtypes <= {"float32", "float64"}:  # as from_torch / from_hf take them back
        raise TypeError(f"{owner}: expected float32 or float64 parameters, got {sorted(dtypes)}")
    return {"float32": torch.float32, "float64": torch.float64}[dtypes.pop()]


def _our_dtype(torch_module, owner="from_torch"):
    dtypes = {str(p.dtype).replace("torch.", "") for p in torch_module.parameters()}
    if not dtypes:
        return None
    if len(dtypes) != 1 or not dtypes <= {"float32", "float64"}:
        raise TypeError(f"{owner}: expected float32 or float64 parameters of one dtype, got {sorted(dtypes)}")
    return dtypes.pop()


def _torch_activation(layer):
    """The torch layer's `activation` argument for ours: torch.nn's names, GELU(tanh) for gelu_tanh."""
    name = layer.activation_name
    if name is None:
        raise ValueError("to_torch: only activations given by name ('relu', 'gelu', 'gelu_tanh') can be converted")
    return _torch().nn.GELU(approximate="tanh") if name == "gelu_tanh" else name


def _no_rotary(module):
    for m in module.modules():
        if isinstance(m, nn.MultiheadAttention) and m.rotary:
            raise NotImplementedError("to_torch: rotary position embeddings (RoPE) have no torch.nn "
                                      "counterpart; only sinusoidal, learned or no positions convert"
                                      + _HF_HINT * isinstance(module, models.CausalLM))


_HF_HINT = "; npformer.interop.to_hf converts Llama-style models to transformers (Llama, Qwen2, Mistral)"


def _torch_expressible(module):
    """NotImplementedError naming the first option of a model's config that torch.nn's
    Transformer layers cannot express (torch_modules.torch_unsupported)."""
    if isinstance(module, MODELS):
        unsupported = torch_unsupported(module.config)
        if unsupported:
            raise NotImplementedError(f"to_torch: {type(module).__name__}({unsupported}) has no torch.nn "
                                      f"counterpart (torch.nn's Transformer layers have no RMSNorm, SwiGLU, "
                                      f"grouped-query or sliding-window attention, separate q/k/v biases or "
                                      f"rotary positions){_HF_HINT}")


def _layer_options(layer):
    """torch's constructor arguments of our encoder or decoder layer, from its TransformerConfig."""
    c = layer.config
    return dict(d_model=c.d_model, nhead=c.nhead, dim_feedforward=c.dim_feedforward, dropout=c.dropout,
                activation=_torch_activation(layer), layer_norm_eps=c.layer_norm_eps, norm_first=c.norm_first,
                bias=c.bias)


def _torch_layer_options(layer):
    """Our TransformerConfig's settings read off a torch.nn.TransformerEncoderLayer/DecoderLayer:
    the arguments of `_layer_options`, and attention_dropout / activation_dropout where the
    layer's self_attn.dropout / dropout.p differ from its residual dropout (dropout1)."""
    tnn, tF = _torch().nn, _torch().nn.functional
    act = layer.activation
    if act is tF.relu or isinstance(act, tnn.ReLU):
        activation = "relu"
    elif act is tF.gelu or (isinstance(act, tnn.GELU) and act.approximate == "none"):
        activation = "gelu"
    elif isinstance(act, tnn.GELU) and act.approximate == "tanh":
        activation = "gelu_tanh"
    else:
        raise ValueError("from_torch: only layers with activation relu or gelu (exact, or GELU(approximate='tanh')) "
                         "can be converted")
    dropout = layer.dropout1.p  # the residual dropout; attention and activation dropout may differ from it
    return dict(d_model=layer.self_attn.embed_dim, nhead=layer.self_attn.num_heads,
                dim_feedforward=layer.linear1.out_features, dropout=dropout,
                attention_dropout=None if layer.self_attn.dropout == dropout else layer.self_attn.dropout,
                activation_dropout=None if layer.dropout.p == dropout else layer.dropout.p,
                activation=activation, layer_norm_eps=layer.norm1.eps,
                norm_first=layer.norm_first, bias=layer.linear1.bias is not None)


def _torch_layer(layer, dtype):
    torch = _torch()
    options = _layer_options(layer)
    cls = (torch.nn.TransformerEncoderLayer if isinstance(layer, nn.TransformerEncoderLayer)
           else torch.nn.TransformerDecoderLayer)
    twin = cls(options.pop("d_model"), options.pop("nhead"), batch_first=True, dtype=dtype, **options)
    return _set_dropout_rates(twin, layer.config)


def _set_dropout_rates(torch_module, config):
    """torch.nn's layers take one dropout rate; ours may give the attention weights and the
    feed-forward activation their own (config.attention_dropout, activation_dropout): set them
    on every attention module and layer of `torch_module`. Returns it."""
    tnn = _torch().nn
    for m in torch_module.modules():
        if isinstance(m, tnn.MultiheadAttention):
            m.dropout = config.attention_dropout_p
        elif isinstance(m, (tnn.TransformerEncoderLayer, tnn.TransformerDecoderLayer)):
            m.dropout.p = config.activation_dropout_p
    return torch_module


def _attention_options(attention):
    """kdim, vdim, add_bias_kv, add_zero_attn, read off ours or torch's MultiheadAttention."""
    return dict(kdim=attention.kdim, vdim=attention.vdim, add_bias_kv=attention.bias_k is not None,
                add_zero_attn=attention.add_zero_attn)


def _norm_options(norm):
    """LayerNorm arguments, read off ours or torch's (same attribute names)."""
    return dict(eps=norm.eps, elementwise_affine=norm.weight is not None, bias=norm.bias is not None)


def _rms_norm_options(norm):
    """RMSNorm arguments, read off ours or torch's (same names; eps None: the dtype's epsilon in both)."""
    return dict(eps=norm.eps, elementwise_affine=norm.weight is not None)


def _build_torch(module, dtype):
    torch = _torch()
    tnn = torch.nn
    if isinstance(module, MODELS):
        return torch_model_classes()[type(module).__name__](**module.config).to(dtype)
    if isinstance(module, nn.Transformer):
        layer = module.encoder.layers[0]
        options = _layer_options(layer)
        return _set_dropout_rates(tnn.Transformer(num_encoder_layers=len(module.encoder.layers),
                                                  num_decoder_layers=len(module.decoder.layers), batch_first=True,
                                                  dtype=dtype, **options), layer.config)
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
                                      bias=module.in_proj_bias is not None, batch_first=True, dtype=dtype,
                                      **_attention_options(module))
    if isinstance(module, nn.Linear):
        return tnn.Linear(module.in_features, module.out_features, bias=module.bias is not None, dtype=dtype)
    if isinstance(module, nn.LayerNorm):
        return tnn.LayerNorm(module.normalized_shape, dtype=dtype, **_norm_options(module))
    if isinstance(module, nn.RMSNorm):
        return tnn.RMSNorm(module.normalized_shape, dtype=dtype, **_rms_norm_options(module))
    if isinstance(module, nn.Embedding):
        return tnn.Embedding(module.num_embeddings, module.embedding_dim, padding_idx=module.padding_idx, dtype=dtype)
    raise TypeError(f"to_torch: no torch counterpart for {type(module).__name__}")


def to_torch(module: nn.Module) -> TorchModule:
    """The equivalent torch module with `module`'s weights (copied), dtype and training mode:
    torch.nn's own class for nn layers, the composition in `torch_model_classes()` for models.
    Raises TypeError for a module that has no torch counterpart (or is not an npformer module),
    ValueError for an activation given as a callable, NotImplementedError for rotary embeddings
    and the options torch.nn's layers cannot express (RMSNorm, SwiGLU, grouped-query or
    sliding-window attention: npformer.interop.to_hf converts Llama-style models)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"to_torch: expected an npformer nn.Module, got {type(module).__name__}")
    _no_rotary(module)
    _torch_expressible(module)
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
        return nn.Transformer(config=nn.TransformerConfig(num_encoder_layers=len(module.encoder.layers),
                                                          num_decoder_layers=len(module.decoder.layers), **options))
    if isinstance(module, (tnn.TransformerEncoderLayer, tnn.TransformerDecoderLayer)):
        return _our_layer(module)
    if isinstance(module, (tnn.TransformerEncoder, tnn.TransformerDecoder)):
        norm = module.norm and nn.LayerNorm(module.norm.normalized_shape, **_norm_options(module.norm))
        if isinstance(module, tnn.TransformerEncoder):
            return nn.TransformerEncoder(_our_layer(module.layers[0]), len(module.layers), norm)
        return nn.TransformerDecoder(_our_layer(module.layers[0]), len(module.layers), norm)
    if isinstance(module, tnn.MultiheadAttention):
        if not module.batch_first:
            raise ValueError("from_torch: only MultiheadAttention(batch_first=True) can be converted (npformer "
                             "is batch-first only); rebuild it with batch_first=True and copy the state_dict")
        return nn.MultiheadAttention(module.embed_dim, module.num_heads, dropout=module.dropout,
                                     bias=module.in_proj_bias is not None, **_attention_options(module))
    if isinstance(module, tnn.Linear):
        return nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
    if isinstance(module, tnn.LayerNorm):
        return nn.LayerNorm(module.normalized_shape, **_norm_options(module))
    if isinstance(module, tnn.RMSNorm):
        return nn.RMSNorm(module.normalized_shape, **_rms_norm_options(module))
    if isinstance(module, tnn.Embedding):
        return nn.Embedding(module.num_embeddings, module.embedding_dim, padding_idx=module.padding_idx)
    raise TypeError(f"from_torch: no npformer counterpart for {type(module).__name__}")


def _our_layer(layer):
    torch = _torch()
    cls = nn.TransformerEncoderLayer if isinstance(layer, torch.nn.TransformerEncoderLayer) else nn.TransformerDecoderLayer
    return cls(config=nn.TransformerConfig(**_torch_layer_options(layer)))


def _check_batch_first(torch_module):
    """Refuse a torch transformer module built with batch_first=False (torch's default): ours
    takes (batch, seq, feature), so the same (seq, batch, feature) input would silently mean
    something else. The weights do not depend on the layout: the message says how to rebuild."""
    tnn = _torch().nn
    attentions = [m for m in torch_module.modules() if isinstance(m, tnn.MultiheadAttention)]
    if isinstance(torch_module, tnn.MultiheadAttention) or all(a.batch_first for a in attentions):
        return
    name = type(torch_module).__name__
    raise ValueError(
        f"from_torch: this torch.nn.{name} was built with batch_first=False (torch's default: inputs "
        f"(seq, batch, feature)), but npformer is batch-first only (inputs (batch, seq, feature)), so the "
        f"same input would mean something else. Rebuild it with batch_first=True and copy the weights, "
        f"which do not depend on the layout: `twin = torch.nn.{name}(..., batch_first=True); "
        f"twin.load_state_dict(module.state_dict()); ours = from_torch(twin)`, then feed ours x.transpose(0, 1)")


def from_torch(torch_module: TorchModule) -> nn.Module:
    """Our module equivalent to `torch_module`, with its weights (copied), dtype and training
    mode. Transformer modules must be batch-first (batch_first=True): one built with torch's
    default batch_first=False is refused with a message saying how to rebuild it (ValueError);
    TypeError for a module without an npformer counterpart."""
    torch = _torch()
    if not isinstance(torch_module, torch.nn.Module):
        raise TypeError(f"from_torch: expected a torch.nn.Module, got {type(torch_module).__name__}")
    _check_batch_first(torch_module)
    dtype = _our_dtype(torch_module)
    ours = _build_ours(torch_module).to(dtype=dtype)
    ours.load_state_dict({name: t.detach().cpu().numpy() for name, t in torch_module.state_dict().items()})
    return ours.train(torch_module.training)
