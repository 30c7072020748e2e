"""The cases of npformer.nn's modules: each module's input gradients and the gradient of every
parameter, against the same module converted to torch (`interop.to_torch`)."""
import numpy as np

from npformer import nn
from npformer.functional.rotary.cases import ROTARY_POSITIONS, torch_rope
from npformer.runtime import random

from .inputs import normal, op_case
from .registry import Family, register

B, T, E = 2, 4, 8
PAD = np.array([[False, False, False, True], [False, False, False, False]])      # True = padding
CAUSAL = np.triu(np.ones((T, T), dtype=bool), 1)                                    # True = may not attend

FAMILIES = [
    Family("multihead_attention", ("nn.MultiheadAttention",), "npformer/nn/attention.py",
           tests="tests/nn/test_nn_attention.py"),
    Family("transformer", ("nn.TransformerEncoderLayer", "nn.TransformerDecoderLayer", "nn.Transformer"),
           "npformer/nn/transformer.py", tests="tests/nn/test_nn_transformer.py"),
]


def randomize_vectors(module, rng):
    """Every 1-D parameter (biases, norm weights) drawn standard normal: torch inits attention
    biases at 0 and LayerNorm at weight 1, bias 0, which would hide gradients. Returns the module."""
    for p in module.parameters():
        if p.ndim == 1:
            p.data = rng.standard_normal(p.shape).astype(p.dtype)
    return module


def _module_case(name, family, module, inputs, fn, torch=None, **options):
    return op_case(name, family, inputs, fn, torch, module=lambda rng: randomize_vectors(module(), rng), **options)


def _call(m, x):
    return m(x)


def _torch_call(t, m, x):
    return m(x)


def _seeded_call(m, x):
    random.manual_seed(3)  # the same dropout mask on every evaluation
    return m(x)


def _activation_inputs(rng):
    x = 2 * rng.standard_normal((3, 4))
    x[np.abs(x) < 0.1] = 0.5  # keep finite differences away from relu's kink
    return [x]


_SMALL = dict(d_model=4, nhead=2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=6)


def _layer_cases(norm_first):
    """An encoder layer (relu) with key padding and a decoder layer (gelu) with a causal
    self-attention and memory padding, small enough for finite differences over every parameter."""
    name, options = ("pre-LN" if norm_first else "post-LN"), dict(dim_feedforward=6, dropout=0.0, norm_first=norm_first)
    pad = PAD[:, 1:]                                                          # (B, 3)
    return [
        _module_case(f"nn.TransformerEncoderLayer ({name})", "transformer",
                     lambda: nn.TransformerEncoderLayer(4, 2, **options), normal((B, 3, 4)),
                     lambda m, x: m(x, src_key_padding_mask=pad),
                     lambda t, m, x: m(x, src_key_padding_mask=t.tensor(pad))),
        _module_case(f"nn.TransformerDecoderLayer ({name}, gelu)", "transformer",
                     lambda: nn.TransformerDecoderLayer(4, 2, activation="gelu", **options), normal((B, 2, 4), (B, 3, 4)),
                     lambda m, x, mem: m(x, mem, tgt_is_causal=True, memory_key_padding_mask=pad),
                     lambda t, m, x, mem: m(x, mem, tgt_mask=t.tensor(CAUSAL[:2, :2]), tgt_is_causal=True,
                                            memory_key_padding_mask=t.tensor(pad))),
    ]


_IDS = np.array([[1, 5, 1], [0, 1, 2]])  # repeated ids accumulate


def _embedding_case(padding_idx):
    label = "" if padding_idx is None else f" (padding_idx={padding_idx})"
    return op_case(f"nn.Embedding{label}", "embedding", normal((2, 3, 3)), lambda m, x: m(_IDS) * x,
                   lambda t, m, x: m(t.tensor(_IDS)) * x,
                   module=lambda rng: nn.Embedding(6, 3, padding_idx=padding_idx),
                   finite_differences=padding_idx is None)


