"""The cases of npformer.functional's ops: each op on ordinary inputs and on its edge cases
(masks of every kind, fully masked rows, masks that require grad, broadcast inputs, ignored
targets, padding rows, extreme logits), with
the PyTorch reference written once here."""
import numpy as np

import npformer.functional as F
from npformer.functional.activation import dropout_scale, keep_mask
from npformer.runtime import random

from .case import COMPOSITE, OpCase, torch_args
from .registry import Family, register

_constants = np.random.default_rng(1234)  # masks and class weights: drawn once, at import


def op_case(name, family, inputs, fn, torch=None, **options):
    """A case of one of npformer's own ops: in `family`, checked against its composite twin
    (twin=None for an op that has none in npformer/functional/composite.py)."""
    return OpCase(name, inputs, fn, torch, family=family, **{"twin": COMPOSITE, **options})


def normal(*shapes, scale=1.0, offset=0.0):
    """inputs: standard normal arrays of these shapes, times scale, plus offset."""
    return lambda rng: [offset + scale * rng.standard_normal(shape) for shape in shapes]


def away_from_zero(shape):
    """inputs: |x| >= 0.1, so finite differences never straddle ReLU's kink."""
    return lambda rng: [np.sign(rng.standard_normal(shape)) * (0.1 + np.abs(rng.standard_normal(shape)))]


def fixed(*arrays):
    """inputs: these arrays (float64)."""
    return lambda rng: [np.array(a, dtype=np.float64) for a in arrays]


def seeded(seed, like):
    """A fresh dropout stream for a dropout inside a case: every evaluation, on every device
    (`like`'s included), draws the same mask."""
    return random.Philox(seed)


# -- the op families (docs/backprop.md's op table) ----------------------------------------------------
def _op(name, ops_, source, functions, section):
    return Family(name, ops_, f"npformer/functional/{source}", functions, section,
                  f"tests/functional/test_op_{name}.py")


FAMILIES = [
    _op("linear", ("F.linear", "nn.Linear"), "linear.py", ("LinearFunction",), "Linear"),
    _op("relu", ("F.relu", "nn.ReLU"), "activation/", ("ReLUFunction",), "ReLU"),
    _op("gelu", ("F.gelu", "nn.GELU"), "activation/", ("GELUFunction",), "GELU"),
    _op("dropout", ("F.dropout", "nn.Dropout"), "activation/", ("DropoutFunction",), "Dropout"),
    _op("dropout_add", ("F.dropout_add",), "dropout_add/", ("DropoutAddFunction",), "Dropout + residual"),
    _op("softmax", ("F.softmax", "F.log_softmax"), "softmax/", ("SoftmaxFunction", "LogSoftmaxFunction"),
        "Softmax"),
    _op("cross_entropy", ("F.cross_entropy",), "cross_entropy/", ("CrossEntropyFunction",), "Cross-entropy"),
    _op("layer_norm", ("F.layer_norm", "nn.LayerNorm"), "layer_norm/", ("LayerNormFunction",), "LayerNorm"),
    _op("embedding", ("F.embedding", "nn.Embedding"), "embedding.py", ("EmbeddingFunction",), "Embedding"),
    _op("attention", ("F.scaled_dot_product_attention", "F.attention_backend"), "attention.py",
        ("AttentionFunction", "MemoryEfficientAttentionFunction"), "Scaled dot-product attention"),
    _op("split_heads", ("F.split_heads",), "attention.py", ("SplitHeadsFunction",), "Splitting heads"),
    _op("rotary", ("F.apply_rotary_emb", "F.rotary_cos_sin", "nn.RotaryEmbedding"), "rotary.py",
        ("RotaryEmbeddingFunction",), "RoPE"),
]


