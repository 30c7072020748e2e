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
# # Softmax, LayerNorm and cross-entropy by hand
#
# **Solutions ahead.** This notebook works out the softmax, LayerNorm and cross-entropy backwards
# of `python -m npformer.exercises`. Write yours first (the README's Learn order), then read on.
#
# Three ops every Transformer runs, each derived twice. First through its **atomic steps**
# (max, subtract, exp, sum, reciprocal, multiply, log, index, mean), one line of backward per
# line of forward, in the manner of Karpathy's *backprop ninja*, exercise 1. Then as the **one
# line** the algebra collapses to (exercises 2 and 3), which is what npformer's own backward
# runs. Every gradient is checked against the engine (autograd's backward through the same
# steps) and against central finite differences, in float64 (`npformer.exercises.ForwardSteps`
# for the steps, `npformer.exercises.check` for the one-line versions).
#
# On the way: why testing a backward with `loss = out.sum()` proves nothing for softmax and
# LayerNorm.

# %%
import matplotlib.pyplot as plt
import numpy as np

import npformer.functional as F
from autograd import Function, GradcheckError, Tensor, gradcheck
from npformer.exercises import ForwardSteps, check
from notebook_figures import figure_folder, show_figure  # notebooks/notebook_figures.py

FIGURES = figure_folder("02_softmax_layernorm_ce")   # runs/notebooks/02_softmax_layernorm_ce/

rng = np.random.default_rng(0)


def cmp(steps, name, mine):
    """backprop ninja's cmp(): one line per gradient (exact / close / wrong, the largest
    differences from the engine and from finite differences); a wrong one stops the notebook."""
    assert steps.compare(name, mine).verdict != "wrong", f"d{name} is wrong"


# %% [markdown]
# ## Cross-entropy through its atomic steps
#
# N = 6 rows of C = 5 logits, one target class per row, the loss the mean over the rows of
# $-\log \mathrm{softmax}(\text{logits})_{\text{target}}$. The forward below is written the long
# way on purpose: the max subtraction (for stability), the exponentials, their row sums, the
# reciprocal, the probabilities, their log, the picked entries, the mean. The loss is a scalar;
# its upstream gradient `dloss` is a random number (`steps.upstream`), not 1, so that a
# forgotten factor of it shows.

# %%
N, C = 6, 5
logits = rng.standard_normal((N, C))
target = rng.integers(0, C, size=N)
rows = np.arange(N)
ce = ForwardSteps({"logits": logits}, {
    "logit_maxes": lambda a: a["logits"].max(axis=1, keepdims=True),        # (N, 1)
    "norm_logits": lambda a: a["logits"] - a["logit_maxes"],                # (N, C)
    "counts": lambda a: a["norm_logits"].exp(),                             # (N, C)
    "counts_sum": lambda a: a["counts"].sum(axis=1, keepdims=True),         # (N, 1)
    "counts_sum_inv": lambda a: a["counts_sum"] ** -1,                      # (N, 1)
    "probs": lambda a: a["counts"] * a["counts_sum_inv"],                   # (N, C)
    "logprobs": lambda a: a["probs"].log(),                                 # (N, C)
    "loss": lambda a: -a["logprobs"][rows, target].mean()})                 # ()
logit_maxes, counts, counts_sum, counts_sum_inv, probs, loss = (
    ce.values[n] for n in ("logit_maxes", "counts", "counts_sum", "counts_sum_inv", "probs", "loss"))
dloss = float(ce.upstream)
print(f"loss {float(loss):.4f} (the engine's F.cross_entropy: {F.cross_entropy(logits, target).item():.4f}), "
      f"dloss {dloss:.4f}")

