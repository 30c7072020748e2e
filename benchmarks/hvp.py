"""Hessian-vector products through npformer's ops: a model's HVP against torch, and the memory of
an attention HVP.

    python benchmarks/hvp.py [--config gpt_char|tiny_gpt] [--steps N] [--threads 2] [--defaults]
    python benchmarks/hvp.py --attention-memory [--seq 4096] [--head-dim 64] [--block-size 512]
                             [--dtype float32|float64] [--causal]

Default mode: H v of the char-level GPT's cross-entropy loss (train_step.py's `gpt_char` CausalLM,
float32, dropout 0, batch and sequence from the config) over every parameter along one random
direction v, side by side in one run: ours forward over reverse (autograd.functional.hvp), ours
reverse over reverse (autograd.functional.vhp: the gradient of <g, v>), torch reverse over reverse
(torch.autograd.grad twice) and torch forward over reverse (torch.func.jvp of torch.func.grad) on
the torch.nn twin with ours' weights, torch's attention on its math backend (the only one with a
double backward). First a correctness check (every H v against torch's reverse over reverse,
relative to its largest entry), then --steps alternating runs of each runner after one untimed
run: median ms, ratios ours/torch and forward over reverse / reverse over reverse. `tiny_gpt`: a
very small model to check that the script runs. Threads: npformer.set_num_threads(--threads) and
torch.set_num_threads(--threads) (default 2); --defaults: each library's default threads.

--attention-memory: the peak host memory of an HVP through scaled_dot_product_attention,
memory-efficient path against naive path.

The HVP is d/dx <d/dx <attention(x), g>, u> for x = (q, k, v), B = H = 1: a backward with
create_graph, then a backward through that gradient (the double backward). Each path runs in
its own process; the inputs, g and u are allocated before the baseline, so the figures count
what the HVP adds (its results included): the growth of the process's peak resident memory
(VmHWM) and the peak of numpy's allocations seen by tracemalloc. The naive path holds several
(T, T) matrices; the memory-efficient one recomputes (block, block) tiles of P from the saved
logsumexp and holds none. Prints both and the ratio memory-efficient / naive.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import tracemalloc

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jvp  # noqa: E402  (benchmarks/ is the script's directory)
from train_step import CONFIGS, make_batch, rss_mb  # noqa: E402

PATHS = ("naive", "memory_efficient")
MODEL_CONFIGS = {name: cfg for name, cfg in CONFIGS.items() if cfg.get("causal")}
MODEL_CONFIGS["tiny_gpt"] = dict(vocab=20, d_model=16, nhead=2, d_ff=32, layers=1, seq=8, batch=2, causal=True)
AGREEMENT = 1e-3  # max |H v - torch's| / max |torch's H v|: float32 rounding through two passes stays far below


class Ours(jvp.Ours):
    """jvp.py's CausalLM and direction v, and its loss as a function of the parameters."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.targets = make_batch(cfg)[2]

    def loss(self, *params):
        import npformer.functional as F
        with self.parameters_set(params) as model:
            logits = model(self.ids)
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), self.targets.reshape(-1))

    def hvp(self, strategy):
        """H v as host arrays, forward over reverse ("forward") or reverse over reverse ("reverse")."""
        from autograd import Tensor, functional
        product = functional.hvp if strategy == "forward" else functional.vhp
        directions = tuple(map(Tensor, self.directions))
        return [h.numpy() for h in product(self.loss, tuple(self.model.parameters()), directions)[1]]


class Torch(jvp.Torch):
    """jvp.py's torch.nn twin on ours' weights and the same v; its loss as a function of the parameters."""

    def __init__(self, cfg, ours):
        super().__init__(cfg, ours)
        self.targets = self.torch.from_numpy(ours.targets)

    def loss(self, params):
        torch = self.torch
        logits = torch.func.functional_call(self.model, dict(zip(self.params, params)), (self.ids,))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), self.targets.reshape(-1))

    def hvp(self, strategy):
        torch = self.torch
        directions = tuple(self.directions[name] for name in self.params)
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            if strategy == "forward":
                products = torch.func.jvp(torch.func.grad(self.loss), (tuple(self.params.values()),),
                                          (directions,))[1]
            else:
                params = [p.detach().requires_grad_() for p in self.params.values()]
                gradient = torch.autograd.grad(self.loss(params), params, create_graph=True)
                products = torch.autograd.grad(gradient, params, directions)
        return [h.detach().numpy() for h in products]


