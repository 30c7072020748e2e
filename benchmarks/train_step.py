"""One training step (forward, cross-entropy, backward, Adam) of Seq2SeqTransformer, ours beside
PyTorch eager, torch.compile and JAX jit in one run, float32.

    python benchmarks/train_step.py --config tiny|base|paper|gpt_char [--steps N] [--device cpu|cuda|test]
                                    [--threads N] [--ours-threads N] [--defaults] [--no-memory] [--no-graphed]
                                    [--no-recorded]
                                    [--compile-mode default|reduce-overhead|max-autotune-no-cudagraphs|best]
                                    [--no-compile] [--no-jax]

On cuda (and on "test", its stand-in without a GPU) ours runs twice: eager and as a captured CUDA
graph (npformer.cuda.graphed: one capture, then one replay per step), beside torch's CUDA eager.
On cpu ours runs twice too: eager and as a recorded step (npformer.recorded: its forward and
backward recorded once, then replayed; the optimizer step after it, eagerly).
Prints the median ms/step of each (steps alternate between the runners), the ratio ours/torch,
tokens/s (the tokens a step reads: source + target, or a causal LM's one sequence),
achieved GFLOP/s and the time as a multiple of the GEMM floor (below), and the peak
resident host memory of each side measured in a separate process: in all, and above what
the process holds once its libraries are imported (torch's alone are ~190 MB).
Configurations: docs/benchmark_configurations.md.
Threads: torch.set_num_threads(--threads), numpy's BLAS on --threads threads (threadpoolctl) and
npformer.set_num_threads(--ours-threads, default --threads; above 1 npformer splits the GEMMs and
numpy's BLAS runs one thread; --ours-threads 1 leaves the GEMMs to BLAS's --threads threads).
--defaults: each library's default threads instead (npformer's set_num_threads default, torch's
intra-op default, BLAS's every core, XLA's).
gpt_char is a CausalLM step (AdamW) against its torch.nn twin (npformer.interop.torch_model_classes).

The GEMM floor: the step's GEMM FLOPs (training_flops) at the measured float32 GEMM rate
(gemm_rate: numpy's BLAS on --threads threads, or cupy on cuda), the time no step can beat at
that rate; each runner's time is printed as a multiple of it. On cpu, the GEMMs at the step's shapes
beside it (shape_floor): each matrix product of one step of ours timed alone, its operands laid out
as the step's, on the rate's BLAS threads; small and thin products run below the square rate.
Peers, each timed in the same alternation as ours and torch eager (their compilation in untimed
warm-up steps):
- torch.compile of the torch twin's whole step (forward, loss, zero_grad, backward, optimizer
  step) with --compile-mode (best: each mode, the fastest reported); Dynamo splits the step at
  the calls it does not trace (zero_grad, backward; AOTAutograd compiles the backward with the
  forward graph). A mode whose compilation fails here (e.g. no C++ compiler for inductor's CPU
  code) is skipped with the reason.
- JAX (optional: `pip install -e .[jax]`, its CPU build; not in the dev extra, skipped when jax
  is not importable; device cpu only): a pure-jax twin (jax_loss: the same model, dropout sites and
  Adam/AdamW arithmetic as ours), its whole step in one jax.jit, from ours' initial weights: its
  loss without dropout must equal ours' to float32 rounding (checked and printed; the script
  stops otherwise). XLA's CPU threads (import_jax): --threads 1 sets
  XLA_FLAGS=--xla_cpu_multi_thread_eigen=false before jax is imported (Eigen's intra-op threads;
  with jax 0.10 its products still ran on every CPU with the flag alone), and for fewer threads
  than this process's CPUs jax's CPU client, which sizes its thread pool by the CPUs the process
  may run on, is made under an affinity of --threads CPUs, restored after (its pool threads stay
  on those CPUs): that is what held jax 0.10's products to one thread. intra_op_parallelism_threads
  is a TensorFlow session option, no XLA flag: XLA_FLAGS starting with it is read as a flags file
  (an error), and after a flag it ends the flags read, silently.
Each runner's CPU time per wall time in its timed steps (time.process_time: every thread of the
process) shows the cores it kept busy; the ratio npformer / the fastest peer closes the report.
"""
import argparse
import functools
import itertools
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

CONFIGS = {  # vocab, d_model, heads, d_ff, layers (enc = dec), seq, batch
    "tiny": dict(vocab=20, d_model=32, nhead=4, d_ff=64, layers=2, seq=6, batch=64),
    "base": dict(vocab=1000, d_model=256, nhead=8, d_ff=1024, layers=4, seq=64, batch=32),
    "paper": dict(vocab=8000, d_model=512, nhead=8, d_ff=2048, layers=6, seq=128, batch=16),
    # a character-level GPT (CausalLM, pre-LN, GELU, learned positions, AdamW): demos/gpt_char.py's shape
    "gpt_char": dict(vocab=100, d_model=128, nhead=4, d_ff=512, layers=4, seq=64, batch=32, causal=True),
}
DEFAULT_STEPS = {"tiny": 200, "base": 12, "paper": 5, "gpt_char": 40}
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")
GEMM_SIZE, GEMM_WARMUPS, GEMM_REPEATS = 1024, 2, 5  # gemm_rate: the best of 5 n x n products after 2
SHAPE_REPEATS = 3  # shape_floor: each of the step's products, the best of 3 after 1


