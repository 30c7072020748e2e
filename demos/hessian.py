"""The Hessian of the reversal Transformer, block by block: second derivatives by hand.

    python demos/hessian.py                                    # trains the seed preset briefly, then analyses it
    python demos/hessian.py --checkpoint runs/reverse-seed/checkpoint.npz
    python demos/hessian.py --steps 0                          # the model at initialisation

The loss L(theta) of one fixed batch is differentiated twice, by hand-written rules only, and
neither way forms H. Forward over reverse (the default, the JAX autodiff cookbook's way): H v is
the tangent along v of the gradient g(theta). `autograd.functional.linearize` runs the loss and
its gradient once with the parameters as dual tensors, recording each op's tangent step (its
jvp rule, with what it saved); every product then takes those steps again along v, and nothing
else. Reverse over reverse (`--hvp reverse-over-reverse`): g(theta) is built once with
create_graph=True and each product is one more backward, the gradient of <g(theta), v>
(Pearlmutter's trick). Both reuse the batch's work across the hundreds of products; the tangent
steps are the faster (seed preset at initialisation, 2 cores, median per product over the 35
blocks: 7.7 against 11.3 ms at batch 8, 28.8 against 31.5 ms at batch 64). Both give the same
numbers (tests/demos/test_hessian_demo.py).

The parameters are split into blocks as in Zhang et al. 2024, "Why Transformers Need Adam: A
Hessian Perspective": the embeddings, each attention's Q, K, V (rows of the packed in_proj) and
O (out_proj), each feed-forward, each layer's norms, the output layer. For each block b:

- the top eigenvalue of its diagonal block H_bb, by power iteration on H_bb v;
- the spectral density of H_bb by stochastic Lanczos quadrature (PyHessian's method: a few
  random probes, m Lanczos steps each, Gaussian-smoothed Ritz values weighted by the squared
  first components of their eigenvectors);
- the "block heterogeneity": the Jensen-Shannon distance between the blocks' densities. The
  paper finds it large in Transformers (blocks of very different curvature, which a single
  learning rate (SGD) serves badly and Adam's per-parameter scale serves well) and small in CNNs.

Writes to --out (runs/hessian): hessian.json (eigenvalues, distances), top_eigenvalues.png,
spectra.png, block_distances.png. Results go to stdout.
"""
import argparse
import json
import math
import os
import sys
import time

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402

import autograd  # noqa: E402
import npformer  # noqa: E402
from autograd import Tensor  # noqa: E402
from npformer import load_model, optim  # noqa: E402
from npformer.data import PAD, SequenceTask  # noqa: E402
from npformer.models import Seq2SeqTransformer  # noqa: E402
from npformer.training import Seq2SeqTrainer, token_loss  # noqa: E402

SEED_PRESET = dict(vocab=20, min_len=6, max_len=6, d_model=32, nhead=4, dim_feedforward=64, layers=2)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="hessian.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", help="a checkpoint of demos/reverse.py (else: train the seed preset --steps steps)")
    p.add_argument("--steps", type=int, default=300, help="training steps before the analysis (without --checkpoint)")
    p.add_argument("--batch", type=int, default=64, help="sequences in the fixed batch whose loss is analysed")
    p.add_argument("--power-iters", type=int, default=20, help="power-iteration steps per block")
    p.add_argument("--lanczos", type=int, default=24, help="Lanczos steps per probe")
    p.add_argument("--probes", type=int, default=2, help="random probes per block for the spectral density")
    p.add_argument("--hvp", choices=["forward-over-reverse", "reverse-over-reverse"], default="forward-over-reverse",
                   help="how each Hessian-vector product is computed (default: forward over reverse, the tangent "
                        "steps of the gradient recorded once by autograd.functional.linearize: the faster)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join("runs", "hessian"))
    p.add_argument("--no-plots", action="store_true")
    args = p.parse_args(argv)
    for name in ("steps", "power_iters", "lanczos", "probes", "batch"):
        if getattr(args, name) < (0 if name == "steps" else 1):
            p.error(f"--{name.replace('_', '-')} must be at least {0 if name == 'steps' else 1}")
    return args


# -- the model and its loss ------------------------------------------------------------------
def model_and_batch(args):
    """A float64 model (second derivatives are compared to rounding: float64) and a fixed batch."""
    if args.checkpoint:
        model, state = load_model(args.checkpoint)
        settings = state.get("demo", {}).get("settings", SEED_PRESET)
    else:
        settings = SEED_PRESET
        npformer.manual_seed(args.seed)
        model = Seq2SeqTransformer(settings["vocab"], settings["vocab"], d_model=settings["d_model"],
                                   nhead=settings["nhead"], num_encoder_layers=settings["layers"],
                                   num_decoder_layers=settings["layers"], dim_feedforward=settings["dim_feedforward"],
                                   dropout=0.0, max_len=settings["max_len"] + 2, pad_idx=PAD)
        task = SequenceTask("reverse", vocab_size=settings["vocab"], min_len=settings["min_len"],
                            max_len=settings["max_len"], seed=args.seed)
        if args.steps:
            opt = optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.98), weight_decay=0.0)
            Seq2SeqTrainer(model, opt, task, batch_size=64, progress=False).fit(args.steps)
    model.double().eval()
    task = SequenceTask("reverse", vocab_size=settings["vocab"], min_len=settings["min_len"],
                        max_len=settings["max_len"], seed=args.seed + 1)
    return model, task.batch(args.batch)


