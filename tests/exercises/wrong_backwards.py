"""A catalogue of deliberately wrong backward functions, each with the diagnosis the checker must
give it: the mistakes learners make, written as they would write them."""
import dataclasses
import math
from collections.abc import Callable

import numpy as np

import solution_backprop as right


@dataclasses.dataclass(frozen=True)
class Wrong:
    exercise: str
    backward: Callable
    gradient: str        # the output that is wrong
    diagnosis: str       # the checker's diagnosis of it starts with this


def _softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _xhat(x, eps):
    mean = x.mean(axis=-1, keepdims=True)
    rstd = 1.0 / np.sqrt(((x - mean) ** 2).mean(axis=-1, keepdims=True) + eps)
    return (x - mean) * rstd, rstd


def _attention_pieces(q, k, v, mask, dout, scale):
    p = _softmax(np.where(mask, q @ k.swapaxes(-1, -2) * scale, -np.inf))
    return p, dout @ v.swapaxes(-1, -2)                              # P, dP


def _ln_dx_without_mean_terms(x, weight, dy, eps):
    xhat, rstd = _xhat(x, eps)
    return rstd * dy * weight, (dy * xhat).sum(axis=0), dy.sum(axis=0)


def _ln_dx_without_one_mean_term(x, weight, dy, eps):
    xhat, rstd = _xhat(x, eps)
    g = dy * weight
    return rstd * (g - g.mean(axis=-1, keepdims=True)), (dy * xhat).sum(axis=0), dy.sum(axis=0)


def _embedding_overwrites(ids, num_embeddings, dy):
    dweight = np.zeros((num_embeddings, dy.shape[-1]))
    dweight[ids.reshape(-1)] = dy.reshape(-1, dy.shape[-1])
    return dweight


def _embedding_first_row_only(ids, num_embeddings, dy):
    dweight = np.zeros((num_embeddings, dy.shape[-1]))
    seen = set()
    for i, row in zip(ids.reshape(-1), dy.reshape(-1, dy.shape[-1])):
        if i not in seen:
            dweight[i] = row
            seen.add(i)
    return dweight


def _ln_without_weight_in_dx(x, weight, dy, eps):
    _, dweight, dbias = right.layer_norm_backward(x, weight, dy, eps)
    dx, _, _ = right.layer_norm_backward(x, np.ones_like(weight), dy, eps)   # dxhat = dy
    return dx, dweight, dbias


def _attention_no_scale(q, k, v, mask, dout, scale):
    dq, dk, dv = right.attention_backward(q, k, v, mask, dout, scale)
    return dq / scale, dk / scale, dv


def _attention_without_mask(q, k, v, mask, dout, scale):
    return right.attention_backward(q, k, v, np.ones_like(mask), dout, scale)


def _attention_without_row_sum(q, k, v, mask, dout, scale):
    p, dp = _attention_pieces(q, k, v, mask, dout, scale)
    ds = p * dp
    return ds @ k * scale, ds.swapaxes(-1, -2) @ q * scale, p.swapaxes(-1, -2) @ dout


def _attention_masked_by_zero_scores(q, k, v, mask, dout, scale):
    """The forward masked by multiplying the scores by the mask: hidden keys get score 0, not -inf."""
    p = _softmax(q @ k.swapaxes(-1, -2) * scale * mask)
    dp = dout @ v.swapaxes(-1, -2)
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True)) * mask
    return ds @ k * scale, ds.swapaxes(-1, -2) @ q * scale, p.swapaxes(-1, -2) @ dout


def _attention_ds_leaks(q, k, v, mask, dout, scale):
    """dS = dP at the masked cells: the softmax's P * (...) kept only where the mask lets keys in."""
    p, dp = _attention_pieces(q, k, v, mask, dout, scale)
    ds = np.where(mask, p * (dp - (dp * p).sum(axis=-1, keepdims=True)), dp)
    return ds @ k * scale, ds.swapaxes(-1, -2) @ q * scale, p.swapaxes(-1, -2) @ dout


