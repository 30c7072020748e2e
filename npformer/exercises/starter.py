"""The starter file a learner fills in: each forward written (plain numpy, float64), each backward
a docstring with the shapes and what to derive, and `raise NotImplementedError("write me")`."""
import os
import pathlib

from autograd.checks import check_bool
from npformer.files import atomic_write

TEMPLATE = '''"""Backprop by hand: write each backward below, then check it against npformer's engine:

    python -m npformer.exercises check {filename}

Each forward is given (plain numpy, float64). Each backward receives what its forward saw and
the upstream gradient (dy = dL/dy for some loss L), and returns the gradient of L with respect
to the forward's inputs, each of its input's shape. The checker says, per function: exact, close
or wrong, the largest difference, and for a wrong one the worst entry and what the mistake is.
"""
import math

import numpy as np


def softmax(x):
    """x (N, C) -> y (N, C): each row exponentiated and normalized to sum to 1."""
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def softmax_backward(y, dy):
    """y = softmax(x) (N, C), dy = dL/dy (N, C) -> dx = dL/dx (N, C).

    Derive dy_i/dx_j within a row (two cases: i == j and i != j), then
    dx_j = sum_i dy_i * dy_i/dx_j, written with y and dy only."""
    raise NotImplementedError("write me")


def log_softmax(x):
    """x (N, C) -> y (N, C) = x - log(sum(exp(x))) along each row."""
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def log_softmax_backward(y, dy):
    """y = log_softmax(x) (N, C), dy = dL/dy (N, C) -> dx = dL/dx (N, C).

    Derive dy_i/dx_j within a row; exp(y) is softmax(x)."""
    raise NotImplementedError("write me")


def cross_entropy(logits, target):
    """logits (N, C), target (N,) class ids -> the mean over rows of -log softmax(logits)[target]."""
    n = logits.shape[0]
    return -log_softmax(logits)[np.arange(n), target].mean()


def cross_entropy_backward(logits, target, dloss):
    """logits (N, C), target (N,) ints, dloss = dL/dloss (a float) -> dlogits = dL/dlogits (N, C).

    Derive d(-log softmax(z)[t]) / dz_j for one row z with target t, then account for the mean
    over the N rows and for dloss."""
    raise NotImplementedError("write me")


def layer_norm(x, weight, bias, eps):
    """x (N, D), weight (D,), bias (D,) -> y (N, D) = xhat * weight + bias, where each row
    xhat = (x - mean) / sqrt(var + eps) (mean and biased variance over the D features)."""
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * weight + bias


def layer_norm_backward(x, weight, dy, eps):
    """x (N, D), weight (D,), dy = dL/dy (N, D), eps -> (dx (N, D), dweight (D,), dbias (D,)).

    Go through xhat: dxhat = dL/dxhat first; then dx from dxhat, remembering that the mean and
    the variance depend on every x of the row. dweight and dbias gather every row."""
    raise NotImplementedError("write me")


def linear(x, weight, bias):
    """x (B, T, I), weight (O, I), bias (O,) -> y (B, T, O) = x @ weight.T + bias."""
    return x @ weight.T + bias


def linear_backward(x, weight, dy):
    """x (B, T, I), weight (O, I), dy = dL/dy (B, T, O) -> (dx (B, T, I), dweight (O, I), dbias (O,)).

    Write y[b, t, o] = sum_i x[b, t, i] weight[o, i] + bias[o] and differentiate by each input;
    every (b, t) position uses the same weight and bias."""
    raise NotImplementedError("write me")


def gelu(x):
    """x (any shape) -> x * Phi(x), Phi the standard normal CDF, exactly (with erf)."""
    return x * 0.5 * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))


def gelu_backward(x, dy):
    """x, dy = dL/dy (the same shape) -> dx = dL/dx (that shape).

    d/dx [x * Phi(x)]: the product rule, and Phi'(x) is the standard normal density."""
    raise NotImplementedError("write me")


def embedding(ids, weight):
    """ids (B, T) integers in [0, V), weight (V, E) -> y (B, T, E) = weight[ids]."""
    return weight[ids]


def embedding_backward(ids, num_embeddings, dy):
    """ids (B, T), num_embeddings V, dy = dL/dy (B, T, E) -> dweight = dL/dweight (V, E).

    Which rows of weight did each position read? An id may occur more than once."""
    raise NotImplementedError("write me")


def attention(q, k, v, mask, scale):
    """q (B, H, T, hd), k and v (B, H, S, hd), mask bool broadcastable to (B, H, T, S)
    (True = takes part), scale (usually 1 / sqrt(hd)) -> out (B, H, T, hd) = P @ v, where
    P = softmax(where(mask, q @ k^T * scale, -inf)) over the S keys."""
    scores = np.where(mask, q @ k.swapaxes(-1, -2) * scale, -np.inf)
    return softmax(scores) @ v


def attention_backward(q, k, v, mask, dout, scale):
    """q (B, H, T, hd), k and v (B, H, S, hd), mask, dout = dL/dout (B, H, T, hd), scale
    -> (dq (B, H, T, hd), dk (B, H, S, hd), dv (B, H, S, hd)).

    Recompute P, then go back one step at a time: dP and dv from out = P @ v, dS from the
    softmax (a masked key takes no part), then dq and dk from S = q @ k^T * scale."""
    raise NotImplementedError("write me")
'''


def write_starter(path: str | os.PathLike = "my_backprop.py", force: bool = False) -> pathlib.Path:
    """Write the starter file to `path` and return its path. Raises FileExistsError when the file
    is there already (your work would be lost), unless force=True."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"write_starter: path must be a str or os.PathLike, got {type(path).__name__}")
    force = check_bool(force, "force", "write_starter")
    path = pathlib.Path(path)
    if path.exists() and not force:
        raise FileExistsError(f"{path} exists; pass --force (force=True) to overwrite it, or -o another path")
    atomic_write(path, lambda tmp: pathlib.Path(tmp).write_text(TEMPLATE.format(filename=path.name)))
    return path
