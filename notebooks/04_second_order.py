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
# # Second order: Hessian-vector products, by hand and by the engine
#
# A gradient $g(x) = \nabla L(x)$ says which way the loss falls; the Hessian $H = \nabla^2 L$
# says how that direction changes as you move, its **curvature**. Nobody forms $H$ for a model
# ($n$ parameters, $n^2$ entries), but one product $H v$ costs about two gradients, and with
# products alone you get eigenvalues, spectra and Newton-like steps.
#
# Four parts, each checked in float64:
#
# 1. **The engine's second derivatives**: a gradient that is itself in the graph
#    (`create_graph=True`), $H v$ as the gradient of $\langle g, v\rangle$ (reverse over reverse),
#    as the tangent of $g$ along $v$ (forward over reverse, with dual tensors), and
#    `autograd.functional`'s `hvp`, `vhp` and `hessian`.
# 2. **An HVP by hand through softmax**: $L = \langle w, \mathrm{softmax}(x)\rangle$, its gradient,
#    the directional derivative of that gradient, and the full Hessian, each against the engine
#    and finite differences; why the vector of ones is in its null space.
# 3. **The Hessian of one attention layer** with respect to $W_Q$, $W_K$, $W_V$, drawn block by
#    block, against torch, and the structure the algebra predicts.
# 4. **The block spectrum of a Transformer** (`demos/hessian.py`): the top eigenvalue and the
#    spectral density of every parameter block, and how different the blocks are.

# %%
import math
import pathlib
import sys

HERE = pathlib.Path.cwd()
ROOT = next(p for p in [HERE, *HERE.parents] if (p / "demos" / "hessian.py").is_file())
sys.path.insert(0, str(ROOT / "demos"))
import hessian as block_hessian  # noqa: E402  (demos/hessian.py: the blocks, power iteration, Lanczos; one BLAS thread)
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

import autograd  # noqa: E402
import npformer.functional as F  # noqa: E402
from autograd import Tensor, forward_ad  # noqa: E402
from autograd.functional import hessian, hvp, jacobian, vhp  # noqa: E402
from notebook_figures import figure_folder, show, show_figure  # noqa: E402  (notebooks/notebook_figures.py)

try:  # only the comparison with torch's Hessian needs torch; that cell says so and skips without it
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:
    torch = None

rng = np.random.default_rng(0)
EPS = np.finfo(np.float64).eps
FIGURES = figure_folder("04_second_order")   # runs/notebooks/04_second_order/


def assert_close(mine, reference, what, scale=None, ulps=1000):
    """mine equals reference to rounding: `ulps` float64 epsilons times the magnitude `scale`
    (default: the larger entry of the two); prints the difference and stops the notebook if wrong."""
    scale = max(np.abs(mine).max(), np.abs(reference).max()) if scale is None else scale
    tolerance = ulps * EPS * scale
    error = np.abs(np.asarray(mine) - np.asarray(reference)).max()
    assert error <= tolerance, f"{what}: max difference {error:.1e} > tolerance {tolerance:.1e}"
    print(f"{what:52} max diff {error:.1e}  (tolerance {tolerance:.1e})")


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


# %% [markdown]
# ## 1. Second derivatives in the engine
#
# Take $f(x) = \log \sum_i e^{x_i}$ (logsumexp) on n = 6 numbers. Its gradient is the softmax,
# $g = y = \mathrm{softmax}(x)$, and its Hessian is the softmax's Jacobian:
#
# $$H = \frac{\partial y}{\partial x} = \mathrm{diag}(y) - y y^\top, \qquad H v = y \odot (v - \langle y, v\rangle)$$
#
# A plain `backward()` leaves `x.grad` as numbers. With `create_graph=True` every backward
# rule runs on Tensors (each op's `differentiable_backward`), so the gradient is a Tensor with
# its own graph back to `x`, and can be differentiated like any other result.

# %%
n = 6
x0 = rng.standard_normal(n)
v = rng.standard_normal(n)                            # the direction of every H v below


def logsumexp(x):
    return x.exp().sum().log()                         # () ; its gradient is softmax(x)


x = Tensor(x0.copy(), requires_grad=True)
logsumexp(x).backward(create_graph=True)
g = x.grad                                             # (n,) a Tensor in the graph
y = softmax(x0)                                        # (n,)
print("x.grad is a Tensor that requires grad:", g.requires_grad)
assert g.requires_grad
assert_close(g.numpy(), y, "gradient of logsumexp = softmax")

