"""Attention forward + backward, ours (naive and memory-efficient) against torch's
scaled_dot_product_attention, float32, B=1, H=8, head_dim=64, for T = 128 ... 4096.

    python benchmarks/attention.py [--lengths 128 256 ...] [--repeats 3] [--causal] [--block-size 512]
                                   [--threads N]

--threads N sets OPENBLAS_NUM_THREADS / OMP_NUM_THREADS and torch's thread count to N in the
worker processes (default: the environment as it is, torch on every core). On a machine
shared with other work, multithreaded BLAS calls wait for descheduled threads and small
GEMMs slow down by orders of magnitude; --threads 1 gives steadier figures there.

Every (implementation, T) runs in its own process. Time: median of --repeats runs of forward +
backward (after one untimed run). Peak extra memory of that first run, two ways: the growth of
the process's peak RSS (ru_maxrss: numpy and torch alike), and for ours numpy's own allocations
seen by tracemalloc. Inputs are allocated before the baseline, so both count only what the
attention adds (including the returned gradients).
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

IMPLS = ("ours-naive", "ours-memory-efficient", "torch")
B, H, HD = 1, 8, 64


def rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def worker(impl, t, repeats, causal, block_size):
    """Time and measure one implementation at one length; returns a dict."""
    import tracemalloc

    import numpy as np

    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((B, H, t, HD)).astype(np.float32) for _ in range(4)]  # q, k, v, dout
    if impl == "torch":
        import torch
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
        q, k, v = (torch.tensor(a, requires_grad=True) for a in arrays[:3])
        dout = torch.tensor(arrays[3])

        def step():
            q.grad = k.grad = v.grad = None
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(dout)
    else:
        import npformer.functional as F
        from autograd import Tensor
        q, k, v = (Tensor(a, requires_grad=True) for a in arrays[:3])
        dout = arrays[3]
        options = {"memory_efficient": True, "block_size": block_size} if impl == "ours-memory-efficient" else {}

        def step():
            q.grad = k.grad = v.grad = None
            F.scaled_dot_product_attention(q, k, v, is_causal=causal, **options).backward(dout)

    baseline = rss_mb()
    tracemalloc.start()
    step()
    traced_peak = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    peak_rss = rss_mb() - baseline
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {"ms": 1000 * statistics.median(times), "rss_mb": peak_rss,
            "traced_mb": traced_peak if impl != "torch" else None}


def run_in_subprocess(impl, t, args):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", impl, "--lengths", str(t),
           "--repeats", str(args.repeats), "--block-size", str(args.block_size)] + (["--causal"] if args.causal else [])
    env = dict(os.environ)
    if args.threads:
        env.update(OPENBLAS_NUM_THREADS=str(args.threads), OMP_NUM_THREADS=str(args.threads),
                   MKL_NUM_THREADS=str(args.threads))
    result = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512, 1024, 2048, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--block-size", type=int, default=512)
    parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    parser.add_argument("--threads", type=int, default=0, help="BLAS/torch threads per worker (0: as is)")
    parser.add_argument("--worker", choices=IMPLS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.lengths[0], args.repeats, args.causal, args.block_size)))
        return

    threads = args.threads or os.environ.get("OPENBLAS_NUM_THREADS", "default")
    print(f"attention forward+backward, float32, B={B}, H={H}, head_dim={HD}, causal={args.causal}, "
          f"block_size={args.block_size}, median of {args.repeats}, {os.cpu_count()} CPUs, threads={threads}, "
          f"load average {os.getloadavg()[0]:.1f}")
    header = f"{'T':>6} | " + " | ".join(f"{name:>34}" for name in args.impls)
    print(header)
    print(f"{'':>6} | " + " | ".join(f"{'ms':>9} {'peak RSS MB':>11} {'numpy MB':>11}" for _ in args.impls))
    results = {}
    for t in args.lengths:
        cells = []
        for impl in args.impls:
            r = results[impl, t] = run_in_subprocess(impl, t, args)
            traced = f"{r['traced_mb']:11.1f}" if r["traced_mb"] is not None else f"{'-':>11}"
            cells.append(f"{r['ms']:9.1f} {r['rss_mb']:11.1f} {traced}")
        print(f"{t:>6} | " + " | ".join(cells), flush=True)
    if "ours-naive" in args.impls and "ours-memory-efficient" in args.impls:
        print("\nmemory-efficient / naive:")
        for t in args.lengths:
            naive, eff = results["ours-naive", t], results["ours-memory-efficient", t]
            print(f"  T={t:>5}: time {eff['ms'] / naive['ms']:.2f}x, peak numpy memory "
                  f"{eff['traced_mb'] / naive['traced_mb']:.3f}x, peak RSS {eff['rss_mb'] / max(naive['rss_mb'], 1e-9):.3f}x")


if __name__ == "__main__":
    main()