# -- the PyTorch references -------------------------------------------------------------------------
def torch_rope(t, x, cos=None, sin=None, base=10000.0, positions=None):
    """Half-split RoPE written with torch ops, x (B, H, T, hd) (or (..., T, hd) without
    positions); the tables are computed in float64 (as F.rotary_cos_sin does) unless given, at
    positions 0 .. T-1 or at `positions` (B, T) per row (an integer numpy array)."""
    T, hd = x.shape[-2:]
    if cos is None:
        inv_freq = base ** (-t.arange(0, hd, 2, dtype=t.float64) / hd)
        at = t.arange(T, dtype=t.float64) if positions is None else t.as_tensor(positions, dtype=t.float64)
        angle = at[..., None] * inv_freq                                               # (T, hd/2) or (B, T, hd/2)
        cos, sin = t.cos(angle), t.sin(angle)
        if positions is not None:
            cos, sin = cos[:, None], sin[:, None]                                      # (B, 1, T, hd/2)
    cos, sin = (t.as_tensor(a).to(x.dtype) for a in (cos, sin))
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return t.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def torch_sdpa(t, q, k, v, attn_mask=None, is_causal=False, **kwargs):
    """torch's scaled_dot_product_attention with npformer's arguments: npformer combines a mask
    with is_causal (torch refuses both), so the causal part is folded into the mask (a numpy
    array, or a torch leaf: a float mask that is differentiated)."""
    if attn_mask is not None and is_causal:
        tril = np.tril(np.ones((q.shape[-2], k.shape[-2]), dtype=bool))
        if not isinstance(attn_mask, np.ndarray):
            attn_mask = attn_mask.masked_fill(t.tensor(~tril), -np.inf)
        else:
            attn_mask = attn_mask & tril if attn_mask.dtype == bool else np.where(tril, attn_mask, -np.inf)
        is_causal = False
    mask = {} if attn_mask is None else torch_args(t, {"attn_mask": attn_mask}, q)
    return t.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal, **mask, **kwargs)


def torch_causal_attention_with_weights(t, q, k, v):
    """Causal attention through an explicit softmax, returning (out, weights)."""
    scores = (q @ k.transpose(-1, -2)) / np.sqrt(q.shape[-1])
    allowed = t.ones(q.shape[-2], k.shape[-2], dtype=t.bool).tril()
    weights = t.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return weights @ v, weights


def torch_dropout_attention(t, q, k, v, p=0.3, seed=7):
    """Causal attention whose weights are dropped by the dropout contract's mask of a fresh
    Philox(seed) (every path draws it): (out, the dropped weights)."""
    _, weights = torch_causal_attention_with_weights(t, q, k, v)
    keep = keep_mask(tuple(weights.shape), p, seed, 0, "cpu")
    dropped = weights * t.as_tensor(keep * dropout_scale(p)).to(weights.dtype)
    return dropped @ v, dropped


def mix_heads(q, k, v):
    """Every chunk of split_heads reaches the output, so the backward assembles all three gradients."""
    return q * k + 2.0 * v


# -- linear, activations, dropout ---------------------------------------------------------------------
def _linear_torch(t, *args):
    return t.nn.functional.linear(*args)


def _linear_activation_torch(kind):
    def reference(t, *args):
        h = t.nn.functional.linear(*args)
        return t.relu(h) if kind == "relu" else t.nn.functional.gelu(h, approximate="tanh" if kind == "gelu_tanh" else "none")
    return reference


LINEAR = [
    op_case("F.linear", "linear", normal((2, 3, 4), (5, 4), (5,)), F.linear, _linear_torch),
    op_case("F.linear (no bias)", "linear", normal((2, 7, 5), (6, 5)), F.linear, _linear_torch),
] + [  # the bias and the activation fused after the GEMM; ReLU's inputs kept away from its kink
    op_case(f"F.linear (activation={kind})", "linear",
            (lambda rng: [rng.standard_normal((2, 3, 4)), rng.standard_normal((5, 4)), 0.5 + rng.random(5)])
            if kind == "relu" else normal((2, 3, 4), (5, 4), (5,)),
            lambda x, w, b, kind=kind: F.linear(x, w, b, activation=kind), _linear_activation_torch(kind))
    for kind in ("relu", "gelu", "gelu_tanh")
]

RELU = [op_case("F.relu", "relu", away_from_zero((3, 5)), F.relu, lambda t, x: t.relu(x))]

GELU = [
    op_case("F.gelu", "gelu", normal((3, 5), scale=3.0), F.gelu, lambda t, x: t.nn.functional.gelu(x)),
    op_case("F.gelu (tanh)", "gelu", normal((3, 5), scale=3.0), lambda x: F.gelu(x, approximate="tanh"),
            lambda t, x: t.nn.functional.gelu(x, approximate="tanh")),
]

def _dropout_torch(t, x):
    """x * m with m the mask of a fresh Philox(7) stream (the dropout contract)."""
    keep = keep_mask(tuple(x.shape), 0.4, 7, 0, "cpu")
    return x * t.as_tensor(keep * dropout_scale(0.4)).to(x.dtype)   # not via numpy: torch.func's x has no storage