def make_batch(cfg, seed=0):
    rng = np.random.default_rng(seed)
    shape = (cfg["batch"], cfg["seq"])
    return (rng.integers(3, cfg["vocab"], shape), rng.integers(3, cfg["vocab"], shape),
            rng.integers(3, cfg["vocab"], shape))


def training_flops(cfg):
    """GEMM FLOPs of forward + backward (3x forward) for one step: every matrix product of the
    step's linears and attention (2 m k n each); equal to the products ours' step runs (counted on
    the "test" device, tests/benchmarks) and to torch's FlopCounterMode on the twin. Not counted:
    the bias gradients' 1^T dy (matrix-vector, under 1% of the step)."""
    B, T, d, ff, L, V = cfg["batch"], cfg["seq"], cfg["d_model"], cfg["d_ff"], cfg["layers"], cfg["vocab"]
    n = B * T
    attention = 2 * 2 * B * T * T * d  # QK^T and PV
    enc = 2 * n * d * 3 * d + 2 * n * d * d + attention + 2 * 2 * n * d * ff
    if cfg.get("causal"):
        return 3 * (L * enc + 2 * n * d * V)
    dec = enc + 2 * n * d * d + 2 * n * d * 2 * d + 2 * n * d * d + attention  # + cross-attention
    return 3 * (L * (enc + dec) + 2 * n * d * V)


def step_products(cfg):
    """(products, gemv FLOPs) of one step of ours with cfg (its dropout included): every matrix
    product, in order, as the ((shape, strides), (shape, strides)) of its two operands, and the
    FLOPs of its matrix-vector products (the bias gradients' 1^T dy, no GEMM). Seen on the "test"
    device, whose arrays see every product and which runs the references: each product whole
    (the CPU runs the same products, split in blocks on its threads)."""
    from npformer.runtime import testdevice
    products, gemv = [], 0
    ufunc = testdevice.TestDeviceArray.__array_ufunc__

    def seeing(self, op, method, *inputs, **kwargs):
        nonlocal gemv
        if op is np.matmul and method == "__call__":
            a, b = inputs
            if a.ndim > 1 and b.ndim > 1:  # (..., m, k) @ (..., k, n)
                products.append(((a.shape, a.strides), (b.shape, b.strides)))
            else:                          # a vector and a matrix
                gemv += 2 * a.size * (b.shape[-1] if b.ndim > 1 else 1)
        return ufunc(self, op, method, *inputs, **kwargs)

    ours = Ours(cfg, "test")
    testdevice.TestDeviceArray.__array_ufunc__ = seeing
    try:
        ours.step()
    finally:
        testdevice.TestDeviceArray.__array_ufunc__ = ufunc
    return products, gemv


def product_flops(product):
    """2 m k n for each matrix of the (broadcast) batch of a product of step_products."""
    (a_shape, _), (b_shape, _) = product
    batch = np.broadcast_shapes(a_shape[:-2], b_shape[:-2])
    return 2 * math.prod(batch) * a_shape[-2] * a_shape[-1] * b_shape[-1]


def laid_out(shape, strides, rng):
    """A float32 array of `shape` with exactly `strides` (bytes, >= 0; 0 for a broadcast axis), over
    a buffer of random values just long enough: an operand laid out in memory as the step's was
    (a transposed view, a head of a packed projection, a broadcast mask)."""
    extent = sum((n - 1) * s for n, s in zip(shape, strides)) // 4 + 1 if all(shape) else 0
    buffer = rng.standard_normal(extent).astype(np.float32)
    return np.lib.stride_tricks.as_strided(buffer, shape, strides)


def shape_floor(products, threads):
    """(seconds, FLOPs): the step's products each timed alone, as it lays out its operands, on
    numpy's BLAS with `threads` threads (threadpoolctl's limit), the best of SHAPE_REPEATS after
    one untimed: what the GEMMs of these shapes cost before any other work of the step (small and
    thin products run below the square GEMM rate of the floor)."""
    from threadpoolctl import threadpool_limits
    rng = np.random.default_rng(0)
    best = {}  # a layout seen before: its time again
    with threadpool_limits(limits=threads, user_api="blas"):
        for (a_layout, b_layout) in products:
            key = (a_layout, b_layout)
            if key in best:
                continue
            a, b = laid_out(*a_layout, rng), laid_out(*b_layout, rng)
            best[key] = best_time(lambda: a @ b, 1, SHAPE_REPEATS)
    return sum(best[key] for key in products), sum(map(product_flops, products))


