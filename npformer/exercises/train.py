"""Train the reversal Transformer on your own backward passes, beside the engine's.

    python -m npformer.exercises train my_backprop.py [--steps N] [--seed S] [--out DIR]

The checker judges the file first (one row per function, as `check` prints). Then two models
of the same seed learn the seed tutorial's reversal task (vocab 20, length 6, d_model 32, 4
heads, 2 layers, GELU feed-forward, no dropout): one on the engine's backward passes, one with
each function your file defines in place of the engine's: linear, layer_norm, gelu, embedding,
cross_entropy and attention (their forwards stay the engine's). softmax_backward replaces the
softmax inside the decoder's cross-attention (the engine's attention backward around yours;
inside every attention when your file has no attention_backward, which then runs the
self-attentions), and log_softmax_backward the one inside cross-entropy where your file has no
cross_entropy_backward. A function that raises, loops or is
not written is left out. Printed: both loss curves, the step where they part (relative gap
above PART_RTOL) and by how much, and the held-out accuracy of each; curves.png in --out
(default runs/exercises-train/) when matplotlib is there.

Your functions run in this process (importing the file runs it): the checker's isolation is for
checking. A correct file learns as the engine does, to float rounding; a wrong one's curve parts.
"""
import contextlib
import dataclasses
import functools
import math
import os
import sys
import threading
from collections.abc import Callable

import numpy as np

import npformer
import npformer.functional as F
from autograd import Function, Tensor, no_grad
from npformer import optim
from npformer.data import SequenceTask
from npformer.models import Seq2SeqTransformer
from npformer.training import Seq2SeqTrainer

from .checker import check_file, load_solutions

PART_RTOL = 1e-3        # the curves part at the first step whose losses differ by more than this, relatively
USABLE = ("exact", "close", "wrong")   # verdicts of the functions trained with (the others cannot run)
# the seed tutorial's task and model (demos/reverse.py --preset seed), without dropout: the
# attention exercise has none, so the learner's attention backward sees what the engine's does
SETTINGS = dict(vocab=20, length=6, d_model=32, nhead=4, dim_feedforward=64, layers=2, batch_size=64, lr=1e-3,
                clip_norm=1.0)


_CROSS = threading.local()   # .on: a cross-attention module is running (see _mark_cross_attention)


def _mark_cross_attention(model):
    """Make each decoder cross-attention module (`multihead_attn`) of `model` set _CROSS.on while
    it attends, so that the attention replacement can give it the learner's softmax."""
    for name, module in model.named_modules():
        if name.split(".")[-1] == "multihead_attn":
            def attend(*args, _attend=module.attend, **kwargs):
                _CROSS.on = True
                try:
                    return _attend(*args, **kwargs)
                finally:
                    _CROSS.on = False
            module.attend = attend


def _float64(array):
    return np.array(array, dtype=np.float64)


def _cast(gradient, like, name):
    """The learner's gradient as an array of like's shape and dtype; ValueError naming it otherwise."""
    gradient = np.asarray(gradient)
    if gradient.shape != like.shape:
        raise ValueError(f"your {name} returned shape {gradient.shape}, the model needs {like.shape}")
    return gradient.astype(like.dtype, copy=False)


def _engine_forward(fn, *args, **kwargs):
    """The engine's forward of fn on arrays, as an array (no graph)."""
    with no_grad():
        return fn(*[Tensor(a) if isinstance(a, np.ndarray) else a for a in args], **kwargs).data