# %% [markdown]
# **Reverse over reverse (Pearlmutter's trick).** $H v$ is the derivative of $g$ along $v$, and
# because $v$ is a constant, $H v = \nabla_x \langle g(x), v\rangle$: one more backward, through
# the gradient's graph, from the scalar $\langle g, v \rangle$. No $n \times n$ matrix is formed.
#
# **Forward over reverse.** Make $x$ a dual tensor $x + v\,\varepsilon$ (`forward_ad.make_dual`):
# every op of the forward *and of the backward* also carries a tangent, the first-order change
# along $v$. The gradient comes out with tangent $\frac{d}{dt} g(x + t v) = H v$. One forward and
# one backward, each carrying tangents, and no second graph.
#
# `autograd.functional` wraps both with torch's signatures: `hvp` (forward over reverse), `vhp`
# (reverse over reverse, $v^\top H$, the same numbers since $H$ is symmetric), `hessian` (the
# Jacobian of the gradient, one product per entry).

# %%
(hv_reverse,) = autograd.grad((g * Tensor(v)).sum(), x)                 # (n,) d/dx <g, v>
with forward_ad.dual_level():
    x_dual = forward_ad.make_dual(Tensor(x0.copy(), requires_grad=True), v)
    (g_dual,) = autograd.grad(logsumexp(x_dual), x_dual)
    hv_forward = forward_ad.unpack_dual(g_dual).tangent                  # (n,) the gradient's tangent
_, hv_functional = hvp(logsumexp, Tensor(x0), Tensor(v))
_, vh_functional = vhp(logsumexp, Tensor(x0), Tensor(v))
H_lse = hessian(logsumexp, Tensor(x0)).numpy()                            # (n, n)
H_lse_forward = hessian(logsumexp, Tensor(x0), outer_jacobian_strategy="forward-mode").numpy()

hv_hand = y * (v - y @ v)                                                # (n,)
assert_close(hv_reverse.numpy(), hv_hand, "reverse over reverse vs y * (v - <y, v>)")
assert_close(hv_forward, hv_hand, "forward over reverse vs y * (v - <y, v>)")
assert_close(hv_functional.numpy(), hv_hand, "functional.hvp")
assert_close(vh_functional.numpy(), hv_hand, "functional.vhp")
assert_close(H_lse, np.diag(y) - np.outer(y, y), "functional.hessian vs diag(y) - y y^T")
assert_close(H_lse_forward, H_lse, "hessian, forward-mode outer Jacobian")

# %% [markdown]
# This $H$ is a covariance matrix: $v^\top H v = \sum_i y_i v_i^2 - (\sum_i y_i v_i)^2$ is the
# variance of $v$ under the probabilities $y$, never negative. So logsumexp is convex, and so is
# the cross-entropy $-\log \mathrm{softmax}(x)_t = \mathrm{logsumexp}(x) - x_t$ (the $-x_t$ is
# linear: same Hessian). The variance is 0 exactly when $v$ is constant: the smallest eigenvalue
# is 0, with eigenvector $\mathbf{1}/\sqrt n$.

# %%
values, vectors = np.linalg.eigh(H_lse)
print("eigenvalues of the logsumexp Hessian:", values.round(6))
assert abs(values[0]) <= 100 * EPS * values[-1], "the smallest eigenvalue is 0"
assert values[1] > 0, "the others are positive"
assert_close(np.abs(vectors[:, 0]), np.full(n, 1 / math.sqrt(n)), "eigenvector of eigenvalue 0 = 1 / sqrt(n)",
             scale=1.0)

# %% [markdown]
# ## 2. An HVP by hand through softmax
#
# Now one level deeper: $y = \mathrm{softmax}(x)$ and $L = \langle w, y\rangle$ with a random
# $w$ (an upstream gradient, as in notebook 2: with $w = \mathbf 1$ everything below is 0).
#
# **The gradient.** With the Jacobian $J = \mathrm{diag}(y) - y y^\top$ (symmetric):
#
# $$g = J w = y \odot a, \qquad a = w - \langle w, y\rangle \mathbf 1$$
#
# the softmax backward $dx = y \odot (dy - \langle dy, y\rangle)$ with $dy = w$.
#
# **Its derivative along v.** Move $x$ by $t v$. The product rule on $g = y \odot a$ needs the
# change of each factor:
#
# - $\dot y = J v = y \odot (v - \langle y, v\rangle)$ (the softmax's forward-mode rule),
# - $\dot a = -\langle w, \dot y\rangle \mathbf 1$, and
#   $\langle w, J v\rangle = \langle J w, v\rangle = \langle g, v\rangle$.
#
# $$H v = \dot y \odot a + y \odot \dot a = \dot y \odot a - \langle g, v\rangle\, y$$
#
# **The full Hessian.** Read the same steps entry by entry: $\partial y_i / \partial x_j =
# y_i(\delta_{ij} - y_j)$ and $\partial a_i / \partial x_j = -g_j$, so
# $H_{ij} = y_i(\delta_{ij} - y_j)\,a_i - y_i g_j$, and since $y_i a_i = g_i$:
#
# $$H = \mathrm{diag}(g) - g\, y^\top - y\, g^\top$$
#
# Symmetric, as a Hessian must be: the two rank-one terms are each other's transpose.