# %% [markdown]
# Backward, from the loss down. Each line is the local derivative of one forward line times the
# gradient that arrived, and where a value was **used twice** (`counts` feeds `probs` and
# `counts_sum`), the two contributions add up. Where a forward line **broadcast** a (N, 1)
# column over C entries, the backward sums over those entries.
#
# - `loss = -mean_i logprobs[i, target_i]`: only the picked entries get gradient, each $-1/N$.
# - `logprobs = log(probs)`: $d\,\text{probs} = d\,\text{logprobs} / \text{probs}$.
# - `probs = counts * counts_sum_inv`: a product, each factor gets the other times the gradient;
#   `counts_sum_inv` was broadcast over the C columns, so its gradient is a row sum.

# %%
dlogprobs = np.zeros((N, C))
dlogprobs[rows, target] = -dloss / N                                        # (N, C)
dprobs = dlogprobs / probs                                                  # (N, C)
dcounts_sum_inv = (counts * dprobs).sum(axis=1, keepdims=True)              # (N, 1)
dcounts = counts_sum_inv * dprobs                                           # (N, C), first use of counts
cmp(ce, "logprobs", dlogprobs)
cmp(ce, "probs", dprobs)
cmp(ce, "counts_sum_inv", dcounts_sum_inv)

# %% [markdown]
# - `counts_sum_inv = counts_sum ** -1`: $d\,\text{counts\_sum} = -\text{counts\_sum}^{-2}\,
#   d\,\text{counts\_sum\_inv}$.
# - `counts_sum = counts.sum(1)`: a sum hands its gradient to every term unchanged, so each
#   of the C counts of a row gets the row's $d\,\text{counts\_sum}$, **added** to what `probs`
#   gave it.
# - `counts = exp(norm_logits)`: $e^x$ is its own derivative: $d\,\text{norm\_logits} =
#   \text{counts} \cdot d\,\text{counts}$.

# %%
dcounts_sum = -counts_sum ** -2 * dcounts_sum_inv                           # (N, 1)
dcounts += dcounts_sum                                                      # second use: broadcast back
dnorm_logits = counts * dcounts                                             # (N, C)
cmp(ce, "counts_sum", dcounts_sum)
cmp(ce, "counts", dcounts)
cmp(ce, "norm_logits", dnorm_logits)

# %% [markdown]
# - `norm_logits = logits - logit_maxes`: logits get the gradient as it is; the maxima, broadcast
#   over the row, get minus its row sum.
# - `logit_maxes = logits.max(1)`: the maximum passes its gradient to the entry that is the
#   maximum (a one-hot mask), the second use of `logits`.
#
# $d\,\text{logit\_maxes}$ comes out at about 1e-18, not 0 by accident: shifting a row of
# logits does not change its softmax, so the loss cannot depend on the shift; what is left is
# rounding. (It is still `exact`: the engine's tape rounds the same way, step for step.)

# %%
dlogit_maxes = -dnorm_logits.sum(axis=1, keepdims=True)                     # (N, 1), about 0
dlogits = dnorm_logits + (logits == logit_maxes) * dlogit_maxes             # (N, C)
print("dlogit_maxes:", dlogit_maxes.ravel())
cmp(ce, "logit_maxes", dlogit_maxes)
cmp(ce, "logits", dlogits)

# %% [markdown]
# ## Cross-entropy in one line (exercise 2)
#
# Run the algebra on the steps above: $\log \mathrm{softmax}(z)_t = z_t - \log\sum_c e^{z_c}$,
# whose derivative with respect to $z_c$ is $[c = t] - \mathrm{softmax}(z)_c$. With the mean
# over N rows and the upstream `dloss`:
#
# $$d\,\text{logits} = \big(\mathrm{softmax}(\text{logits}) - \text{onehot}(\text{target})\big)\;
#   \text{dloss} / N$$
#
# Nine lines become one, with no division by `probs` (which underflow to 0 for very negative
# logits). This is what `CrossEntropyFunction` in `npformer/functional/cross_entropy/` computes.

# %%
def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def cross_entropy_backward(logits, target, dloss):
    return (softmax(logits) - np.eye(logits.shape[1])[target]) * dloss / logits.shape[0]


