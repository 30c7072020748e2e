"""The registry cases of F.scaled_dot_product_attention and F.split_heads: each op on ordinary inputs and its
edge cases, with the PyTorch reference written once here (npformer.opcases imports this module; tests/functional/test_op_<family>.py,
`python -m npformer.gradcheck` and the docs' op table read them)."""
import numpy as np

import npformer.functional as F
from npformer.opcases import register, torch_args
from npformer.opcases.inputs import CONSTANTS, normal, op_case, op_family, seeded

from ..activation import dropout_scale, keep_mask


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


def window_allowed(tq, tk, window):
    """The sliding window as an explicit bool mask (True = takes part): query i sees keys
    i - W < j <= i (causal, top-left aligned like torch's is_causal)."""
    i, j = np.arange(tq)[:, None], np.arange(tk)[None, :]
    return (j <= i) & (j > i - window)


def torch_window(t, q, k, v, window, **kwargs):
    """torch's attention with the window as an explicit bool mask."""
    return t.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=t.tensor(window_allowed(q.shape[-2], k.shape[-2], window)), **kwargs)


def torch_grouped_dropout_attention(t, q, k, v, p=0.3, seed=7):
    """torch_dropout_attention with key and value heads repeated for their query heads (torch's
    enable_gqa is repeat_interleave over dim -3)."""
    group = q.shape[-3] // k.shape[-3]
    return torch_dropout_attention(t, q, k.repeat_interleave(group, -3), v.repeat_interleave(group, -3), p, seed)


def mix_heads(q, k, v):
    """Every chunk of split_heads reaches the output, so the backward assembles all three gradients."""
    return q * k + 2.0 * v


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
             for mask, kwargs in attention_masks(CONSTANTS).items() for path in PATHS] + [
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

# grouped-query (H = 4 query heads over H_kv = 2 key/value heads) and multi-query (H_kv = 1) attention
_GQA = ((B, 4, TQ, HD), (B, 2, TK, HD), (B, 2, TK, HD))
_MQA = ((B, 4, TQ, HD), (B, 1, TK, HD), (B, 1, TK, HD))
_GQA_MASK = CONSTANTS.random((B, 4, TQ, TK)) > 0.3                # a bool mask per query head


def _grouped_float_mask_inputs(rng):
    """q, k, v of _GQA and a float mask (B, 1, Tq, Tk) broadcast over the heads, differentiated."""
    mask = rng.standard_normal((B, 1, TQ, TK))
    mask[1, 0, 2, 3:] = -np.inf
    return normal(*_GQA)(rng) + [mask]


def _window_case(label, path, shapes, window, **kwargs):
    return op_case(f"F.sdpa {path}(sliding window {window}, {label})", "attention", normal(*shapes),
                   lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, sliding_window=window,
                                                                  **kwargs, **PATHS[path]),
                   lambda t, q, k, v: torch_window(t, q, k, v, window, **kwargs))


GROUPED = [case for path in PATHS for case in [
    attention_case(f"{path}(grouped-query H=4, H_kv=2, causal)", {"is_causal": True, "enable_gqa": True},
                   PATHS[path], _GQA),
    attention_case(f"{path}(multi-query H=4, H_kv=1, causal)", {"is_causal": True, "enable_gqa": True},
                   PATHS[path], _MQA),
    attention_case(f"{path}(grouped-query H=4, H_kv=2, a bool mask per query head)",
                   {"attn_mask": _GQA_MASK, "enable_gqa": True}, PATHS[path], _GQA),
    op_case(f"F.sdpa {path}(grouped-query H=4, H_kv=2, causal, float mask (B, 1, Tq, Tk) that requires grad)",
            "attention", _grouped_float_mask_inputs,
            lambda q, k, v, m, path=path: F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=True,
                                                                          enable_gqa=True, **PATHS[path]),
            lambda t, q, k, v, m: torch_sdpa(t, q, k, v, attn_mask=m, is_causal=True, enable_gqa=True)),
    # the window: a query block of 2 at q_start 4 skips key block 0 (Tq == Tk), and Tq < Tk
    _window_case("Tq == Tk = 7", path, ((B, H, 7, HD),) * 3, 3),
    _window_case("Tq = 5 < Tk = 8", path, ((B, H, 5, HD), (B, H, 8, HD), (B, H, 8, HD)), 2),
]] + [
    op_case("F.sdpa (grouped-query H=4, H_kv=2, seeded dropout, return_weights)", "attention", normal(*_GQA),
            lambda q, k, v: _dropout_attention(q, k, v, enable_gqa=True, return_weights=True),
            torch_grouped_dropout_attention),
    op_case("F.sdpa memory-efficient (grouped-query H=4, H_kv=2, seeded dropout)", "attention", normal(*_GQA),
            lambda q, k, v: _dropout_attention(q, k, v, enable_gqa=True, memory_efficient=True, block_size=2),
            lambda t, q, k, v: torch_grouped_dropout_attention(t, q, k, v)[0]),
    # Mistral's attention: grouped-query heads and a sliding window, blocks skipped
    _window_case("grouped-query H=4, H_kv=2, Tq == Tk = 7", "memory-efficient ",
                 ((B, 4, 7, HD), (B, 2, 7, HD), (B, 2, 7, HD)), 3, enable_gqa=True),
]

SPLIT_HEADS = [
    op_case("F.split_heads (3 chunks)", "split_heads", normal((2, 4, 12)),
            lambda x: mix_heads(*F.split_heads(x, 2, chunks=3)),
            lambda t, x: mix_heads(*x.reshape(2, 4, 3, 2, 2).permute(2, 0, 3, 1, 4))),
    op_case("F.split_heads (1 chunk)", "split_heads", normal((2, 4, 6)), lambda x: F.split_heads(x, 3) * 2.0,
            lambda t, x: x.reshape(2, 4, 3, 2).transpose(1, 2) * 2.0),
]


register(op_family("attention", ("F.scaled_dot_product_attention", "F.attention_backend"), "attention",
                   ("AttentionFunction", "MemoryEfficientAttentionFunction"), "Scaled dot-product attention"),
         op_family("split_heads", ("F.split_heads",), "attention", ("SplitHeadsFunction",), "Splitting heads"),
         *ATTENTION, *GROUPED, *SPLIT_HEADS)
