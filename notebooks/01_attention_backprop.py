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
# # Backprop through attention, one line at a time
#
# **Solutions ahead.** This notebook works out attention's whole backward, the last of the eight
# exercises of `python -m npformer.exercises`. Write yours first (the README's Learn order), then
# read on and compare.
#
# Scaled dot-product attention is six lines of forward:
#
# $$\text{scores} = Q K^\top,\quad S = s\,\text{scores} + M,\quad P = \mathrm{softmax}(S),\quad
#   P_d = P \odot \text{keep} / (1 - p),\quad O = P_d V$$
#
# with $s = 1/\sqrt{hd}$, a mask $M$ added to the scores ($-\infty$ hides a key) and dropout on the
# probabilities. Here we cut the forward into those steps, print every shape, and derive the
# backward one step at a time, from the output back: $dV$, $dP$, $dS$, $d(\text{mask})$, $dQ$,
# $dK$. Each gradient you derive is checked against the engine (autograd's backward through
# npformer's own ops) and against central finite differences, in float64, by
# `npformer.exercises.ForwardSteps`: one line per gradient, `exact` (the engine's to 1e-12),
# `close` (within gradcheck's tolerance of both) or `wrong`, and the largest differences.
#
# Then the whole backward as one fused function (checked by `npformer.exercises.check`), and
# the memory-efficient backward that never stores $P$: an online softmax in the forward, $P$
# recomputed from one logsumexp per row in the backward.

# %%
import math

import numpy as np

import autograd
import npformer.functional as F
from autograd import Tensor
from npformer import nn, plots
from npformer.exercises import ForwardSteps, check
from npformer.runtime import random

import notebook_figures  # notebooks/notebook_figures.py: save each figure, show it inline or print its path
from notebook_figures import figure_folder

rng = np.random.default_rng(0)
FIGURES = figure_folder("01_attention_backprop")   # runs/notebooks/01_attention_backprop/

# %% [markdown]
# ## The forward, step by step
#
# Every axis gets its own size, so a transposed result has another shape and cannot pass by
# accident: batch B = 2, heads H = 3, T = 4 queries, S = 5 keys, head size hd = 6. The float
# mask (T, S) is one for all batches and heads (a learned bias would be like this), with
# $-\infty$ where key j > query i + 1: query 0 sees keys 0 and 1, query 3 sees all five.
# Dropout keeps each probability with chance 1 - p; the keep mask is the engine's own
# (`F.dropout`'s stream, seeded), drawn once and held fixed so that every run of the
# forward, finite differences included, drops the same entries.

# %%
B, H, T, S, hd = 2, 3, 4, 5, 6
p = 0.2                                                   # dropout probability
s = 1 / math.sqrt(hd)                                     # the scale
q = rng.standard_normal((B, H, T, hd))
k = rng.standard_normal((B, H, S, hd))
v = rng.standard_normal((B, H, S, hd))
mask = 0.5 * rng.standard_normal((T, S))                  # (T, S), broadcast over B and H
mask[np.arange(S) > np.arange(T)[:, None] + 1] = -np.inf  # key j hidden from query i when j > i + 1
keep = F.dropout(Tensor(np.ones((B, H, T, S))), p, generator=random.Philox(seed=7)).numpy() != 0

steps = ForwardSteps(
    {"Q": q, "K": k, "V": v, "mask": mask},
    {"scores": lambda a: a["Q"] @ a["K"].swapaxes(-1, -2),          # (B, H, T, S)
     "S": lambda a: s * a["scores"] + a["mask"],                     # (B, H, T, S), mask broadcast
     "P": lambda a: F.softmax(a["S"], dim=-1),                       # (B, H, T, S), rows sum to 1
     "Pd": lambda a: a["P"] * Tensor(keep / (1 - p)),                # (B, H, T, S), dropout
     "O": lambda a: a["Pd"] @ a["V"]})                               # (B, H, T, hd)