def _replacements(mine: dict, engine: dict) -> dict[str, Callable]:
    """{npformer.functional name: a function with the engine's forward and the learner's
    backward} for each of the learner's functions in `mine` ({exercise name: function});
    `engine`: the original npformer.functional functions, for the forwards and for calls the
    learner's functions do not cover (options the exercises leave out)."""
    replaced = {}

    if "linear_backward" in mine or "gelu_backward" in mine:
        class Linear(Function):
            @staticmethod
            def forward(ctx, x, weight, bias):
                ctx.save_for_backward(x, weight, bias)
                return _engine_forward(engine["linear"], x, weight, bias)

            @staticmethod
            def backward(ctx, dy):
                x, weight, bias = ctx.saved_tensors
                dx, dweight, dbias = mine["linear_backward"](_float64(x), _float64(weight), _float64(dy))
                return (_cast(dx, x, "linear_backward dx"), _cast(dweight, weight, "linear_backward dweight"),
                        _cast(dbias, bias, "linear_backward dbias"))

        def linear(input, weight, bias=None, activation=None):
            """The fused linear + activation of the feed-forward blocks as two steps, so that
            your linear_backward and gelu_backward each take part."""
            if activation not in (None, "gelu", "relu"):
                return engine["linear"](input, weight, bias, activation)
            if "linear_backward" in mine and bias is not None:
                y = Linear.apply(input, weight, bias)
            else:
                y = engine["linear"](input, weight, bias)
            return y if activation is None else getattr(F, activation)(y)    # F.gelu: yours while replaced
        replaced["linear"] = linear

    if "layer_norm_backward" in mine:
        class LayerNorm(Function):
            @staticmethod
            def forward(ctx, x, weight, bias, eps):
                ctx.save_for_backward(x, weight, bias, eps)
                return _engine_forward(engine["layer_norm"], x, x.shape[-1], weight, bias, eps)

            @staticmethod
            def backward(ctx, dy):
                x, weight, bias, eps = ctx.saved_tensors
                rows = x.reshape(-1, x.shape[-1])
                dx, dweight, dbias = mine["layer_norm_backward"](_float64(rows), _float64(weight),
                                                                 _float64(dy.reshape(rows.shape)), eps)
                return (_cast(np.asarray(dx).reshape(x.shape), x, "layer_norm_backward dx"),
                        _cast(dweight, weight, "layer_norm_backward dweight"),
                        _cast(dbias, bias, "layer_norm_backward dbias"), None)

        def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
            one_axis = normalized_shape in (input.shape[-1], (input.shape[-1],))
            if weight is None or bias is None or not one_axis:
                return engine["layer_norm"](input, normalized_shape, weight, bias, eps)
            return LayerNorm.apply(input, weight, bias, eps)
        replaced["layer_norm"] = layer_norm

    if "gelu_backward" in mine:
        class GELU(Function):
            @staticmethod
            def forward(ctx, x):
                ctx.save_for_backward(x)
                return _engine_forward(engine["gelu"], x)

            @staticmethod
            def backward(ctx, dy):
                (x,) = ctx.saved_tensors
                return _cast(mine["gelu_backward"](_float64(x), _float64(dy)), x, "gelu_backward dx")

        def gelu(input, approximate="none"):
            return GELU.apply(input) if approximate == "none" else engine["gelu"](input, approximate)
        replaced["gelu"] = gelu

    if "embedding_backward" in mine:
        class Embedding(Function):
            @staticmethod
            def forward(ctx, weight, ids, padding_idx):
                ctx.save_for_backward(weight, ids, padding_idx)
                return _engine_forward(engine["embedding"], ids, weight, padding_idx)

            @staticmethod
            def backward(ctx, dy):
                weight, ids, padding_idx = ctx.saved_tensors
                dweight = np.array(_cast(mine["embedding_backward"](np.asarray(ids), weight.shape[0], _float64(dy)),
                                         weight, "embedding_backward dweight"))
                if padding_idx is not None:       # the padding row learns nothing (the engine's rule)
                    dweight[padding_idx] = 0
                return dweight, None, None

        def embedding(input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False):
            if max_norm is not None or scale_grad_by_freq:
                return engine["embedding"](input, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq)
            ids = input.data if isinstance(input, Tensor) else np.asarray(input)
            return Embedding.apply(weight, ids, padding_idx)
        replaced["embedding"] = embedding

    if "cross_entropy_backward" in mine or "log_softmax_backward" in mine:
        class CrossEntropySum(Function):
            """Summed cross-entropy over the rows whose target is not ignore_index."""

            @staticmethod
            def forward(ctx, logits, target, ignore_index):
                ctx.save_for_backward(logits, target, ignore_index)
                return _engine_forward(engine["cross_entropy"], logits, target, ignore_index=ignore_index,
                                       reduction="sum")

            @staticmethod
            def backward(ctx, dloss):
                logits, target, ignore_index = ctx.saved_tensors
                valid = target != ignore_index
                rows, labels, n = _float64(logits[valid]), target[valid], int(valid.sum())
                dlogits = np.zeros(logits.shape, dtype=np.float64)
                if n and "cross_entropy_backward" in mine:     # a sum is n times the mean
                    dlogits[valid] = mine["cross_entropy_backward"](rows, labels, float(dloss) * n)
                elif n:                                        # -log_softmax at the targets, summed
                    dy = np.zeros_like(rows)
                    dy[np.arange(n), labels] = -float(dloss)
                    log_p = _engine_forward(engine["log_softmax"], rows)
                    dlogits[valid] = mine["log_softmax_backward"](log_p, dy)
                return _cast(dlogits, logits, "cross-entropy's dlogits"), None, None

        def cross_entropy(input, target, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0):
            target_array = target.data if isinstance(target, Tensor) else np.asarray(target)
            if (weight is not None or reduction != "sum" or label_smoothing or input.ndim != 2
                    or target_array.ndim != 1 or target_array.dtype.kind not in "iu"):
                return engine["cross_entropy"](input, target, weight, ignore_index, reduction, label_smoothing)
            return CrossEntropySum.apply(input, target_array, ignore_index)
        replaced["cross_entropy"] = cross_entropy

    if "attention_backward" in mine or "softmax_backward" in mine:
        class Attention(Function):
            @staticmethod
            def forward(ctx, q, k, v, mask, scale, by_softmax):
                ctx.save_for_backward(q, k, v, mask, scale, by_softmax)
                return _engine_forward(engine["scaled_dot_product_attention"], q, k, v, attn_mask=mask, scale=scale)

            @staticmethod
            def backward(ctx, dout):
                q, k, v, mask, scale, by_softmax = ctx.saved_tensors
                q64, k64, v64, dout64 = (_float64(a) for a in (q, k, v, dout))
                if not by_softmax:
                    dq, dk, dv = mine["attention_backward"](q64, k64, v64, mask, dout64, scale)
                else:                                   # the engine's attention backward around your softmax's
                    scores = np.where(mask, q64 @ k64.swapaxes(-1, -2) * scale, -np.inf)
                    p = _engine_forward(engine["softmax"], scores)
                    dv = p.swapaxes(-1, -2) @ dout64
                    ds = np.where(mask, mine["softmax_backward"](p, dout64 @ v64.swapaxes(-1, -2)), 0.0)
                    dq, dk = ds @ k64 * scale, ds.swapaxes(-1, -2) @ q64 * scale
                return (_cast(dq, q, "attention dq"), _cast(dk, k, "attention dk"), _cast(dv, v, "attention dv"),
                        None, None, None)

        def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                         scale=None, enable_gqa=False, **options):
            mask = _boolean_mask(attn_mask, is_causal, query.shape[-2], key.shape[-2])
            plain = (dropout_p == 0.0 and not enable_gqa and mask is not None and options.get("sliding_window") is None
                     and not options.get("return_weights") and query.shape[:-2] == key.shape[:-2])
            if not plain or not mask.any(axis=-1).all():   # a row with no key: the exercise has none
                return engine["scaled_dot_product_attention"](query, key, value, attn_mask, dropout_p, is_causal,
                                                              scale, enable_gqa, **options)
            scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
            by_softmax = "softmax_backward" in mine and ("attention_backward" not in mine or
                                                         getattr(_CROSS, "on", False))
            return Attention.apply(query, key, value, np.broadcast_to(mask, (*query.shape[:-1], key.shape[-2])),
                                   scale, by_softmax)
        replaced["scaled_dot_product_attention"] = scaled_dot_product_attention
    return replaced