DROPOUT = [op_case("F.dropout (seeded)", "dropout", normal((4, 5)),
                   lambda x: F.dropout(x, 0.4, generator=seeded(7, x)), _dropout_torch)]


def _dropout_add_torch(t, x, residual):
    """residual + dropout(x) with F.dropout's mask (_dropout_torch)."""
    return residual + _dropout_torch(t, x)


DROPOUT_ADD = [op_case("F.dropout_add (seeded)", "dropout_add", normal((4, 5), (4, 5)),
                       lambda x, r: F.dropout_add(x, r, 0.4, generator=random.Philox(7)), _dropout_add_torch)]

# -- softmax, cross-entropy ----------------------------------------------------------------------------
SOFTMAX = [
    op_case("F.softmax", "softmax", normal((3, 5)), F.softmax, lambda t, x: t.softmax(x, dim=-1)),
    op_case("F.softmax (dim=0)", "softmax", normal((4, 5)), lambda x: F.softmax(x, dim=0),
            lambda t, x: t.softmax(x, dim=0)),
    op_case("F.softmax [[-1000, 1]]", "softmax", fixed([[-1000.0, 1.0]]), F.softmax, lambda t, x: t.softmax(x, dim=-1)),
    op_case("F.log_softmax", "softmax", normal((4, 5)), F.log_softmax, lambda t, x: t.log_softmax(x, dim=-1)),
    op_case("F.log_softmax (dim=0)", "softmax", normal((4, 5)), lambda x: F.log_softmax(x, dim=0),
            lambda t, x: t.log_softmax(x, dim=0)),
]


def cross_entropy_case(label, inputs, target, finite_differences=True, **kwargs):
    """F.cross_entropy(x, target, **kwargs) against torch's (class weights become torch tensors)."""
    target = np.asarray(target)
    return op_case(f"F.cross_entropy ({label})", "cross_entropy", inputs,
                   lambda x: F.cross_entropy(x, target, **kwargs),
                   lambda t, x: t.nn.functional.cross_entropy(x, t.tensor(target), **torch_args(t, kwargs, x)),
                   finite_differences=finite_differences)


_CLASS_WEIGHT = np.array([0.5, 1.0, 2.0, 0.1, 3.0])
CROSS_ENTROPY = [
    cross_entropy_case("smoothing", normal((3, 5)), [2, 0, 4], label_smoothing=0.1),
    cross_entropy_case("smoothing, ignore, weight", normal((5, 5)), [2, -100, 4, 0, 4],
                       weight=np.array([0.5, 1.0, 2.0, 0.3, 1.5]), label_smoothing=0.1),
    # finite differences of logits of 1e4 are meaningless (rounding of the loss ~1e-12 * 1e4 / eps)
    cross_entropy_case("logits 1e4", lambda rng: [1e4 * np.sign(rng.standard_normal((4, 5)))], [0, 1, 2, 4],
                       finite_differences=False),
    cross_entropy_case("smoothing, ignored targets", normal((6, 5)), [0, -100, 2, 4, -100, 1], label_smoothing=0.1),
    cross_entropy_case("ignore_index=0 as padding", normal((6, 5)), [0, 0, 2, 4, 3, 0], label_smoothing=0.1,
                       ignore_index=0),
    cross_entropy_case("sum", normal((4, 5)), [0, -100, 2, 4], reduction="sum"),
    cross_entropy_case("none, smoothing", normal((4, 5)), [0, -100, 2, 4], reduction="none", label_smoothing=0.2),
    cross_entropy_case("spatial (N, C, d1, d2)", normal((2, 5, 3, 2)), [[[0, 1], [4, -100], [2, 2]]] * 2,
                       label_smoothing=0.1),
    cross_entropy_case("spatial, none", normal((2, 5, 3)), [[0, 1, 4], [2, -100, 3]], reduction="none"),
    cross_entropy_case("unbatched", normal((5,)), 3),
    cross_entropy_case("weights", normal((6, 5)), [0, -100, 2, 4, 3, 3], weight=_CLASS_WEIGHT),
    cross_entropy_case("weights, smoothing", normal((6, 5)), [0, -100, 2, 4, 3, 3], weight=_CLASS_WEIGHT,
                       label_smoothing=0.3),
    cross_entropy_case("weights, smoothing, sum", normal((6, 5)), [0, -100, 2, 4, 3, 3], weight=_CLASS_WEIGHT,
                       label_smoothing=0.3, reduction="sum"),
]



