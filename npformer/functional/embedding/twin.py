"""The composite twin of F.embedding: the same function built only from autograd primitives, so that
its gradients come from the tape, a test reference beside torch and finite differences
(npformer.functional.composite installs it)."""
from autograd import Tensor, where

from .._common import on_device_of, tensor_of
from . import check_embedding_options
from .math import id_counts, renormalize_rows


def embedding(input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False):
    w = tensor_of(weight)
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