assert check("cross_entropy_backward", cross_entropy_backward).passed
assert np.allclose(cross_entropy_backward(logits, target, dloss), dlogits)

# %% [markdown]
# ## Softmax, and why `sum()` hides a wrong backward
#
# For one row, $y = \mathrm{softmax}(x)$ has the Jacobian $\partial y_j / \partial x_i = y_j([i = j]
# - y_i)$: the diagonal is $y_i(1 - y_i)$, every other entry $-y_i y_j$. Here is one row's:

# %%
x = rng.standard_normal((3, 5))
y0 = softmax(x)[0]
jacobian = np.diag(y0) - np.outer(y0, y0)                                   # (C, C)
fig, ax = plt.subplots(figsize=(4, 3.2))
image = ax.imshow(jacobian, cmap="RdBu_r", vmin=-abs(jacobian).max(), vmax=abs(jacobian).max())
fig.colorbar(image, ax=ax)
ax.set(title="softmax Jacobian of one row: dy_j / dx_i", xlabel="j (output)", ylabel="i (input)")
show_figure(fig, FIGURES / "softmax_jacobian.png")
print("every row of the Jacobian sums to", jacobian.sum(axis=1).round(15))

# %% [markdown]
# Contract it with the upstream $dy$ and it never needs to be formed:
# $dx = y \odot (dy - \mathrm{rowsum}(dy \odot y))$.
#
# Every row of the Jacobian sums to 0 (the outputs always sum to 1, whatever $x$ does). So with
# `loss = y.sum()`, that is $dy = 1$, the correct gradient is exactly 0, and so is the gradient
# of **many** wrong backwards: forgetting the outer factor $y$, $dx = dy - \mathrm{rowsum}(dy
# \odot y)$, gives $1 - 1 = 0$ too. Here is that mistake as a custom autograd op:

