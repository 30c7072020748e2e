"""The eight backward passes a learner writes: their arguments, their default inputs, and the
engine computation each gradient must equal.

Every exercise turns the learner's inputs into a small autograd graph: the leaves (the arrays
whose gradients the learner returns, in the learner's order), a function of the leaf Tensors
built from npformer.functional, and the upstream gradient its output is contracted with. The
same graph gives the engine's gradients (autograd's backward) and the finite differences.
Default inputs give every axis its own size (B=2, H=3, T=4 queries, S=5 keys, hd=6, ...), so
a transposed result has another shape and a worst entry's indices name one axis each.
"""
import dataclasses
import math
from collections.abc import Callable

import numpy as np

import npformer.functional as F
from autograd import Tensor, no_grad
from autograd.gradcheck import numeric_gradient, vjp


@dataclasses.dataclass(frozen=True)
class Graph:
    """What the engine differentiates: fn(*leaf Tensors) -> a Tensor, contracted with upstream."""

    leaves: tuple       # float64 arrays, one per gradient the learner returns
    fn: Callable
    upstream: np.ndarray


@dataclasses.dataclass(frozen=True)
class Exercise:
    """One backward to write: `name(*arguments) -> outputs`, each output with its axes' names."""

    name: str
    arguments: tuple[str, ...]
    outputs: dict               # gradient name -> the names of its axes, e.g. "dk": ("b", "h", "j", "d")
    make_inputs: Callable       # rng -> the default inputs, in the order of `arguments`
    graph: Callable             # the learner's inputs -> Graph
    factors: Callable           # the learner's inputs -> {name: value} of the scale factors a mistake may add


def _normal(rng, *shape):
    return rng.standard_normal(shape)


def _softmax_inputs(rng):
    x = _normal(rng, 3, 5)                                     # (N, C)
    return F.softmax(x).data, _normal(rng, 3, 5)              # y, dy


def _log_softmax_inputs(rng):
    x = _normal(rng, 3, 5)
    return F.log_softmax(x).data, _normal(rng, 3, 5)


def _cross_entropy_inputs(rng):
    logits = _normal(rng, 6, 5)                                # (N, C)
    return logits, rng.integers(0, 5, size=6), float(rng.uniform(0.3, 0.6))   # target (N,), dloss


def _layer_norm_inputs(rng):
    return _normal(rng, 4, 6), 1.0 + 0.5 * _normal(rng, 6), _normal(rng, 4, 6), 1e-5   # x (N, D), weight, dy, eps


def _linear_inputs(rng):
    return _normal(rng, 2, 3, 4), _normal(rng, 5, 4), _normal(rng, 2, 3, 5)   # x (B, T, I), weight (O, I), dy


def _gelu_inputs(rng):
    return 1.5 * _normal(rng, 3, 4), _normal(rng, 3, 4)       # x, dy


def _embedding_inputs(rng):
    ids = np.array([[1, 4, 1], [6, 0, 4]])                     # (B, T), ids 1 and 4 repeat, 2, 3, 5 unused
    return ids, 7, _normal(rng, 2, 3, 4)                       # num_embeddings, dy (B, T, E)


def _attention_inputs(rng):
    b, h, t, s, hd = 2, 3, 4, 5, 6
    mask = rng.random((b, 1, t, s)) < 0.75                     # True = takes part
    mask[:, :, :, 0] = True                                    # every query sees a key
    mask[1, :, :, 3] = False                                   # key 3 of batch 1 hidden from every query
    return (_normal(rng, b, h, t, hd), _normal(rng, b, h, s, hd), _normal(rng, b, h, s, hd), mask,
            _normal(rng, b, h, t, hd), 1.0 / math.sqrt(hd))


def _attention_graph(q, k, v, mask, dout, scale):
    return Graph((q, k, v), lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale),
                 dout)