for name, value in steps.values.items():
    print(f"{name:7} {value.shape}")


def cmp(name, mine, axes=None):
    """backprop ninja's cmp(): one line per gradient (exact / close / wrong, the largest
    differences from the engine and from finite differences); a wrong one stops the notebook."""
    assert steps.compare(name, mine, axes).verdict != "wrong", f"d{name} is wrong"

# %% [markdown]
# The loss is $L = \sum O \odot dO$ with a **random** upstream gradient $dO$ (`steps.upstream`).
# With $L = \sum O$ instead, $dO$ would be all ones and the softmax's row-sum term below would
# vanish whatever it is (notebook 2 shows why): a wrong backward would pass.
#
# Our own numpy forward must give the engine's values first:

# %%
dO = steps.upstream                                                 # (B, H, T, hd)
values = steps.values
scores = q @ k.swapaxes(-1, -2)                                     # (B, H, T, S)
S_ = s * scores + mask                                              # (B, H, T, S)
P = np.exp(S_ - S_.max(-1, keepdims=True))
P /= P.sum(-1, keepdims=True)                                       # (B, H, T, S)
Pd = P * keep / (1 - p)                                             # (B, H, T, S)
O = Pd @ v                                                          # (B, H, T, hd)
print("O equals the engine's:", np.allclose(O, values["O"]), " hidden keys get P = 0:", (P[..., mask == -np.inf] == 0).all())

# %% [markdown]
# ## Step 1: $O = P_d V$, a matrix product
#
# $O_{id} = \sum_j (P_d)_{ij} V_{jd}$. The gradient of an entry of $V$ collects every output that
# read it: $dV_{jd} = \sum_i (P_d)_{ij}\, dO_{id}$, that is $dV = P_d^\top dO$; in the same way
# $dP_d = dO\, V^\top$. Shapes say it too: $dV$ must be (S, hd) per head, and $P_d^\top$ (S, T)
# times $dO$ (T, hd) is the only product that gives it.

# %%
dV = Pd.swapaxes(-1, -2) @ dO                                       # (B, H, S, hd)
dPd = dO @ v.swapaxes(-1, -2)                                       # (B, H, T, S)
cmp("V", dV)
cmp("Pd", dPd)

# %% [markdown]
# ## Step 2: dropout, $P_d = P \odot \text{keep} / (1 - p)$
#
# Elementwise: each $P_{ij}$ reaches only $(P_d)_{ij}$, times keep / (1 - p). So
# $dP = dP_d \odot \text{keep} / (1 - p)$: a dropped probability gets no gradient.

# %%
dP = dPd * keep / (1 - p)                                           # (B, H, T, S)
cmp("P", dP)

# %% [markdown]
# ## Step 3: the softmax, $P = \mathrm{softmax}(S)$ row by row
#
# Within a row, $\partial P_j / \partial S_i = P_j([i = j] - P_i)$: every probability depends on
# every score of its row. Contracting this Jacobian with $dP$:
#
# $$dS_i = \sum_j dP_j P_j([i=j] - P_i) = P_i\,\big(dP_i - \textstyle\sum_j dP_j P_j\big)$$
#
# so $dS = P \odot (dP - \mathrm{rowsum}(dP \odot P))$, without ever forming the (S, S) Jacobian.
# Where a key is hidden, $P = 0$ and so $dS = 0$: the mask needs no special case in backward.

# %%
dS = P * (dP - (dP * P).sum(-1, keepdims=True))                    # (B, H, T, S)
cmp("S", dS, axes=("b", "h", "i", "j"))
print("dS at hidden keys:", np.abs(dS[..., mask == -np.inf]).max())