def loss_of(model, batch):
    """The mean token cross-entropy of the batch (a scalar Tensor)."""
    loss = token_loss(model(batch.src, batch.tgt_in), batch.tgt_out, PAD)
    return loss.sum / loss.count


# -- blocks ----------------------------------------------------------------------------------
def blocks_of(model):
    """{block name: [(parameter, index into it)]}: the embeddings, Q/K/V/O of every attention,
    each feed-forward, each layer's norms, the output layer."""
    d = model.config["d_model"]
    blocks = {}

    def add(name, p, index=Ellipsis):
        blocks.setdefault(name, []).append((p, index))

    for name, p in model.named_parameters():
        parts = name.split(".")
        if parts[0] in ("src_embed", "tgt_embed"):
            add("embeddings", p)
        elif parts[0] == "generator":
            add("output", p)
        elif "layers" in parts:
            layer = f"{parts[1][:3]}{parts[3]}"          # enc0, dec1
            module = parts[4]
            if module in ("self_attn", "multihead_attn"):
                kind = "self" if module == "self_attn" else "cross"
                if parts[5] in ("in_proj_weight", "in_proj_bias"):
                    for j, letter in enumerate("QKV"):
                        add(f"{layer}.{kind}.{letter}", p, slice(j * d, (j + 1) * d))
                else:
                    add(f"{layer}.{kind}.O", p)
            elif module in ("linear1", "linear2"):
                add(f"{layer}.ffn", p)
            else:
                add(f"{layer}.norms", p)
        else:                                             # the stacks' final norms
            add("final norms", p)
    return blocks


