"""npformer.nn: modules named and behaving like torch.nn (batch-first), built on npformer.functional."""
from . import init
from .attention import MultiheadAttention
from .config import TransformerConfig
from .hook_points import ActivationCache, HookedModel, HookPoint, hook_point_names, hook_points
from .layers import GELU, Dropout, Embedding, Identity, LayerNorm, Linear, ReLU, RMSNorm, SiLU, SwiGLU
from .module import Module, ModuleList, Parameter, Sequential, inference_mode, is_inference_mode_enabled
from .positional import LearnedPositionalEmbedding, RotaryEmbedding, SinusoidalPositionalEncoding
from .recording import AttentionRecord, AttentionRecorder, record_attention
from .transformer import (DecoderCache, Transformer, TransformerDecoder, TransformerDecoderLayer,
                          TransformerEncoder, TransformerEncoderLayer, make_norm)

__all__ = ["init", "Module", "ModuleList", "Parameter", "Sequential", "Linear", "Embedding", "LayerNorm",
           "RMSNorm", "Dropout", "ReLU", "GELU", "SiLU", "SwiGLU", "Identity", "MultiheadAttention",
           "SinusoidalPositionalEncoding", "LearnedPositionalEmbedding", "RotaryEmbedding", "TransformerEncoderLayer",
           "TransformerDecoderLayer", "TransformerEncoder", "TransformerDecoder", "Transformer", "TransformerConfig",
           "DecoderCache", "make_norm", "record_attention",
           "AttentionRecorder", "AttentionRecord", "inference_mode", "is_inference_mode_enabled",
           "HookPoint", "ActivationCache", "HookedModel", "hook_points", "hook_point_names"]
