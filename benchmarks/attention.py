"""Attention forward + backward, ours (naive, memory-efficient, flash) against torch's
scaled_dot_product_attention, float32, B=1, H=8, head_dim=64.

    python benchmarks/attention.py [--device cpu|cuda] [--lengths 128 256 ...] [--repeats N] [--causal]
                                   [--impls ...] [--block-size 512] [--threads N] [--timeout S]

Every (implementation, T) runs in its own process; one that runs out of memory or time is
reported as such. Time: median of --repeats runs of forward + backward (after one untimed run).

--device cpu (default lengths 128 ... 4096): peak extra memory of the first run two ways, the
growth of the process's peak RSS (numpy and torch alike) and for ours numpy's own allocations
seen by tracemalloc. --threads N sets OPENBLAS_NUM_THREADS / OMP_NUM_THREADS and torch's thread
count to N in the workers (default: the environment as it is); ours run npformer's ops on one
thread (B = 1 leaves its threads nothing to split), numpy's BLAS threading the products; on a shared machine
multithreaded BLAS calls wait for descheduled threads, --threads 1 gives steadier figures there.

--device cuda (default lengths 1,024 ... 65,536; needs CuPy and torch with CUDA): peak GPU memory
added by one forward + backward, from CuPy's pool (every allocation goes through a counting
allocator) and from torch.cuda.max_memory_allocated. ours-memory-efficient is the blockwise
CuPy reference (run inside npformer.runtime.kernels.reference_only()); ours-flash the CUDA kernels.

Inputs (q, k, v, dout) are allocated before the baseline, so the memory figures count what
attention adds, the returned gradients included.
"""
import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

IMPLS = {"cpu": ("ours-naive", "ours-memory-efficient", "torch"),
         "cuda": ("ours-naive", "ours-memory-efficient", "ours-flash", "torch")}
LENGTHS = {"cpu": [128, 256, 512, 1024, 2048, 4096], "cuda": [1024, 4096, 16384, 65536]}
B, H, HD = 1, 8, 64


def rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


class CupyPeak:
    """Every CuPy allocation through the default pool, counting the peak of the bytes in use."""

    def __init__(self, cupy):
        self.pool = cupy.get_default_memory_pool()
        self.peak = self.pool.used_bytes()
        cupy.cuda.set_allocator(self.malloc)

    def malloc(self, size):
        memory = self.pool.malloc(size)
        self.peak = max(self.peak, self.pool.used_bytes())
        return memory

    def reset(self):
        self.peak = self.pool.used_bytes()
        return self.peak


def ours_step(impl, device, arrays, causal, block_size):
    """One forward + backward of our SDPA on `device` (a closure), and the array module."""
    import npformer.functional as F
    from autograd import Tensor, backend
    from npformer.runtime import kernels
    q, k, v = (Tensor(backend.to_device(a, device), requires_grad=True) for a in arrays[:3])
    dout = backend.to_device(arrays[3], device)
    options = {"ours-naive": {"backend": "naive"}, "ours-flash": {"backend": "flash"},
               "ours-memory-efficient": {"backend": "memory_efficient", "block_size": block_size}}[impl]
    # on a GPU the memory-efficient path would run the flash kernels: force its blockwise reference
    reference = impl == "ours-memory-efficient" and device == "cuda"

    def step():
        q.grad = k.grad = v.grad = None
        with kernels.reference_only() if reference else contextlib.nullcontext():
            F.scaled_dot_product_attention(q, k, v, is_causal=causal, **options).backward(dout)
    return step


def timed(step, repeats, sync):
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def cpu_worker(impl, t, repeats, causal, block_size):
    """Time and measure one implementation at one length on the CPU; returns a dict."""
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
        from npformer.runtime import threads
        # npformer's threads split attention over the batch axis, here of size 1: with n > 1 they
        # would idle and hold numpy's BLAS to one thread. One npformer thread leaves the products
        # to BLAS's threads (the environment's, or --threads), as many as torch's.
        threads.set_num_threads(1)
        step = ours_step(impl, "cpu", arrays, causal, block_size)

    baseline = rss_mb()
    tracemalloc.start()
    step()
    traced_peak = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    peak_rss = rss_mb() - baseline
    return {"ms": timed(step, repeats, lambda: None), "rss_mb": peak_rss,
            "traced_mb": traced_peak if impl != "torch" else None}


def cuda_worker(impl, t, repeats, causal, block_size):
    """Time and measure one implementation at one length on the GPU; returns a dict."""
    import numpy as np

    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((B, H, t, HD)).astype(np.float32) for _ in range(4)]
    if impl == "torch":
        import torch
        q, k, v = (torch.tensor(a, device="cuda", requires_grad=True) for a in arrays[:3])
        dout = torch.tensor(arrays[3], device="cuda")

        def step():
            q.grad = k.grad = v.grad = None
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(dout)
        sync = torch.cuda.synchronize
        step()                                     # warm-up
        sync()
        q.grad = k.grad = v.grad = None
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
        step()
        sync()
        peak = torch.cuda.max_memory_allocated() - baseline
    else:
        import cupy
        counter = CupyPeak(cupy)
        step = ours_step(impl, "cuda", arrays, causal, block_size)
        sync = cupy.cuda.Device().synchronize
        step()                                     # warm-up (and the kernels' compilation)
        sync()
        baseline = counter.reset()
        step()
        sync()
        peak = counter.peak - baseline
    return {"ms": timed(step, repeats, sync), "gpu_mb": peak / 2**20}