def tokens_per_step(cfg):
    """The tokens one step reads: source + target (encoder-decoder), the one sequence (causal LM)."""
    sequences = 1 if cfg.get("causal") else 2
    return sequences * cfg["batch"] * cfg["seq"]


def causal_config(cfg):
    """The CausalLM config of a causal benchmark configuration (ours and the torch twin's)."""
    return dict(vocab_size=cfg["vocab"], d_model=cfg["d_model"], nhead=cfg["nhead"], num_layers=cfg["layers"],
                dim_feedforward=cfg["d_ff"], dropout=cfg.get("dropout", 0.1), max_len=cfg["seq"])


def limit_blas_threads(n):
    """numpy's BLAS on `n` threads from here on (threadpoolctl; nothing without it): the GEMM
    rate's and ours' products when npformer leaves them to BLAS (--ours-threads 1), as many as
    torch's threads (BLAS's own default is every core)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return
    threadpool_limits(limits=n, user_api="blas")


def best_time(fn, warmups, repeats):
    """The least wall time (seconds) of `repeats` timed calls of fn after `warmups` untimed ones."""
    for _ in range(warmups):
        fn()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def gemm_rate(device):
    """(GFLOP/s, how): the float32 GEMM rate of the array library of `device` on this machine, the
    best of GEMM_REPEATS timed products a @ a of GEMM_SIZE x GEMM_SIZE matrices (2 n^3 FLOPs each)
    after GEMM_WARMUPS untimed ones, on the host with numpy's BLAS threads as they are; `how` says
    how it was measured: the threads, the BLAS library and the OpenBLAS core type in use, and
    whether OPENBLAS_CORETYPE is set."""
    import npformer  # noqa: F401  (its runtime registers the "test" device)
    from autograd import backend
    xp = backend.module_for(device)
    n = GEMM_SIZE
    a = xp.ones((n, n), dtype=xp.float32)
    how = "cupy on the GPU" if device == "cuda" else f"numpy's BLAS: {blas_info()}"

    def product():
        a @ a
        if device == "cuda":
            xp.cuda.Stream.null.synchronize()

    best = best_time(product, GEMM_WARMUPS, GEMM_REPEATS)
    coretype = os.environ.get("OPENBLAS_CORETYPE")
    how = (f"float32 {n} x {n} @ {n} x {n}, best of {GEMM_REPEATS} after {GEMM_WARMUPS} untimed, {how}"
           + ("" if device == "cuda" else
              f"; OPENBLAS_CORETYPE {'set to ' + coretype if coretype else 'not set'}"))
    return 2 * n ** 3 / best / 1e9, how


class Ours:
    def __init__(self, cfg, device, graphed=False, recorded=False):
        """graphed: the step as a CUDA graph (npformer.cuda.graphed); recorded: its forward and
        backward as a recorded CPU step (npformer.recorded), the optimizer step after it."""
        import npformer
        from npformer import models, optim
        import npformer.functional as F
        npformer.manual_seed(0)
        self.F, self.cfg, self.device = F, cfg, device
        from autograd import backend
        self.batch = [backend.to_device(a, device) for a in make_batch(cfg)]
        if cfg.get("causal"):
            self.model = models.CausalLM(**causal_config(cfg)).to(device).train()
            self.optimizer = optim.AdamW(self.model.parameters(), lr=1e-3, weight_decay=0.1)
        else:
            self.model = models.Seq2SeqTransformer(
                cfg["vocab"], cfg["vocab"], d_model=cfg["d_model"], nhead=cfg["nhead"],
                num_encoder_layers=cfg["layers"], num_decoder_layers=cfg["layers"],
                dim_feedforward=cfg["d_ff"], dropout=cfg.get("dropout", 0.1), max_len=max(cfg["seq"], 16)).to(device)
            self.model.train()
            self.optimizer = optim.Adam(self.model.parameters(), lr=1e-4)
        self.train = npformer.cuda.graphed(self.train_step, device) if graphed else self.train_step
        if recorded:
            self.recorded, self.train = npformer.recorded(self.loss, self.model), self.recorded_step

    def loss(self, src, tgt_in, tgt_out):
        # a causal LM reads tgt_in and predicts tgt_out; the encoder-decoder also reads src
        logits = self.model(tgt_in) if self.cfg.get("causal") else self.model(src, tgt_in)
        return self.F.cross_entropy(logits.reshape(-1, self.cfg["vocab"]), tgt_out.reshape(-1))

    def loss_without_dropout(self):
        """The loss of the batch at the current weights, the model in eval mode (no dropout), no graph."""
        import npformer
        self.model.eval()
        try:
            with npformer.no_grad():
                return self.loss(*self.batch).item()
        finally:
            self.model.train()

    def train_step(self, src, tgt_in, tgt_out):
        loss = self.loss(src, tgt_in, tgt_out)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return loss

    def recorded_step(self, src, tgt_in, tgt_out):
        self.optimizer.zero_grad()
        loss = self.recorded(src, tgt_in, tgt_out)
        self.optimizer.step()
        return loss

    def step(self):
        return self.train(*self.batch).item()  # reading the loss synchronises a GPU


class Torch:
    def __init__(self, cfg, device):
        import torch
        from torch import nn
        torch.manual_seed(0)
        self.torch, self.cfg = torch, cfg
        self.device = "cuda" if device == "cuda" else "cpu"  # "test" stands in for a GPU: torch on the CPU
        self.batch = [torch.as_tensor(a).to(self.device) for a in make_batch(cfg)]
        if cfg.get("causal"):  # the torch.nn composition npformer.interop.to_torch converts a CausalLM to
            from npformer.interop import torch_model_classes
            self.model = torch_model_classes()["CausalLM"](**causal_config(cfg)).to(self.device).train()
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3, weight_decay=0.1)
            return
        d, V = cfg["d_model"], cfg["vocab"]

        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.src_embed, self.tgt_embed = nn.Embedding(V, d), nn.Embedding(V, d)
                self.transformer = nn.Transformer(d, cfg["nhead"], cfg["layers"], cfg["layers"],
                                                  cfg["d_ff"], dropout=cfg.get("dropout", 0.1), batch_first=True)
                self.generator = nn.Linear(d, V)
                self.dropout = nn.Dropout(cfg.get("dropout", 0.1))
                pos = torch.arange(max(cfg["seq"], 16), dtype=torch.float64)[:, None]
                div = torch.exp(torch.arange(0, d, 2, dtype=torch.float64) * (-math.log(10000.0) / d))
                pe = torch.zeros(len(pos), d, dtype=torch.float64)
                pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
                self.register_buffer("pe", pe.float(), persistent=False)

            def embed(self, embedding, ids):
                return self.dropout(embedding(ids) * math.sqrt(d) + self.pe[: ids.shape[1]])

            def forward(self, src, tgt):
                mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1], device=tgt.device)
                out = self.transformer(self.embed(self.src_embed, src), self.embed(self.tgt_embed, tgt),
                                       tgt_mask=mask, tgt_is_causal=True)
                return self.generator(out)

        self.model = Model().to(self.device).train()
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-4)

    def train_step(self, src, tgt_in, tgt_out):
        logits = self.model(tgt_in) if self.cfg.get("causal") else self.model(src, tgt_in)
        loss = self.torch.nn.functional.cross_entropy(logits.reshape(-1, self.cfg["vocab"]), tgt_out.reshape(-1))
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return loss

    def step(self):
        return self.train_step(*self.batch).item()


class TorchCompiled(Torch):
    """The torch twin (the same initial weights: torch.manual_seed(0)) with its whole train_step
    under torch.compile(mode=mode); the first calls compile (untimed warm-up)."""

    def __init__(self, cfg, device, mode):
        super().__init__(cfg, device)
        self.compiled = self.torch.compile(self.train_step, mode=mode)

    def step(self):
        return self.compiled(*self.batch).item()


def dynamo_counts():
    """(graphs compiled, graph breaks) so far in this process, from Dynamo's counters."""
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def compile_failure(error):
    """Why torch.compile could not run here: the error's first line, and the likely cause when no
    C++ compiler is to be found (inductor compiles its CPU code with one)."""
    lines = str(error).strip().splitlines()
    reason = f"{type(error).__name__}: {lines[0][:300] if lines else ''}"
    compilers = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "c++", "clang++"]
    if not any(shutil.which(cxx) for cxx in compilers):
        reason += f" (no C++ compiler: {' / '.join(compilers)} not found)"
    return f"skipped: compilation failed on this machine: {reason}"