class BlockHessian:
    """H_bb v for the blocks of one model and batch.

    forward over reverse (the default, the JAX autodiff cookbook's way): H v is the tangent along
    v of the gradient g(theta). `autograd.functional.linearize` runs the loss and its gradient
    once with the parameters as dual tensors and records every tangent step (each op's jvp rule
    with what the op saved); each product then takes those steps again along v, and nothing
    else. reverse over reverse (`--hvp reverse-over-reverse`): the gradient is built once with
    create_graph=True and each product is one more backward through it (the gradient of <g, v>).
    Both reuse the one batch's work across products; the tangent steps measured faster (see
    the module's docstring)."""

    def __init__(self, model, batch, mode="forward-over-reverse"):
        self.model, self.batch, self.mode = model, batch, mode
        self.params = list(model.parameters())
        self.slots = [(m, name) for m in model.modules() for name, q in m._parameters.items() if q is not None]
        if mode == "reverse-over-reverse":
            loss = loss_of(model, batch)
            self.grads = autograd.grad(loss, self.params, create_graph=True)
        else:
            loss, self.gradient_tangent = autograd.functional.linearize(self._gradient, *self.params)
            loss = loss[0]
        self.loss = float(loss.item())
        self.products = 0

    def size(self, block):
        return sum(p.data[index].size for p, index in block)

    def hvp(self, block, v):
        """H_bb v for the flat vector v over `block`'s entries: v placed into the block's
        entries (zeros elsewhere), H v by `mode`, read back on the block."""
        vs = [np.zeros_like(p.data) for p in self.params]
        where = {id(p): i for i, p in enumerate(self.params)}
        offset = 0
        for p, index in block:
            n = p.data[index].size
            vs[where[id(p)]][index] = v[offset:offset + n].reshape(p.data[index].shape)
            offset += n
        if self.mode == "reverse-over-reverse":
            hv = [None if g is None else g.numpy() for g in autograd.grad(
                list(self.grads), self.params, [Tensor(x) for x in vs], retain_graph=True, allow_unused=True)]
        else:
            hv = [t.numpy() for t in self.gradient_tangent(*map(Tensor, vs))[1:]]
        self.products += 1
        return np.concatenate([(np.zeros_like(p.data) if hv[where[id(p)]] is None else hv[where[id(p)]])[index]
                               .reshape(-1) for p, index in block])

    def _gradient(self, *params):
        """(the loss, its gradient w.r.t. every parameter) with the model computing on `params`."""
        saved = [m._parameters[name] for m, name in self.slots]
        by_id = {id(p): q for p, q in zip(self.params, params)}
        try:
            for m, name in self.slots:
                m._parameters[name] = by_id[id(m._parameters[name])]
            loss = loss_of(self.model, self.batch)
            grads = autograd.grad(loss, list(params), allow_unused=True)
        finally:
            for (m, name), p in zip(self.slots, saved):
                m._parameters[name] = p
        return (loss,) + tuple(Tensor(np.zeros_like(p.data)) if g is None else g for p, g in zip(params, grads))


def top_eigenvalue(hvp, n, iters, rng):
    """The eigenvalue of largest magnitude by power iteration (Rayleigh quotient of the last iterate)."""
    v = rng.standard_normal(n)
    v /= np.linalg.norm(v)
    value = 0.0
    for _ in range(iters):
        w = hvp(v)
        value = float(v @ w)
        norm = np.linalg.norm(w)
        if norm == 0:
            return 0.0
        v = w / norm
    return value


def lanczos(hvp, n, steps, rng):
    """Ritz values and weights (squared first components of the Ritz vectors) of `steps`
    Lanczos steps from a Rademacher probe, with full reorthogonalisation (steps is small)."""
    v = rng.choice([-1.0, 1.0], size=n) / math.sqrt(n)
    basis, alphas, betas = [v], [], []
    for k in range(min(steps, n)):
        w = hvp(basis[-1])
        alpha = float(w @ basis[-1])
        w = w - alpha * basis[-1] - (betas[-1] * basis[-2] if betas else 0)
        for b in basis:                       # reorthogonalise: keeps the Ritz values honest
            w -= (w @ b) * b
        alphas.append(alpha)
        beta = float(np.linalg.norm(w))
        if beta < 1e-10 or k == min(steps, n) - 1:
            break
        betas.append(beta)
        basis.append(w / beta)
    tridiagonal = np.diag(alphas) + np.diag(betas[:len(alphas) - 1], 1) + np.diag(betas[:len(alphas) - 1], -1)
    values, vectors = np.linalg.eigh(tridiagonal)
    return values, vectors[0] ** 2


def density(ritz, grid, width):
    """The spectral density on `grid`: each probe's Ritz values smoothed by Gaussians of `width`,
    weighted, averaged over probes, normalised to integrate to 1."""
    total = np.zeros_like(grid)
    for values, weights in ritz:
        total += (weights[:, None] * np.exp(-((grid[None, :] - values[:, None]) / width) ** 2 / 2)).sum(axis=0)
    total /= total.sum() * (grid[1] - grid[0])
    return total


def js_distance(p, q):
    """The Jensen-Shannon distance (sqrt of the divergence, base 2: 0 same, 1 disjoint) of two densities on one grid."""
    p, q = p / p.sum(), q / q.sum()
    m = (p + q) / 2

    def kl(a, b):
        keep = (a > 0) & (b > 0)          # b >= a / 2: b is 0 only where a/2 underflows (a negligible term)
        return float((a[keep] * np.log2(a[keep] / b[keep])).sum())
    return math.sqrt(max(0.0, (kl(p, m) + kl(q, m)) / 2))


