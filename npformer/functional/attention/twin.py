"""The composite twin of F.scaled_dot_product_attention and F.split_heads: the same function built only from autograd primitives, so that
its gradients come from the tape, a test reference beside torch and finite differences
(npformer.functional.composite installs it)."""
import math

from autograd import Tensor, where
from autograd.checks import check_real

from .._common import tensor_of
from ..activation import dropout_mask, dropout_scale
from ..softmax.twin import softmax
from . import _lead_shape, _prepare_mask, causal_blocked


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                 scale=None, enable_gqa=False, *, sliding_window=None, return_weights=False,
                                 backend=None, memory_efficient=False, block_size=512, generator=None):
    q, k, v = tensor_of(query), tensor_of(key), tensor_of(value)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        # torch's repeat_interleave: query head h reads kv head h // (H / H_kv), gathered by index
        heads = q.xp.arange(q.shape[-3]) // (q.shape[-3] // k.shape[-3])
        k, v = k[..., heads, :, :], v[..., heads, :, :]
    lead = _lead_shape(q.data, k.data, v.data)
    score_shape = lead + (q.shape[-2], k.shape[-2])
    scores = (q @ k.swapaxes(-1, -2)) * scale
    blocked, additive = _prepare_mask(attn_mask, q.data, score_shape)
    if additive is not None:  # a mask Tensor that requires grad gets it from the tape
        mask_grad = isinstance(attn_mask, Tensor) and attn_mask.requires_grad
        scores = scores + (attn_mask if mask_grad else Tensor(additive))
    if is_causal:
        causal = causal_blocked(q.xp, 0, q.shape[-2], 0, k.shape[-2], sliding_window)
        blocked = causal if blocked is None else blocked | causal
    if blocked is not None:
        scores = where(blocked, -math.inf, scores)
    probs = softmax(scores, dim=-1)
    dropout_p = check_real(dropout_p, "dropout_p", "scaled_dot_product_attention", at_least=0, at_most=1)
    if dropout_p > 0:  # the mask of the dropout contract over (..., Tq, Tk), as on every path
        keep = dropout_mask(score_shape, dropout_p, q.device, generator, "scaled_dot_product_attention")
        probs = probs * Tensor(keep.astype(q.dtype) * dropout_scale(dropout_p))
    out = probs @ v
    return (out, probs) if return_weights else out


def split_heads(input, num_heads, chunks=1):
    x = tensor_of(input)
    B, T, width = x.shape
    heads = x.reshape(B, T, chunks, num_heads, width // (chunks * num_heads)).permute(2, 0, 3, 1, 4)
    return tuple(heads[i] for i in range(chunks)) if chunks > 1 else heads[0]