# %%
class WrongSoftmax(Function):
    @staticmethod
    def forward(ctx, x):
        y = softmax(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return dy - (dy * y).sum(-1, keepdims=True)                        # forgot: times y


xt = Tensor(x.copy(), requires_grad=True)
WrongSoftmax.apply(xt).sum().backward()
print("gradient of sum(): wrong op", np.abs(xt.grad).max(), "- the right one is 0 too: the test passes")
try:
    gradcheck(WrongSoftmax.apply, [Tensor(x.copy(), requires_grad=True)])    # random upstream gradient
except GradcheckError as error:
    print("gradcheck with a random upstream gradient says the op is wrong:\n" + str(error))

# %% [markdown]
# `autograd.gradcheck` contracts with a random upstream gradient for this reason, and so do
# `ForwardSteps` and the exercises' checker. The one-line softmax backward, and the mistake,
# checked (the checker has no hypothesis for this one, so it names the worst entry only):

# %%
assert check("softmax_backward", lambda y, dy: y * (dy - (dy * y).sum(-1, keepdims=True))).passed
assert not check("softmax_backward", lambda y, dy: dy - (dy * y).sum(-1, keepdims=True)).passed

# %% [markdown]
# ## LayerNorm through its atomic steps
#
# Per row of D features: the mean, the centred values, the (biased) variance, the reciprocal
# standard deviation, the normalised values, then a weight and a bias per feature. N = 4 rows,
# D = 6 features, a random upstream gradient `dy` of the output's shape.

# %%
D, eps = 6, 1e-5
xs = rng.standard_normal((4, D))
w, b = 1.0 + 0.5 * rng.standard_normal(D), rng.standard_normal(D)
ln = ForwardSteps({"x": xs, "w": w, "b": b}, {
    "mu": lambda a: a["x"].mean(axis=1, keepdims=True),                    # (N, 1)
    "xc": lambda a: a["x"] - a["mu"],                                       # (N, D)
    "var": lambda a: (a["xc"] ** 2).mean(axis=1, keepdims=True),            # (N, 1)
    "rstd": lambda a: (a["var"] + eps) ** -0.5,                             # (N, 1)
    "xhat": lambda a: a["xc"] * a["rstd"],                                  # (N, D)
    "y": lambda a: a["xhat"] * a["w"] + a["b"]})                            # (N, D)
mu, xc, var, rstd, xhat = (ln.values[n] for n in ("mu", "xc", "var", "rstd", "xhat"))
dy = ln.upstream
print("y equals the engine's F.layer_norm:", np.allclose(ln.values["y"], F.layer_norm(xs, D, w, b, eps).numpy()))

# %% [markdown]
# The weight and bias were broadcast over the rows: their gradients sum over the rows. `xc` is
# used twice (in `var` and in `xhat`), and `x` twice (directly and through `mu`):

# %%
dw = (dy * xhat).sum(axis=0)                                                # (D,)
db = dy.sum(axis=0)                                                         # (D,)
dxhat = dy * w                                                              # (N, D)
drstd = (dxhat * xc).sum(axis=1, keepdims=True)                             # (N, 1)
dvar = -0.5 * (var + eps) ** -1.5 * drstd                                   # (N, 1)
dxc = dxhat * rstd + 2 * xc / D * dvar                                      # (N, D), both uses
dmu = -dxc.sum(axis=1, keepdims=True)                                       # (N, 1)
dx = dxc + dmu / D                                                          # (N, D), both uses
for name, mine in [("w", dw), ("b", db), ("xhat", dxhat), ("rstd", drstd), ("var", dvar), ("xc", dxc),
                   ("mu", dmu), ("x", dx)]:
    cmp(ln, name, mine)

# %% [markdown]
# ## LayerNorm in one line (exercise 3)
#
# Substitute the steps into each other: with $g = dy \odot w$,
#
# $$dx = \text{rstd}\,\big(g - \mathrm{mean}(g) - \hat x\, \mathrm{mean}(g \odot \hat x)\big)$$
#
# two row means and one pass, the formula of `layer_norm_backward` in
# `npformer/functional/layer_norm/math.py` (docs/backprop.md derives it from the Jacobian).

# %%
def layer_norm_backward(x, weight, dy, eps):
    xc = x - x.mean(-1, keepdims=True)
    rstd = 1 / np.sqrt((xc ** 2).mean(-1, keepdims=True) + eps)
    xhat, g = xc * rstd, dy * weight
    dx = rstd * (g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True))
    return dx, (dy * xhat).sum(0), dy.sum(0)


assert check("layer_norm_backward", layer_norm_backward).passed
assert np.allclose(layer_norm_backward(xs, w, dy, eps)[0], dx)

# %% [markdown]
# `sum()` is blind here as well: with $dy = 1$ and $w = 1$, $g = 1$, so $g - \mathrm{mean}(g) =
# 0$ and $\mathrm{mean}(g \odot \hat x) = \mathrm{mean}(\hat x) = 0$: the gradient is 0, and a
# backward that forgot the $\hat x$ term gives 0 as well. The checker's random `dy` sees it:

# %%
def layer_norm_backward_without_xhat_term(x, weight, dy, eps):
    dx, dweight, dbias = layer_norm_backward(x, weight, dy, eps)
    xc = x - x.mean(-1, keepdims=True)
    rstd = 1 / np.sqrt((xc ** 2).mean(-1, keepdims=True) + eps)
    g = dy * weight
    return rstd * (g - g.mean(-1, keepdims=True)), dweight, dbias


ones = np.ones((4, D))
print("dy = 1, w = 1: right", np.abs(layer_norm_backward(xs, np.ones(D), ones, eps)[0]).max().round(12),
      "wrong", np.abs(layer_norm_backward_without_xhat_term(xs, np.ones(D), ones, eps)[0]).max().round(12))
assert not check("layer_norm_backward", layer_norm_backward_without_xhat_term).passed