def analyse(model, batch, args):
    rng = np.random.default_rng(args.seed)
    hessian = BlockHessian(model, batch, args.hvp)
    blocks = blocks_of(model)
    results = {}
    for name, block in blocks.items():
        n = hessian.size(block)
        product = lambda v, block=block: hessian.hvp(block, v)  # noqa: E731
        top = top_eigenvalue(product, n, args.power_iters, rng)
        ritz = [lanczos(product, n, args.lanczos, rng) for _ in range(args.probes)]
        results[name] = {"parameters": n, "top_eigenvalue": top, "ritz": ritz}
        print(f"{name:>16}: {n:6d} parameters, top eigenvalue {top:+.4e}")
    # one evenly spaced grid around every block's spectrum, symmetric about 0 (curvature of both signs)
    extent = max(abs(v) for r in results.values() for values, _ in r["ritz"] for v in values) * 1.1 or 1.0
    grid = np.linspace(-extent, extent, 801)
    width = extent / 100
    densities = {name: density(r["ritz"], grid, width) for name, r in results.items()}
    names = list(results)
    distances = np.array([[js_distance(densities[a], densities[b]) for b in names] for a in names])
    upper = distances[np.triu_indices(len(names), 1)]
    print(f"loss {hessian.loss:.4f}; {hessian.products} Hessian-vector products ({hessian.mode}); block heterogeneity "
          f"(mean Jensen-Shannon distance between block spectra) {upper.mean():.3f}")
    return hessian, results, grid, densities, names, distances


def write_outputs(out, hessian, results, grid, densities, names, distances, plots=True):
    os.makedirs(out, exist_ok=True)
    summary = {"loss": hessian.loss, "hessian_vector_products": hessian.products,
               "blocks": {n: {"parameters": r["parameters"], "top_eigenvalue": r["top_eigenvalue"],
                              "ritz_values": [v.tolist() for v, _ in r["ritz"]]} for n, r in results.items()},
               "js_distances": {"names": names, "matrix": distances.tolist()},
               "block_heterogeneity": float(distances[np.triu_indices(len(names), 1)].mean()) if len(names) > 1 else 0.0}
    with open(os.path.join(out, "hessian.json"), "w") as f:
        json.dump(summary, f, indent=1)
    if not plots:
        return summary
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, len(names) * 0.45), 3.6))
    tops = [results[n]["top_eigenvalue"] for n in names]
    ax.bar(range(len(names)), np.abs(tops), color=["C3" if t < 0 else "C0" for t in tops])
    ax.set_yscale("log")
    ax.set_xticks(range(len(names)), names, rotation=70, fontsize=7)
    ax.set_ylabel("|top eigenvalue| of H_bb (red: negative)")
    ax.set_title("Curvature by parameter block")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "top_eigenvalues.png"), dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    for name in names:
        ax.semilogy(grid, densities[name] + 1e-12, lw=0.8, label=name)
    ax.set_ylim(1e-6, None)
    ax.set_xlabel("eigenvalue")
    ax.set_ylabel("density (stochastic Lanczos)")
    ax.set_title("Hessian spectrum of each block")
    ax.legend(fontsize=5, ncol=3)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "spectra.png"), dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 5))
    image = ax.imshow(distances, vmin=0, vmax=1, cmap="magma")
    ax.set_xticks(range(len(names)), names, rotation=90, fontsize=6)
    ax.set_yticks(range(len(names)), names, fontsize=6)
    ax.set_title("Block heterogeneity: JS distance between spectra")
    fig.colorbar(image)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "block_distances.png"), dpi=120)
    plt.close(fig)
    return summary


def main(argv=None):
    args = parse_args(argv)
    start = time.perf_counter()
    model, batch = model_and_batch(args)
    hessian, results, grid, densities, names, distances = analyse(model, batch, args)
    write_outputs(args.out, hessian, results, grid, densities, names, distances, plots=not args.no_plots)
    print(f"wrote {args.out}/hessian.json" + ("" if args.no_plots else ", top_eigenvalues.png, spectra.png, "
          "block_distances.png") + f" in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