# %%
w = rng.standard_normal(n)


def weighted_softmax(x):
    return (F.softmax(x, dim=-1) * Tensor(w)).sum()        # () L = <w, softmax(x)>


a = w - w @ y                                              # (n,)
g_hand = y * a                                             # (n,) the gradient
y_dot = y * (v - y @ v)                                    # (n,) J v
hv_hand = y_dot * a - (g_hand @ v) * y                     # (n,) H v
H_hand = np.diag(g_hand) - np.outer(g_hand, y) - np.outer(y, g_hand)   # (n, n)

x = Tensor(x0.copy(), requires_grad=True)
(g_engine,) = autograd.grad(weighted_softmax(x), x, create_graph=True)
(hv_reverse,) = autograd.grad((g_engine * Tensor(v)).sum(), x)
_, hv_forward = hvp(weighted_softmax, Tensor(x0), Tensor(v))
H_engine = hessian(weighted_softmax, Tensor(x0)).numpy()   # (n, n)

assert_close(g_engine.numpy(), g_hand, "gradient: y * (w - <w, y>)")
assert_close(hv_reverse.numpy(), hv_hand, "H v: reverse over reverse vs by hand")
assert_close(hv_forward.numpy(), hv_hand, "H v: forward over reverse vs by hand")
assert_close(H_hand @ v, hv_hand, "H v: (explicit H) @ v vs by hand")
assert_close(H_engine, H_hand, "H: functional.hessian vs diag(g) - g y^T - y g^T")

# %% [markdown]
# The engine does not run our formula: `SoftmaxFunction.differentiable_backward` writes the
# first backward with Tensors and the tape differentiates it (docs/backprop.md, softmax, "Double
# backward"). Differentiating $\langle dx, v\rangle = \sum_i v_i y_i (w_i - s)$, $s = \langle w, y\rangle$, in
# $y$ gives $r = v \odot (w - s) - w \langle v, y\rangle$, and then the softmax's backward takes
# it to $x$: $y \odot (r - \langle r, y\rangle)$. Expand
# $\langle r, y\rangle = \langle v, g\rangle - s\langle v, y\rangle$ and it is our
# $\dot y \odot a - \langle g, v\rangle y$, term for term:

# %%
s = w @ y
r = v * (w - s) - w * (v @ y)                              # (n,) d<dx, v>/dy
assert_close(y * (r - r @ y), hv_hand, "docs/backprop.md's double backward vs ours")

# %% [markdown]
# **Finite differences.** $H v \approx (g(x + h v) - g(x - h v)) / 2h$, with the engine's first-order
# gradient. Its error has two parts. Truncation: $\frac{h^2}{6} g'''[v, v, v] + O(h^4)$; the
# difference between the steps $2h$ and $h$ is $3 \cdot \frac{h^2}{6} g'''$, so a third of it
# estimates the truncation. Rounding: each gradient is right to a few $\varepsilon\,|g|$, and
# dividing by $2h$ magnifies that to about $\varepsilon\,|g| / h$. The tolerance is ten times
# their sum. A wrong derivation, here our $H v$ without its last term, must miss by far more.

# %%
def engine_gradient(x_values):
    xt = Tensor(x_values, requires_grad=True)
    (gx,) = autograd.grad(weighted_softmax(xt), xt)
    return gx.numpy()                                       # (n,)


def central_difference(step):
    return (engine_gradient(x0 + step * v) - engine_gradient(x0 - step * v)) / (2 * step)


h = 1e-4
fd, fd_double = central_difference(h), central_difference(2 * h)
truncation = np.abs(fd_double - fd).max() / 3
rounding = n * EPS * np.abs(g_hand).max() / h
tolerance = 10 * (truncation + rounding)
fd_error = np.abs(fd - hv_hand).max()
wrong_error = np.abs(fd - y_dot * a).max()                  # forgot - <g, v> y
print(f"step {h:g}: truncation ~{truncation:.1e}, rounding ~{rounding:.1e}, tolerance {tolerance:.1e}")
print(f"finite differences vs our H v: {fd_error:.1e};  vs H v without - <g, v> y: {wrong_error:.1e}")
assert fd_error <= tolerance and wrong_error > 100 * tolerance