CASES = [
    _module_case("nn.Linear", "linear", lambda: nn.Linear(4, 3), normal((2, 5, 4)), _call, _torch_call),
    _module_case("nn.Linear (bias=False)", "linear", lambda: nn.Linear(3, 2, bias=False), normal((2, 2, 3)), _call,
                 _torch_call),
    _module_case("nn.ReLU", "relu", nn.ReLU, _activation_inputs, _call, lambda t, m, x: t.relu(x), convert=False),
    _module_case("nn.GELU", "gelu", nn.GELU, _activation_inputs, _call, lambda t, m, x: t.nn.functional.gelu(x),
                 convert=False),
    _module_case("nn.GELU (tanh)", "gelu", lambda: nn.GELU("tanh"), _activation_inputs, _call,
                 lambda t, m, x: t.nn.functional.gelu(x, approximate="tanh"), convert=False),
    _module_case("nn.Dropout (eval)", "dropout", lambda: nn.Dropout(0.3).eval(), normal((3, 4)), _call,
                 lambda t, m, x: t.nn.functional.dropout(x, 0.3, training=False), convert=False),
    _module_case("nn.Dropout (train, seeded)", "dropout", lambda: nn.Dropout(0.4), normal((4, 5)), _seeded_call),
    _module_case("nn.LayerNorm", "layer_norm", lambda: nn.LayerNorm(5), normal((2, 3, 5), scale=3.0, offset=2.0), _call, _torch_call),
    _module_case("nn.LayerNorm (bias=False)", "layer_norm", lambda: nn.LayerNorm(4, bias=False),
                 normal((2, 3, 4), scale=3.0, offset=2.0), _call, _torch_call),
    _module_case("nn.LayerNorm (no affine)", "layer_norm", lambda: nn.LayerNorm(4, elementwise_affine=False),
                 normal((2, 3, 4), scale=3.0, offset=2.0), _call, _torch_call),
    _module_case("nn.LayerNorm (eps=1e-3)", "layer_norm", lambda: nn.LayerNorm(4, eps=1e-3),
                 normal((2, 3, 4), scale=3.0, offset=2.0), _call, _torch_call),
    _module_case("nn.RMSNorm (no affine)", "rms_norm", lambda: nn.RMSNorm(4, elementwise_affine=False),
                 normal((2, 3, 4), scale=3.0, offset=2.0), _call, lambda t, m, x: t.nn.functional.rms_norm(x, (4,)),
                 convert=False),
    # interop.to_torch has no RMSNorm or SwiGLU yet: tests/functional/test_op_rms_norm.py and test_op_swiglu.py
    # compare these with torch.nn.RMSNorm and Llama's feed-forward written in torch
    _module_case("nn.RMSNorm", "rms_norm", lambda: nn.RMSNorm((3, 4), eps=1e-3), normal((2, 3, 4), offset=1.0), _call),
    _module_case("nn.SiLU", "silu", nn.SiLU, _activation_inputs, _call, lambda t, m, x: t.nn.functional.silu(x),
                 convert=False),
    _module_case("nn.SwiGLU", "swiglu", lambda: nn.SwiGLU(4, 6), normal((2, 3, 4)), _call),
    _module_case("nn.SwiGLU (bias=False, out_features=3)", "swiglu", lambda: nn.SwiGLU(4, 5, 3, bias=False),
                 normal((2, 4)), _call),
    _embedding_case(None),
    _embedding_case(1),
    _embedding_case(-1),
    _module_case("nn.RotaryEmbedding", "rotary", lambda: nn.RotaryEmbedding(6), normal((2, 2, 5, 6)), _call,
                 lambda t, m, x: torch_rope(t, x), convert=False),
    _module_case("nn.RotaryEmbedding (position_ids)", "rotary", lambda: nn.RotaryEmbedding(6), normal((2, 2, 4, 6)),
                 lambda m, x: m(x, position_ids=ROTARY_POSITIONS),
                 lambda t, m, x: torch_rope(t, x, positions=ROTARY_POSITIONS), convert=False),
    # key and value separate inputs: a gradient that lands on the other one shows
    _module_case("nn.MultiheadAttention", "multihead_attention", lambda: nn.MultiheadAttention(E, 2, batch_first=True),
                 normal((B, T, E), (B, T, E), (B, T, E)),
                 lambda m, x, k, v: m(x, k, v, key_padding_mask=PAD, attn_mask=CAUSAL),
                 lambda t, m, x, k, v: m(x, k, v, key_padding_mask=t.tensor(PAD), attn_mask=t.tensor(CAUSAL))),
] + [case for norm_first in (False, True) for case in _layer_cases(norm_first)] + [
    _module_case("nn.Transformer (1+1 layers, d=4)", "transformer", lambda: nn.Transformer(**_SMALL, dropout=0.0),
                 normal((B, 3, 4), (B, 2, 4)),
                 lambda m, s, x: m(s, x, tgt_is_causal=True, src_key_padding_mask=PAD[:, 1:]),
                 lambda t, m, s, x: m(s, x, tgt_mask=t.tensor(CAUSAL[:2, :2]), tgt_is_causal=True,
                                      src_key_padding_mask=t.tensor(PAD[:, 1:]))),
]

register(*FAMILIES, *CASES)
