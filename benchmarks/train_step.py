"""One training step (forward, cross-entropy, backward, Adam) of Seq2SeqTransformer, ours and
PyTorch eager side by side in one run, float32.

    python benchmarks/train_step.py --config tiny|base|paper|gpt_char [--steps N] [--device cpu|cuda|test]
                                    [--threads N] [--ours-threads N] [--defaults] [--no-memory] [--no-graphed]

On cuda (and on "test", its stand-in without a GPU) ours runs twice: eager and as a captured CUDA
graph (npformer.cuda.graphed: one capture, then one replay per step), beside torch's CUDA eager.
Prints the median ms/step of each (steps alternate between the runners), the ratio ours/torch,
tokens/s (the tokens a step reads: source + target, or a causal LM's one sequence),
achieved GFLOP/s and its share of this machine's measured float32 GEMM rate, and the peak
resident host memory of each side measured in a separate process: in all, and above what
the process holds once its libraries are imported (torch's alone are ~190 MB).
Configurations: docs/benchmark_configurations.md.
Threads: torch.set_num_threads(--threads) and npformer.set_num_threads(--ours-threads,
default --threads; above 1 npformer splits the GEMMs and numpy's BLAS runs one thread;
--ours-threads 1 leaves the GEMMs to BLAS's own threads). --defaults: each library's default
threads instead (npformer's set_num_threads default, torch's intra-op default).
gpt_char is a CausalLM step (AdamW) against its torch.nn twin (npformer.interop.torch_model_classes).
"""
import argparse
import json
import math
import os
import resource
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


def make_batch(cfg, seed=0):
    rng = np.random.default_rng(seed)
    shape = (cfg["batch"], cfg["seq"])
    return (rng.integers(3, cfg["vocab"], shape), rng.integers(3, cfg["vocab"], shape),
            rng.integers(3, cfg["vocab"], shape))


def training_flops(cfg):
    """GEMM FLOPs of forward + backward (3x forward) for one step."""
    B, T, d, ff, L, V = cfg["batch"], cfg["seq"], cfg["d_model"], cfg["d_ff"], cfg["layers"], cfg["vocab"]
    n = B * T
    attention = 2 * 2 * B * T * T * d  # QK^T and PV
    enc = 2 * n * d * 3 * d + 2 * n * d * d + attention + 2 * 2 * n * d * ff
    if cfg.get("causal"):
        return 3 * (L * enc + 2 * n * d * V)
    dec = enc + 2 * n * d * d + 2 * n * d * 2 * d + 2 * n * d * d + attention  # + cross-attention
    return 3 * (L * (enc + dec) + 2 * n * d * V)


def tokens_per_step(cfg):
    """The tokens one step reads: source + target (encoder-decoder), the one sequence (causal LM)."""
    sequences = 1 if cfg.get("causal") else 2
    return sequences * cfg["batch"] * cfg["seq"]


def causal_config(cfg):
    """The CausalLM config of a causal benchmark configuration (ours and the torch twin's)."""
    return dict(vocab_size=cfg["vocab"], d_model=cfg["d_model"], nhead=cfg["nhead"], num_layers=cfg["layers"],
                dim_feedforward=cfg["d_ff"], dropout=cfg.get("dropout", 0.1), max_len=cfg["seq"])


def gemm_rate(device):
    """Measured float32 GEMM GFLOP/s of the array library on this machine."""
    import npformer  # noqa: F401  (its runtime registers the "test" device)
    from autograd import backend
    xp = backend.module_for(device)
    n = 1024
    a = xp.ones((n, n), dtype=xp.float32)
    for _ in range(2):
        a @ a
    best = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        c = a @ a
        if device == "cuda":
            xp.cuda.Stream.null.synchronize()
        best = min(best, time.perf_counter() - t0)
    del c
    return 2 * n ** 3 / best / 1e9


class Ours:
    def __init__(self, cfg, device, graphed=False):
        import npformer
        from npformer import models, optim
        import npformer.functional as F
        npformer.manual_seed(0)
        self.F, self.cfg, self.device = F, cfg, device
        from autograd import backend
        self.batch = [backend.to_device(a, device) for a in make_batch(cfg)]
        self.train = npformer.cuda.graphed(self.train_step, device) if graphed else self.train_step
        if cfg.get("causal"):
            self.model = models.CausalLM(**causal_config(cfg)).to(device).train()
            self.optimizer = optim.AdamW(self.model.parameters(), lr=1e-3, weight_decay=0.1)
            return
        self.model = models.Seq2SeqTransformer(
            cfg["vocab"], cfg["vocab"], d_model=cfg["d_model"], nhead=cfg["nhead"],
            num_encoder_layers=cfg["layers"], num_decoder_layers=cfg["layers"],
            dim_feedforward=cfg["d_ff"], dropout=cfg.get("dropout", 0.1), max_len=max(cfg["seq"], 16)).to(device)
        self.model.train()
        self.optimizer = optim.Adam(self.model.parameters(), lr=1e-4)

    def train_step(self, src, tgt_in, tgt_out):
        # a causal LM reads tgt_in and predicts tgt_out; the encoder-decoder also reads src
        logits = self.model(tgt_in) if self.cfg.get("causal") else self.model(src, tgt_in)
        loss = self.F.cross_entropy(logits.reshape(-1, self.cfg["vocab"]), tgt_out.reshape(-1))
        self.optimizer.zero_grad()
        loss.backward()
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

    def step(self):
        src, tgt_in, tgt_out = self.batch
        logits = self.model(tgt_in) if self.cfg.get("causal") else self.model(src, tgt_in)
        loss = self.torch.nn.functional.cross_entropy(logits.reshape(-1, self.cfg["vocab"]), tgt_out.reshape(-1))
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return loss.item()


