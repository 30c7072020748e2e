"""Slow twins of the fused ops, built only from autograd primitives (Tensor arithmetic, exp,
log, sum, max, where, matmul, getitem, ...), so their gradients come from the tape rather
than from a hand-written backward. Same names and signatures as npformer.functional; the
test suite uses them as a second reference next to torch and finite differences."""
import contextlib
import math

from autograd import Tensor, concatenate, where
from autograd.checks import check_bool, check_real, check_shape

from .activation import TANH_C, TANH_K, dropout_mask, dropout_scale
from .activation.erf import BOUNDS, SQRT_2, erf_far, erf_middle, erf_near, erf_small
from .attention import _lead_shape, _prepare_mask, causal_blocked
from .cross_entropy import classes_last, is_probability_target, probability_cross_entropy, probability_target
from .embedding import check_embedding_options
from .embedding.math import id_counts, renormalize_rows
from ._common import _twins, on_device_of
from .dropout_add import check_dropout_add
from .rotary import rotary_tables


def _tensor(x):
    return x if isinstance(x, Tensor) else Tensor(x)


def linear(input, weight, bias=None, activation=None):
    y = _tensor(input) @ _tensor(weight).T
    y = y + bias if bias is not None else y
    if activation == "relu":
        return relu(y)
    return gelu(y, approximate="tanh" if activation == "gelu_tanh" else "none") if activation else y


def relu(input):
    return _tensor(input).relu()


def erf(z):
    """erf of a Tensor from fdlibm's branch formulas, each fed only its own interval's entries."""
    a_data = abs(z.data)
    a = where(z.data < 0, -z, z)
    pieces = [((a_data < BOUNDS[0]), 0.5, erf_small),
              ((a_data >= BOUNDS[0]) & (a_data < BOUNDS[1]), 1.0, erf_middle),
              ((a_data >= BOUNDS[1]) & (a_data < BOUNDS[2]), 2.0,
               lambda t: erf_near(t, Tensor.exp)),
              ((a_data >= BOUNDS[2]) & (a_data < BOUNDS[3]), 4.0,
               lambda t: erf_far(t, Tensor.exp))]
    result = 1.0  # |z| >= 6
    for inside, filler, formula in reversed(pieces):
        result = where(inside, formula(where(inside, a, filler)), result)
    return where(z.data < 0, -result, result)


def gelu(input, approximate="none"):
    x = _tensor(input)
    if approximate == "tanh":
        return 0.5 * x * (1.0 + (TANH_C * (x + TANH_K * x * x * x)).tanh())
    return x * (0.5 * (1.0 + erf(x / SQRT_2)))


def dropout(input, p=0.5, training=True, generator=None):
    x = _tensor(input)
    p = check_real(p, "p", "dropout", at_least=0, at_most=1)
    if not check_bool(training, "training", "dropout") or p == 0.0:
        return input
    keep = dropout_mask(x.shape, p, x.device, generator)     # the same values of the same stream as F.dropout
    scale = keep.astype(x.dtype)
    scale *= dropout_scale(p)                                 # in place: a 0-d array stays an array of x's dtype
    return x * Tensor(scale)


def dropout_add(input, residual, p=0.5, training=True, generator=None):
    check_dropout_add(input, residual, p, training, "dropout_add")
    return _tensor(residual) + dropout(input, p, training, generator)   # the same stream's values as F's


def _stable_shift(x, dim):
    """x - max (a constant: softmax does not depend on it), with all -inf rows shifted by 0."""
    xp = x.xp
    if x.data.size == 0:                                      # nothing to shift (an empty max has no identity)
        return x
    m = x.data.max(axis=dim, keepdims=True)
    return x - Tensor(xp.where(m == -xp.inf, 0, m))   # +inf, NaN: a NaN row, as torch's


def softmax(input, dim=-1):
    e = _stable_shift(_tensor(input), dim).exp()
    total = e.sum(axis=dim, keepdims=True)
    return e / where(total.data == 0, 1.0, total)


def log_softmax(input, dim=-1):
    shifted = _stable_shift(_tensor(input), dim)
    total = shifted.exp().sum(axis=dim, keepdims=True)
    return shifted - where(total.data == 0, 1.0, total).log()


def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    x = _tensor(input)
    shape = check_shape(normalized_shape, "normalized_shape", "layer_norm")
    axes = tuple(range(x.ndim - len(shape), x.ndim))
    centered = x - x.mean(axis=axes, keepdims=True)
    y = centered / ((centered * centered).mean(axis=axes, keepdims=True) + eps).sqrt()
    if weight is not None:
        y = y * weight
    return y + bias if bias is not None else y