def _boolean_mask(attn_mask, is_causal, t, s):
    """attn_mask and is_causal as one boolean mask (True = takes part), or None where the mask
    is a float mask with values other than 0 and -inf (the exercise's mask is boolean)."""
    mask = np.ones((t, s), dtype=bool)
    if is_causal:
        if t != s:
            return None
        mask = np.tril(mask)
    if attn_mask is not None:
        m = attn_mask.data if isinstance(attn_mask, Tensor) else np.asarray(attn_mask)
        if m.dtype != bool:
            if not np.all((m == 0) | (m == -np.inf)):
                return None
            m = m == 0
        mask = mask & m
    return mask


# the npformer.functional functions a learner's backward may stand in for, the engine's own
NAMES = ("linear", "layer_norm", "gelu", "embedding", "cross_entropy", "scaled_dot_product_attention", "softmax",
         "log_softmax")
_ENGINE = {name: getattr(F, name) for name in NAMES}
_THIS_THREAD = threading.local()    # .replaced: {name: replacement} of this thread's learner_backwards
_INSTALLED = {"users": 0}           # how many learner_backwards are open, in all threads
_INSTALL_LOCK = threading.Lock()


def _dispatcher(name):
    """npformer.functional.<name> while a learner_backwards is open somewhere: the learner's
    replacement in the thread that opened it, the engine's function in every other thread."""
    engine = _ENGINE[name]

    @functools.wraps(engine)
    def dispatch(*args, **kwargs):
        replaced = getattr(_THIS_THREAD, "replaced", None) or {}
        return replaced.get(name, engine)(*args, **kwargs)
    return dispatch


