"""What is wrong with a gradient: hypotheses about known mistakes, each tested numerically.

A hypothesis is a candidate array: what the learner's output would be had they made that
mistake (the correct gradient negated, transposed, scaled, without the row-sum term, with the
mask ignored, ...). The first candidate the learner's output matches (same shape, equal to the
close tolerance) names the mistake. The exercise's own hypotheses come first (they are the most
precise), then the ones that apply to any gradient.
"""
import itertools

import numpy as np

import npformer.functional as F
from autograd import Tensor

from .problems import EXERCISES, Graph, engine_gradients

# gradcheck's float64 tolerance: |yours - reference| <= ATOL + RTOL |reference| everywhere
ATOL, RTOL = 1e-5, 1e-3


def matches(mine, reference):
    """Same shape, and equal to the close tolerance."""
    return mine.shape == reference.shape and bool(np.all(np.abs(mine - reference) <= ATOL + RTOL * np.abs(reference)))


def _softmax(y, dy):
    return [("missing the row-sum term: dx = y * dy, without - y * sum(y * dy)", {"dx": y * dy}),
            ("missing the row-sum term: y * (1 - y) * dy is only the Jacobian's diagonal",
             {"dx": y * (1 - y) * dy}),
            ("the row sum runs over the wrong axis (axis 0, not the last)",
             {"dx": y * (dy - (y * dy).sum(axis=0, keepdims=True))}),
            ("the row sum sum(y * dy) is replaced by 1: y sums to 1 over a row, y * dy does not",
             {"dx": y * (dy - 1)})]


def _log_softmax(y, dy):
    p = np.exp(y)                                                   # (N, C) the probabilities
    return [("missing the row-sum term: dx = dy, without - exp(y) * sum(dy)", {"dx": dy}),
            ("used the log-probabilities y where the probabilities exp(y) belong",
             {"dx": dy - y * dy.sum(axis=-1, keepdims=True)}),
            ("the row sum runs over the wrong axis (axis 0, not the last)",
             {"dx": dy - p * dy.sum(axis=0, keepdims=True)}),
            ("missing the row sum: exp(y) multiplies dy itself where it multiplies sum(dy) over the row",
             {"dx": dy - p * dy})]


def _cross_entropy(logits, target, dloss):
    n, c = logits.shape
    p = F.softmax(logits).data                                      # (N, C)
    onehot = np.eye(c)[target]                                      # (N, C)
    return [("not multiplied by the upstream gradient dloss", {"dlogits": (p - onehot) / n}),
            ("missing the softmax term: the gradient is not just - onehot(target)",
             {"dlogits": -onehot * dloss / n}),
            ("missing the one-hot term: - onehot(target) at each row's target",
             {"dlogits": p * dloss / n}),
            ("the mean divides by the number of classes C, not of rows N",
             {"dlogits": (p - onehot) * dloss / c})]