def _attention_zero_scores_unmasked_ds(q, k, v, mask, dout, scale):
    """Hidden scores set to 0 (not -inf), and dS left as it is at the hidden cells."""
    p = _softmax(np.where(mask, q @ k.swapaxes(-1, -2) * scale, 0.0))
    dp = dout @ v.swapaxes(-1, -2)
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))
    return ds @ k * scale, ds.swapaxes(-1, -2) @ q * scale, p.swapaxes(-1, -2) @ dout


def _ln_mean_of_dy(x, weight, dy, eps):
    xhat, rstd = _xhat(x, eps)
    g = dy * weight
    dx = rstd * (g - dy.mean(axis=-1, keepdims=True) - xhat * (g * xhat).mean(axis=-1, keepdims=True))
    return dx, (dy * xhat).sum(axis=0), dy.sum(axis=0)


def _swap(first, second, backward):
    def swapped(*args):
        grads = list(backward(*args))
        grads[first], grads[second] = grads[second], grads[first]
        return tuple(grads)
    return swapped


def _change(index, change, backward):
    def changed(*args):
        grads = backward(*args)
        if not isinstance(grads, tuple):
            return change(grads, *args)
        grads = list(grads)
        grads[index] = change(grads[index], *args)
        return tuple(grads)
    return changed


# the mistakes issue 44 found with no diagnosis ("none of the known mistakes"), each named now
NAMED_SINCE_44 = [
    Wrong("log_softmax_backward", lambda y, dy: dy - np.exp(y) * dy, "dx", "missing the row sum: exp(y) multiplies dy"),
    Wrong("layer_norm_backward", _ln_mean_of_dy, "dx", "the mean term uses mean(dy) where mean(dxhat)"),
    Wrong("attention_backward", _attention_ds_leaks, "dq",
          "gradient on masked positions: your dq implies dS is not 0 at masked cells, e.g. dS[b=0, h=0, i="),
    Wrong("attention_backward", _attention_ds_leaks, "dk",
          "gradient on masked positions: your dk implies dS is not 0 at masked cells"),
    Wrong("attention_backward", _attention_zero_scores_unmasked_ds, "dq",
          "gradient on masked positions: masked scores set to 0 instead of -inf"),
    Wrong("attention_backward", _attention_zero_scores_unmasked_ds, "dk",
          "gradient on masked positions: masked scores set to 0 instead of -inf"),
    Wrong("attention_backward", _attention_zero_scores_unmasked_ds, "dv",
          "gradient on masked positions: masked scores set to 0 instead of -inf"),
    Wrong("softmax_backward", lambda y, dy: y * (dy - 1), "dx", "the row sum sum(y * dy) is replaced by 1"),
    Wrong("layer_norm_backward", _change(1, lambda dw, x, w, dy, eps: _xhat(x, eps)[0].sum(axis=0),
                                         right.layer_norm_backward), "dweight", "dweight forgets dy"),
    Wrong("layer_norm_backward", _change(2, lambda db, x, w, dy, eps: np.full(x.shape[1], float(x.shape[0])),
                                         right.layer_norm_backward), "dbias", "dbias counts the rows (a sum of ones, 4)"),
    Wrong("linear_backward", _change(2, lambda db, x, w, dy: np.ones(dy.shape).sum(axis=(0, 1)), right.linear_backward),
          "dbias", "dbias counts the rows (a sum of ones, 6)"),
    Wrong("attention_backward", _change(2, lambda dv, q, k, v, mask, dout, scale:
                                        _attention_pieces(q, k, v, mask, dout, scale)[0].swapaxes(-1, -2)
                                        @ np.ones_like(dout), right.attention_backward),
          "dv", "dv = P^T @ ones: dout is missing"),
    Wrong("layer_norm_backward", _change(2, lambda db, x, w, dy, eps: dy.sum(axis=-1), right.layer_norm_backward),
          "dbias", "summed over the wrong axes: over (d), where the sum runs over (n)"),
    Wrong("linear_backward", _change(2, lambda db, x, w, dy: dy.sum(axis=(0, 2)), right.linear_backward),
          "dbias", "summed over the wrong axes: over (b, o), where the sum runs over (b, t)"),
    Wrong("linear_backward", _change(1, lambda dw, x, w, dy: np.einsum("bto,bti->toi", dy, x), right.linear_backward),
          "dweight", "summed over the wrong axes: over (b), where the sum runs over (b, t)"),
    Wrong("linear_backward", _change(2, lambda db, x, w, dy: dy.sum(axis=(0, 1), keepdims=True), right.linear_backward),
          "dbias", "summed over (b, t) as it should, but with keepdims"),
]

