"""The registry cases of F.embedding: each op on ordinary inputs and its
edge cases, with the PyTorch reference written once here (npformer.opcases imports this module; tests/functional/test_op_<family>.py,
`python -m npformer.gradcheck` and the docs' op table read them)."""
import numpy as np

import npformer.functional as F
from npformer.opcases import register
from npformer.opcases.inputs import normal, op_case, op_family


def embedding_case(label, ids, vocab, dim, padding_idx=None, **options):
    """F.embedding(ids, weight, padding_idx, **options); with a padding row, whose gradient is held at
    zero on purpose, or scale_grad_by_freq, which scales it on purpose, finite differences would see
    the difference: no gradcheck there, nor with max_norm (which renormalises the weight in place)."""
    ids = np.asarray(ids)
    return op_case(f"F.embedding{label}", "embedding", normal((vocab, dim)),
                   lambda w: F.embedding(ids, w, padding_idx=padding_idx, **options),
                   lambda t, w: t.nn.functional.embedding(t.tensor(ids), w, padding_idx=padding_idx, **options),
                   finite_differences=padding_idx is None and not options)


_REPEATED_IDS = [[2, 2, 2, 5], [0, 5, 2, 6], [6, 6, 1, 1]]
EMBEDDING = [
    embedding_case("", [[1, 3, 3, 0], [6, 1, 3, 3]], 7, 3),
    embedding_case(" (padding_idx=3)", [[1, 3, 3, 0], [6, 1, 3, 3]], 7, 3, padding_idx=3),
    embedding_case(" (repeated ids)", _REPEATED_IDS, 7, 4),
    embedding_case(" (repeated ids, padding_idx=2)", _REPEATED_IDS, 7, 4, padding_idx=2),
    embedding_case(" (repeated ids, padding_idx=-1)", _REPEATED_IDS, 7, 4, padding_idx=-1),
    embedding_case(" (scale_grad_by_freq)", _REPEATED_IDS, 7, 4, scale_grad_by_freq=True),
    embedding_case(" (scale_grad_by_freq, padding_idx=2)", _REPEATED_IDS, 7, 4, padding_idx=2, scale_grad_by_freq=True),
    embedding_case(" (max_norm=1)", _REPEATED_IDS, 7, 4, max_norm=1.0),
    embedding_case(" (max_norm=1.5, norm_type=1)", _REPEATED_IDS, 7, 4, max_norm=1.5, norm_type=1.0),
    embedding_case(" (max_norm=0.8, norm_type=inf)", _REPEATED_IDS, 7, 4, max_norm=0.8, norm_type=float("inf")),
]


register(op_family("embedding", ("F.embedding", "nn.Embedding"), "embedding", ("EmbeddingFunction",), "Embedding"),
         *EMBEDDING)
