"""Hessian-vector products through npformer's ops. --attention-memory: the peak host memory of an
HVP through scaled_dot_product_attention, memory-efficient path against naive path.

    python benchmarks/hvp.py --attention-memory [--seq 4096] [--head-dim 64] [--block-size 512]
                             [--dtype float32|float64] [--causal]

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
import subprocess
import sys
import tracemalloc

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from train_step import rss_mb  # noqa: E402  (benchmarks/ is the script's directory)

PATHS = ("naive", "memory_efficient")


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
    parser.add_argument("--attention-memory", action="store_true", required=True,
                        help="peak memory of an attention HVP, memory-efficient vs naive")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=512)
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float64")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--only", choices=PATHS, help=argparse.SUPPRESS)  # the worker process of one path
    args = parser.parse_args()
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
