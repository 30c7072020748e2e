"""Rotary position embedding (RoPE), half-split layout."""
from __future__ import annotations

from autograd import Function, Tensor, backend, concatenate, is_grad_enabled
from autograd.backend import Array, DType
from autograd.checks import check_float_dtype, check_int, check_real
from autograd.forward_ad import unpack_dual

from .._common import broadcasts_to, check_tensor, has_twin, on_device_of
from . import math

__all__ = ["apply_rotary_emb", "rotary_cos_sin"]  # its public ops, which npformer.functional exports


class RotaryEmbeddingFunction(Function):
    """x (..., T, hd) with halves x1, x2; cos, sin (T, hd/2) (broadcastable) ->
    y = [x1 cos - x2 sin, x2 cos + x1 sin] (a rotation of each pair (x1_i, x2_i)).

    The backward is the inverse rotation: dx1 = dy1 cos + dy2 sin, dx2 = dy2 cos - dy1 sin.
    """
    backward_formula = staticmethod(math.rotary_backward)

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return math.rotary_forward(backend.get_array_module(x), x, cos, sin)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return math.rotary_backward(backend.get_array_module(dy), dy, cos, sin)

    @staticmethod
    def differentiable_backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        half = dy.shape[-1] // 2
        dy1, dy2 = dy[..., :half], dy[..., half:]
        # dx1 = dy1 cos + dy2 sin, dx2 = dy2 cos - dy1 sin: linear in dy (the tables are constants)
        return concatenate([dy1 * cos + dy2 * sin, dy2 * cos - dy1 * sin], axis=-1)

    @staticmethod
    def jvp(ctx, t):
        # y = R x, a rotation linear in x  ->  t_y = R t_x
        return math.rotary_tangent(backend.get_array_module(t), t, *ctx.saved_tensors)


@has_twin
def apply_rotary_emb(x: Tensor | Array, cos: Tensor | Array, sin: Tensor | Array) -> Tensor:
    """Rotate the two halves of x's last dimension by position-dependent angles (RoPE).

    x (..., T, head_dim) with head_dim even; cos, sin (T, head_dim // 2) (or broadcastable to
    (..., T, head_dim // 2)), e.g. from `rotary_cos_sin`. Slice them (cos[start:start+T]) to
    rotate positions that do not start at 0. The pairs are (i, i + head_dim // 2) (GPT-NeoX /
    Llama in Hugging Face's layout). Raises ValueError for an odd head_dim or tables that do not
    broadcast, RuntimeError for a table Tensor that requires grad (the tables get no gradient).
    """
    cos, sin = rotary_tables(x, cos, sin)
    return RotaryEmbeddingFunction.apply(x, cos=cos, sin=sin)


