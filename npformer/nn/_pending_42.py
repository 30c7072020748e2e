"""TEMPORARY (issue 42): stand-ins for ops that other branches add, so that the nn layer can be
built and tested before they land. DELETE THIS FILE AT MERGE and switch the three shims (checked
against branches ops + attn merged: tests/nn and tests/test_layering.py pass after this switch):

  npformer/nn/attention.py   drop `from ._pending_42 import sdpa`; `sdpa(` -> `F.scaled_dot_product_attention(`
  npformer/nn/recording.py   likewise
  npformer/nn/transformer.py drop `from ._pending_42 import RMSNorm, silu, swiglu`; import RMSNorm
                             from .layers; `_PLAIN = {"silu": F.silu, "swiglu": F.swiglu}`

Each name below already prefers the real op when it exists (F.rms_norm, F.silu, F.swiglu,
nn.RMSNorm in .layers, F.scaled_dot_product_attention(enable_gqa=, sliding_window=)); only the
fallbacks are stand-ins, written from autograd primitives (composites, no hand-written gradient).
"""
from __future__ import annotations

import inspect
import math

import npformer.functional as F
from autograd import Tensor



# -- F.scaled_dot_product_attention(..., enable_gqa=, sliding_window=) ---------------------------
_REAL_SDPA = "enable_gqa" in inspect.signature(F.scaled_dot_product_attention).parameters


def _window_mask(attn_mask, xp, T, S, window):
    """attn_mask (None, bool True = takes part, float added; array or Tensor) combined with the
    causal sliding window over (T, S), top-left aligned: key j takes part for i - W < j <= i."""
    i, j = xp.arange(T)[:, None], xp.arange(S)[None, :]
    band = (j <= i) & (j > i - window)                                              # (T, S)
    if attn_mask is None:
        return band
    if attn_mask.dtype == bool:
        return (attn_mask.data if isinstance(attn_mask, Tensor) else attn_mask) & band
    return attn_mask + xp.where(band, 0.0, -math.inf).astype(attn_mask.dtype)


def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *,
         sliding_window=None, **options):
    """F.scaled_dot_product_attention with the contract's enable_gqa and sliding_window: the real
    op when it has them, else a stand-in that repeats the key/value heads and masks the window."""
    if _REAL_SDPA:
        return F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                              sliding_window=sliding_window, **options)
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        from .attention import repeat_kv_heads
        key, value = repeat_kv_heads(key, query.shape[-3]), repeat_kv_heads(value, query.shape[-3])
    if sliding_window is not None:
        if not is_causal:
            raise ValueError("scaled_dot_product_attention: sliding_window needs is_causal=True")
        attn_mask = _window_mask(attn_mask, query.xp, query.shape[-2], key.shape[-2], sliding_window)
        is_causal = False
    return F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, **options)