def probabilities(rng, shape, axis):
    """Class probabilities (soft labels) of `shape`, normalised along the class `axis`."""
    q = rng.random(shape) + 0.05
    return q / q.sum(axis=axis, keepdims=True)


def probability_case(label, shape, differentiate_target=False, **kwargs):
    """F.cross_entropy(x, target probabilities, **kwargs) against torch's; the target is a constant
    drawn once, or, with differentiate_target, an input that is differentiated like the logits."""
    axis = 0 if len(shape) == 1 else 1
    torch_ce = lambda t, x, q: t.nn.functional.cross_entropy(x, q, **torch_args(t, kwargs, x))  # noqa: E731
    if differentiate_target:
        return op_case(f"F.cross_entropy (probabilities, {label})", "cross_entropy",
                       lambda rng: [rng.standard_normal(shape), probabilities(rng, shape, axis)],
                       lambda x, q: F.cross_entropy(x, q, **kwargs), torch_ce)
    target = probabilities(_constants, shape, axis)
    return op_case(f"F.cross_entropy (probabilities, {label})", "cross_entropy", normal(shape),
                   lambda x: F.cross_entropy(x, target.astype(x.dtype), **kwargs),
                   lambda t, x: torch_ce(t, x, t.tensor(target).to(x.dtype)))


CROSS_ENTROPY += [
    probability_case("mean", (4, 5)),
    probability_case("smoothing, weights", (4, 5), weight=_CLASS_WEIGHT, label_smoothing=0.2),
    probability_case("sum, weights", (4, 5), weight=_CLASS_WEIGHT, reduction="sum"),
    probability_case("spatial (N, C, d1), none, smoothing", (2, 5, 3), reduction="none", label_smoothing=0.1),
    probability_case("unbatched", (5,)),
    probability_case("target differentiated, smoothing", (3, 5), differentiate_target=True, label_smoothing=0.1),
]

# -- layer norm, embedding -----------------------------------------------------------------------------
def layer_norm_case(label, shape, normalized_shape, affine, **kwargs):
    """F.layer_norm over the trailing `normalized_shape` with `affine` of (weight, bias)."""
    def inputs(rng):
        params = [1 + rng.standard_normal(normalized_shape), rng.standard_normal(normalized_shape)]
        return [rng.standard_normal(shape)] + params[:affine]
    return op_case(f"F.layer_norm{label}", "layer_norm", inputs,
                   lambda x, *p: F.layer_norm(x, normalized_shape, *p, **kwargs),
                   lambda t, x, *p: t.nn.functional.layer_norm(x, normalized_shape, *p, **kwargs),
                   input_names=("x", "weight", "bias")[:1 + affine])


LAYER_NORM = [
    layer_norm_case("", (2, 3, 5), (5,), 2),
    layer_norm_case(" ((4, 5), eps=1e-3)", (2, 3, 4, 5), (4, 5), 2, eps=1e-3),
    layer_norm_case(" ((4, 5), weight only)", (2, 3, 4, 5), (4, 5), 1, eps=1e-3),
    layer_norm_case(" ((4, 5), no affine)", (2, 3, 4, 5), (4, 5), 0, eps=1e-3),
    # the bias added after torch's layer_norm: the same function, but torch's double backward of
    # layer_norm(x, shape, None, bias) fails ("Expected a proper Tensor but got None", torch 2.x)
    op_case("F.layer_norm (bias only)", "layer_norm", normal((2, 3, 5), (5,)), lambda x, b: F.layer_norm(x, 5, None, b),
            lambda t, x, b: t.nn.functional.layer_norm(x, (5,)) + b),
]


def embedding_case(label, ids, vocab, dim, padding_idx=None, **options):
    """F.embedding(ids, weight, padding_idx, **options); with a padding row, whose gradient is held at
    zero on purpose, or scale_grad_by_freq, which scales it on purpose, finite differences would see
    the difference: no gradcheck there, nor with max_norm (which renormalises the weight in place)."""
    ids = np.asarray(ids)
    return op_case(f"F.embedding{label}", "embedding", normal((vocab, dim)),
                   lambda w: F.embedding(ids, w, padding_idx=padding_idx, **options),
                   lambda t, w: t.nn.functional.embedding(t.tensor(ids), w, padding_idx=padding_idx, **options),
                   finite_differences=padding_idx is None and not options)