# %% [markdown]
# **Symmetry, the null space and the signs.** Softmax does not change when every logit moves by
# the same amount: $\mathrm{softmax}(x + c\mathbf 1) = \mathrm{softmax}(x)$, so $L(x + c\mathbf 1) = L(x)$
# for every $c$. Differentiate in $c$: $\langle g, \mathbf 1\rangle = 0$, the gradient sums to 0
# (indeed $\sum_i y_i a_i = \langle w, y\rangle - \langle w, y\rangle = 0$). The gradient itself does not change
# either, $g(x + c\mathbf 1) = g(x)$; differentiate in $c$ once more: $H\mathbf 1 = 0$. From the
# formula: $H\mathbf 1 = g - g\,\langle y, \mathbf 1\rangle - y\,\langle g, \mathbf 1\rangle = g - g - 0$.
# The loss is flat along $\mathbf 1$: the Hessian of any loss of $\mathrm{softmax}(x)$, with
# respect to $x$, is singular.
#
# And unlike logsumexp this $H$ is not of one sign. Its diagonal is $H_{ii} = g_i - 2 g_i y_i =
# g_i (1 - 2 y_i)$, and since $H\mathbf 1 = 0$ that is also the curvature along $e_i - c\mathbf 1$ for
# any $c$. When no probability reaches 1/2 (as here) the diagonal has the signs of $g$, and $g$
# sums to 0: unless it is all zeros, some $H_{ii}$ are positive and some negative.
# $\langle w, \mathrm{softmax}(x)\rangle$ curves up along some logits and down along others, a saddle.
#
# %%
ones = np.ones(n)
curvature = np.linalg.eigvalsh(H_engine)
print("eigenvalues:", curvature.round(5), " g:", g_hand.round(4))
assert_close(H_engine, H_engine.T, "engine's H is symmetric")
assert_close(g_hand @ ones, 0.0, "<g, 1> = 0", scale=np.abs(g_hand).max() * n)
assert_close(H_engine @ ones, np.zeros(n), "H 1 = 0 (shift invariance)", scale=np.abs(H_engine).max() * n)
assert_close(np.diag(H_engine), g_hand * (1 - 2 * y), "diagonal H_ii = g_i (1 - 2 y_i)")
assert y.max() < 0.5 and g_hand.min() < 0 < g_hand.max() and curvature[0] < 0 < curvature[-1]

# %% [markdown]
# ## 3. The Hessian of one attention layer
#
# One head on T = 5 tokens of width d = 3: $Q = X W_Q^\top$, $K = X W_K^\top$, $V = X W_V^\top$,
# $O = \mathrm{softmax}(Q K^\top / \sqrt d)\, V = P V$, through `F.scaled_dot_product_attention`.
# The parameters are the three (3, 3) matrices, 27 numbers: the Hessian is 27 x 27, nine blocks
# (QQ, QK, ..., VV) of 9 x 9, each entry a second derivative. Two losses:
#
# - linear in the output, $L_1 = \langle R, O\rangle$ (R random, like an upstream gradient);
# - squared error, $L_2 = \frac12 \|O - Y\|^2$.
#
# `autograd.functional.hessian` with a tuple of inputs returns the blocks as nested tuples
# [i][j], each of shape $W_i$.shape + $W_j$.shape; `np.block` lays them out (row-major flattening
# of each $W$). torch computes the same with `torch.autograd.functional.hessian`, its
# attention on the math backend (plain differentiable ops, so it has second derivatives).

# %%
T, d = 5, 3
X = rng.standard_normal((T, d))                          # (T, d) the tokens
R = rng.standard_normal((T, d))                          # (T, d) L1's weights
Y = rng.standard_normal((T, d))                          # (T, d) L2's target
weights = [rng.standard_normal((d, d)) for _ in "QKV"]   # W_Q, W_K, W_V, each (d, d)
BLOCKS = ["Q", "K", "V"]


def attention(Wq, Wk, Wv):
    Xt = Tensor(X)
    return F.scaled_dot_product_attention(Xt @ Wq.T, Xt @ Wk.T, Xt @ Wv.T)    # (T, d)


def linear_loss_of(weights_of_O):
    def weighted_output(Wq, Wk, Wv):
        return (attention(Wq, Wk, Wv) * Tensor(weights_of_O)).sum()
    return weighted_output


linear_loss = linear_loss_of(R)


def squared_loss(Wq, Wk, Wv):
    return ((attention(Wq, Wk, Wv) - Tensor(Y)) ** 2).sum() / 2