def _layer_norm(x, weight, dy, eps):
    centered = x - x.mean(axis=-1, keepdims=True)                   # (N, D)
    rstd = 1.0 / np.sqrt((centered ** 2).mean(axis=-1, keepdims=True) + eps)   # (N, 1)
    xhat = centered * rstd
    g = dy * weight                                                 # (N, D) dxhat

    def dx(g, first=True, second=True):
        """rstd (dxhat - mean(dxhat) - xhat mean(dxhat xhat)), with or without each mean term."""
        mean_term = g.mean(axis=-1, keepdims=True)                  # (N, 1)
        xhat_term = xhat * (g * xhat).mean(axis=-1, keepdims=True)  # (N, D)
        return rstd * (g - first * mean_term - second * xhat_term)

    return ([("missing the mean terms: dx = rstd * dxhat, without - mean(dxhat) - xhat * mean(dxhat * xhat)",
             {"dx": dx(g, False, False)}),
            ("missing the mean terms: - xhat * mean(dxhat * xhat) is missing", {"dx": dx(g, second=False)}),
            ("missing the mean terms: - mean(dxhat) is missing", {"dx": dx(g, first=False)}),
            ("dx forgets the weight: dxhat = dy * weight, not dy", {"dx": dx(dy)}),
            ("the mean term uses mean(dy) where mean(dxhat) = mean(dy * weight) belongs",
             {"dx": rstd * (g - dy.mean(axis=-1, keepdims=True) - xhat * (g * xhat).mean(axis=-1, keepdims=True))}),
            ("the xhat term uses mean(dy * xhat) where mean(dxhat * xhat) = mean(dy * weight * xhat) belongs",
             {"dx": rstd * (g - g.mean(axis=-1, keepdims=True) - xhat * (dy * xhat).mean(axis=-1, keepdims=True))}),
            ("weight gradient not summed over the batch: dweight = sum over the rows of dy * xhat",
             {"dweight": dy * xhat}),
            ("bias gradient not summed over the batch: dbias = sum over the rows of dy", {"dbias": dy}),
            ("dweight uses x where xhat belongs", {"dweight": (dy * x).sum(axis=0)}),
            ("dweight forgets dy: it is the sum over the rows of dy * xhat, not of xhat",
             {"dweight": xhat.sum(axis=0)}),
            (f"dbias counts the rows (a sum of ones, {x.shape[0]}): it is the sum over the rows of dy",
             {"dbias": np.full(dy.shape[-1], float(x.shape[0]))})]
            + _wrong_axes("dweight", dy * xhat, ("n", "d"), (0,))
            + _wrong_axes("dbias", dy, ("n", "d"), (0,)))


def _wrong_axes(output, terms, axes, right):
    """Hypotheses for a gradient that is `terms` summed over the axes `right` (e.g. dbias = dy
    summed over (b, t)): summed over any other set of axes, with or without keepdims. axes: the
    names of terms' axes."""
    named = lambda subset: "(" + ", ".join(axes[a] for a in subset) + ")"  # noqa: E731
    hypotheses = []
    for size in range(1, terms.ndim + 1):
        for subset in itertools.combinations(range(terms.ndim), size):
            if subset == tuple(right):
                hypotheses.append((f"summed over {named(right)} as it should, but with keepdims: the summed axes "
                                   "must go", {output: terms.sum(axis=subset, keepdims=True)}))
                continue
            for keep in (False, True):
                hypotheses.append((f"summed over the wrong axes: over {named(subset)}"
                                   f"{' with keepdims' if keep else ''}, where the sum runs over {named(right)}",
                                   {output: terms.sum(axis=subset, keepdims=keep)}))
    return hypotheses


def _linear(x, weight, dy):
    batch_axes = tuple(range(dy.ndim - 1))
    names = ("b", "t")[:len(batch_axes)] if len(batch_axes) <= 2 else tuple(f"axis{a}" for a in batch_axes)
    over = "(" + ", ".join(names) + ")"
    rows = x.size // x.shape[-1]
    return ([("bias gradient not summed over the batch: dbias = dy summed over every axis but the last",
              {"dbias": dy})]
            + [(f"bias gradient not summed over the batch: summed over axis {axis} ({names[axis]}) only, where the "
                f"sum runs over {over}", {"dbias": dy.sum(axis=axis)}) for axis in batch_axes if len(batch_axes) > 1]
            + [(f"dbias counts the rows (a sum of ones, {rows}): it is dy summed over {over}",
                {"dbias": np.full(dy.shape[-1], float(rows))})]
            + _wrong_axes("dbias", dy, (*names, "o"), batch_axes)
            + _wrong_axes("dweight", dy[..., :, None] * x[..., None, :], (*names, "o", "i"), batch_axes))


def _gelu(x, dy):
    cdf = F.gelu(x).data / np.where(x == 0, 1.0, x)                 # Phi(x) = gelu(x) / x
    pdf = np.exp(-0.5 * x * x) / np.sqrt(2 * np.pi)                 # phi(x)
    (tanh_dx,) = engine_gradients(Graph((x,), lambda t: F.gelu(t, approximate="tanh"), dy))
    return [("not multiplied by the upstream gradient dy", {"dx": cdf + x * pdf}),
            ("missing the x * pdf(x) term of the product rule", {"dx": cdf * dy}),
            ("missing the Phi(x) term of the product rule", {"dx": x * pdf * dy}),
            ("the derivative of the tanh approximation, not of the exact GELU", {"dx": tanh_dx})]