CATALOGUE = NAMED_SINCE_44 + [
    Wrong("softmax_backward", lambda y, dy: y * dy, "dx", "missing the row-sum term"),
    Wrong("softmax_backward", lambda y, dy: y * (1 - y) * dy, "dx", "missing the row-sum term"),
    Wrong("softmax_backward", _change(0, lambda dx, y, dy: -dx, right.softmax_backward), "dx", "sign flipped"),
    Wrong("softmax_backward", lambda y, dy: y * (dy - (dy * y).sum(axis=0, keepdims=True)), "dx",
          "the row sum runs over the wrong axis"),
    Wrong("log_softmax_backward", lambda y, dy: dy, "dx", "missing the row-sum term"),
    Wrong("log_softmax_backward", lambda y, dy: dy - y * dy.sum(axis=-1, keepdims=True), "dx",
          "used the log-probabilities y"),
    Wrong("log_softmax_backward", lambda y, dy: dy - np.exp(y) * dy.sum(axis=0, keepdims=True), "dx",
          "the row sum runs over the wrong axis"),
    Wrong("cross_entropy_backward", _change(0, lambda d, logits, t, dloss: d * logits.shape[0],
                                            right.cross_entropy_backward), "dlogits", "off by the scale factor N"),
    Wrong("cross_entropy_backward", _change(0, lambda d, logits, t, dloss: d / dloss, right.cross_entropy_backward),
          "dlogits", "not multiplied by the upstream gradient dloss"),
    Wrong("cross_entropy_backward", lambda logits, t, dloss: _softmax(logits) * dloss / len(t), "dlogits",
          "missing the one-hot term"),
    Wrong("cross_entropy_backward", lambda logits, t, dloss: -np.eye(logits.shape[1])[t] * dloss / len(t), "dlogits",
          "missing the softmax term"),
    Wrong("cross_entropy_backward", _change(0, lambda d, logits, t, dloss: d * logits.shape[0] / logits.shape[1],
                                            right.cross_entropy_backward), "dlogits",
          "the mean divides by the number of classes C"),
    Wrong("cross_entropy_backward", _change(0, lambda d, *args: -d, right.cross_entropy_backward), "dlogits",
          "sign flipped"),
    Wrong("layer_norm_backward", _ln_dx_without_mean_terms, "dx", "missing the mean terms"),
    Wrong("layer_norm_backward", _ln_dx_without_one_mean_term, "dx", "missing the mean terms"),
    Wrong("layer_norm_backward", _ln_without_weight_in_dx, "dx", "dx forgets the weight"),
    Wrong("layer_norm_backward", _change(1, lambda dw, x, w, dy, eps: (dy * x).sum(axis=0), right.layer_norm_backward),
          "dweight", "dweight uses x where xhat belongs"),
    Wrong("layer_norm_backward", _change(1, lambda dw, x, w, dy, eps: dy * _xhat(x, eps)[0], right.layer_norm_backward),
          "dweight", "weight gradient not summed over the batch"),
    Wrong("layer_norm_backward", _change(2, lambda db, x, w, dy, eps: dy, right.layer_norm_backward), "dbias",
          "bias gradient not summed over the batch"),
    Wrong("layer_norm_backward", _swap(1, 2, right.layer_norm_backward), "dweight",
          "gradient of the wrong input: this is dbias"),
    Wrong("layer_norm_backward", _change(0, lambda dx, *args: 2 * dx, right.layer_norm_backward), "dx",
          "off by the scale factor 2"),
    Wrong("linear_backward", _change(1, lambda dw, *args: dw.T, right.linear_backward), "dweight", "transposed"),
    Wrong("linear_backward", _change(2, lambda db, x, w, dy: dy, right.linear_backward), "dbias",
          "bias gradient not summed over the batch"),
    Wrong("linear_backward", _change(2, lambda db, x, w, dy: dy.sum(axis=0), right.linear_backward), "dbias",
          "bias gradient not summed over the batch"),
    Wrong("linear_backward", _change(1, lambda dw, x, w, dy: dw / (x.size // x.shape[-1]), right.linear_backward),
          "dweight", "off by the scale factor N"),
    Wrong("gelu_backward", lambda x, dy: right.gelu_backward(x, np.ones_like(dy)), "dx",
          "not multiplied by the upstream gradient dy"),
    Wrong("gelu_backward", lambda x, dy: right.gelu_backward(x, dy) - dy * x * np.exp(-x * x / 2) / np.sqrt(2 * np.pi),
          "dx", "missing the x * pdf(x) term"),
    Wrong("gelu_backward", lambda x, dy: dy * 0.5 * (1 + np.vectorize(math.erf)(x / np.sqrt(2))), "dx",
          "missing the x * pdf(x) term"),
    Wrong("gelu_backward", lambda x, dy: dy * x * np.exp(-x * x / 2) / np.sqrt(2 * np.pi), "dx",
          "missing the Phi(x) term"),
    Wrong("gelu_backward", lambda x, dy: dy * 0.5 * (1 + np.tanh(0.7978845608 * (x + 0.044715 * x ** 3)))
          + dy * 0.5 * x * (1 - np.tanh(0.7978845608 * (x + 0.044715 * x ** 3)) ** 2)
          * 0.7978845608 * (1 + 3 * 0.044715 * x ** 2), "dx", "the derivative of the tanh approximation"),
    Wrong("embedding_backward", _embedding_overwrites, "dweight", "repeated ids overwrite"),
    Wrong("embedding_backward", _embedding_first_row_only, "dweight", "repeated ids keep only their first row"),
    Wrong("embedding_backward", _change(0, lambda dw, *args: dw.T, right.embedding_backward), "dweight",
          "transposed"),
    Wrong("attention_backward", _attention_no_scale, "dq", "off by the scale factor 1/sqrt(hd)"),
    Wrong("attention_backward", _swap(0, 1, right.attention_backward), "dq", "dq and dk swapped"),
    Wrong("attention_backward", _attention_without_mask, "dk",
          "gradient on masked positions: the mask is not applied"),
    Wrong("attention_backward", lambda q, k, v, mask, *rest: right.attention_backward(q, k, v, ~mask, *rest), "dv",
          "gradient on masked positions: the mask is inverted"),
    Wrong("attention_backward", _attention_masked_by_zero_scores, "dv",
          "gradient on masked positions: masked scores set to 0"),
    Wrong("attention_backward", _attention_without_row_sum, "dk", "missing the row-sum term (softmax)"),
    Wrong("attention_backward", _change(2, lambda dv, *args: -dv, right.attention_backward), "dv", "sign flipped"),
    Wrong("attention_backward", _change(1, lambda dk, *args: right.attention_backward(*args)[2],   # dv as dk
                                        right.attention_backward), "dk", "gradient of the wrong input: this is dv"),
]
