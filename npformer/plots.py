"""Figures of a training run and of what the network attends to (PNG files).

matplotlib is imported only when a figure is drawn (`pip install -e .[plot]`), and only
its object-oriented API is used (`matplotlib.figure.Figure`, saved by the Agg canvas), so
no pyplot backend or global state is touched. Figures are written atomically
(`npformer.files.atomic_write`: missing folders are made, a file replaced keeps its mode), in
the format of the path's extension (PNG without one).

`attention_maps` (no matplotlib needed) returns the per-head attention probabilities of
every attention module of a Seq2SeqTransformer for one forward pass.
"""
from __future__ import annotations

import os
import textwrap
from collections.abc import Sequence
from typing import Any

import numpy as np

from autograd.backend import ArrayLike

from .files import atomic_write
from .nn import Module, inference_mode, record_attention

__all__ = ["attention_maps", "attention_panels", "plot_curves", "plot_grad_norms", "plot_attention", "plot_attention_and_grads", "TITLES"]


_GROUPS = ("encoder_self", "decoder_self", "cross")
TITLES = {"encoder_self": "encoder self-attention", "decoder_self": "decoder self-attention (causal)",
          "cross": "cross-attention (decoder queries, encoder keys)"}


def _matplotlib():
    try:
        import matplotlib
        import matplotlib.figure
    except ImportError as e:
        raise ImportError("npformer.plots needs matplotlib: pip install -e '.[plot]' (or pip install "
                          "matplotlib)") from e
    return matplotlib


def _figure(**kwargs):
    return _matplotlib().figure.Figure(**kwargs)


def _save(fig, path):
    """fig written to path atomically, in the format of path's extension (PNG without one); -> path."""
    fmt = os.path.splitext(os.fspath(path))[1][1:].lower() or "png"
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, format=fmt))
    return path


def _yscale(*series):
    """"log" when the finite values of the series are all positive (and there are some), else "linear":
    a zero or negative value would vanish from a log axis."""
    values = np.concatenate([np.asarray(s, dtype=float).ravel() for s in series])
    finite = values[np.isfinite(values)]
    return "log" if finite.size and (finite > 0).all() else "linear"


def _group_of(name):
    if name.endswith("multihead_attn"):
        return "cross"
    return "decoder_self" if ".decoder." in f".{name}" else "encoder_self"


def attention_maps(model: Module, *inputs: ArrayLike) -> dict[str, list[np.ndarray]]:
    """Run `model(*inputs)` (e.g. `model(src, tgt_in)`, or `model(ids)` for a causal LM) once in
    nn.inference_mode() (no dropout, model.training untouched) and return the attention
    probabilities of every MultiheadAttention, per head: {"encoder_self": [(B, H, S, S) per
    layer], "decoder_self": [(B, H, T, T)], "cross": [(B, H, T, S)]} as numpy arrays (a causal
    LM's layers are its encoder stack: "encoder_self"; recorded with `npformer.nn.record_attention`)."""
    maps = {group: [] for group in _GROUPS}
    with inference_mode(), record_attention(model) as recorder:
        model(*inputs)
    for record in recorder:
        maps[_group_of(record.name)].append(record.weights.numpy())          # (B, H, Tq, Tk)
    return maps


_CURVE_KEYS = ("step", "loss", "lr", "grad_norm", "items", "seconds")