def _embedding(ids, num_embeddings, dy):
    rows = dy.reshape(-1, dy.shape[-1])                             # (B*T, E)
    last, first = np.zeros((num_embeddings, rows.shape[1])), np.zeros((num_embeddings, rows.shape[1]))
    last[ids.reshape(-1)] = rows                                    # numpy keeps the last write
    first[ids.reshape(-1)[::-1]] = rows[::-1]
    return [("repeated ids overwrite instead of adding up (np.add.at accumulates)", {"dweight": last}),
            ("repeated ids keep only their first row instead of adding up (np.add.at accumulates)",
             {"dweight": first})]


def _attention(q, k, v, mask, dout, scale):
    def gradients(mask):
        return dict(zip(("dq", "dk", "dv"), engine_gradients(EXERCISES["attention_backward"].graph(
            q, k, v, mask, dout, scale))))

    scores = np.where(mask, q @ k.swapaxes(-1, -2) * scale, -np.inf)   # (B, H, T, S)
    p = F.softmax(scores).data
    dp = dout @ v.swapaxes(-1, -2)                                  # (B, H, T, S)
    ds = p * dp                                                     # dS without the row sum
    zeroed = F.softmax(np.where(mask, q @ k.swapaxes(-1, -2) * scale, 0.0)).data   # hidden scores 0, not -inf
    ds_zeroed = zeroed * (dp - (dp * zeroed).sum(axis=-1, keepdims=True))
    ds_right = p * (dp - (dp * p).sum(axis=-1, keepdims=True))
    transpose = [] if q.shape[-2] != k.shape[-2] else [
        ("dk = dS @ q: dS needs a transpose (dk = dS^T @ q * scale); with T = S the shapes cannot tell",
         {"dk": ds_right @ q * scale})]
    return transpose + [
            ("gradient on masked positions: the mask is not applied in backward", gradients(np.ones_like(mask))),
            ("gradient on masked positions: the mask is inverted (True = takes part)", gradients(~mask)),
            ("gradient on masked positions: masked scores set to 0 instead of -inf still take part",
             dict(zip(("dq", "dk", "dv"), engine_gradients(Graph(
                 (q, k, v), lambda q, k, v: F.softmax(q @ k.swapaxes(-1, -2) * Tensor(scale * mask)) @ v, dout))))),
            ("missing the row-sum term (softmax): dS = P * dP, without - P * sum(P * dP)",
             {"dq": ds @ k * scale, "dk": ds.swapaxes(-1, -2) @ q * scale}),
            ("gradient on masked positions: masked scores set to 0 instead of -inf still take part (in P and dS)",
             {"dq": ds_zeroed @ k * scale, "dk": ds_zeroed.swapaxes(-1, -2) @ q * scale,
              "dv": zeroed.swapaxes(-1, -2) @ dout}),
            ("dv = P^T @ ones: dout is missing (dv = P^T @ dout)", {"dv": p.swapaxes(-1, -2) @ np.ones_like(dout)})]


def _cells(name, implied, correct, mask, what):
    """Where `implied` (the learner's dS or P, recovered from their gradient) differs from
    `correct`, cell by cell: the words naming the first such cell and whether the mask hides it."""
    wrong = ~(np.abs(implied - correct) <= ATOL + RTOL * np.abs(correct))
    if not wrong.any():
        return ""
    hidden = np.broadcast_to(~mask, wrong.shape)
    index = tuple(int(i) for i in np.argwhere(wrong)[0])
    cell = "[" + ", ".join(f"{a}={i}" for a, i in zip("bhij", index)) + "]"
    if np.all(hidden[wrong]):
        return (f"gradient on masked positions: your {name} implies {what} is not 0 at masked cells, "
                f"e.g. {what}{cell} = {implied[index]:.4g} where the mask hides key j={index[3]} from query "
                f"i={index[2]} ({int(wrong.sum())} masked cells leak)")
    return (f"{what} differs cell by cell, first at {what}{cell}: yours {implied[index]:.4g}, correct "
            f"{correct[index]:.4g} ({int(wrong.sum())} of {wrong.size} cells, {int((wrong & hidden).sum())} masked)")