# %% [markdown]
# ## Step 4: the mask, $S = s\,\text{scores} + M$
#
# An addition passes the gradient through unchanged: $dM = dS$, but $M$ is (T, S) and was
# broadcast over the B batches and H heads, so each entry of $M$ collects the gradients of
# all of them: $dM = \sum_{b,h} dS_{bh}$. (A mask that broadcasts silently needs its gradient
# summed explicitly; forgetting it gives a (B, H, T, S) array where (T, S) belongs.)
# The scale is a plain factor: $d\,\text{scores} = s\, dS$.

# %%
dmask = dS.sum(axis=(0, 1))                                         # (T, S)
dscores = s * dS                                                    # (B, H, T, S)
cmp("mask", dmask, axes=("i", "j"))
cmp("scores", dscores)

# %% [markdown]
# ## Step 5: $\text{scores} = Q K^\top$
#
# Another matrix product: $\text{scores}_{ij} = \sum_d Q_{id} K_{jd}$, so
# $dQ = d\,\text{scores}\; K$ (T, S)(S, hd) and $dK = d\,\text{scores}^\top Q$ (S, T)(T, hd).
# Written with $dS$: $dQ = s\, dS\, K$ and $dK = s\, dS^\top Q$.

# %%
dQ = dscores @ k                                                    # (B, H, T, hd)
dK = dscores.swapaxes(-1, -2) @ q                                   # (B, H, S, hd)
cmp("Q", dQ, axes=("b", "h", "i", "d"))
cmp("K", dK, axes=("b", "h", "j", "d"))

# %% [markdown]
# The engine's fused op (`F.scaled_dot_product_attention`, the naive path, with the same
# dropout mask drawn from the same seeded generator) gives the same four gradients:

# %%
leaves = [Tensor(a.copy(), requires_grad=True) for a in (q, k, v, mask)]
out = F.scaled_dot_product_attention(*leaves[:3], attn_mask=leaves[3], dropout_p=p, scale=s,
                                     generator=random.Philox(seed=7))
out.backward(dO)
for name, mine, leaf in zip(["dQ", "dK", "dV", "dmask"], [dQ, dK, dV, dmask], leaves):
    print(f"{name:6} fused op vs ours: max diff {np.abs(leaf.grad - mine).max():.1e}")

# %% [markdown]
# ## What P and dL/dP look like
#
# Top: $P$ for batch 0, every head (hidden keys are 0, each row sums to 1). Bottom: $dL/dP$.
# Red entries: attending more to that key would raise the loss; blue: lower it. $dL/dP$ is
# not zero where $P$ is: the loss *would* change if a hidden key took part, but the softmax
# passes none of it to $S$ ($dS = P \odot \dots = 0$ there). The dropped entries are exactly 0.

# %%
labels_q, labels_k = [f"q{i}" for i in range(T)], [f"k{j}" for j in range(S)]
show = plots.plot_attention_and_grads(P[0], dP[0], f"{FIGURES}/p_and_dp.png", "random inputs: P and dL/dP (batch 0)",
                                      labels_q, labels_k)
notebook_figures.show(show)

# %% [markdown]
# ## The fused formula
#
# Put together, without dropout and with a boolean mask (True = takes part, the convention of
# `F.scaled_dot_product_attention`), the whole backward is six lines. This is exercise
# `attention_backward` of `python -m npformer.exercises` (docs/exercises.md); `check` runs it
# on its own inputs and compares each gradient with the engine and finite differences.

# %%
def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def attention_backward(q, k, v, mask, dout, scale):
    P = softmax(np.where(mask, scale * q @ k.swapaxes(-1, -2), -np.inf))   # (..., T, S)
    dP = dout @ v.swapaxes(-1, -2)                                          # (..., T, S)
    dS = P * (dP - (dP * P).sum(-1, keepdims=True))                         # (..., T, S)
    return scale * dS @ k, scale * dS.swapaxes(-1, -2) @ q, P.swapaxes(-1, -2) @ dout   # dq, dk, dv


assert check("attention_backward", attention_backward).passed