def embedding(input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False):
    w = _tensor(weight)
    ids = on_device_of(input, w.data, "input", "embedding")
    max_norm, norm_type, scale_grad_by_freq = check_embedding_options(max_norm, norm_type, scale_grad_by_freq)
    if max_norm is not None:  # in place, outside the graph, as F.embedding
        renormalize_rows(w.xp, w.data, ids, max_norm, norm_type)
    if scale_grad_by_freq:  # the value of w, the gradient of w times 1 / count(id): w0 + (w - w0) s, w0 constant
        w = w.detach() + (w - w.detach()) * Tensor(id_counts(w.xp, ids.reshape(-1), w.shape[0], w.dtype) ** -1.0)
    if padding_idx is not None:  # the padding row enters as a constant: zero gradient
        is_pad = w.xp.arange(w.shape[0])[:, None] == padding_idx % w.shape[0]
        w = where(is_pad, w.detach(), w)
    return w[ids]


def cross_entropy(input, target, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0):
    logits = _tensor(input)
    x = classes_last(logits)                                  # (M, C)
    w = weight
    if weight is not None and not isinstance(weight, Tensor):  # a plain array of class weights follows the logits
        w = Tensor(on_device_of(weight, x.data, "weight", "cross_entropy").astype(x.dtype, copy=False))
    if is_probability_target(target):
        tgt = classes_last(probability_target(target, logits.data))
        loss = probability_cross_entropy(log_softmax(x, dim=1), tgt, w, label_smoothing, reduction)
        rows = logits.shape[:1] + logits.shape[2:] if logits.ndim > 1 else ()
        return loss.reshape(rows) if reduction == "none" else loss
    c = x.shape[1]
    tgt = on_device_of(target, x.data, "target", "cross_entropy")
    flat = tgt.reshape(-1)
    valid = flat != ignore_index
    safe = x.xp.where(valid, flat, 0)
    logp = log_softmax(x, dim=1)
    picked = logp[x.xp.arange(x.shape[0]), safe]
    w_target = w[safe] if w is not None else None
    nll = -(picked * w_target if w is not None else picked)
    smooth = -((logp * w).sum(axis=1) if w is not None else logp.sum(axis=1)) / c
    loss = where(valid, (1.0 - label_smoothing) * nll + label_smoothing * smooth, 0.0)
    if reduction == "none":
        return loss.reshape(tgt.shape)
    if reduction == "sum":
        return loss.sum()
    divisor = where(valid, w_target, 0.0).sum() if w is not None else float(valid.sum())
    return loss.sum() / divisor


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                 scale=None, *, return_weights=False, backend=None, memory_efficient=False,
                                 block_size=512, generator=None):
    q, k, v = _tensor(query), _tensor(key), _tensor(value)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    lead = _lead_shape(q.data, k.data, v.data)
    score_shape = lead + (q.shape[-2], k.shape[-2])
    scores = (q @ k.swapaxes(-1, -2)) * scale
    blocked, additive = _prepare_mask(attn_mask, q.data, score_shape)
    if additive is not None:  # a mask Tensor that requires grad gets it from the tape
        mask_grad = isinstance(attn_mask, Tensor) and attn_mask.requires_grad
        scores = scores + (attn_mask if mask_grad else Tensor(additive))
    if is_causal:
        causal = causal_blocked(q.xp, 0, q.shape[-2], 0, k.shape[-2])
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


def apply_rotary_emb(x, cos, sin):
    cos, sin = map(Tensor, rotary_tables(x, cos, sin))
    x = _tensor(x)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def split_heads(input, num_heads, chunks=1):
    x = _tensor(input)
    B, T, width = x.shape
    heads = x.reshape(B, T, chunks, num_heads, width // (chunks * num_heads)).permute(2, 0, 3, 1, 4)
    return tuple(heads[i] for i in range(chunks)) if chunks > 1 else heads[0]


@contextlib.contextmanager
def installed():
    """Within the block, in the calling thread, npformer.functional's ops run these twins, so
    every module that calls `F.op(...)` (npformer.nn, npformer.models) runs on autograd
    primitives instead. Other threads keep the fused ops."""
    old = _twins.active
    _twins.active = True
    try:
        yield
    finally:
        _twins.active = old