def attention_cells(inputs, output, mine):
    """The per-cell diagnosis of a wrong attention gradient: the dS (from dq or dk) or the P
    (from dv) that `mine` implies, compared with the correct one cell by cell. dq = dS @ K scale
    gives dS back when K's rows are independent (S <= hd), dk = dS^T @ Q scale when T <= hd, dv =
    P^T @ dout when T <= hd; "" where it cannot be recovered or mine is no such product."""
    q, k, v, mask, dout, scale = inputs
    if mine.shape != {"dq": q.shape, "dk": k.shape, "dv": v.shape}[output]:
        return ""
    scores = np.where(mask, q @ k.swapaxes(-1, -2) * scale, -np.inf)
    p = F.softmax(scores).data
    dp = dout @ v.swapaxes(-1, -2)
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))
    factor, product, correct, what = {                  # mine = product(implied), factor the known matrix
        "dq": (k, lambda s: s @ k * scale, ds, "dS"),
        "dk": (q, lambda s: s.swapaxes(-1, -2) @ q * scale, ds, "dS"),
        "dv": (dout, lambda s: s.swapaxes(-1, -2) @ dout, p, "P")}[output]
    if factor.shape[-2] > factor.shape[-1]:
        return ""                                   # more rows than features: the product loses information
    pinv = np.linalg.pinv(factor)                   # (..., hd, rows)
    if output == "dq":
        implied = mine / scale @ pinv               # (B, H, T, S)
    elif output == "dk":
        implied = (mine / scale @ pinv).swapaxes(-1, -2)
    else:
        implied = (mine @ pinv).swapaxes(-1, -2)
    if not matches(product(implied), mine):
        return ""                                   # not of the form dS @ K: nothing to locate
    return _cells(output, implied, correct, mask, what)


SPECIFIC = {"softmax_backward": _softmax, "log_softmax_backward": _log_softmax,
            "cross_entropy_backward": _cross_entropy, "layer_norm_backward": _layer_norm,
            "linear_backward": _linear, "gelu_backward": _gelu, "embedding_backward": _embedding,
            "attention_backward": _attention}


def _general(output, correct, factors):
    """(diagnosis, candidate) of the mistakes any gradient can have."""
    ref = correct[output]
    for other, value in correct.items():
        if other != output:
            swapped = {output, other} == {"dq", "dk"}
            yield ("dq and dk swapped" if swapped else f"gradient of the wrong input: this is {other}"), value
    yield "sign flipped", -ref
    if ref.ndim >= 2:
        yield "transposed: the last two axes are swapped", ref.swapaxes(-1, -2)
    for name, factor in {"2": 2.0, **factors}.items():
        for times in (factor, 1 / factor):
            yield f"off by the scale factor {name}: yours is {times:.4g} times the correct gradient", times * ref


def diagnose(exercise, inputs, output, mine, correct, specific):
    """Plain words for what is wrong with `mine`, the learner's `output` (e.g. "dk").

    correct: {output name: the engine's gradient}; specific: the exercise's hypotheses
    [(diagnosis, {output: candidate})], computed once per check."""
    ref = correct[output]
    shape_note = "" if mine.shape == ref.shape else f" (shape {mine.shape}, expected {ref.shape})"
    candidates = [(words, c[output]) for words, c in specific if output in c]
    candidates += list(_general(output, correct, exercise.factors(*inputs)))
    for words, candidate in candidates:
        if matches(mine, candidate):
            return words + shape_note
    if exercise.name == "attention_backward":
        located = attention_cells(inputs, output, mine)
        if located:
            return located
    if mine.shape != ref.shape:
        return f"shape {mine.shape} expected {ref.shape}"
    if not mine.any():
        return "zero everywhere: no gradient reached it"
    ratio = float((mine * ref).sum() / (ref * ref).sum()) if ref.any() else 0.0
    if ratio and matches(mine, ratio * ref):
        return f"off by a constant factor: yours is {ratio:.4g} times the correct gradient"
    return "none of the known mistakes"
