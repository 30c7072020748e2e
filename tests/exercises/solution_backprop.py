"""A correct solution of the starter file's backward functions (python -m npformer.exercises),
which the starter does not contain: the checker must pass every one of them."""
import math

import numpy as np


def softmax_backward(y, dy):
    # dy_i/dx_j = y_i ([i == j] - y_j)  ->  dx_j = y_j (dy_j - sum_i dy_i y_i)
    return y * (dy - (dy * y).sum(axis=-1, keepdims=True))


def log_softmax_backward(y, dy):
    # dy_i/dx_j = [i == j] - softmax_j  ->  dx_j = dy_j - exp(y_j) sum_i dy_i
    return dy - np.exp(y) * dy.sum(axis=-1, keepdims=True)


def cross_entropy_backward(logits, target, dloss):
    n = logits.shape[0]
    z = logits - logits.max(axis=-1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(axis=-1, keepdims=True)          # (N, C)
    p[np.arange(n), target] -= 1.0                                 # softmax - onehot
    return p * dloss / n


def layer_norm_backward(x, weight, dy, eps):
    mean = x.mean(axis=-1, keepdims=True)
    rstd = 1.0 / np.sqrt(((x - mean) ** 2).mean(axis=-1, keepdims=True) + eps)   # (N, 1)
    xhat = (x - mean) * rstd                                       # (N, D)
    g = dy * weight                                                # dxhat
    dx = rstd * (g - g.mean(axis=-1, keepdims=True) - xhat * (g * xhat).mean(axis=-1, keepdims=True))
    return dx, (dy * xhat).sum(axis=0), dy.sum(axis=0)


def linear_backward(x, weight, dy):
    rows_x, rows_dy = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])   # (B*T, I), (B*T, O)
    return dy @ weight, rows_dy.T @ rows_x, rows_dy.sum(axis=0)


def gelu_backward(x, dy):
    cdf = 0.5 * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))
    pdf = np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    return dy * (cdf + x * pdf)


def embedding_backward(ids, num_embeddings, dy):
    dweight = np.zeros((num_embeddings, dy.shape[-1]))
    np.add.at(dweight, ids.reshape(-1), dy.reshape(-1, dy.shape[-1]))
    return dweight


def attention_backward(q, k, v, mask, dout, scale):
    scores = np.where(mask, q @ k.swapaxes(-1, -2) * scale, -np.inf)   # (B, H, T, S)
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    dv = p.swapaxes(-1, -2) @ dout                                  # (B, H, S, hd)
    dp = dout @ v.swapaxes(-1, -2)                                  # (B, H, T, S)
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))            # masked keys: p = 0, ds = 0
    return ds @ k * scale, ds.swapaxes(-1, -2) @ q * scale, dv
