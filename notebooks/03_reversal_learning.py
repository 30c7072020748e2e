# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Watching the reversal task learn
#
# An encoder-decoder Transformer learns to reverse sequences of symbols: `13 8 10 7` in,
# `7 10 8 13` out. To write output position t it must read source position L - 1 - t, so its
# **cross-attention** (decoder queries, encoder keys) has a known right answer: the
# anti-diagonal. We train a small one (demos/reverse.py's default preset, made smaller to
# train in about 20 s) and look at the last decoder layer's cross-attention on one held-out
# sequence at steps 0, 50, 150 and the last: the probabilities $P$, and next to them $dL/dP$,
# the gradient of the loss with respect to those probabilities, which says where attending
# more would lower the loss (blue) or raise it (red). The gradient points at the anti-diagonal
# before the attention gets there.
#
# `npformer.nn.record_attention` records $P$ and, after the backward pass, the true $dL/dP$
# (demos/attention_grads.py's `weights_and_grads`); `npformer.plots` draws them.

# %%
import pathlib
import sys

HERE = pathlib.Path.cwd()
ROOT = next(p for p in [HERE, *HERE.parents] if (p / "demos" / "reverse.py").is_file())
sys.path.insert(0, str(ROOT / "demos"))
import attention_grads  # noqa: E402  (demos/attention_grads.py: P and dL/dP of one attention module)
import reverse  # noqa: E402  (demos/reverse.py: the presets, the task, the model; one BLAS thread)
import numpy as np  # noqa: E402

from npformer import plots  # noqa: E402
from npformer.training import Seq2SeqTrainer  # noqa: E402
from notebook_figures import figure_folder, show  # noqa: E402  (notebooks/notebook_figures.py)

FIGURES = figure_folder("03_reversal_learning")   # runs/notebooks/03_reversal_learning/

# %% [markdown]
# ## The task and the model
#
# The default preset with sequences of 3 to 8 symbols (symbols 1..17, ids 3..19; ids 0, 1, 2
# are PAD, BOS and EOS), d_model 32, 4 heads, 2 layers, 400 steps of AdamW with warmup and a
# cosine schedule. 1,000 held-out sequences are never trained on.

# %%
settings = dict(reverse.PRESETS["default"], max_len=8, d_model=32, dim_feedforward=64, steps=400, warmup=40,
                lr=3e-3)
task = reverse.make_task(settings, seed=0)
model, optimizer, scheduler = reverse.build(settings, seed=0, device="cpu")
print(task)
print(f"{sum(p.size for p in model.parameters()):,} parameters")

example = reverse.example_for_plots(task)                                   # one held-out sequence
source = [str(s) for s in task.decode(example.src[0])]
decoder_input = ["BOS"] + [str(s) for s in task.decode(example.tgt_in[0, 1:])]
name, where = attention_grads.module_name(model, "cross", -1)               # the last decoder layer's
print("source       ", " ".join(source))
print("decoder input", " ".join(decoder_input), "-> predicts", " ".join(decoder_input[1:]), "EOS")
print("recording", name, f"({where})")

# %% [markdown]
# ## Training, with snapshots
#
# A Trainer callback runs after every step; at the snapshot steps it records $P$ and $dL/dP$
# of the example (in eval mode, teacher-forced, so the loss is the example's cross-entropy).
# Recording needs a backward pass of its own; the Trainer zeroes the gradients before each
# step, so training is not disturbed.

# %%
SNAPSHOTS = (0, 50, 150, settings["steps"])
snapshots = {}


def snapshot(trainer, record=None):
    if trainer.step in SNAPSHOTS:
        snapshots[trainer.step] = attention_grads.weights_and_grads(trainer.model, example, name)


trainer = Seq2SeqTrainer(model, optimizer, task, scheduler=scheduler, batch_size=settings["batch_size"],
                         clip_norm=settings["clip_norm"], eval_every=100, eval_size=200, progress=False,
                         callbacks=[snapshot])
snapshot(trainer)                                                           # step 0: the untrained model
result = trainer.fit(settings["steps"])
print(f"held-out after {trainer.step} steps: exact-sequence accuracy {result['exact_match']:.1%}, "
      f"token accuracy {result['token_accuracy']:.1%} ({result['sequences']} sequences)")

# %% [markdown]
# ## Loss and accuracy
#
# Training loss per batch (and its running mean), token accuracy of the training batches and
# held-out exact-sequence accuracy of greedy decoding every 100 steps, and the learning rate.

# %%
show(plots.plot_curves(trainer.history, f"{FIGURES}/curves.png", "sequence reversal"))

# %% [markdown]
# ## Cross-attention: P and dL/dP at steps 0, 50, 150 and the last
#
# Rows are decoder positions (queries), columns source positions (keys). Query t predicts
# source symbol L - 1 - t, so the right key is on the anti-diagonal; the last query predicts
# EOS. For each snapshot: the example's loss, the mean share of attention on the anti-diagonal
# (over the heads and the first L queries), and the mean $dL/dP$ on and off the anti-diagonal.

# %%
L = len(source)
rows, mirrored = np.arange(L), L - 1 - np.arange(L)
for step, (P, dP, loss) in snapshots.items():                               # P, dP: (H, T + 1, L)
    on = np.zeros(P.shape[1:], dtype=bool)
    on[rows, mirrored] = True
    print(f"step {step:3}: loss {loss:.3f}, attention on the anti-diagonal {P[:, on].sum(-1).mean() / L:.0%}, "
          f"dL/dP on it {dP[:, on].mean():+.4f}, off it {dP[:, ~on].mean():+.4f}")
    path = plots.plot_attention_and_grads(P, dP, f"{FIGURES}/cross_step{step}.png",
                                          f"step {step}: cross-attention of {where}, loss {loss:.3g}",
                                          decoder_input, source, query_axis="query: decoder input",
                                          key_axis="key: source")
    show(path)

# %% [markdown]
# What to see (the numbers differ a little from machine to machine; the picture does not):
#
# - **Step 0**: $P$ is nearly uniform, each of the L keys gets about 1/L. $dL/dP$ has a
#   pattern by rows (a head's output helps one query and hurts another) but not yet by keys:
#   on the anti-diagonal it is about what it is off it.
# - **Step 50**: the loss has dropped through the easy part (which symbols occur at all), $P$
#   is still nearly uniform, but $dL/dP$ now points at keys: in the rows the model gets wrong,
#   the blue entries are the keys that hold the symbol that query must output (both copies of
#   a repeated symbol). The gradient is on the anti-diagonal before the attention is.
# - **Step 150**: the anti-diagonal shows in every head; $dL/dP$ is left only in the few rows
#   still wrong, blue on the right key, red on the neighbours attended instead.
# - **The last step**: a sharp anti-diagonal (the rest of the mass on neighbours, which the
#   decoder can tell apart by position), held-out sequences reversed almost perfectly, and a
#   $dL/dP$ ten times smaller: a loss near 0 has little left to push.
#
# Why $dL/dP$ is negative where attention should go: a head's output at query t is
# $O_t = \sum_j P_{tj} V_j$, so $dL/dP_{tj} = dO_t \cdot V_j$ (notebook 1, step 1). The loss
# falls when $O_t$ moves along $-dO_t$; attending more to key j adds $V_j$, which lowers the
# loss exactly when $V_j$ points that way, that is when key j carries what query t needs.