@contextlib.contextmanager
def learner_backwards(mine: dict):
    """While open, in this thread, npformer.functional's linear, layer_norm, gelu, embedding,
    cross_entropy and scaled_dot_product_attention run the learner's backward passes (`mine`:
    {exercise name: function}); other threads keep the engine's, and on exit this one does too.
    nn looks the functions up as module attributes (F.linear), which dispatch per thread while
    any learner_backwards is open. Yields the names of the functions replaced."""
    replaced = _replacements(mine, _ENGINE)
    with _INSTALL_LOCK:
        if _INSTALLED["users"] == 0:
            for name in NAMES:
                setattr(F, name, _dispatcher(name))
        _INSTALLED["users"] += 1
    outer = getattr(_THIS_THREAD, "replaced", None)
    _THIS_THREAD.replaced = replaced
    try:
        yield sorted(replaced)
    finally:
        _THIS_THREAD.replaced = outer
        with _INSTALL_LOCK:
            _INSTALLED["users"] -= 1
            if _INSTALLED["users"] == 0:
                for name in NAMES:
                    setattr(F, name, _ENGINE[name])


@dataclasses.dataclass
class Run:
    """One training run: its loss per step, where it stopped (a non-finite loss ends it) and its
    held-out accuracy (exact sequences, tokens)."""

    losses: list
    stopped: str = ""
    exact_match: float = float("nan")
    token_accuracy: float = float("nan")


def train_run(seed, steps, mine=None, heldout=200):
    """The reversal model trained `steps` steps from `seed` (with the learner's backward passes
    in `mine`, or the engine's): its Run."""
    s = SETTINGS
    task = SequenceTask("reverse", vocab_size=s["vocab"], min_len=s["length"], max_len=s["length"], seed=seed,
                        heldout_size=heldout)
    npformer.manual_seed(seed)
    model = Seq2SeqTransformer(s["vocab"], s["vocab"], d_model=s["d_model"], nhead=s["nhead"],
                               num_encoder_layers=s["layers"], num_decoder_layers=s["layers"],
                               dim_feedforward=s["dim_feedforward"], dropout=0.0, max_len=s["length"] + 2,
                               activation="gelu", pad_idx=0)
    _mark_cross_attention(model)
    optimizer = optim.AdamW(model.parameters(), lr=s["lr"], betas=(0.9, 0.98), weight_decay=0.0)
    trainer = Seq2SeqTrainer(model, optimizer, task, batch_size=s["batch_size"], clip_norm=s["clip_norm"],
                             eval_every=0, progress=False)
    run = Run([])
    with learner_backwards(mine or {}):
        for _ in range(steps):
            try:
                loss = float(trainer.train_step()["loss"])
            except Exception as error:  # the learner's function broke the step: the run ends there
                run.stopped = f"stopped at step {len(run.losses) + 1}: {type(error).__name__}: {error}"
                break
            run.losses.append(loss)
            if not math.isfinite(loss):
                run.stopped = f"stopped at step {len(run.losses)}: the loss is {loss}"
                break
    result = trainer.evaluate()
    run.exact_match, run.token_accuracy = result["exact_match"], result["token_accuracy"]
    return run


def parting(engine, yours, rtol=PART_RTOL):
    """(first step whose losses differ by more than rtol relatively, that gap) or None; then the
    largest relative gap over the run."""
    gaps = [abs(a - b) / max(abs(a), 1e-12) if math.isfinite(b) else math.inf for a, b in zip(engine, yours)]
    first = next(((i + 1, g) for i, g in enumerate(gaps) if g > rtol), None)
    return first, max(gaps, default=0.0)