def torch_loss(kind):
    Xt, Rt, Yt = (torch.from_numpy(a) for a in (X, R, Y))

    def torch_function(Wq, Wk, Wv):
        O = torch.nn.functional.scaled_dot_product_attention(Xt @ Wq.T, Xt @ Wk.T, Xt @ Wv.T)
        return (O * Rt).sum() if kind == "linear" else ((O - Yt) ** 2).sum() / 2
    return torch_function


LOSSES = {"linear": linear_loss, "squared": squared_loss}


def assembled(blocks):
    """Nested [i][j] blocks of shape (d, d, d, d) -> one (3 d^2, 3 d^2) array."""
    return np.block([[np.asarray(entry).reshape(d * d, d * d) for entry in row] for row in blocks])


hessians = {}
for kind, loss_fn in LOSSES.items():
    ours = assembled([[b.numpy() for b in row] for row in hessian(loss_fn, tuple(Tensor(W) for W in weights))])
    if torch is None:
        print(f"{kind} loss: skipped the comparison with torch's Hessian: it needs torch (pip install torch)")
    else:
        with sdpa_kernel(SDPBackend.MATH):
            theirs = assembled([[b.numpy() for b in row] for row in torch.autograd.functional.hessian(
                torch_loss(kind), tuple(torch.from_numpy(W) for W in weights))])
        assert_close(ours, theirs, f"{kind} loss: Hessian vs torch's")
    assert_close(ours, ours.T, f"{kind} loss: Hessian is symmetric")
    hessians[kind] = ours


def block(H, i, j):
    """The (d^2, d^2) block of H for parameters i and j ("Q", "K" or "V")."""
    rows, columns = (slice(BLOCKS.index(b) * d * d, (BLOCKS.index(b) + 1) * d * d) for b in (i, j))
    return H[rows, columns]


# %%
fig, axes = plt.subplots(1, 2, figsize=(10, 4.4))
for ax, (kind, H) in zip(axes, hessians.items()):
    limit = np.abs(H).max()
    image = ax.imshow(H, cmap="RdBu_r", vmin=-limit, vmax=limit)
    for edge in (d * d - 0.5, 2 * d * d - 0.5):
        ax.axhline(edge, color="k", lw=0.8)
        ax.axvline(edge, color="k", lw=0.8)
    centres = [(k + 0.5) * d * d - 0.5 for k in range(3)]
    ax.set_xticks(centres, [f"W_{b}" for b in BLOCKS])
    ax.set_yticks(centres, [f"W_{b}" for b in BLOCKS])
    ax.set_title({"linear": "L1 = <R, O>: the VV block is 0", "squared": "L2 = |O - Y|^2 / 2"}[kind])
    fig.colorbar(image, ax=ax, shrink=0.8)
fig.suptitle("Hessian of one attention head w.r.t. (W_Q, W_K, W_V), 27 x 27")
fig.tight_layout()
show_figure(fig, FIGURES / "attention_hessian.png")

# %% [markdown]
# **The VV block.** $O = P X W_V^\top$ is linear in $W_V$ ($P$ does not depend on it): entry by
# entry $O_{ta} = \sum_c (P X)_{tc} (W_V)_{ac}$, so $\partial O_{ta} / \partial (W_V)_{bc} = \delta_{ab} (PX)_{tc}$
# and $\partial^2 O / \partial W_V^2 = 0$.
#
# - For $L_1$, linear in $O$, the VV block is therefore exactly 0.
# - For $L_2$, the chain rule leaves only the Gauss-Newton term (the one with $\partial^2 O$ is 0):
#   $H_{VV} = \sum_{t,a} \frac{\partial O_{ta}}{\partial W_{V,bc}} \frac{\partial O_{ta}}{\partial W_{V,b'c'}}
#   = \delta_{bb'} \big((PX)^\top (PX)\big)_{cc'}$,
#   that is $I_d \otimes (PX)^\top PX$ in row-major order: positive semidefinite, the same
#   d x d matrix on the diagonal d times.
#
# **The saddle.** $H_1$ has a zero diagonal block (VV) beside non-zero QV and KV blocks. Such a
# matrix is never semidefinite: take $u$ on the Q and K entries, $z$ on the V entries, with
# $u^\top H_{(QK)V}\, z \ne 0$. Along $(\epsilon u, z)$ the curvature is
# $\epsilon^2 u^\top H_{(QK)(QK)} u + 2\epsilon\, u^\top H_{(QK)V}\, z + 0$, whose sign for small
# $\epsilon$ is that of $\epsilon$: either.