# %% [markdown]
# A classic mistake is to drop the row-sum term ($dS = P \odot dP$). The checker finds it, and
# says which hypothesis matches:

# %%
def attention_backward_without_row_sum(q, k, v, mask, dout, scale):
    P = softmax(np.where(mask, scale * q @ k.swapaxes(-1, -2), -np.inf))
    dS = P * (dout @ v.swapaxes(-1, -2))                                    # forgot - rowsum(dP * P)
    return scale * dS @ k, scale * dS.swapaxes(-1, -2) @ q, P.swapaxes(-1, -2) @ dout


assert not check("attention_backward", attention_backward_without_row_sum).passed

# %% [markdown]
# ## The memory-efficient backward: online softmax, logsumexp recompute
#
# The naive forward keeps $P$, a (T, S) matrix per head: at T = S = 8192 that is 256 MiB per
# head in float32. FlashAttention keeps none. The forward walks the keys in blocks with an
# **online softmax**: a running row maximum $m$, running sum $\ell$ and unnormalised output
# $\text{acc}$, every earlier term rescaled by $e^{m_\text{old} - m_\text{new}}$ when the
# maximum grows. At the end $O = \text{acc} / \ell$, and it saves one number per query row,
# the logsumexp $L = m + \log \ell$.
#
# The backward recomputes each block's probabilities from $L$: $P = e^{S - L}$. The softmax rule
# needs $\mathrm{rowsum}(dP \odot P)$ over the whole row, which one block does not see; but
#
# $$\sum_j dP_{ij} P_{ij} = \sum_j (dO_i \cdot V_j) P_{ij} = dO_i \cdot \sum_j P_{ij} V_j = dO_i \cdot O_i$$
#
# so $D = \mathrm{rowsum}(dO \odot O)$ is computed once, up front, from the output alone.

# %%
def attention_forward_blockwise(q, k, v, mask, scale, block):
    """O and the row logsumexp L, walking the keys in blocks: never a (T, S) matrix.
    The first block must hold a visible key for every query (here key 0 always is)."""
    m = np.full(q.shape[:-1] + (1,), -np.inf)                     # (..., T, 1) running max
    l = np.zeros(q.shape[:-1] + (1,))                             # (..., T, 1) running sum
    acc = np.zeros(q.shape[:-1] + v.shape[-1:])                   # (..., T, hd) unnormalised O
    for j in range(0, k.shape[-2], block):
        Sj = np.where(mask[..., j:j + block], scale * q @ k[..., j:j + block, :].swapaxes(-1, -2), -np.inf)
        m_new = np.maximum(m, Sj.max(-1, keepdims=True))          # (..., T, 1)
        Pj = np.exp(Sj - m_new)                                   # (..., T, block)
        l = l * np.exp(m - m_new) + Pj.sum(-1, keepdims=True)     # old terms rescaled to the new max
        acc = acc * np.exp(m - m_new) + Pj @ v[..., j:j + block, :]
        m = m_new
    return acc / l, (m + np.log(l))[..., 0]                       # O (..., T, hd), L (..., T)


def attention_backward_blockwise(q, k, v, mask, dout, scale, block=2):
    O, L = attention_forward_blockwise(q, k, v, mask, scale, block)
    D = (dout * O).sum(-1, keepdims=True)                         # (..., T, 1) = rowsum(dP * P)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for j in range(0, k.shape[-2], block):
        kj, vj = k[..., j:j + block, :], v[..., j:j + block, :]
        Pj = np.exp(np.where(mask[..., j:j + block], scale * q @ kj.swapaxes(-1, -2), -np.inf) - L[..., None])
        dSj = Pj * (dout @ vj.swapaxes(-1, -2) - D)               # (..., T, block)
        dv[..., j:j + block, :] = Pj.swapaxes(-1, -2) @ dout
        dk[..., j:j + block, :] = scale * dSj.swapaxes(-1, -2) @ q
        dq += scale * dSj @ kj
    return dq, dk, dv


