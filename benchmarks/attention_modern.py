"""Issue 42's attention, in one run, float32 on the CPU:

    python benchmarks/attention_modern.py [--lengths 4096 16384] [--window 512] [--head-dim 64]
                                          [--block-size 512] [--full-length 4096]
                                          [--gqa 4 8 2 256 64] [--repeats 5] [--threads 2] [--json]

(a) Sliding-window attention on the memory-efficient path (B = 1, H = 1, causal, --window W):
    forward + backward at each of --lengths, each timed as the median of --repeats runs (after one
    untimed run), and its peak memory: numpy's allocations seen by tracemalloc above the inputs
    (q, k, v and dO are made before the baseline; the returned gradients are counted). The full
    (T, T) path, the naive one, keeps the probabilities P, one (T, T) matrix (4 T^2 bytes in
    float32), so at the longest T its peak is at least that: the ratio printed is the window's peak
    over that lower bound. The naive path itself is measured at --full-length (tracemalloc: its
    peak in (T, T) matrices), so that the bound can be compared with what it really holds. The
    time ratio longest / shortest T is linear in T when it is the ratio of the lengths
    (4 for 4,096 against 16,384), quadratic when its square.
(b) The grouped-query attention step: F.scaled_dot_product_attention(q, k, v, is_causal=True,
    enable_gqa=True) forward + backward on npformer's default path (on the CPU the naive one) against
    torch eager's torch.nn.functional.scaled_dot_product_attention(..., enable_gqa=True), for
    --gqa B H H_kv T head_dim, both on the same float32 inputs and upstream gradient: three rounds,
    in each --repeats runs of each implementation back to back (after a pause and one untimed run:
    torch's OpenMP threads spin for milliseconds after its calls and slow whatever runs next),
    the median of all; the ratio ours / torch (the target: at most 1.0).

Threads: npformer.set_num_threads(--threads) and torch.set_num_threads(--threads) (default 2; BLAS
as the environment sets it). --json prints one JSON object instead of the text.
"""
import argparse
import gc
import json
import os
import statistics
import sys
import time
import tracemalloc

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def step(q, k, v, dout, **kwargs):
    """One forward + backward of npformer's attention; returns the gradients (q, k, v)."""
    import autograd
    import npformer.functional as F
    from autograd import Tensor
    xs = [Tensor(a, requires_grad=True) for a in (q, k, v)]
    out = F.scaled_dot_product_attention(*xs, **kwargs)
    return autograd.grad(out, xs, Tensor(dout))


def inputs(rng, lead_q, lead_kv, t, hd):
    q = rng.standard_normal(lead_q + (t, hd)).astype(np.float32)
    k, v = (rng.standard_normal(lead_kv + (t, hd)).astype(np.float32) for _ in range(2))
    return q, k, v, rng.standard_normal(lead_q + (t, hd)).astype(np.float32)


def peak_bytes(fn):
    """numpy's peak allocation (tracemalloc) during fn(), above what was allocated before."""
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    result = fn()
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    del result
    return peak


def median_ms(fn, repeats):
    fn()                                                                      # untimed: first-call costs
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def sliding_window(args, rng):
    """(a): {length: {"ms", "peak_mb"}} of the window path, the naive path's peak at --full-length."""
    window = dict(is_causal=True, sliding_window=args.window, memory_efficient=True, block_size=args.block_size)
    rows = {}
    for t in args.lengths:
        arrays = inputs(rng, (1, 1), (1, 1), t, args.head_dim)
        peak = peak_bytes(lambda: step(*arrays, **window))
        rows[t] = {"ms": median_ms(lambda: step(*arrays, **window), args.repeats), "peak_mb": peak / 2**20}
    full = None
    if args.full_length:
        t = args.full_length
        arrays = inputs(rng, (1, 1), (1, 1), t, args.head_dim)
        peak = peak_bytes(lambda: step(*arrays, is_causal=True))
        full = {"length": t, "peak_mb": peak / 2**20, "matrices": peak / (4 * t * t),
                "window_peak_mb": peak_bytes(lambda: step(*arrays, **window)) / 2**20}
    return rows, full