def blas_info():
    try:
        from threadpoolctl import threadpool_info
        return "; ".join(f"{i.get('internal_api')} {i.get('version')} {i.get('architecture')} "
                         f"threads={i.get('num_threads')}" for i in threadpool_info() if i.get("user_api") == "blas")
    except ImportError:
        return "threadpoolctl not installed"


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
                        help="torch's intra-op threads and, by default, npformer's (default: every core)")
    parser.add_argument("--ours-threads", type=int,
                        help="npformer.set_num_threads (default --threads; 1: BLAS threads the GEMMs)")
    parser.add_argument("--defaults", action="store_true",
                        help="each library's default threads (--threads and --ours-threads are not applied)")
    parser.add_argument("--only", choices=["ours", "graphed", "torch"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    cfg = dict(CONFIGS[args.config], dropout=args.dropout)
    steps = args.steps or DEFAULT_STEPS[args.config]
    args.ours_threads = args.ours_threads or args.threads
    peak_rate = gemm_rate(args.device) if not args.only else None  # with BLAS's own threads
    import npformer
    if not args.defaults:
        npformer.set_num_threads(args.ours_threads)
    if args.only != "ours":  # the memory of our side is measured without torch loaded
        import torch
        if not args.defaults:
            torch.set_num_threads(args.threads)

    if args.only:  # a child process measuring one side's peak memory
        imports = rss_mb("VmRSS")
        runner = Torch(cfg, args.device) if args.only == "torch" else Ours(cfg, args.device, args.only == "graphed")
        for _ in range(steps):
            runner.step()
        print(json.dumps({"peak_mb": rss_mb(), "imports_mb": imports}))
        return

    runners = {"ours": Ours(cfg, args.device), "torch": Torch(cfg, args.device)}
    if args.device != "cpu" and not args.no_graphed:
        runners["graphed"] = Ours(cfg, args.device, graphed=True)
    times = {name: [] for name in runners}
    for name, runner in list(runners.items()):  # warm-up (the graphed runner: eager, then the capture)
        try:
            for _ in range(2 if name == "graphed" else 1):
                runner.step()
        except Exception as error:  # a step that cannot be captured is reported, the others still run
            print(f"{name}: could not run: {type(error).__name__}: {error}")
            del runners[name], times[name]
    for _ in range(steps):
        for name, runner in runners.items():
            t0 = time.perf_counter()
            runner.step()
            times[name].append(time.perf_counter() - t0)
    flops = training_flops(cfg)
    tokens = tokens_per_step(cfg)
    print(f"config {args.config} {CONFIGS[args.config]}  dropout {args.dropout}  device {args.device}  steps {steps}")
    print(f"numpy BLAS: {blas_info()}   OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE')}  "
          f"OPENBLAS_L2_SIZE={os.environ.get('OPENBLAS_L2_SIZE')}  load average {os.getloadavg()[0]:.2f}")
    print(f"threads: npformer {npformer.get_num_threads()}, torch {torch.get_num_threads()}")
    print(f"measured float32 GEMM rate: {peak_rate:.0f} GFLOP/s")
    median = {}
    for name in sorted(runners, key=["ours", "graphed", "torch"].index):
        median[name] = statistics.median(times[name])
        gflops = flops / median[name] / 1e9
        print(f"{name:>7}: {median[name] * 1e3:9.1f} ms/step  {tokens / median[name]:9.0f} tokens/s  "
              f"{gflops:6.1f} GFLOP/s  ({100 * gflops / peak_rate:4.1f}% of GEMM rate)")
    print(f"ratio ours/torch: {median['ours'] / median['torch']:.2f}x")
    if "graphed" in median:
        print(f"ratio graphed/torch: {median['graphed'] / median['torch']:.2f}x  "
              f"(graphed/eager {median['graphed'] / median['ours']:.2f}x)")
    if not args.no_memory:
        mem = {side: peak_memory_mb(args, side, 2) for side in runners}
        peak = {side: m["peak_mb"] for side, m in mem.items()}
        step = {side: m["peak_mb"] - m["imports_mb"] for side, m in mem.items()}

        def sides(mb):
            return ", ".join(f"{side} {mb[side]:.0f} MB" for side in mb) + f", ratio {mb['ours'] / mb['torch']:.2f}x"
        print(f"peak host memory (separate processes, 2 steps): {sides(peak)}; "
              f"above the imported libraries: {sides(step)}")


if __name__ == "__main__":
    main()