assert check("attention_backward", attention_backward_blockwise).passed

# %% [markdown]
# The blockwise forward gives the engine's memory-efficient path's output (and the naive
# path's), and the recomputed $P = e^{S - L}$ is the softmax itself:

# %%
bool_mask = mask != -np.inf                                      # (T, S), True = takes part
O_blocks, L = attention_forward_blockwise(q, k, v, bool_mask, s, block=2)
O_engine = F.scaled_dot_product_attention(q, k, v, attn_mask=bool_mask, memory_efficient=True, block_size=2)
P_full = softmax(np.where(bool_mask, s * scores, -np.inf))
print("O vs the engine's memory-efficient path: max diff", f"{np.abs(O_blocks - O_engine.numpy()).max():.1e}")
print("exp(S - L) vs softmax(S):               max diff",
      f"{np.abs(np.exp(np.where(bool_mask, s * scores, -np.inf) - L[..., None]) - P_full).max():.1e}")
print(f"memory: P would be {T}x{S} per head; the blocks hold {T}x2 at a time, plus L: {T} numbers")

# %% [markdown]
# ## Where this lives in npformer
#
# `attention_backward` in `npformer/functional/attention/math.py` is steps 1 to 5, with the comments you
# just derived (`AttentionFunction` runs it); `npformer/functional/attention/blockwise.py` is the
# blockwise version. docs/backprop.md derives every other op the same way.

# %% [markdown]
# ## The engine's backward, one node at a time
#
# `autograd.backward_steps(loss)` runs `loss.backward()` one node of the tape at a time and hands
# over each: the op, the gradient arriving at its outputs, the gradient leaving towards each input
# (arrays, and their norms), where that goes (the node that made the input, or a leaf's `.grad`),
# and the file and line of the op's backward formula; `autograd.print_backward` prints the whole
# pass (docs/backward_steps.md). Here one `nn.MultiheadAttention` layer, self-attention on
# B = 1, T = 3, E = 6 with 2 heads, under a random upstream gradient: the output projection, the
# heads merged, the attention op itself, the heads split, the packed q, k, v projection.

# %%
E, heads = 6, 2
layer = nn.MultiheadAttention(E, heads).to(dtype=np.float64)
x = Tensor(rng.standard_normal((1, 3, E)), requires_grad=True)
out, _ = layer(x, x, x, need_weights=False)
loss = (out * Tensor(rng.standard_normal(out.shape))).sum()
steps = autograd.print_backward(loss, names={"x": x, **dict(layer.named_parameters())})

# %% [markdown]
# The attention node's step holds $dO$ arriving, per head, and $dQ$, $dK$, $dV$ leaving. They are
# the fused formula's above (`attention_backward`, no mask here) on the q, k, v the op got:

# %%
step = next(s for s in steps if s.name == "AttentionFunction")
q_h, k_h, v_h = (i.tensor.data for i in step.inputs)                # (1, 2, 3, 3) each: the heads
dO = step.outputs[0].grad
print(f"step #{step.index}: {step.name}, formula at {step.formula_path}:{step.formula_line}")
print(f"dO arriving {dO.shape}, |dO| = {step.outputs[0].grad_norm:.6g}")
by_hand = attention_backward(q_h, k_h, v_h, np.ones((3, 3), bool), dO, 1 / math.sqrt(E // heads))
for name, mine, leaving in zip(("dQ", "dK", "dV"), by_hand, step.inputs):
    print(f"{name} leaving to #{leaving.to_step} {leaving.to_op.__name__}: |{name}| = {leaving.grad_norm:.6g}, "
          f"max diff from the fused formula {np.abs(mine - leaving.grad).max():.1e}")
    assert np.allclose(mine, leaving.grad, rtol=1e-12, atol=1e-14)
assert x.grad is not None and layer.in_proj_weight.grad is not None   # the pass ran to the end: .grad is filled