# %%
P = softmax(X @ weights[0].T @ (X @ weights[1].T).T / math.sqrt(d))      # (T, T)
PX = P @ X                                                                # (T, d)
H1, H2 = hessians["linear"], hessians["squared"]
assert_close(block(H1, "V", "V"), np.zeros((d * d, d * d)), "L1: VV block = 0", scale=np.abs(H1).max())
assert_close(block(H2, "V", "V"), np.kron(np.eye(d), PX.T @ PX), "L2: VV block = I kron (PX)^T PX")
assert np.linalg.eigvalsh(block(H2, "V", "V"))[0] >= -1000 * EPS * np.abs(H2).max()
assert np.abs(block(H1, "Q", "V")).max() > 0.01 * np.abs(H1).max()
eigen_1 = np.linalg.eigvalsh(H1)
print(f"L1: eigenvalues from {eigen_1[0]:+.3f} to {eigen_1[-1]:+.3f}: a saddle")
assert eigen_1[0] < 0 < eigen_1[-1]

# %% [markdown]
# **A symmetry of Q and K, and what it does to H.** The scores are $X W_Q^\top W_K X^\top$: only
# the product $W_Q^\top W_K$ matters. For any d x d matrix $E$, the curve
# $W_Q \to (I + tE) W_Q$, $W_K \to (I + tE)^{-\top} W_K$ leaves every score, and so the loss,
# unchanged. Its tangent at $t = 0$ is $\xi(\theta) = (E W_Q, -E^\top W_K, 0)$, linear in the
# parameters: $\xi = A\theta$. Two consequences:
#
# - first order: $\langle g(\theta), \xi(\theta)\rangle = 0$ at every $\theta$;
# - second order: differentiate that identity, $\nabla_\theta \langle g, A\theta\rangle = H\xi + A^\top g = 0$, so
#   $H\xi = -A^\top g = (-E^\top g_Q,\; E\, g_K,\; 0)$.
#
# So the directions that keep $W_Q^\top W_K$ fixed are flat to first order but curved by the
# gradient; at a minimum ($g = 0$) each of them is an eigenvector of eigenvalue 0: $d^2 = 9$ of
# the 18 QK directions carry no curvature there, whatever the data.

# %%
E = rng.standard_normal((d, d))
Wq, Wk, _ = weights
for kind, loss_fn in LOSSES.items():
    params = [Tensor(W.copy(), requires_grad=True) for W in weights]
    gq, gk, gv = (grad.numpy() for grad in autograd.grad(loss_fn(*params), params))
    xi = np.concatenate([(E @ Wq).ravel(), (-E.T @ Wk).ravel(), np.zeros(d * d)])     # (27,)
    gradient = np.concatenate([gq.ravel(), gk.ravel(), gv.ravel()])                    # (27,)
    assert_close(gradient @ xi, 0.0, f"{kind}: <g, xi> = 0", scale=np.abs(gradient).max() * np.abs(xi).max() * xi.size)
    predicted = np.concatenate([(-E.T @ gq).ravel(), (E @ gk).ravel(), np.zeros(d * d)])
    assert_close(hessians[kind] @ xi, predicted, f"{kind}: H xi = (-E^T g_Q, E g_K, 0)",
                 scale=np.abs(hessians[kind]).max() * np.abs(xi).max() * xi.size)

# %% [markdown]
# **Gauss-Newton and the rest.** The VV result is one case of a general split. For
# $L_2 = \frac12\|O - Y\|^2$ the chain rule twice gives
#
# $$\nabla^2 L_2 = J^\top J + \sum_{t,a} r_{ta}\, \nabla^2 O_{ta}, \qquad r = O - Y,\quad
#   J = \partial O / \partial \theta$$
#
# The first term (Gauss-Newton) is positive semidefinite; the second is the Hessian of the linear
# loss $\langle r, O\rangle$ with the residual $r$ held fixed: $L_1$'s Hessian with $R := r$.
# In $W_V$ the second term is 0 (O is linear in $W_V$), so the VV block is all Gauss-Newton,
# semidefinite. In $W_Q$ and $W_K$ the softmax makes it non-zero and of either sign, and with
# these weights it wins: the QQ and KK blocks curve mostly downward, VV only upward. Blocks of
# one layer, then, with spectra of different signs and sizes; a single learning rate serves
# such blocks badly. That is the subject of part 4.

# %%
O_values = attention(*(Tensor(W) for W in weights)).numpy()                    # (T, d)
J = np.concatenate([j.numpy().reshape(T * d, d * d) for j in jacobian(attention, tuple(Tensor(W) for W in weights))],
                   axis=1)                                                     # (T d, 27)