def model_hvp(args):
    """The default mode: the correctness check, then the median ms of each runner and the ratios."""
    import npformer
    import torch
    cfg = dict(MODEL_CONFIGS[args.config], dropout=0.0)
    ours = Ours(cfg)
    theirs = Torch(cfg, ours)
    runners = {"ours forward over reverse": lambda: ours.hvp("forward"),
               "ours reverse over reverse": lambda: ours.hvp("reverse"),
               "torch reverse over reverse": lambda: theirs.hvp("reverse"),
               "torch forward over reverse": lambda: theirs.hvp("forward")}
    print(f"HVP of the loss w.r.t. every parameter, config {args.config} {cfg}, threads: npformer "
          f"{npformer.get_num_threads()}, torch {torch.get_num_threads()}")
    results = {}
    for name, runner in list(runners.items()):  # the untimed first runs
        try:
            results[name] = np.concatenate([h.ravel() for h in runner()])
        except Exception as error:  # torch's forward over reverse may not run; the others still do
            print(f"{name}: could not run: {type(error).__name__}: {error}")
            del runners[name]
    reference = results.pop("torch reverse over reverse")
    scale = np.abs(reference).max()
    for name, product in results.items():
        apart = np.abs(product - reference).max() / scale
        print(f"max |{name} - torch reverse over reverse| / max |torch's|: {apart:.1e}")
        if not apart <= AGREEMENT:
            sys.exit(f"{name} disagrees with torch's reverse over reverse: {apart:.1e} > {AGREEMENT}")
    times = {name: [] for name in runners}
    for _ in range(args.steps):
        for name, runner in runners.items():
            t0 = time.perf_counter()
            runner()
            times[name].append(time.perf_counter() - t0)
    median = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    for name, ms in median.items():
        print(f"{name:>27}: {ms:9.1f} ms")
    for side in ("ours", "torch"):
        if f"{side} forward over reverse" in median:
            print(f"{side} forward over reverse / reverse over reverse: "
                  f"{median[f'{side} forward over reverse'] / median[f'{side} reverse over reverse']:.2f}x")
    for strategy in ("forward", "reverse"):
        if f"torch {strategy} over reverse" in median:
            print(f"ratio ours/torch, {strategy} over reverse: "
                  f"{median[f'ours {strategy} over reverse'] / median[f'torch {strategy} over reverse']:.2f}x")
    print(f"ratio ours forward over reverse / torch reverse over reverse: "
          f"{median['ours forward over reverse'] / median['torch reverse over reverse']:.2f}x")


def attention_hvp_memory(path, seq, head_dim, block_size, dtype, causal):
    """{"rss_mb", "traced_mb"}: the memory one attention HVP on `path` adds, in this process."""
    import autograd
    import npformer.functional as F
    from autograd import Tensor

    rng = np.random.default_rng(0)
    shape = (1, 1, seq, head_dim)
    q, k, v = (Tensor(rng.standard_normal(shape).astype(dtype), requires_grad=True) for _ in range(3))
    g, *u = (Tensor(rng.standard_normal(shape).astype(dtype)) for _ in range(4))
    options = {"memory_efficient": True, "block_size": block_size} if path == "memory_efficient" else {}
    baseline = rss_mb()
    tracemalloc.start()
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, **options)
    first = autograd.grad(out, [q, k, v], g, create_graph=True)
    second = autograd.grad(first, [q, k, v], u)
    traced = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    assert all(np.isfinite(s.numpy()).all() for s in second)
    return {"rss_mb": rss_mb() - baseline, "traced_mb": traced}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attention-memory", action="store_true",
                        help="peak memory of an attention HVP, memory-efficient vs naive")
    parser.add_argument("--config", choices=MODEL_CONFIGS, default="gpt_char", help="the model (default mode)")
    parser.add_argument("--steps", type=int, default=20, help="timed runs of each runner (default mode)")
    parser.add_argument("--threads", type=int, default=2, help="npformer's and torch's threads (default mode)")
    parser.add_argument("--defaults", action="store_true",
                        help="each library's default threads (--threads is not applied)")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=512)
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float64")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--only", choices=PATHS, help=argparse.SUPPRESS)  # the worker process of one path
    args = parser.parse_args()
    if not args.attention_memory:
        import npformer
        import torch
        if not args.defaults:
            npformer.set_num_threads(args.threads)
            torch.set_num_threads(args.threads)
        model_hvp(args)
        return
    settings = (args.seq, args.head_dim, args.block_size, args.dtype, args.causal)
    if args.only:
        print(json.dumps(attention_hvp_memory(args.only, *settings)))
        return
    results = {}
    for path in PATHS:
        cmd = [sys.executable, os.path.abspath(__file__), "--attention-memory", "--only", path, "--seq", str(args.seq),
               "--head-dim", str(args.head_dim), "--block-size", str(args.block_size), "--dtype", args.dtype]
        out = subprocess.run(cmd + (["--causal"] if args.causal else []), capture_output=True, text=True, check=True)
        results[path] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"attention HVP, B=1 H=1 T={args.seq} hd={args.head_dim} {args.dtype}"
          f"{' causal' if args.causal else ''}, block {args.block_size}: memory the HVP adds")
    for path, result in results.items():
        print(f"  {path:17s} peak RSS {result['rss_mb']:9.1f} MB   numpy (tracemalloc) {result['traced_mb']:9.1f} MB")
    naive, efficient = results["naive"], results["memory_efficient"]
    print(f"  memory-efficient / naive: peak RSS {efficient['rss_mb'] / max(naive['rss_mb'], 1e-9):.4f}, "
          f"numpy {efficient['traced_mb'] / naive['traced_mb']:.4f}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