def run_in_subprocess(impl, t, args):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", impl, "--device", args.device, "--lengths", str(t),
           "--repeats", str(args.repeats), "--block-size", str(args.block_size)] + (["--causal"] if args.causal else [])
    env = dict(os.environ)
    if args.threads:
        env.update(OPENBLAS_NUM_THREADS=str(args.threads), OMP_NUM_THREADS=str(args.threads),
                   MKL_NUM_THREADS=str(args.threads))
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"failed": f"over {args.timeout:.0f} s"}
    if result.returncode:
        out_of_memory = any(word in result.stderr for word in ("OutOfMemory", "out of memory", "MemoryError"))
        return {"failed": "out of memory" if out_of_memory else
                f"error: {(result.stderr.strip().splitlines() or ['?'])[-1][:60]}"}
    return json.loads(result.stdout.strip().splitlines()[-1])


def cell(result, device):
    if "failed" in result:
        return f"{result['failed']:>{24 if device == 'cuda' else 33}}"
    if device == "cuda":
        return f"{result['ms']:10.2f} {result['gpu_mb']:13.1f}"
    traced = f"{result['traced_mb']:11.1f}" if result["traced_mb"] is not None else f"{'-':>11}"
    return f"{result['ms']:9.1f} {result['rss_mb']:11.1f} {traced}"


def ratio(a, b, key):
    return f"{a[key] / b[key]:.2f}x" if "failed" not in a and "failed" not in b and b[key] > 0 else "-"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--lengths", type=int, nargs="+")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--block-size", type=int, default=512)
    parser.add_argument("--impls", nargs="+", choices=IMPLS["cuda"])
    parser.add_argument("--threads", type=int, default=0, help="BLAS/torch threads per CPU worker (0: as is)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per (implementation, T)")
    parser.add_argument("--worker", choices=IMPLS["cuda"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    lengths = args.lengths or LENGTHS[args.device]
    if args.worker:
        worker = cuda_worker if args.device == "cuda" else cpu_worker
        print(json.dumps(worker(args.worker, lengths[0], args.repeats, args.causal, args.block_size)))
        return
    impls = args.impls or list(IMPLS[args.device])
    if args.device == "cpu" and "ours-flash" in impls:
        parser.error("ours-flash runs on --device cuda only")
    if args.device == "cuda":
        from autograd import backend
        if not backend.cuda_available():
            parser.error("--device cuda needs CuPy and a GPU (pip install -e .[cuda12] or .[cuda13])")

    threads = args.threads or os.environ.get("OPENBLAS_NUM_THREADS", "default")
    print(f"attention forward+backward, float32, B={B}, H={H}, head_dim={HD}, causal={args.causal}, "
          f"device={args.device}, block_size={args.block_size}, median of {args.repeats}, {os.cpu_count()} CPUs, "
          f"threads={threads}, load average {os.getloadavg()[0]:.1f}")
    units = f"{'ms':>10} {'peak GPU MB':>13}" if args.device == "cuda" else f"{'ms':>9} {'peak RSS MB':>11} {'numpy MB':>11}"
    print(f"{'T':>6} | " + " | ".join(f"{name:>{len(units)}}" for name in impls))
    print(f"{'':>6} | " + " | ".join(units for _ in impls))
    results = {}
    for t in lengths:
        for impl in impls:
            results[impl, t] = run_in_subprocess(impl, t, args)
        print(f"{t:>6} | " + " | ".join(cell(results[impl, t], args.device) for impl in impls), flush=True)
    if args.device == "cuda" and {"ours-flash", "torch"} <= set(impls):
        print("\nflash / torch SDPA:")
        for t in lengths:
            flash, torch_result = results["ours-flash", t], results["torch", t]
            print(f"  T={t:>6}: time {ratio(flash, torch_result, 'ms')}, peak GPU memory "
                  f"{ratio(flash, torch_result, 'gpu_mb')}")
    if args.device == "cpu" and {"ours-naive", "ours-memory-efficient"} <= set(impls):
        print("\nmemory-efficient / naive:")
        for t in lengths:
            naive, eff = results["ours-naive", t], results["ours-memory-efficient", t]
            print(f"  T={t:>5}: time {ratio(eff, naive, 'ms')}, peak numpy memory {ratio(eff, naive, 'traced_mb')}, "
                  f"peak RSS {ratio(eff, naive, 'rss_mb')}")


if __name__ == "__main__":
    main()