def plot_curves(history: dict[str, Any], path: str | os.PathLike, title: str = "training") -> str | os.PathLike:
    """Loss, metrics and learning rate against the step, side by side, from a Trainer's
    history (see npformer.training for its keys).

    Needs "step", "loss" and "lr" (one entry per step). Also drawn when present: every other
    per-step list of the same length (the loss function's metrics, e.g. "accuracy") and every
    "eval_<name>" list of numbers other than counts against "eval_step" ("eval_loss" beside
    the training loss, the rest beside the metrics). The metrics panel is left out when there are none.
    Writes a PNG to `path` and returns path. KeyError naming the missing keys; ImportError
    without matplotlib."""
    missing = [k for k in ("step", "loss", "lr") if k not in history]
    if missing:
        raise KeyError(f"history: expected the keys 'step', 'loss' and 'lr' (a Trainer's history), "
                       f"missing {missing}")
    steps = np.asarray(history["step"])
    per_step = {k: v for k, v in history.items() if k not in _CURVE_KEYS and not k.startswith(("eval_", "layer_"))
                and isinstance(v, list) and len(v) == len(steps) and len(v)}
    eval_steps = history.get("eval_step", [])
    evals = {k[len("eval_"):]: v for k, v in history.items() if k.startswith("eval_") and k != "eval_step"
             and isinstance(v, list) and len(v) == len(eval_steps) and len(v)
             and not all(isinstance(x, int) for x in v)}  # counts (eval_sequences) are not drawn
    eval_loss = evals.pop("loss", None)
    panels = 3 if per_step or evals else 2
    fig = _figure(figsize=(5 * panels, 4), layout="constrained")
    axes = fig.subplots(1, panels)
    ax_loss, ax_lr = axes[0], axes[-1]
    loss = np.asarray(history["loss"])
    ax_loss.plot(steps, loss, lw=0.6, alpha=0.4, color="C0", label="training (batch)")
    if len(loss) >= 20:
        k = max(len(loss) // 50, 5)
        ax_loss.plot(steps[k - 1:], np.convolve(loss, np.ones(k) / k, mode="valid"), color="C0",
                     label=f"training (mean of {k})")
    if eval_loss is not None:
        ax_loss.plot(eval_steps, eval_loss, "o-", color="C1", label="held-out")
    ax_loss.set(yscale=_yscale(loss, eval_loss or []), xlabel="step", ylabel="loss", title="loss")
    ax_loss.legend()
    if panels == 3:
        ax_metrics = axes[1]
        for name, values in per_step.items():
            ax_metrics.plot(steps, values, lw=0.6, alpha=0.6, label=f"{name} (training batch)")
        for name, values in evals.items():
            ax_metrics.plot(eval_steps, values, "o-", label=f"{name} (held-out)")
        ax_metrics.set(xlabel="step", title="metrics")
        ax_metrics.legend(loc="lower right", fontsize=8)
    ax_lr.plot(steps, history["lr"], color="C2")
    ax_lr.set(xlabel="step", ylabel="learning rate", title="learning rate")
    fig.suptitle(title)
    return _save(fig, path)


def plot_loss(steps, loss, path, title, evaluations=None, baselines=None, ylabel="cross-entropy (bits per token)"):
    """Training loss per step (and its running mean), held-out evaluations {label: (steps,
    values)} as points, horizontal reference lines {label: value}."""
    fig = _figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.subplots()
    steps, loss = np.asarray(steps), np.asarray(loss)
    ax.plot(steps, loss, lw=0.6, alpha=0.4, color="C0", label="training batch")
    if len(loss) >= 20:
        k = max(len(loss) // 50, 5)
        ax.plot(steps[k - 1:], np.convolve(loss, np.ones(k) / k, mode="valid"), color="C0", label=f"mean of {k}")
    for i, (label, (at, values)) in enumerate((evaluations or {}).items()):
        ax.plot(at, values, "o-", color=f"C{i + 1}", label=label)
    for i, (label, value) in enumerate((baselines or {}).items()):
        ax.axhline(value, ls="--", color=f"C{i + 4}", label=label)
    ax.set(xlabel="step", ylabel=ylabel, title=title)
    ax.legend()
    return _save(fig, path)


def _grad_norm_panels(names):
    """Per-layer gradient-norm names (training.layer_of) grouped for small multiples:
    {panel title: [(name, line label)]}. A stack's layers and final norm share a panel
    ('encoder': 'layer 0', 'layer 1', 'final norm'); embeddings and output layers share the last."""
    panels = {}
    for name in names:
        head, sep, tail = f".{name}".rpartition(".layers.")
        if sep and tail.isdigit():
            panel, label = head.rpartition(".")[2] or "layers", f"layer {tail}"
        elif name.endswith(".norm") and any(n.startswith(name[:-len("norm")] + "layers.") for n in names):
            panel, label = name[:-len(".norm")].rpartition(".")[2], "final norm"
        else:
            panel, label = "embeddings and output", name
        panels.setdefault(panel, []).append((name, label))
    other = panels.pop("embeddings and output", None)
    return {**panels, **({"embeddings and output": other} if other else {})}  # the stacks first


def plot_grad_norms(history: dict[str, Any], path: str | os.PathLike) -> str | os.PathLike:
    """The gradient norm of every layer (before clipping) against the step: one panel per
    layer stack (encoder, decoder) and one for the embeddings and output, layers coloured from
    first (dark) to last (light), the total norm of all layers in grey behind each. Needs a
    Trainer history with "layer_grad_norm_step", "layer_grad_norm", "step" and "grad_norm"
    (KeyError naming the missing ones). The scale is logarithmic unless a norm is 0.
    Writes a PNG to `path` and returns path."""
    missing = [k for k in ("step", "grad_norm", "layer_grad_norm_step", "layer_grad_norm") if k not in history]
    if missing:
        raise KeyError(f"history: expected the keys 'step', 'grad_norm', 'layer_grad_norm_step' and "
                       f"'layer_grad_norm' (a Trainer's history), missing {missing}")
    panels = _grad_norm_panels(list(history["layer_grad_norm"]))
    fig = _figure(figsize=(4.6 * len(panels), 4), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(panels), sharey=True))
    steps = history["layer_grad_norm_step"]
    yscale = _yscale(history["grad_norm"], *history["layer_grad_norm"].values())
    for ax, (title, lines) in zip(axes, panels.items()):
        ax.plot(history["step"], history["grad_norm"], color="0.6", lw=0.6, alpha=0.6, label="total (all layers)")
        colours = _matplotlib().colormaps["viridis"](np.linspace(0.0, 0.85, len(lines)))
        for (name, label), colour in zip(lines, colours):
            ax.plot(steps, history["layer_grad_norm"][name], color=colour, lw=1.4, label=label)
        ax.set(yscale=yscale, xlabel="step", title=title)
        ax.legend(fontsize=8, loc="upper right", framealpha=0.8)
    axes[0].set_ylabel("gradient L2 norm (before clipping)")
    fig.suptitle("gradient norm per layer")
    return _save(fig, path)


_MAX_INCHES = 80.0  # an attention figure's longer side (8,800 pixels): many heads or keys shrink the cells
_LABEL_INCHES = 0.1  # tick labels (7 points) need this much per position; in smaller cells they are left out


def _cell(length, per_position, across, down, margin):
    """The side (inches) of one heatmap of `length` positions in a grid across x down: it grows with
    the length, and shrinks where the figure's longer side (cells plus `margin`) would pass _MAX_INCHES."""
    return min(per_position * length + 1.2, (_MAX_INCHES - margin) / max(across, down))


def _heatmaps(arrays, names, query_labels, key_labels, owner):
    """arrays as float arrays of one shape (H, Tq, Tk) that the labels fit; ValueError naming what does not."""
    arrays = [np.asarray(a, dtype=float) for a in arrays]
    shapes = [a.shape for a in arrays]
    if not arrays or arrays[0].ndim != 3 or len(set(shapes)) != 1:
        raise ValueError(f"{owner}: {names}: expected (H, Tq, Tk) arrays of one shape (one example: "
                         f"[w[0] for w in maps]), got shapes {shapes}")
    tq, tk = shapes[0][1:]
    if len(query_labels) != tq or len(key_labels) != tk:
        raise ValueError(f"{owner}: query_labels, key_labels: expected {tq} and {tk} labels (Tq, Tk), got "
                         f"{len(query_labels)} and {len(key_labels)}")
    return arrays


def _ticks(ax, cell, query_labels, key_labels):
    """The query and key tokens as tick labels of a heatmap `cell` inches wide, where they fit."""
    if cell / max(len(query_labels), len(key_labels)) >= _LABEL_INCHES:
        ax.set_xticks(range(len(key_labels)), key_labels, fontsize=7)
        ax.set_yticks(range(len(query_labels)), query_labels, fontsize=7)
    else:
        ax.set(xticks=[], yticks=[])


def plot_attention(layers: Sequence[np.ndarray], path: str | os.PathLike, title: str, query_labels: Sequence[str],
                   key_labels: Sequence[str]) -> str | os.PathLike:
    """A grid of heatmaps, one row per layer and one column per head; cells where P = 0 (masked
    keys: the decoder's future positions, padding) are grey, not the colour of a small P.

    layers: list of (H, Tq, Tk) arrays (one example). query_labels / key_labels: Tq and Tk tick
    labels. Writes a PNG to `path` and returns path. ValueError for arrays or labels that do not fit.
    """
    layers = _heatmaps(layers, "layers", query_labels, key_labels, "plot_attention")
    (n_heads, tq, tk), n_layers = layers[0].shape, len(layers)
    cell = _cell(max(tq, tk), 0.28, n_heads, n_layers, 1.0)
    fig = _figure(figsize=(cell * n_heads + 1, cell * n_layers + 0.6), layout="constrained")
    axes = np.asarray(fig.subplots(n_layers, n_heads, squeeze=False))
    image = None
    cmap = _matplotlib().colormaps["viridis"].with_extremes(bad="lightgrey")
    for i, weights in enumerate(layers):
        for h in range(n_heads):
            ax = axes[i, h]
            image = ax.imshow(np.ma.masked_where(weights[h] == 0, weights[h]), vmin=0.0, vmax=1.0, cmap=cmap)
            _ticks(ax, cell, query_labels, key_labels)
            ax.set_title(f"layer {i} head {h}", fontsize=8)
            if h == 0:
                ax.set_ylabel("query")
            if i == n_layers - 1:
                ax.set_xlabel("key")
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, label="attention probability")
    fig.suptitle(title)
    if any((weights == 0).any() for weights in layers):
        fig.supxlabel("grey: masked keys (P = 0)", fontsize=8)
    return _save(fig, path)