_REPEATED_IDS = [[2, 2, 2, 5], [0, 5, 2, 6], [6, 6, 1, 1]]
EMBEDDING = [
    embedding_case("", [[1, 3, 3, 0], [6, 1, 3, 3]], 7, 3),
    embedding_case(" (padding_idx=3)", [[1, 3, 3, 0], [6, 1, 3, 3]], 7, 3, padding_idx=3),
    embedding_case(" (repeated ids)", _REPEATED_IDS, 7, 4),
    embedding_case(" (repeated ids, padding_idx=2)", _REPEATED_IDS, 7, 4, padding_idx=2),
    embedding_case(" (repeated ids, padding_idx=-1)", _REPEATED_IDS, 7, 4, padding_idx=-1),
    embedding_case(" (scale_grad_by_freq)", _REPEATED_IDS, 7, 4, scale_grad_by_freq=True),
    embedding_case(" (scale_grad_by_freq, padding_idx=2)", _REPEATED_IDS, 7, 4, padding_idx=2, scale_grad_by_freq=True),
    embedding_case(" (max_norm=1)", _REPEATED_IDS, 7, 4, max_norm=1.0),
    embedding_case(" (max_norm=1.5, norm_type=1)", _REPEATED_IDS, 7, 4, max_norm=1.5, norm_type=1.0),
    embedding_case(" (max_norm=0.8, norm_type=inf)", _REPEATED_IDS, 7, 4, max_norm=0.8, norm_type=float("inf")),
]

# -- attention -------------------------------------------------------------------------------------------
B, H, TQ, TK, HD = 2, 2, 5, 6, 3
PATHS = {"": {}, "memory-efficient ": {"memory_efficient": True, "block_size": 2}}


def attention_masks(rng, tq=TQ, tk=TK):
    """name -> npformer's keyword arguments, for every kind of mask (bool: True = takes part)."""
    pad = np.ones((B, 1, 1, tk), dtype=bool)
    pad[1, ..., tk - 2:] = False                                   # batch 1: the last two keys are padding
    tril = np.tril(np.ones((tq, tk), dtype=bool))
    fully = np.ones((tq, tk), dtype=bool)
    fully[1] = False                                               # query row 1 sees no key
    additive = rng.standard_normal((B, H, tq, tk))
    additive[0, 1, tq - 1, :3] = -np.inf
    additive[1, 0, tq - 2] = -np.inf                               # a fully masked row in a float mask
    return {
        "no mask": {},
        "causal": {"is_causal": True},
        "padding": {"attn_mask": pad},
        "causal and padding in one mask": {"attn_mask": pad & tril},
        "is_causal with padding": {"attn_mask": pad, "is_causal": True},
        "fully masked row": {"attn_mask": fully},
        "float mask with a fully masked row": {"attn_mask": additive},
        "float causal mask": {"attn_mask": np.triu(np.full((tq, tk), -np.inf), 1)},  # generate_square_subsequent_mask
        "scale=0.3, causal": {"scale": 0.3, "is_causal": True},
    }


def attention_case(label, kwargs, path=None, shapes=((B, H, TQ, HD), (B, H, TK, HD), (B, H, TK, HD)), **options):
    """F.scaled_dot_product_attention(q, k, v, **kwargs) on one path against torch's."""
    path = path or {}
    return op_case(f"F.sdpa {label}", "attention", normal(*shapes),
                   lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **kwargs, **path),
                   lambda t, q, k, v: torch_sdpa(t, q, k, v, **kwargs), **options)


def _dropout_attention(q, k, v, **kwargs):
    return F.scaled_dot_product_attention(q, k, v, dropout_p=0.3, is_causal=True, generator=seeded(7, q), **kwargs)


def float_mask_inputs(mask_shape, hidden):
    """inputs: q (2, 2, 3, 2), k, v (2, 2, 4, 2) and a float attn_mask of `mask_shape`, -inf at
    `hidden` (an index), that is differentiated like them: d(mask) = dS summed over the axes
    the mask is broadcast along, 0 where it is -inf."""
    def inputs(rng):
        mask = rng.standard_normal(mask_shape)
        mask[hidden] = -np.inf
        return normal((2, 2, 3, 2), (2, 2, 4, 2), (2, 2, 4, 2))(rng) + [mask]
    return inputs