def ascii_curves(engine, yours, width=60, height=12):
    """Both loss curves as text: e for the engine's, y for yours, * where they meet."""
    series = [engine, yours]
    finite = [v for s in series for v in s if math.isfinite(v)]
    if not finite:
        return "(no finite loss to draw)"
    low, high = min(finite), max(finite)
    span = (high - low) or 1.0
    steps = max(len(engine), len(yours))
    grid = [[" "] * width for _ in range(height)]
    for mark, s in (("e", engine), ("y", yours)):
        for i, v in enumerate(s):
            if not math.isfinite(v):
                continue
            col = min(width - 1, i * width // max(steps, 1))
            row = height - 1 - round((v - low) / span * (height - 1))
            grid[row][col] = "*" if grid[row][col] not in (" ", mark) else mark
    lines = [f"{high:8.3f} |" + "".join(grid[0])]
    lines += ["         |" + "".join(r) for r in grid[1:-1]]
    lines += [f"{low:8.3f} |" + "".join(grid[-1]), "          " + "-" * width,
              f"          step 1{' ' * (width - 6 - len(str(steps)))}{steps}",
              "          e: the engine's backward passes, y: yours, *: both"]
    return "\n".join(lines)


def plot_curves(engine, yours, path):
    """curves.png of both runs' losses; None when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot(range(1, len(engine) + 1), engine, label="engine's backward passes", lw=2)
    ax.plot(range(1, len(yours) + 1), yours, label="yours", lw=1, ls="--")
    ax.set(xlabel="step", ylabel="training loss", title="sequence reversal: your backward passes vs the engine's")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def train_file(path, steps=300, seed=0, out=os.path.join("runs", "exercises-train"), heldout=200,
               stream=None, timeout=10.0):
    """The whole `train` command on the file at `path`: check, train both, print; returns
    {"results", "used", "engine", "yours", "parted", "max_gap", "figure"}."""
    stream = stream or sys.stdout
    results = check_file(path, stream=stream, timeout=timeout)
    usable = {r.name for r in results if r.verdict in USABLE}
    module = load_solutions(path)
    mine = {name: getattr(module, name) for name in sorted(usable)}
    left_out = [f"{r.name} ({r.verdict})" for r in results if r.name not in usable and r.verdict != "not written"]
    if not _replacements(mine, _ENGINE):
        stream.write("\nno backward function of yours to train with (write one, then run this again)\n")
        return {"results": results, "used": [], "engine": None, "yours": None, "parted": None, "max_gap": None,
                "figure": None}
    shadowed = ["log_softmax_backward"] if {"log_softmax_backward", "cross_entropy_backward"} <= set(mine) else []
    stream.write(f"\ntraining the reversal model {steps} steps from seed {seed}, twice: the engine's backward "
                 f"passes, then yours ({', '.join(n for n in mine if n not in shadowed)})\n")
    if shadowed:
        stream.write("not used: log_softmax_backward (your cross_entropy_backward covers the loss; a file "
                     "without it trains on log_softmax_backward)\n")
    if {"softmax_backward", "attention_backward"} <= set(mine):
        stream.write("attention: the self-attentions run your attention_backward, the cross-attention the "
                     "engine's attention backward around your softmax_backward\n")
    if left_out:
        stream.write(f"left out (they cannot run): {', '.join(left_out)}\n")
    engine = train_run(seed, steps, None, heldout)
    yours = train_run(seed, steps, mine, heldout)
    stream.write(ascii_curves(engine.losses, yours.losses) + "\n")
    parted, max_gap = parting(engine.losses, yours.losses)
    if yours.stopped:
        stream.write(f"your run {yours.stopped}\n")
    if parted is None and yours.stopped:
        stream.write(f"before it stopped, the curves agree within {max_gap:.1e} (relative) over "
                     f"{len(yours.losses)} steps\n")
    elif parted is None:
        stream.write(f"the curves never part: the losses agree within {max_gap:.1e} (relative) over "
                     f"{len(yours.losses)} steps\n")
    else:
        step, gap = parted
        stream.write(f"the curves part at step {step}: engine {engine.losses[step - 1]:.4f}, yours "
                     f"{yours.losses[step - 1]:.4f} ({gap:.1%} apart); final: engine {engine.losses[-1]:.4f}, "
                     f"yours {yours.losses[-1]:.4f}\n")
    stream.write(f"held-out ({heldout} unseen sequences): engine exact {engine.exact_match:.1%} tokens "
                 f"{engine.token_accuracy:.1%}; yours exact {yours.exact_match:.1%} tokens {yours.token_accuracy:.1%}\n")
    wrong = [r.name for r in results if r.verdict == "wrong"]
    if wrong:
        stream.write(f"the checker's verdict: wrong: {', '.join(wrong)} (see the table above)\n")
    figure = None
    if out:
        os.makedirs(out, exist_ok=True)
        figure = plot_curves(engine.losses, yours.losses, os.path.join(out, "curves.png"))
        if figure:
            stream.write(f"wrote {figure}\n")
    return {"results": results, "used": list(mine), "engine": engine, "yours": yours, "parted": parted,
            "max_gap": max_gap, "figure": figure}