H_residual = assembled([[b.numpy() for b in row] for row in hessian(linear_loss_of(O_values - Y),
                                                                    tuple(Tensor(W) for W in weights))])
assert_close(H2, J.T @ J + H_residual, "L2: H = J^T J + Hessian of <O - Y, O>")
for b in BLOCKS:
    spectra = [np.linalg.eigvalsh(block(M, b, b)) for M in (H2, J.T @ J, H_residual)]
    print(f"block {b}{b}: eigenvalues {spectra[0].min():+8.4f} .. {spectra[0].max():+8.4f};  "
          f"Gauss-Newton {spectra[1].min():+.4f} .. {spectra[1].max():+.4f};  "
          f"the rest {spectra[2].min():+8.4f} .. {spectra[2].max():+.4f}")
assert np.abs(block(H_residual, "V", "V")).max() <= 1000 * EPS * np.abs(H2).max()

# %% [markdown]
# ## 4. The block spectrum of a Transformer
#
# `demos/hessian.py` does part 3 at the size of a real model, where $H$ cannot be formed: the
# encoder-decoder of the reversal task (d_model 32, 4 heads, 2 + 2 layers, 45k parameters),
# trained briefly, in float64, on the mean token cross-entropy of one fixed batch. Its
# `BlockHessian` computes $H_{bb} v$ for one parameter block $b$ at a time (reverse over reverse:
# the gradient graph is built once and every product is one more backward through it). The
# blocks are those of Zhang et al. (below): the embeddings, each attention's $W_Q$, $W_K$, $W_V$
# (rows of the packed `in_proj`) and $W_O$, each feed-forward, each layer's norms, the output.
#
# For each block, from products alone:
#
# - the **top eigenvalue** by power iteration ($v \leftarrow H v / \|H v\|$, then $v^\top H v$);
# - the **spectral density** by stochastic Lanczos quadrature: m Lanczos steps from a random
#   probe give a tridiagonal m x m matrix, whose eigenvalues (Ritz values) and the squared first
#   components of its eigenvectors (weights) are a quadrature rule for the spectrum; each Ritz
#   value is smoothed by a Gaussian;
# - the **block heterogeneity**: the Jensen-Shannon distance between every two blocks' densities
#   (0: the same spectrum, 1: disjoint).
#
# Tiny settings here, to run in seconds: 200 training steps, a batch of 8 sequences, 10 power
# iterations and 12 Lanczos steps from one probe per block.

# %%
args = block_hessian.parse_args(["--steps", "200", "--batch", "8", "--power-iters", "10", "--lanczos", "12",
                                 "--probes", "1", "--out", str(FIGURES)])
model, batch = block_hessian.model_and_batch(args)
hess, results, grid, densities, names, distances = block_hessian.analyse(model, batch, args)

# %% [markdown]
# ## Checking the estimates on one block
#
# The smallest blocks can be formed exactly, one product per column: the first encoder layer's
# norms, 128 parameters. Three facts to assert:
#
# - $H_{bb}$ built from the demo's products is symmetric (a wrong product would not be);
# - the power-iteration value is a Rayleigh quotient, so it lies within the exact spectrum, and
#   after 10 steps it is near the eigenvalue of largest magnitude;
# - Lanczos' quadrature is exact for polynomials of degree below 2m: with the probe $u$ and
#   the Ritz values $\theta_k$ and weights $\omega_k$, $\sum_k \omega_k \theta_k^j = u^\top H^j u$, for
#   j = 0 (the weights sum to 1), 1 and 2. This is why a handful of Lanczos steps gives a
#   density: its moments are the true spectrum's moments along the probe. (And $n\, u^\top H u$,
#   for a Rademacher $u / \sqrt n$, is Hutchinson's estimate of the trace.)
#
# The Ritz values of a symmetric matrix lie within its extreme eigenvalues (Cauchy interlacing).

# %%
norms = block_hessian.blocks_of(model)["enc0.norms"]
size = hess.size(norms)
H_block = np.stack([hess.hvp(norms, column) for column in np.eye(size)], axis=1)   # (size, size)
assert_close(H_block, H_block.T, "enc0.norms: H_bb from products is symmetric")
exact = np.linalg.eigvalsh((H_block + H_block.T) / 2)
largest = exact[np.abs(exact).argmax()]
top = results["enc0.norms"]["top_eigenvalue"]
print(f"exact eigenvalues {exact[0]:+.4f} .. {exact[-1]:+.4f}; power iteration {top:+.4f} (exact {largest:+.4f})")
assert exact[0] - 1e-10 <= top <= exact[-1] + 1e-10 and abs(top - largest) <= 0.1 * abs(largest)

