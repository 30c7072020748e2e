"""Position information as modules: the paper's sinusoids, learned positions, and RoPE."""
from __future__ import annotations

import math

import npformer.functional as F
from autograd import Tensor, backend
from autograd.backend import Array, ArrayLike, DType
from autograd.checks import check_int, check_real
from npformer.functional.rotary import cos_sin_at

from . import init
from .layers import new_parameter
from .module import Module


def _check_span(length, offset, max_len, owner):
    offset = check_int(offset, "offset", owner, at_least=0)
    if offset + length > max_len:
        raise ValueError(f"{owner}: positions [{offset}, {offset + length}) exceed max_len={max_len}; "
                         f"build the module with a larger max_len (sequence length {length}, offset {offset})")


def check_position_ids(position_ids, batch_seq, like, max_len, owner):
    """position_ids (B, T) or (T,) integer array (or list/Tensor) for inputs of batch and length
    `batch_seq` (B, T), in [0, max_len) (max_len None: any integers, read without a copy to the
    host), as an array on the device of the array `like`."""
    ids = position_ids.data if isinstance(position_ids, Tensor) else position_ids
    device = backend.device_of(like)
    ids = backend.to_device(ids if backend.is_array(ids) else backend.get_array_module(like).asarray(ids), device)
    if ids.dtype.kind not in "iu" or ids.shape not in (batch_seq[1:], batch_seq):
        raise ValueError(f"{owner}: position_ids must be integers of shape (batch, seq) = {batch_seq} or "
                         f"(seq,), got {ids.dtype} {ids.shape}")
    if max_len is not None and ids.size and (int(ids.min()) < 0 or int(ids.max()) >= max_len):
        raise ValueError(f"{owner}: position_ids must be in [0, {max_len - 1}] (max_len={max_len}), got values in "
                         f"[{int(ids.min())}, {int(ids.max())}]")
    return ids


def sinusoid_table(max_len, d_model, xp):
    """PE[pos, 2i] = sin(pos / 10000^(2i/d)), PE[pos, 2i+1] = cos(pos / 10000^(2i/d)), in float64."""
    position = xp.arange(max_len, dtype="float64")[:, None]                          # (L, 1)
    inv_freq = xp.exp(xp.arange(0, d_model, 2, dtype="float64") * (-math.log(10000.0) / d_model))  # (ceil(d/2),)
    angle = position * inv_freq                                                        # (L, ceil(d/2))
    table = xp.zeros((max_len, d_model), dtype="float64")                             # (L, d)
    table[:, 0::2] = xp.sin(angle)
    table[:, 1::2] = xp.cos(angle[:, : d_model // 2])
    return table


class SinusoidalPositionalEncoding(Module):
    """x (B, T, d) -> x + PE[offset : offset + T] with the paper's fixed sinusoids.

    `pe` (max_len, d_model) is a non-persistent buffer (not in state_dict). It is computed in
    float64 and cast to the module's dtype, and recomputed (not re-cast) whenever the module
    moves or changes dtype, so a `.double()` model carries the exact float64 table. Raises
    TypeError / ValueError for sizes that are not integers >= 1.
    """

    def __init__(self, d_model: int, max_len: int = 5000, device: str | None = None, dtype: DType | None = None):
        super().__init__()
        self.d_model = check_int(d_model, "d_model", "SinusoidalPositionalEncoding", at_least=1)
        self.max_len = check_int(max_len, "max_len", "SinusoidalPositionalEncoding", at_least=1)
        self.register_buffer("pe", self._table(device or "cpu", dtype or "float32"), persistent=False)

    def _table(self, device, dtype):
        return sinusoid_table(self.max_len, self.d_model, backend.module_for(device)).astype(dtype)

    def _move(self, device, dtype):
        self.pe = self._table(device or self.pe.device, dtype or self.pe.dtype)

    def forward(self, x: Tensor, offset: int = 0, position_ids: ArrayLike | None = None) -> Tensor:
        """x (B, T, d_model) + PE[offset : offset + T] (offset: the first position, for decoding
        step by step), or x + PE[position_ids] with position_ids (B, T) or (T,) (e.g. per-row
        positions of left-padded sequences). ValueError for another shape or positions beyond
        max_len."""
        owner = "SinusoidalPositionalEncoding"
        if not isinstance(x, Tensor) or x.ndim != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"{owner}: expected a Tensor (B, T, {self.d_model}), "
                             f"got {getattr(x, 'shape', type(x).__name__)}")
        if position_ids is not None:
            return x + Tensor(self.pe.data[check_position_ids(position_ids, x.shape[:2], x.data, self.max_len, owner)])
        _check_span(x.shape[1], offset, self.max_len, owner)
        return x + Tensor(self.pe.data[offset: offset + x.shape[1]])

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, max_len={self.max_len}"


class LearnedPositionalEmbedding(Module):
    """x (B, T, d) -> x + weight[offset : offset + T]; weight (max_len, d) learned, init N(0, 0.02^2)
    (GPT-2's `wpe`; torch has no module of its own: an nn.Embedding of positions)."""

    def __init__(self, max_len: int, d_model: int, device: str | None = None, dtype: DType | None = None):
        super().__init__()
        self.max_len = check_int(max_len, "max_len", "LearnedPositionalEmbedding", at_least=1)
        self.d_model = check_int(d_model, "d_model", "LearnedPositionalEmbedding", at_least=1)
        self.weight = init.normal_(new_parameter((self.max_len, self.d_model), device, dtype), std=0.02)

    def forward(self, x: Tensor, offset: int = 0, position_ids: ArrayLike | None = None) -> Tensor:
        """x (B, T, d_model) + weight[offset : offset + T], or x + weight[position_ids] with
        position_ids (B, T) or (T,) (e.g. per-row positions of left-padded sequences; the
        gradient reaches those rows). ValueError for another shape or positions beyond max_len."""
        owner = "LearnedPositionalEmbedding"
        if not isinstance(x, Tensor) or x.ndim != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"{owner}: expected a Tensor (B, T, {self.d_model}), "
                             f"got {getattr(x, 'shape', type(x).__name__)}")
        if position_ids is not None:
            positions = check_position_ids(position_ids, x.shape[:2], x.data, self.max_len, owner)
            return x + F.embedding(positions, self.weight)
        _check_span(x.shape[1], offset, self.max_len, owner)
        return x + self.weight[offset: offset + x.shape[1]]

    def extra_repr(self) -> str:
        return f"max_len={self.max_len}, d_model={self.d_model}"