def grouped_query(args, rng):
    """(b): median ms of ours (default path and memory-efficient) and torch, and the ratio."""
    import torch
    b, h, h_kv, t, hd = args.gqa
    q, k, v, dout = inputs(rng, (b, h), (b, h_kv), t, hd)
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    tdout = torch.tensor(dout)

    def theirs():
        out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True, enable_gqa=True)
        return torch.autograd.grad(out, (tq, tk, tv), tdout)

    ours = lambda **kw: step(q, k, v, dout, is_causal=True, enable_gqa=True, **kw)
    # the same gradients (float32 rounding), so both sides do the same work
    for a, ref in zip(ours(), theirs()):
        np.testing.assert_allclose(a.numpy(), ref.numpy(), rtol=1e-4, atol=1e-4)
    runs = {"ours": ours, "ours_memory_efficient": lambda: ours(memory_efficient=True, block_size=args.block_size),
            "torch": theirs}
    times = {name: [] for name in runs}
    for _ in range(3):                      # rounds; in each, every implementation's runs back to back
        for name, fn in runs.items():
            time.sleep(0.2)                 # torch's OpenMP threads spin after its calls: let them settle
            fn()                            # untimed
            for _ in range(args.repeats):
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    result = {name: 1e3 * statistics.median(ts) for name, ts in times.items()}
    result["ratio"] = result["ours"] / result["torch"]
    result["ratio_memory_efficient"] = result["ours_memory_efficient"] / result["torch"]
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=512)
    parser.add_argument("--full-length", type=int, default=4096, help="the naive path's length (0: skip it)")
    parser.add_argument("--gqa", type=int, nargs=5, default=[4, 8, 2, 256, 64], metavar=("B", "H", "H_KV", "T", "HD"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    import npformer
    import torch
    npformer.set_num_threads(args.threads)
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    rows, full = sliding_window(args, rng)
    longest, shortest = max(rows), min(rows)
    bound_mb = 4 * longest * longest / 2**20                   # one float32 (T, T) matrix: P of the naive path
    report = {"window": args.window, "head_dim": args.head_dim, "block_size": args.block_size,
              "threads": args.threads, "lengths": {str(t): r for t, r in rows.items()},
              "time_ratio": rows[longest]["ms"] / rows[shortest]["ms"], "length_ratio": longest / shortest,
              "full_path_bound_mb": bound_mb, "memory_ratio": rows[longest]["peak_mb"] / bound_mb,
              "full_path": full, "gqa_config": args.gqa, "gqa": grouped_query(args, rng)}
    if args.json:
        print(json.dumps(report))
        return report
    print(f"(a) sliding window {args.window}, memory-efficient (block {args.block_size}), B=1, H=1, "
          f"head dim {args.head_dim}, float32, causal, forward + backward, threads {args.threads}:")
    print("|      T |      ms | peak MB (tracemalloc) |")
    print("|--------|---------|-----------------------|")
    for t, r in rows.items():
        print(f"| {t:6d} | {r['ms']:7.1f} | {r['peak_mb']:21.1f} |")
    print(f"time T={longest} / T={shortest}: {report['time_ratio']:.2f} (lengths {report['length_ratio']:.0f}x: "
          f"linear {report['length_ratio']:.0f}, quadratic {report['length_ratio'] ** 2:.0f})")
    print(f"peak at T={longest}: {rows[longest]['peak_mb']:.1f} MB against the full path's one (T, T) float32 "
          f"matrix, {bound_mb:.0f} MB: {report['memory_ratio']:.4f}")
    if full:
        print(f"the full (naive) path at T={full['length']}: peak {full['peak_mb']:.1f} MB = "
              f"{full['matrices']:.2f} (T, T) float32 matrices; the window path there: {full['window_peak_mb']:.1f} MB "
              f"({full['window_peak_mb'] / full['peak_mb']:.4f})")
    g = report["gqa"]
    b, h, h_kv, t, hd = args.gqa
    print(f"(b) grouped-query attention step (causal, B={b}, H={h}, H_kv={h_kv}, T={t}, head dim {hd}, float32, "
          f"forward + backward), median of 3 x {args.repeats}: ours (naive) {g['ours']:.1f} ms, ours memory-efficient "
          f"{g['ours_memory_efficient']:.1f} ms, torch eager SDPA(enable_gqa=True) {g['torch']:.1f} ms: "
          f"ratio {g['ratio']:.2f} (memory-efficient {g['ratio_memory_efficient']:.2f})")
    return report


if __name__ == "__main__":
    main()