def attention_panels(weights: np.ndarray, grads: np.ndarray) -> dict:
    """What `plot_attention_and_grads` draws, per head: {"P", "dL/dP", "dL/dS"}, (H, Tq, Tk)
    numpy masked arrays. Cells where P = 0 (a masked key, or a probability that underflowed)
    are masked in all three: nothing flows through them, whatever dL/dP says there.
    dL/dS = P * (dL/dP - rowsum), rowsum = sum_k P dL/dP over each query's keys, is the
    softmax's backward: the gradient that actually reaches the scores S = Q K^T / sqrt(hd)."""
    weights, grads = np.asarray(weights, dtype=float), np.asarray(grads, dtype=float)
    blocked = weights == 0                                             # (H, Tq, Tk)
    rowsum = np.where(blocked, 0.0, weights * grads).sum(-1, keepdims=True)   # (H, Tq, 1)
    score_grads = weights * (grads - rowsum)                            # (H, Tq, Tk)
    return {name: np.ma.masked_where(blocked | ~np.isfinite(array), array)
            for name, array in (("P", weights), ("dL/dP", grads), ("dL/dS", score_grads))}


def _symmetric_limit(array):
    """The colour scale's half width: the largest |value| not masked, 1 where there is none."""
    return float(np.abs(array).max(fill_value=0.0)) or 1.0


