"""The registry cases of F.apply_rotary_emb: each op on ordinary inputs and its
edge cases, with the PyTorch reference written once here (npformer.opcases imports this module; tests/functional/test_op_<family>.py,
`python -m npformer.gradcheck` and the docs' op table read them)."""
import numpy as np

import npformer.functional as F
from npformer.opcases import register
from npformer.opcases.inputs import normal, op_case, op_family


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


_COS, _SIN = F.rotary_cos_sin(4, 6, dtype="float64")
ROTARY_POSITIONS = np.array([[0, 1, 2, 0], [3, 1, 1, 2]])  # per row (B, T): packed sequences restart, repeats
ROTARY = [op_case("F.apply_rotary_emb", "rotary", normal((2, 4, 6)), lambda x: F.apply_rotary_emb(x, _COS, _SIN),
                  lambda t, x: torch_rope(t, x, _COS, _SIN)),
          # tables gathered per row (B, 1, T, hd/2), broadcast over the heads: RoPE with position_ids
          op_case("F.apply_rotary_emb (per-row tables)", "rotary", normal((2, 3, 4, 6)),
                  lambda x: F.apply_rotary_emb(x, _COS[ROTARY_POSITIONS][:, None], _SIN[ROTARY_POSITIONS][:, None]),
                  lambda t, x: torch_rope(t, x, positions=ROTARY_POSITIONS))]


register(op_family("rotary", ("F.apply_rotary_emb", "F.rotary_cos_sin", "nn.RotaryEmbedding"), "rotary",
                   ("RotaryEmbeddingFunction",), "RoPE"),
         *ROTARY)
