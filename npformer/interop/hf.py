"""Hugging Face transformers models <-> npformer models, with the same weights and numbers.

from_hf(GPT2LMHeadModel) -> CausalLM, from_hf(BertModel) -> BidirectionalEncoder,
from_hf(BertForSequenceClassification) -> EncoderClassifier, from_hf(LlamaForCausalLM,
Qwen2ForCausalLM or MistralForCausalLM) -> a Llama-style CausalLM (RMSNorm, SwiGLU, RoPE,
grouped-query attention, no biases; Qwen2's q/k/v biases, Mistral's sliding window), and to_hf
back. The configs and weight names are mapped by npformer.models.huggingface (shared with
the safetensors files); this module only moves tensors between transformers objects and npformer.
transformers (and torch) are imported inside these functions only.
"""
from __future__ import annotations

from typing import Any

from .. import models
from ..models.huggingface import ARCHITECTURES, config_from_hf, hf_config, hf_state_dict, state_dict_from_hf
from .pytorch import _our_dtype, _torch, _torch_dtype

HFModel = Any  # a transformers PreTrainedModel (for type hints: transformers is imported lazily)


def _transformers():
    import transformers  # a dev/test dependency: only imported when from_hf/to_hf is used
    return transformers


def from_hf(hf_model: HFModel) -> models.CausalLM | models.BidirectionalEncoder | models.EncoderClassifier:
    """The npformer model equivalent to a transformers GPT2LMHeadModel, BertModel,
    BertForSequenceClassification, LlamaForCausalLM, Qwen2ForCausalLM or MistralForCausalLM,
    with its weights (copied), dtype (float32/float64) and training mode. Raises ValueError
    naming the config option or the first weight key that has no npformer counterpart, TypeError
    for another kind of model."""
    transformers = _transformers()
    name = type(hf_model).__name__
    if name not in ARCHITECTURES or not isinstance(hf_model, getattr(transformers, name)):
        raise TypeError(f"from_hf: expected a transformers {', '.join(ARCHITECTURES)}, got {name}")
    pooler = name != "BertModel" or hf_model.pooler is not None
    class_name, config = config_from_hf(hf_model.config.to_dict(), architecture=name, pooler=pooler)
    ours = getattr(models, class_name)(**config)
    dtype = _our_dtype(hf_model, "from_hf")
    tensors = {key: t.detach().cpu().numpy() for key, t in hf_model.state_dict().items()}
    state, _ = state_dict_from_hf(ours, tensors)
    ours.to(dtype=dtype).load_state_dict(state)
    return ours.train(hf_model.training)


def to_hf(model: models.CausalLM | models.BidirectionalEncoder | models.EncoderClassifier) -> HFModel:
    """The transformers model equivalent to an npformer CausalLM (GPT2LMHeadModel; a Llama-style
    one: LlamaForCausalLM, Qwen2ForCausalLM with qkv_bias=True, MistralForCausalLM with a
    sliding_window), BidirectionalEncoder (BertModel) or EncoderClassifier
    (BertForSequenceClassification), with its weights (copied), dtype and training mode. Raises
    ValueError naming an option that the Hugging Face architecture cannot express (see
    npformer.models.huggingface.hf_config)."""
    transformers, torch = _transformers(), _torch()
    config = hf_config(model)
    architecture = config["architectures"][0]
    cls = getattr(transformers, architecture)
    hf_settings = cls.config_class.from_dict({k: v for k, v in config.items() if k != "model_type"})
    options = {"add_pooling_layer": model.config["pooler"]} if architecture == "BertModel" else {}
    hf_model = cls(hf_settings, **options).to(_torch_dtype(model, "to_hf"))
    tensors = {key: torch.tensor(array) for key, array in hf_state_dict(model).items()}
    missing, unexpected = hf_model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if model.config.get("tie_weights") else set()
    if unexpected or set(missing) - tied:  # cannot happen unless the mapping and transformers disagree
        raise RuntimeError(f"to_hf: {architecture} did not take the mapped weights: missing {missing}, "
                           f"unexpected {unexpected}")
    return hf_model.train(model.training)