def import_jax(threads, defaults):
    """(jax or None, what was done): jax imported with XLA's CPU threads limited to `threads`
    (unless `defaults`): XLA_FLAGS --xla_cpu_multi_thread_eigen=false for one thread, set before
    the import, and jax's CPU client made under an affinity of `threads` CPUs when this process
    may run on more (XLA sizes the client's thread pool by them; the affinity is restored after)."""
    if "jax" in sys.modules:
        return None, "skipped: jax was imported before its threads could be set"
    done = []
    if not defaults and threads == 1:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false").strip()
        done.append("XLA_FLAGS=--xla_cpu_multi_thread_eigen=false set before the import")
    try:
        import jax
    except ImportError as error:
        return None, f"skipped: jax is not importable ({error}; `pip install -e .[jax]`: its CPU build)"
    jax.config.update("jax_platforms", "cpu")
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    if not defaults and cpus is not None and threads < len(cpus):
        os.sched_setaffinity(0, sorted(cpus)[:threads])
        try:
            jax.devices("cpu")  # makes the CPU client and its thread pool
        finally:
            os.sched_setaffinity(0, cpus)
        done.append(f"CPU client made under an affinity of {threads} of the {len(cpus)} CPUs")
    count = os.cpu_count() if cpus is None else len(cpus)
    return jax, "; ".join(done) or f"XLA's default threads (one per CPU: {count})"