class RotaryEmbedding(Module):
    """RoPE (half-split layout) for attention heads: x (B, H, T, head_dim) at positions
    offset .. offset+T-1 -> x*cos + rotate_half(x)*sin. No parameters and no state_dict
    entries; the cos/sin tables are cached per (length, dtype, device) and grow on demand.
    scaling: None, or a rope scaling dict that scales the frequencies ({"rope_type": "linear",
    "factor": f}: positions / f; "llama3": Llama 3.1's; see functional.rotary.check_rope_scaling).
    ValueError for an odd head_dim, base <= 0 or a scaling it does not know."""

    def __init__(self, head_dim: int, base: float = 10000.0, scaling: dict | None = None):
        super().__init__()
        self.head_dim = check_int(head_dim, "head_dim", "RotaryEmbedding", at_least=1)
        if head_dim % 2:
            raise ValueError(f"RotaryEmbedding: head_dim must be even, got {head_dim}")
        self.base = check_real(base, "base", "RotaryEmbedding", above=0)
        self.scaling = F.rotary.check_rope_scaling(scaling, "RotaryEmbedding", "scaling")
        self._tables = {}

    def cos_sin(self, length: int, like: Array) -> tuple[Array, Array]:
        """(cos, sin), each (length, head_dim // 2), in the dtype and on the device of the array `like`."""
        key = (str(like.dtype), backend.device_of(like))
        cached = self._tables.get(key)
        if cached is None or cached[0].shape[0] < length:
            size = max(length, 2 * cached[0].shape[0] if cached else 0)
            cached = self._tables[key] = F.rotary_cos_sin(size, self.head_dim, base=self.base, dtype=like.dtype,
                                                          device=backend.device_of(like), scaling=self.scaling)
        return cached[0][:length], cached[1][:length]

    def forward(self, x: Tensor, offset: int = 0, position_ids: ArrayLike | None = None) -> Tensor:
        """x (B, H, T, head_dim) rotated for positions offset .. offset + T - 1, or for
        position_ids (B, T) (per row, e.g. packed sequences whose positions restart; as Hugging
        Face's Llama) or (T,) ints (F.apply_rotary_emb with the tables computed at those positions:
        no table bounds them, and positions on a GPU are never read on the host, so no sync)."""
        if position_ids is None:
            offset = check_int(offset, "offset", "RotaryEmbedding", at_least=0)
            cos, sin = self.cos_sin(offset + x.shape[-2], x.data)
            return F.apply_rotary_emb(x, cos[offset:], sin[offset:])
        if not isinstance(x, Tensor) or x.ndim != 4:
            raise ValueError(f"RotaryEmbedding: with position_ids, x must be a Tensor (B, H, T, head_dim), "
                             f"got {getattr(x, 'shape', type(x).__name__)}")
        ids = check_position_ids(position_ids, (x.shape[0], x.shape[2]), x.data, None, "RotaryEmbedding")
        cos, sin = cos_sin_at(ids, self.head_dim, self.base, x.dtype, self.scaling)              # (B, T, hd/2) or (T, hd/2)
        if ids.ndim == 2:                                      # (B, 1, T, hd/2): the same over the heads
            cos, sin = cos[:, None], sin[:, None]
        return F.apply_rotary_emb(x, cos, sin)

    def extra_repr(self) -> str:
        scaling = "" if self.scaling is None else f", scaling={self.scaling}"
        return f"head_dim={self.head_dim}, base={self.base}{scaling}"