EXERCISES = {e.name: e for e in [
    Exercise("softmax_backward", ("y", "dy"), {"dx": ("n", "c")}, _softmax_inputs,
             lambda y, dy: Graph((np.log(y),), F.softmax, dy),            # softmax(log y) = y
             lambda y, dy: {"C": y.shape[-1]}),
    Exercise("log_softmax_backward", ("y", "dy"), {"dx": ("n", "c")}, _log_softmax_inputs,
             lambda y, dy: Graph((y,), F.log_softmax, dy),                # log_softmax(y) = y
             lambda y, dy: {"C": y.shape[-1]}),
    Exercise("cross_entropy_backward", ("logits", "target", "dloss"), {"dlogits": ("n", "c")},
             _cross_entropy_inputs,
             lambda logits, target, dloss: Graph((logits,), lambda z: F.cross_entropy(z, target), np.array(dloss)),
             lambda logits, target, dloss: {"N": logits.shape[0], "C": logits.shape[1]}),
    Exercise("layer_norm_backward", ("x", "weight", "dy", "eps"),
             {"dx": ("n", "d"), "dweight": ("d",), "dbias": ("d",)}, _layer_norm_inputs,
             lambda x, weight, dy, eps: Graph(
                 (x, weight, np.zeros_like(weight)), lambda x, w, b: F.layer_norm(x, x.shape[-1], w, b, eps), dy),
             lambda x, weight, dy, eps: {"N": x.shape[0], "D": x.shape[-1]}),
    Exercise("linear_backward", ("x", "weight", "dy"), {"dx": ("b", "t", "i"), "dweight": ("o", "i"), "dbias": ("o",)},
             _linear_inputs,
             lambda x, weight, dy: Graph((x, weight, np.zeros(weight.shape[0])), F.linear, dy),
             lambda x, weight, dy: {"N": math.prod(x.shape[:-1])}),
    Exercise("gelu_backward", ("x", "dy"), {"dx": ("n", "d")}, _gelu_inputs,
             lambda x, dy: Graph((x,), F.gelu, dy), lambda x, dy: {}),
    Exercise("embedding_backward", ("ids", "num_embeddings", "dy"), {"dweight": ("v", "e")}, _embedding_inputs,
             lambda ids, num_embeddings, dy: Graph((np.zeros((num_embeddings, dy.shape[-1])),),
                                                   lambda w: F.embedding(ids, w), dy),
             lambda ids, num_embeddings, dy: {"N": ids.size}),
    Exercise("attention_backward", ("q", "k", "v", "mask", "dout", "scale"),
             {"dq": ("b", "h", "i", "d"), "dk": ("b", "h", "j", "d"), "dv": ("b", "h", "j", "d")}, _attention_inputs,
             _attention_graph, lambda q, k, v, mask, dout, scale: {"1/sqrt(hd)": scale, "S": k.shape[-2]}),
]}


# the argument of each exercise that is the upstream gradient (dL/d(output)); cross-entropy's
# dloss is a scalar, so it has none to vary
UPSTREAM = {"softmax_backward": "dy", "log_softmax_backward": "dy", "layer_norm_backward": "dy",
            "linear_backward": "dy", "gelu_backward": "dy", "embedding_backward": "dy", "attention_backward": "dout"}


def _leaf_tensors(graph):
    return [Tensor(np.array(a, dtype=np.float64), requires_grad=True) for a in graph.leaves]


def engine_gradients(graph):
    """The engine's gradient of sum(fn(*leaves) * upstream) for every leaf (autograd's backward)."""
    _, _, grads = vjp(graph.fn, _leaf_tensors(graph), [np.asarray(graph.upstream, dtype=np.float64)])
    return grads


def finite_differences(graph):
    """The same gradients by float64 central differences of the engine's forward, entry by entry."""
    leaves = _leaf_tensors(graph)

    def loss():
        with no_grad():
            return float((graph.fn(*leaves).data * graph.upstream).sum())

    return [numeric_gradient(loss, t) for t in leaves]