def jax_loss(cfg, jax, pe=None):
    """loss(params, batch, key, train): the configuration's model and mean cross-entropy in jax
    alone, the same math as ours, params named as ours' state_dict. Seq2SeqTransformer: post-LN,
    ReLU, embeddings times sqrt(d_model) plus the sinusoidal table `pe` (max_len, d_model), final
    norms; CausalLM: pre-LN, exact GELU, learned positions, final norm, lm_head. With train,
    dropout (cfg["dropout"]) at ours' sites: embeddings, attention probabilities, the feed-forward
    activation, every sublayer's output; each site draws from its own fold of `key`."""
    jnp = jax.numpy
    d, nhead, vocab, rate = cfg["d_model"], cfg["nhead"], cfg["vocab"], cfg["dropout"]
    causal_lm = bool(cfg.get("causal"))

    def loss(params, batch, key, train):
        sites = itertools.count()

        def dropout(x):
            if not train or rate == 0:
                return x
            keep = jax.random.bernoulli(jax.random.fold_in(key, next(sites)), 1.0 - rate, x.shape)
            return jnp.where(keep, x / (1.0 - rate), 0.0)

        def linear(x, name, bias=True):
            y = x @ params[name + ".weight"].T
            return y + params[name + ".bias"] if bias else y

        def layer_norm(x, name):
            centred = x - x.mean(-1, keepdims=True)
            rstd = 1.0 / jnp.sqrt((centred * centred).mean(-1, keepdims=True) + 1e-5)  # ours' layer_norm_eps
            return centred * rstd * params[name + ".weight"] + params[name + ".bias"]

        def split_heads(x):                                   # (B, T, d) -> (B, nhead, T, d / nhead)
            return x.reshape(x.shape[0], x.shape[1], nhead, d // nhead).transpose(0, 2, 1, 3)

        def attention(x, name, memory=None, causal=False):
            w, b = params[name + ".in_proj_weight"], params[name + ".in_proj_bias"]
            if memory is None:  # q, k, v of x in one product
                q, k, v = jnp.split(x @ w.T + b, 3, axis=-1)
            else:               # q of x, k and v of the encoder's memory
                q = x @ w[:d].T + b[:d]
                k, v = jnp.split(memory @ w[d:].T + b[d:], 2, axis=-1)
            q, k, v = split_heads(q), split_heads(k), split_heads(v)
            scores = q @ k.swapaxes(-1, -2) / math.sqrt(d // nhead)              # (B, nhead, T, S)
            if causal:
                later = jnp.triu(jnp.ones(scores.shape[-2:], dtype=bool), 1)  # key after query
                scores = jnp.where(later, -jnp.inf, scores)
            heads = dropout(jax.nn.softmax(scores, axis=-1)) @ v                 # (B, nhead, T, d / nhead)
            merged = heads.transpose(0, 2, 1, 3).reshape(x.shape[0], x.shape[1], d)
            return linear(merged, name + ".out_proj")

        def feed_forward(x, name):
            h = linear(x, name + ".linear1")
            h = jax.nn.gelu(h, approximate=False) if causal_lm else jax.nn.relu(h)
            return linear(dropout(h), name + ".linear2")

        def cross_entropy(logits, target):
            logits = logits.reshape(-1, vocab)                                    # (N, V)
            picked = jnp.take_along_axis(logits, target.reshape(-1, 1), axis=1)[:, 0]
            return (jax.nn.logsumexp(logits, axis=1) - picked).mean()

        src, tgt_in, tgt_out = batch
        if causal_lm:  # pre-LN: x + dropout(sublayer(norm(x)))
            x = dropout(params["tok_embed.weight"][tgt_in] + params["pos_embed.weight"][: tgt_in.shape[1]])
            for i in range(cfg["layers"]):
                layer = f"encoder.layers.{i}"
                x = x + dropout(attention(layer_norm(x, layer + ".norm1"), layer + ".self_attn", causal=True))
                x = x + dropout(feed_forward(layer_norm(x, layer + ".norm2"), layer))
            return cross_entropy(linear(layer_norm(x, "encoder.norm"), "lm_head", bias=False), tgt_out)

        def embed(table, ids):
            return dropout(params[table][ids] * math.sqrt(d) + pe[: ids.shape[1]])

        # post-LN: norm(x + dropout(sublayer(x)))
        memory = embed("src_embed.weight", src)
        for i in range(cfg["layers"]):
            layer = f"transformer.encoder.layers.{i}"
            memory = layer_norm(memory + dropout(attention(memory, layer + ".self_attn")), layer + ".norm1")
            memory = layer_norm(memory + dropout(feed_forward(memory, layer)), layer + ".norm2")
        memory = layer_norm(memory, "transformer.encoder.norm")
        x = embed("tgt_embed.weight", tgt_in)
        for i in range(cfg["layers"]):
            layer = f"transformer.decoder.layers.{i}"
            x = layer_norm(x + dropout(attention(x, layer + ".self_attn", causal=True)), layer + ".norm1")
            x = layer_norm(x + dropout(attention(x, layer + ".multihead_attn", memory)), layer + ".norm2")
            x = layer_norm(x + dropout(feed_forward(x, layer)), layer + ".norm3")
        return cross_entropy(linear(layer_norm(x, "transformer.decoder.norm"), "generator"), tgt_out)

    return loss


def jax_adam(jax, group, decoupled):
    """update(params, grads, m, v, t) -> (params, m, v): step t of ours' Adam (AdamW when
    `decoupled`) with the hyperparameters of the parameter group `group`, torch's arithmetic."""
    jnp = jax.numpy
    lr, (beta1, beta2), eps, weight_decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]

    def update(params, grads, m, v, t):
        step_size = lr / (1.0 - beta1 ** t)
        root = jnp.sqrt(1.0 - beta2 ** t)
        new = {}
        for name, p in params.items():
            g = grads[name]
            if decoupled:  # p *= 1 - lr wd, then Adam on the raw gradient
                p = p * (1.0 - lr * weight_decay)
            elif weight_decay:  # g = grad + wd p
                g = g + weight_decay * p
            # m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;  p -= lr / (1 - b1^t) m / (sqrt(v / (1 - b2^t)) + eps)
            m_new = beta1 * m[name] + (1.0 - beta1) * g
            v_new = beta2 * v[name] + (1.0 - beta2) * g * g
            new[name] = (p - step_size * m_new / (jnp.sqrt(v_new) / root + eps), m_new, v_new)
        return tuple({name: parts[i] for name, parts in new.items()} for i in range(3))

    return update


class Jax:
    """The pure-jax twin of the configuration (jax_loss) from ours' current (initial) weights and
    batch, its whole step (loss, gradients, ours' optimizer's update) one jax.jit call."""

    def __init__(self, cfg, ours, jax):
        jnp = jax.numpy
        self.jax = jax
        params = {name: jnp.asarray(np.array(value)) for name, value in ours.model.state_dict().items()}
        buffers = dict(ours.model.named_buffers())
        pe = jnp.asarray(np.array(buffers["positional.pe"])) if "positional.pe" in buffers else None
        self.batch = tuple(jnp.asarray(a.astype(np.int32)) for a in make_batch(cfg))
        self.loss = jax_loss(cfg, jax, pe)
        update = jax_adam(jax, ours.optimizer.param_groups[0], type(ours.optimizer).decoupled)

        def train_step(params, m, v, t, key, batch):
            key, dropout_key = jax.random.split(key)
            loss, grads = jax.value_and_grad(self.loss)(params, batch, dropout_key, True)
            t = t + 1.0
            params, m, v = update(params, grads, m, v, t)
            return params, m, v, t, key, loss

        self.train = jax.jit(train_step, donate_argnums=(0, 1, 2))
        m, v = ({name: jnp.zeros_like(p) for name, p in params.items()} for _ in range(2))  # distinct buffers
        self.state = (params, m, v, jnp.zeros((), jnp.float32), jax.random.key(0))

    def loss_without_dropout(self):
        evaluate = self.jax.jit(functools.partial(self.loss, train=False))
        return float(evaluate(self.state[0], self.batch, self.state[4]))

    def step(self):
        *self.state, loss = self.train(*self.state, self.batch)
        return float(loss)  # waits for the step


def jax_loss_tolerance(loss, cfg):
    """How far two float32 computations of the same loss may differ by rounding alone: a few
    float32 ulps per layer on its magnitude (every layer's sums and norms round once more)."""
    depth = cfg["layers"] * (1 if cfg.get("causal") else 2) + 1
    return 8 * depth * float(np.finfo(np.float32).eps) * max(abs(loss), 1.0)


def blas_libraries():
    """threadpoolctl's record of each of numpy's BLAS libraries now (library, version, core type,
    threads), or None without threadpoolctl."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return None
    return [i for i in threadpool_info() if i.get("user_api") == "blas"]


def blas_info():
    """numpy's BLAS now: library, version, the OpenBLAS core type in use (threadpoolctl's
    'architecture') and its threads."""
    libraries = blas_libraries()
    if libraries is None:
        return "threadpoolctl not installed (its threads, library and core type unknown)"
    return "; ".join(f"{i.get('internal_api')} {i.get('version')}, core type {i.get('architecture')}, "
                     f"threads {i.get('num_threads')}" for i in libraries)


def rss_mb(field="VmHWM"):
    """This process's peak (VmHWM) or current (VmRSS) resident memory from /proc/self/status on
    Linux (ru_maxrss would include the parent's resident memory at the fork that started this
    process); elsewhere ru_maxrss."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith(field + ":")) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_memory_mb(args, side, steps):
    """{"peak_mb", "imports_mb"}: the peak resident memory of a fresh process that builds one
    side and runs `steps` steps, and its resident memory once its libraries were imported."""
    cmd = [sys.executable, os.path.abspath(__file__), "--config", args.config, "--device", args.device,
           "--only", side, "--steps", str(steps), "--threads", str(args.threads),
           "--ours-threads", str(args.ours_threads), "--dropout", str(args.dropout)] + \
        (["--defaults"] if args.defaults else [])
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=CONFIGS, default="base")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--device", choices=["cpu", "cuda", "test"], default="cpu")
    parser.add_argument("--no-memory", action="store_true", help="skip the separate-process memory runs")
    parser.add_argument("--no-graphed", action="store_true", help="on cuda/test: skip the CUDA-graph runner")
    parser.add_argument("--dropout", type=float, default=0.1, help="dropout probability of both models")
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="torch's intra-op threads, XLA's, numpy's BLAS threads for the GEMM rate and, by "
                             "default, npformer's (default: every core)")
    parser.add_argument("--ours-threads", type=int,
                        help="npformer.set_num_threads (default --threads; 1: BLAS threads the GEMMs)")
    parser.add_argument("--defaults", action="store_true",
                        help="each library's default threads (--threads and --ours-threads are not applied)")
    parser.add_argument("--compile-mode", choices=COMPILE_MODES + ("best",), default="default",
                        help="torch.compile's mode for the torch twin's step (best: each mode, the fastest reported)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile peer")
    parser.add_argument("--no-jax", action="store_true", help="skip the JAX peer")
    parser.add_argument("--no-recorded", action="store_true", help="on cpu: skip the recorded-step runner")
    parser.add_argument("--only", choices=["ours", "graphed", "recorded", "torch"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")
    cfg = dict(CONFIGS[args.config], dropout=args.dropout)
    steps = args.steps or DEFAULT_STEPS[args.config]
    args.ours_threads = args.ours_threads or args.threads
    if not args.defaults:
        limit_blas_threads(args.threads)
    if not args.only:
        peak_rate, rate_how = gemm_rate(args.device)
        # the step's own products at their shapes, on the rate's BLAS threads (the step seen here may limit them)
        rate_threads = max((i["num_threads"] for i in blas_libraries() or ()), default=None)
        products = step_products(cfg)[0] if args.device == "cpu" and rate_threads else None
        at_shapes = shape_floor(products, rate_threads) if products else None
    import npformer
    if not args.defaults:
        npformer.set_num_threads(args.ours_threads)
    if args.only != "ours":  # the memory of our side is measured without torch loaded
        import torch
        if not args.defaults:
            torch.set_num_threads(args.threads)

    if args.only:  # a child process measuring one side's peak memory
        imports = rss_mb("VmRSS")
        runner = Torch(cfg, args.device) if args.only == "torch" else Ours(cfg, args.device, args.only == "graphed",
                                                                           args.only == "recorded")
        for _ in range(steps):
            runner.step()
        print(json.dumps({"peak_mb": rss_mb(), "imports_mb": imports}))
        return

    runners = {"ours": Ours(cfg, args.device)}
    if args.device != "cpu" and not args.no_graphed:
        runners["graphed"] = Ours(cfg, args.device, graphed=True)
    if args.device == "cpu" and not args.no_recorded:
        runners["recorded"] = Ours(cfg, args.device, recorded=True)
    runners["torch"] = Torch(cfg, args.device)
    skipped = {}  # runner -> why it was not timed
    if not args.no_compile:
        for mode in COMPILE_MODES if args.compile_mode == "best" else (args.compile_mode,):
            runners[f"torch.compile[{mode}]"] = TorchCompiled(cfg, args.device, mode)
    jax_threads = jax_check = None
    if not args.no_jax and args.device != "cpu":
        skipped["jax.jit"] = "skipped: the jax twin runs on jax's CPU backend, with --device cpu only"
    elif not args.no_jax:
        jax, jax_threads = import_jax(args.threads, args.defaults)
        if jax is None:
            skipped["jax.jit"] = jax_threads
        else:
            runners["jax.jit"] = Jax(cfg, runners["ours"], jax)  # before any step: ours' initial weights
            ours_loss, twin_loss = runners["ours"].loss_without_dropout(), runners["jax.jit"].loss_without_dropout()
            tolerance = jax_loss_tolerance(ours_loss, cfg)
            equal = abs(twin_loss - ours_loss) <= tolerance
            jax_check = (f"jax.jit check: the loss without dropout at ours' initial weights: jax {twin_loss:.7f}, "
                         f"ours {ours_loss:.7f}, |difference| {abs(twin_loss - ours_loss):.1e} "
                         f"{'<=' if equal else '>'} {tolerance:.1e} (float32 rounding): "
                         f"{'equal' if equal else 'DIFFERENT: the twin is not the same model'}")
            if not equal:
                sys.exit(jax_check)

    warmup = {}  # runner -> (seconds, steps, note)
    for name, runner in list(runners.items()):  # untimed: compilation, the graphed runner's capture
        warmup_steps = (3 if isinstance(runner, TorchCompiled) else 2 if name in ("graphed", "recorded", "jax.jit")
                        else 1)
        counts = dynamo_counts() if isinstance(runner, TorchCompiled) else None
        t0 = time.perf_counter()
        try:
            for _ in range(warmup_steps):
                runner.step()
        except Exception as error:  # a runner that cannot run here is reported, the others still run
            skipped[name] = compile_failure(error) if counts else f"could not run: {type(error).__name__}: {error}"
            del runners[name]
            continue
        note = ""
        if counts:
            graphs, breaks = (now - before for now, before in zip(dynamo_counts(), counts))
            note = f"; {graphs} graphs, {breaks} graph breaks"
        warmup[name] = (time.perf_counter() - t0, warmup_steps, note)
    times = {name: [] for name in runners}
    cpu_seconds = dict.fromkeys(runners, 0.0)  # the process's CPU time (every thread) in each runner's steps
    for _ in range(steps):
        for name, runner in runners.items():
            cpu0 = time.process_time()
            t0 = time.perf_counter()
            runner.step()
            times[name].append(time.perf_counter() - t0)
            cpu_seconds[name] += time.process_time() - cpu0

    flops = training_flops(cfg)
    floor = flops / (peak_rate * 1e9)
    tokens = tokens_per_step(cfg)
    print(f"config {args.config} {CONFIGS[args.config]}  dropout {args.dropout}  device {args.device}  steps {steps}")
    print(f"numpy BLAS: {blas_info()}   OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE')}  "
          f"OPENBLAS_L2_SIZE={os.environ.get('OPENBLAS_L2_SIZE')}  load average {os.getloadavg()[0]:.2f}")
    print(f"threads: npformer {npformer.get_num_threads()}, torch {torch.get_num_threads()}"
          + (f", jax: {jax_threads}" if "jax.jit" in runners else ""))
    print("CPU time / wall time in the timed steps (every thread of the process, a library's spinning idle ones "
          "too): " + ", ".join(f"{name} {cpu_seconds[name] / sum(times[name]):.2f}" for name in runners))
    print(f"measured GEMM rate: {peak_rate:.1f} GFLOP/s ({rate_how})")
    print(f"GEMM floor: {floor * 1e3:.3f} ms/step = {flops} GEMM FLOPs per step (training_flops) / "
          f"{peak_rate:.1f} GFLOP/s")
    if at_shapes:
        seconds, counted = at_shapes
        print(f"GEMMs at the step's shapes: {seconds * 1e3:.3f} ms/step = {seconds / floor:.2f}x the GEMM floor: "
              f"its {len(products)} products ({counted} FLOPs) at {counted / seconds / 1e9:.1f} GFLOP/s, each alone, "
              f"laid out as ours', best of {SHAPE_REPEATS} after 1 untimed, BLAS threads {rate_threads} (the rate's)")
    for name, (seconds, warmup_steps, note) in warmup.items():
        if name not in ("ours", "torch"):
            print(f"{name}: {warmup_steps} untimed warm-up steps in {seconds:.1f} s{note}")
    if jax_check:
        print(jax_check)
    median = {name: statistics.median(times[name]) for name in runners}
    width = max(map(len, list(runners) + list(skipped)))
    for name in runners:
        gflops = flops / median[name] / 1e9
        print(f"{name:>{width}}: {median[name] * 1e3:9.1f} ms/step  {tokens / median[name]:9.0f} tokens/s  "
              f"{gflops:6.1f} GFLOP/s  {median[name] / floor:7.1f}x the GEMM floor")
    for name, why in skipped.items():
        print(f"{name:>{width}}: {why}")
    print(f"ratio ours/torch: {median['ours'] / median['torch']:.2f}x")
    for ours in ("graphed", "recorded"):
        if ours in median:
            print(f"ratio {ours}/torch: {median[ours] / median['torch']:.2f}x  "
                  f"({ours}/eager {median[ours] / median['ours']:.2f}x)")
    compiled = [name for name in median if name.startswith("torch.compile[")]
    if args.compile_mode == "best" and compiled:
        print(f"torch.compile best mode: {min(compiled, key=median.get)[len('torch.compile['):-1]}")
    peer = min((name for name in median if name not in ("ours", "graphed", "recorded")), key=median.get)
    for ours in ("ours", "graphed", "recorded"):
        if ours in median:
            print(f"npformer / best peer: {ours} / {peer} {median[ours] / median[peer]:.2f}x "
                  f"({median[ours] * 1e3:.1f} vs {median[peer] * 1e3:.1f} ms/step)")
    if not args.no_memory:
        mem = {side: peak_memory_mb(args, side, 3) for side in ("ours", "graphed", "recorded", "torch")
               if side in runners}
        peak = {side: m["peak_mb"] for side, m in mem.items()}
        step = {side: m["peak_mb"] - m["imports_mb"] for side, m in mem.items()}

        def sides(mb):
            return ", ".join(f"{side} {mb[side]:.0f} MB" for side in mb) + f", ratio {mb['ours'] / mb['torch']:.2f}x"
        print(f"peak host memory (separate processes, 3 steps; ours and torch eager): {sides(peak)}; "
              f"above the imported libraries: {sides(step)}")


if __name__ == "__main__":
    main()