seed = 1
probe = np.random.default_rng(seed).choice([-1.0, 1.0], size=size) / math.sqrt(size)   # lanczos' first draw
ritz, ritz_weights = block_hessian.lanczos(lambda u: hess.hvp(norms, u), size, args.lanczos,
                                           np.random.default_rng(seed))
Hu = H_block @ probe
for j, exact_moment in enumerate([probe @ probe, probe @ Hu, Hu @ Hu]):
    assert_close(ritz_weights @ ritz ** j, exact_moment, f"sum_k w_k theta_k^{j} = u^T H^{j} u",
                 scale=max(1.0, abs(largest)) ** j)
assert exact[0] - 1e-10 <= ritz.min() and ritz.max() <= exact[-1] + 1e-10
print(f"Hutchinson trace from this probe {size * probe @ Hu:.3f}, exact trace {np.trace(H_block):.3f}")

# %% [markdown]
# And the density and distances as the demo computed them: every density integrates to 1 on
# the grid, and the Jensen-Shannon distances form a symmetric matrix with zeros on the diagonal
# and entries in [0, 1].

# %%
spacing = grid[1] - grid[0]
for name in names:
    assert abs(densities[name].sum() * spacing - 1) < 1e-12
assert np.allclose(distances, distances.T, rtol=0, atol=1e-12) and np.all(np.diag(distances) == 0)
assert np.all((distances >= 0) & (distances <= 1))
print(f"block heterogeneity (mean JS distance) {distances[np.triu_indices(len(names), 1)].mean():.3f}")

# %% [markdown]
# ## The pictures
#
# The demo's own figures (`write_outputs`): the top eigenvalue of each block (log scale), the
# spectral density of each block, and the matrix of Jensen-Shannon distances.

# %%
block_hessian.write_outputs(FIGURES, hess, results, grid, densities, names, distances)
for figure in ("top_eigenvalues.png", "spectra.png", "block_distances.png"):
    show(FIGURES / figure)
top_of = {name: abs(results[name]["top_eigenvalue"]) for name in names}
by_family = {}
for name in names:
    by_family.setdefault(name.split(".")[-1], []).append(top_of[name])
for family, tops in by_family.items():
    print(f"{family:>11}: |top eigenvalue| {min(tops):.3g} .. {max(tops):.3g} over {len(tops)} block(s)")
assert max(top_of.values()) > 10 * min(top_of.values())
for attention_block in sorted({name.rsplit(".", 1)[0] for name in names if ".self." in name}):
    q, k, value = (top_of[f"{attention_block}.{letter}"] for letter in "QKV")
    print(f"{attention_block}: top eigenvalue of V / max(Q, K) = {value / max(q, k):.1f}")
    assert value > max(q, k)

# %% [markdown]
# What to see (the numbers move a little with the machine and the settings):
#
# - The top eigenvalues span more than an order of magnitude across blocks, here about two. In
#   every self-attention the V block curves more than Q and K, by a factor of a few to tens.
# - The densities share a tall peak at 0 (most directions of every block barely change the
#   loss) and differ in their tails, the few large eigenvalues. At these settings the shared
#   peak holds most of every density, so the Jensen-Shannon distances come out small (a mean
#   near 0.06): on one common grid, unnormalised, the tails weigh little. Here the top
#   eigenvalues show the differences between blocks more plainly than the distances do.
#
# **Zhang et al. 2024, "Why Transformers Need Adam: A Hessian Perspective".** SGD trains CNNs
# about as well as Adam but falls clearly behind on Transformers; the paper asks why, through the
# Hessian. The full spectra of the two kinds of network look alike, so the full spectrum cannot
# tell them apart. The blockwise spectra can: in CNNs the blocks' densities are similar, in
# Transformers they differ from block to block, the paper's **block heterogeneity** (its
# plots normalise each block's spectrum; it measures the heterogeneity as here, by the averaged
# Jensen-Shannon distance between the blocks' SLQ densities, at initialisation). One learning
# rate for all blocks must suit the sharpest and then crawls along the flat ones; Adam's
# per-coordinate scaling gives each block its own effective step. The authors find the same gap
# on quadratic problems built with and without heterogeneity, and suggest the distance as a way
# to tell beforehand whether SGD will do. Our model is tiny and briefly trained, so its numbers
# illustrate the method rather than replicate the paper: `python demos/hessian.py` runs the
# default settings (300 steps, batch 64, 20 power iterations, 24 Lanczos steps, 2 probes).
