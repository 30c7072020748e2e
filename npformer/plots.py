"""Figures of a training run and of what the network attends to (PNG files).

matplotlib is imported only when a figure is drawn (`pip install -e .[plot]`), and only
its object-oriented API is used (`matplotlib.figure.Figure`, saved by the Agg canvas), so
no pyplot backend or global state is touched.

`record_attention` (no matplotlib needed) returns the per-head attention probabilities of
every attention module of a model for one forward pass.
"""
import numpy as np

from .decoding import _inference

_GROUPS = ("encoder_self", "decoder_self", "cross")
TITLES = {"encoder_self": "encoder self-attention", "decoder_self": "decoder self-attention (causal)",
          "cross": "cross-attention (decoder queries, encoder keys)"}


def _figure(**kwargs):
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("npformer.plots needs matplotlib: pip install -e '.[plot]' (or pip install "
                          "matplotlib)") from e
    return Figure(**kwargs)


def _group_of(name):
    if name.endswith("multihead_attn"):
        return "cross"
    return "decoder_self" if ".decoder." in f".{name}" else "encoder_self"


def record_attention(model, src, tgt_in):
    """Run `model(src, tgt_in)` once in eval mode and return the attention probabilities of
    every MultiheadAttention, per head: {"encoder_self": [(B, H, S, S) per layer],
    "decoder_self": [(B, H, T, T)], "cross": [(B, H, T, S)]} as numpy arrays.

    Each attention module's `attend` is wrapped for the duration of the call (an instance
    attribute shadowing the method, removed afterwards) so that it also returns its
    per-head weights; the model's own code path runs unchanged.
    """
    from .nn import MultiheadAttention

    maps = {group: [] for group in _GROUPS}
    wrapped = []

    def recorder(module, group):
        method = type(module).attend

        def attend(q, k, v, mask=None, is_causal=False, need_weights=False, average_attn_weights=True):
            out, weights = method(module, q, k, v, mask, is_causal, need_weights=True, average_attn_weights=False)
            maps[group].append(weights.numpy())                               # (B, H, Tq, Tk)
            if not need_weights:
                return out, None
            return out, weights.mean(axis=1) if average_attn_weights else weights
        return attend

    for name, module in model.named_modules():
        if isinstance(module, MultiheadAttention):
            module.__dict__["attend"] = recorder(module, _group_of(name))
            wrapped.append(module)
    try:
        with _inference(model):
            model(src, tgt_in)
    finally:
        for module in wrapped:
            del module.__dict__["attend"]
    return maps


_CURVE_KEYS = ("step", "loss", "lr", "grad_norm", "items", "seconds")


def plot_curves(history, path, title="training"):
    """Loss, metrics and learning rate against the step, side by side, from a Trainer's
    history (see npformer.training for its keys).

    Needs "step", "loss" and "lr" (one entry per step). Also drawn when present: every other
    per-step list of the same length (the loss function's metrics, e.g. "accuracy") and every
    "eval_<name>" list of numbers other than counts against "eval_step" ("eval_loss" beside
    the training loss, the rest beside the metrics). The metrics panel is left out when there are none."""
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
    ax_loss.set(yscale="log" if (loss > 0).all() else "linear", xlabel="step", ylabel="loss", title="loss")
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
    fig.savefig(path, dpi=110)
    return path


def plot_grad_norms(history, path):
    """The gradient norm of every layer (before clipping) against the step, and the total."""
    fig = _figure(figsize=(10, 5), layout="constrained")
    ax = fig.subplots()
    steps = history["layer_grad_norm_step"]
    for i, (name, norms) in enumerate(history["layer_grad_norm"].items()):
        style = "-" if "decoder" in name else "--" if "encoder" in name else ":"
        ax.plot(steps, norms, style, color=f"C{i % 10}", label=name)
    ax.plot(history["step"], history["grad_norm"], color="black", lw=0.5, alpha=0.4, label="total (all layers)")
    ax.set(yscale="log", xlabel="step", ylabel="gradient L2 norm", title="gradient norm per layer")
    ax.legend(fontsize=7, ncol=2)
    fig.savefig(path, dpi=110)
    return path


def plot_attention(layers, path, title, query_labels, key_labels):
    """A grid of heatmaps, one row per layer and one column per head.

    layers: list of (H, Tq, Tk) arrays (one example). query_labels / key_labels: tick labels.
    """
    n_layers, n_heads = len(layers), layers[0].shape[0]
    tq, tk = layers[0].shape[1:]
    cell = 0.28 * max(tq, tk) + 1.2
    fig = _figure(figsize=(cell * n_heads + 1, cell * n_layers + 0.6), layout="constrained")
    axes = np.asarray(fig.subplots(n_layers, n_heads, squeeze=False))
    image = None
    for i, weights in enumerate(layers):
        for h in range(n_heads):
            ax = axes[i, h]
            image = ax.imshow(weights[h], vmin=0.0, vmax=1.0, cmap="viridis")
            ax.set_xticks(range(tk), key_labels, fontsize=7)
            ax.set_yticks(range(tq), query_labels, fontsize=7)
            ax.set_title(f"layer {i} head {h}", fontsize=8)
            if h == 0:
                ax.set_ylabel("query")
            if i == n_layers - 1:
                ax.set_xlabel("key")
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, label="attention probability")
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
    return path


def plot_attention_and_grads(weights, grads, path, title, query_labels, key_labels):
    """Per head: the attention probabilities P (top row) next to dL/dP (bottom row,
    a diverging scale centred on 0). weights, grads: (H, Tq, Tk)."""
    n_heads, tq, tk = weights.shape
    cell = 0.3 * max(tq, tk) + 1.2
    fig = _figure(figsize=(cell * n_heads + 1.5, 2 * cell + 0.8), layout="constrained")
    axes = np.asarray(fig.subplots(2, n_heads, squeeze=False))
    limit = float(np.abs(grads).max()) or 1.0
    top = bottom = None
    for h in range(n_heads):
        top = axes[0, h].imshow(weights[h], vmin=0.0, vmax=1.0, cmap="viridis")
        bottom = axes[1, h].imshow(grads[h], vmin=-limit, vmax=limit, cmap="RdBu_r")
        axes[0, h].set_title(f"head {h}: P", fontsize=9)
        axes[1, h].set_title(f"head {h}: dL/dP", fontsize=9)
        for ax in axes[:, h]:
            ax.set_xticks(range(tk), key_labels, fontsize=7)
            ax.set_yticks(range(tq), query_labels, fontsize=7)
    fig.colorbar(top, ax=axes[0].tolist(), shrink=0.8, label="P")
    fig.colorbar(bottom, ax=axes[1].tolist(), shrink=0.8, label="dL/dP")
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
    return path