def rotary_tables(x, cos, sin):
    """apply_rotary_emb's arguments checked: the cos and sin tables as arrays of x's dtype on x's
    device. They are constants: a table Tensor that requires grad is refused in grad mode."""
    op = "apply_rotary_emb"
    xd = check_tensor("x", x, op)
    if xd.ndim < 2 or xd.shape[-1] % 2:
        raise ValueError(f"{op}: x must be (..., T, head_dim) with an even head_dim, got shape {tuple(xd.shape)}")
    half_shape = tuple(xd.shape[:-1]) + (xd.shape[-1] // 2,)
    tables = []
    for name, table in (("cos", cos), ("sin", sin)):
        if isinstance(table, Tensor) and table.requires_grad and is_grad_enabled():
            raise RuntimeError(f"{op}: {name} requires grad, but the rotary tables are constants and get no "
                               f"gradient; pass {name}.detach()")
        if isinstance(table, Tensor) and unpack_dual(table).tangent is not None:
            raise RuntimeError(f"{op}: {name} carries a tangent (forward mode), but the rotary tables are constants "
                               f"and their tangent would be dropped; pass forward_ad.unpack_dual({name}).primal")
        table = on_device_of(table, xd, name, op)
        if table.dtype.kind != "f":
            raise TypeError(f"{op}: {name} must be a floating array (e.g. from rotary_cos_sin), got dtype {table.dtype}")
        if not broadcasts_to(table.shape, half_shape):
            raise ValueError(f"{op}: {name} must broadcast to (..., T, head_dim/2) = {half_shape}, "
                             f"got shape {tuple(table.shape)}")
        tables.append(table.astype(xd.dtype, copy=False))
    return tables


ROPE_SCALING = {"linear": ("factor",),
                "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def check_rope_scaling(scaling: dict | None, owner: str, name: str = "rope_scaling") -> dict | None:
    """None, or `scaling` as a new dict of plain numbers: {"rope_type": "linear", "factor": f}
    (positions divided by f) or {"rope_type": "llama3", "factor", "low_freq_factor",
    "high_freq_factor", "original_max_position_embeddings"} (Llama 3.1's, as transformers'). Every
    number > 0 (factor >= 1 is usual, not required), high_freq_factor > low_freq_factor.
    ValueError naming another rope_type, a missing key or an unknown one (never ignored)."""
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise TypeError(f"{owner}: {name} must be None or a dict such as {{'rope_type': 'linear', 'factor': 2.0}}, "
                        f"got {type(scaling).__name__}")
    kind = scaling.get("rope_type")
    if kind not in ROPE_SCALING:
        raise ValueError(f"{owner}: {name} rope_type {kind!r} is not supported (supported: {sorted(ROPE_SCALING)})")
    keys = ROPE_SCALING[kind]
    unknown = sorted(str(k) for k in scaling if k != "rope_type" and k not in keys)
    missing = [k for k in keys if k not in scaling]
    if unknown or missing:
        raise ValueError(f"{owner}: {name} of rope_type {kind!r} takes the keys {list(keys)}"
                         + (f"; unknown {unknown}" if unknown else "") + (f"; missing {missing}" if missing else ""))
    checked = {"rope_type": kind}
    for key in keys:
        checked[key] = check_real(scaling[key], f"{name}[{key!r}]", owner, above=0)
    if kind == "llama3" and checked["high_freq_factor"] <= checked["low_freq_factor"]:
        raise ValueError(f"{owner}: {name} needs high_freq_factor > low_freq_factor, got "
                         f"{checked['high_freq_factor']} and {checked['low_freq_factor']}")
    return checked


def rotary_cos_sin(seq_len: int, head_dim: int, base: float = 10000.0, dtype: DType = "float32",
                   device: str = "cpu", scaling: dict | None = None) -> tuple[Array, Array]:
    """cos and sin tables (seq_len, head_dim // 2) of angle t * base^(-2i/head_dim) for position t
    and pair i, computed in float64 and cast to `dtype`, as arrays on `device`. scaling: None or
    a rope scaling dict (see check_rope_scaling: "linear", "llama3"), which scales the frequencies."""
    head_dim = check_int(head_dim, "head_dim", "rotary_cos_sin", at_least=1)
    if head_dim % 2:
        raise ValueError(f"rotary_cos_sin: head_dim must be a positive even number, got {head_dim}")
    seq_len = check_int(seq_len, "seq_len", "rotary_cos_sin", at_least=0)
    base = check_real(base, "base", "rotary_cos_sin", above=0)
    dtype = check_float_dtype(dtype, "dtype", "rotary_cos_sin")
    scaling = check_rope_scaling(scaling, "rotary_cos_sin", "scaling")
    return cos_sin_at(backend.module_for(device).arange(seq_len), head_dim, base, dtype, scaling)


def cos_sin_at(positions: Array, head_dim: int, base: float, dtype: DType,
               scaling: dict | None = None) -> tuple[Array, Array]:
    """rotary_cos_sin's tables at integer `positions` (any shape P, on their device, checked by
    the caller): cos and sin (*P, head_dim // 2), computed in float64 and cast to `dtype`;
    scaling: None or a dict checked by check_rope_scaling."""
    return math.cos_sin_at(backend.get_array_module(positions), positions, head_dim, base, dtype, scaling)