def plot_attention_and_grads(weights: np.ndarray, grads: np.ndarray, path: str | os.PathLike, title: str,
                             query_labels: Sequence[str], key_labels: Sequence[str], query_axis: str = "query",
                             key_axis: str = "key") -> str | os.PathLike:
    """Per head (one column each): the attention probabilities P (top row), dL/dP (middle)
    and dL/dS, the gradient that reaches the scores (bottom), the gradients on diverging
    scales centred on 0; cells where P = 0 (masked keys) are grey in every row (see
    `attention_panels`). weights, grads: (H, Tq, Tk); the ticks are labelled with the query
    and key tokens, the axes with query_axis and key_axis. Writes a PNG to `path` and returns
    path. ValueError for arrays or labels that do not fit."""
    weights, grads = _heatmaps([weights, grads], "weights, grads", query_labels, key_labels,
                               "plot_attention_and_grads")
    panels = attention_panels(weights, grads)
    n_heads, tq, tk = weights.shape
    cell = _cell(max(tq, tk), 0.3, n_heads, 3, 1.5)
    fig = _figure(figsize=(cell * n_heads + 1.5, 3 * cell + 1.2), layout="constrained")
    axes = np.asarray(fig.subplots(3, n_heads, squeeze=False))
    colormaps = _matplotlib().colormaps
    # colour bar labels short enough for the smallest figure; what they mean is the caption's
    rows = [("P", dict(vmin=0.0, vmax=1.0, cmap=colormaps["viridis"].with_extremes(bad="lightgrey")), "P"),
            ("dL/dP", None, "dL/dP"), ("dL/dS", None, "dL/dS")]
    for r, (name, style, label) in enumerate(rows):
        if style is None:
            limit = _symmetric_limit(panels[name])
            style = dict(vmin=-limit, vmax=limit, cmap=colormaps["RdBu_r"].with_extremes(bad="lightgrey"))
        image = None
        for h in range(n_heads):
            image = axes[r, h].imshow(panels[name][h], **style)
            axes[r, h].set_title(f"head {h}: {name}", fontsize=9)
            _ticks(axes[r, h], cell, query_labels, key_labels)
        fig.colorbar(image, ax=axes[r].tolist(), shrink=0.8, label=label)
    for h in range(n_heads):
        axes[-1, h].set_xlabel(key_axis, fontsize=8)
    for ax in axes[:, 0]:
        ax.set_ylabel(query_axis, fontsize=8)
    fig.suptitle(title, fontsize=10)
    width = max(20, int(fig.get_figwidth() * 72 / (8 * 0.6)))       # characters of 8 pt that fit across
    caption = ["grey: masked keys (P = 0). red: raising P or S raises the loss.",
               "dL/dS = P (dL/dP - r), r = sum over the keys of P dL/dP: what reaches the scores"]
    fig.supxlabel("\n".join(textwrap.fill(line, width) for line in caption), fontsize=8)
    return _save(fig, path)
