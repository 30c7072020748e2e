"""Greedy decoding speed: our KV cache vs full recompute vs torch (uncached), side by side.

    python benchmarks/decode.py                      # base config, 64 target tokens
    python benchmarks/decode.py --config tiny --batch 64
    python benchmarks/decode.py --device cuda --no-torch

Threads: --threads N (default 1) for numpy's BLAS (OPENBLAS_NUM_THREADS, unless already set)
and torch; npformer runs its ops on one thread (set_num_threads(1)), so BLAS's threads are all
ours use: one step's matrices are small, and on a busy machine BLAS threads that wait for
each other slow small products down many times.

Every run decodes exactly --tgt-len tokens (EOS disabled) for a batch of random sources
with a randomly initialised Seq2SeqTransformer (decoding cost does not depend on the
weights); torch runs the same weights (npformer.interop.to_torch) with the seed tutorial's
loop: the whole prefix through nn.Transformer's decoder at every step. Reports tokens/s
(batch * tgt_len / seconds, best of --repeat) and the ratios; the cached and uncached
token sequences are checked to be identical.
"""
import argparse
import os
import sys
import time


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from threads_arg import set_blas_threads, threads_arg  # noqa: E402  (before numpy loads OpenBLAS)

THREADS = threads_arg(sys.argv[1:], default="1")  # BLAS threads for us, torch threads
set_blas_threads(THREADS)

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import npformer  # noqa: E402
from autograd import backend  # noqa: E402
from npformer.decoding import greedy_decode  # noqa: E402
from npformer.models import Seq2SeqTransformer  # noqa: E402
from npformer.runtime import threads  # noqa: E402

CONFIGS = {  # docs/benchmark_configurations.md
    "tiny": dict(vocab=20, d_model=32, nhead=4, dim_feedforward=64, layers=2),
    "base": dict(vocab=1000, d_model=256, nhead=8, dim_feedforward=1024, layers=4),
    "paper": dict(vocab=8000, d_model=512, nhead=8, dim_feedforward=2048, layers=6),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", choices=sorted(CONFIGS), default="base")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--src-len", dest="src_len", type=int, default=64)
    p.add_argument("--tgt-len", dest="tgt_len", type=int, default=64)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--no-torch", dest="torch", action="store_false", help="skip the torch reference")
    p.add_argument("--threads", type=int, default=1,
                   help="BLAS threads (numpy, via OPENBLAS_NUM_THREADS unless already set) and torch threads")
    return p.parse_args(argv)


def best_time(fn, repeat, sync=lambda: None):
    """(best seconds, result) over `repeat` runs."""
    best, result = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best, result


def torch_greedy(model, src, steps, bos=1):
    """The seed tutorial's greedy loop on the torch twin: full recompute every step."""
    import torch

    with torch.no_grad():
        memory = model.encode(src)
        prefix = torch.full((src.shape[0], 1), bos, dtype=torch.long)
        for _ in range(steps):
            logits = model.decode(prefix, memory)[:, -1]
            prefix = torch.cat([prefix, logits.argmax(-1, keepdim=True)], dim=1)
    return prefix[:, 1:].numpy()


def main(argv=None):
    args = parse_args(argv)
    cfg = CONFIGS[args.config]
    npformer.manual_seed(0)
    threads.set_num_threads(1)  # BLAS's threads only (npformer's default would add one per core)
    model = Seq2SeqTransformer(cfg["vocab"], cfg["vocab"], d_model=cfg["d_model"], nhead=cfg["nhead"],
                               num_encoder_layers=cfg["layers"], num_decoder_layers=cfg["layers"],
                               dim_feedforward=cfg["dim_feedforward"], dropout=0.1,
                               max_len=max(args.src_len, args.tgt_len) + 1).to(args.device)
    model.eval()
    src = np.random.default_rng(0).integers(3, cfg["vocab"], size=(args.batch, args.src_len))
    tokens = args.batch * args.tgt_len
    sync = (lambda: backend.module_for("cuda").cuda.Device().synchronize()) if args.device == "cuda" else (lambda: None)
    print(f"greedy decoding, config {args.config} ({sum(p.size for p in model.parameters()):,} parameters), "
          f"batch {args.batch}, source {args.src_len}, {args.tgt_len} target tokens, {args.device}, "
          f"{os.environ['OPENBLAS_NUM_THREADS']} BLAS thread(s) (npformer {threads.get_num_threads()}), "
          f"best of {args.repeat}")

    greedy_decode(model, src[:2], 4, eos=None)  # warm-up (allocations, CuPy kernels)
    results = {}
    for name, use_cache in (("npformer cached", True), ("npformer uncached", False)):
        seconds, out = best_time(lambda: greedy_decode(model, src, args.tgt_len, eos=None, use_cache=use_cache),
                                 args.repeat, sync)
        results[name] = (seconds, out)
    if not np.array_equal(results["npformer cached"][1], results["npformer uncached"][1]):
        raise SystemExit("cached and uncached decoding disagree")
    if args.torch and args.device == "cpu":
        import torch

        from npformer.interop import to_torch

        torch.set_num_threads(args.threads)
        twin = to_torch(model).eval()
        torch_greedy(twin, torch.as_tensor(src[:2]), 4)  # warm-up, as ours
        results["torch uncached"] = best_time(lambda: torch_greedy(twin, torch.as_tensor(src), args.tgt_len),
                                              args.repeat)
        agree = (results["torch uncached"][1] == results["npformer cached"][1]).mean()
        print(f"tokens equal to ours: {agree:.1%} (float32 rounding may flip near-ties)")

    for name, (seconds, _) in results.items():
        print(f"{name:<20} {seconds * 1000:9.1f} ms  {tokens / seconds:10,.0f} tokens/s")
    cached = results["npformer cached"][0]
    print(f"cached vs uncached (ours): {results['npformer uncached'][0] / cached:.2f}x faster (target >= 3x)")
    if "torch uncached" in results:
        print(f"ours cached vs torch uncached: {results['torch uncached'][0] / cached:.2f}x; "
              f"ours uncached vs torch uncached: {results['torch uncached'][0] / results['npformer uncached'][0]:.2f}x")
    return {name: tokens / seconds for name, (seconds, _) in results.items()}


if __name__ == "__main__":
    main()
