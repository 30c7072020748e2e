"""Dropout fused with the residual add, y = residual + dropout(x), on whole arrays of `xp` (numpy or
CuPy): the residual connection of a Transformer sublayer. keep is F.dropout's mask (the dropout
contract, drawn by the caller from a Philox stream), so the gradients are F.dropout's for x and dy
itself for the residual (see derivation.md)."""
from ..activation.math import dropout_backward, dropout_forward


def dropout_add_forward(xp, x, residual, keep, p):
    """x, residual and keep (bool) of one shape (...) -> y = residual + x * keep / (1 - p)."""
    y = dropout_forward(xp, x, keep, p)                     # x * keep / (1 - p)
    y += residual
    return y


def dropout_add_backward(xp, dy, keep, p):
    """dy (...) -> (dx, dresidual)."""
    # y = residual + x * keep / (1 - p)  ->  dx = dy * keep / (1 - p) (F.dropout's backward)
    dx = dropout_backward(xp, dy, keep, p)
    # y = residual + ...  ->  dresidual = dy
    return dx, dy