def float_mask_case(shape, label, path, mask_shape, hidden, **kwargs):
    return op_case(f"F.sdpa {path}(float mask {shape} that requires grad, {label})", "attention",
                   float_mask_inputs(mask_shape, hidden),
                   lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m, **kwargs, **PATHS[path]),
                   lambda t, q, k, v, m: torch_sdpa(t, q, k, v, attn_mask=m, **kwargs))


_SMALL = ((2, 2, 4, 3),) * 3
ATTENTION = [attention_case(f"{path}({mask})", kwargs, PATHS[path])
             for mask, kwargs in attention_masks(_constants).items() for path in PATHS] + [
    attention_case("memory-efficient (is_causal, Tq != Tk, hdv != hd)", {"is_causal": True},
                   {"memory_efficient": True, "block_size": 2}, ((1, 2, 5, 3), (1, 2, 3, 3), (1, 2, 3, 2))),
    op_case("F.sdpa (return_weights, causal)", "attention", normal(*_SMALL),
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, return_weights=True),
            torch_causal_attention_with_weights),
    op_case("F.sdpa (seeded dropout, return_weights)", "attention", normal(*_SMALL),
            lambda q, k, v: _dropout_attention(q, k, v, return_weights=True), torch_dropout_attention),
    # the blockwise path draws each block's part of the contract's mask: the twin's mask
    op_case("F.sdpa memory-efficient (seeded dropout)", "attention", normal(*_SMALL),
            lambda q, k, v: _dropout_attention(q, k, v, memory_efficient=True, block_size=3),
            lambda t, q, k, v: torch_dropout_attention(t, q, k, v)[0]),
] + [case for path in PATHS for case in [
    # batch 1's last key hidden; broadcast over heads and queries (summed across query blocks)
    float_mask_case("(B, 1, 1, Tk)", "causal", path, (2, 1, 1, 4), np.s_[1, ..., 3], is_causal=True),
    # query row 1 sees no key; broadcast over batch and heads
    float_mask_case("(Tq, Tk)", "a fully masked row", path, (3, 4), np.s_[1]),
    # k shared by the heads, v by the batch: their gradients are summed over those axes
    attention_case(f"{path}(k, v broadcast over heads / batch, causal)", {"is_causal": True}, PATHS[path],
                   ((2, 2, 3, 2), (2, 1, 4, 2), (1, 2, 4, 2))),
]]

SPLIT_HEADS = [
    op_case("F.split_heads (3 chunks)", "split_heads", normal((2, 4, 12)),
            lambda x: mix_heads(*F.split_heads(x, 2, chunks=3)),
            lambda t, x: mix_heads(*x.reshape(2, 4, 3, 2, 2).permute(2, 0, 3, 1, 4))),
    op_case("F.split_heads (1 chunk)", "split_heads", normal((2, 4, 6)), lambda x: F.split_heads(x, 3) * 2.0,
            lambda t, x: x.reshape(2, 4, 3, 2).transpose(1, 2) * 2.0),
]

_COS, _SIN = F.rotary_cos_sin(4, 6, dtype="float64")
ROTARY_POSITIONS = np.array([[0, 1, 2, 0], [3, 1, 1, 2]])  # per row (B, T): packed sequences restart, repeats
ROTARY = [op_case("F.apply_rotary_emb", "rotary", normal((2, 4, 6)), lambda x: F.apply_rotary_emb(x, _COS, _SIN),
                  lambda t, x: torch_rope(t, x, _COS, _SIN)),
          # tables gathered per row (B, 1, T, hd/2), broadcast over the heads: RoPE with position_ids
          op_case("F.apply_rotary_emb (per-row tables)", "rotary", normal((2, 3, 4, 6)),
                  lambda x: F.apply_rotary_emb(x, _COS[ROTARY_POSITIONS][:, None], _SIN[ROTARY_POSITIONS][:, None]),
                  lambda t, x: torch_rope(t, x, positions=ROTARY_POSITIONS))]

CASES = LINEAR + RELU + GELU + DROPOUT + DROPOUT_ADD + SOFTMAX + CROSS_ENTROPY + LAYER_NORM + EMBEDDING + ATTENTION + SPLIT_HEADS \
    + ROTARY

register(*FAMILIES, *CASES)
