"""Greedy generation speed: npformer's `decoding.generate` (KV cache) vs Hugging Face's
`model.generate` on the same random GPT-2-small-shaped model, on the CPU, side by side.

    python benchmarks/generate.py                          # batch 1 and batch 8, 64 new tokens
    python benchmarks/generate.py --batch 1 --new-tokens 32 --prompt 16 --repeat 5
    python benchmarks/generate.py --threads 1              # one thread each (BLAS too)
    python benchmarks/generate.py --profile                # where our cached step's time goes, per op
    python benchmarks/generate.py --profile --cprofile     # cProfile's top functions instead

The model: transformers.GPT2LMHeadModel(GPT2Config()) (12 layers, d_model 768, 12 heads,
vocabulary 50257, 1024 positions: 124M parameters), randomly initialised (speed does not depend
on the weights), float32, eval mode; ours is `npformer.interop.from_hf` of it. Each library runs
with its default threads (torch: its intra-op threads; npformer: set_num_threads' default, under
which `generate` runs the ops on one thread and lets numpy's BLAS thread the products), or
--threads N for both (torch's intra-op threads and numpy's BLAS threads). The header prints the
threads ours' decoding steps actually ran with. On a machine shared with other
work, torch's OpenMP threads suffer most from the competition: the header prints the load.
Prompts are random ids of --prompt tokens; both generate exactly --new-tokens tokens (no EOS).
Runs alternate between the two libraries; reported: the best of --repeat of batch *
new_tokens / seconds (prefill included), the ratio ours / Hugging Face (above 1: we are faster),
and whether the generated tokens are identical.
"""
import argparse
import collections
import cProfile
import os
import pstats
import sys
import time


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from threads_arg import set_blas_threads, threads_arg  # noqa: E402  (before numpy loads OpenBLAS)

THREADS = threads_arg(sys.argv[1:], default=None)  # None: each library's default
if THREADS is not None:  # generate runs npformer's ops on one thread and numpy's BLAS threads the products
    set_blas_threads(THREADS)

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import npformer  # noqa: E402
from npformer.runtime import threads  # noqa: E402
from npformer import interop  # noqa: E402
from npformer.decoding import generate  # noqa: E402
from timing import time_functions, timed  # noqa: E402


def build(seed=0):
    import torch
    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    config = transformers.GPT2Config(bos_token_id=None, eos_token_id=None)  # GPT-2 small's shape
    hf_model = transformers.GPT2LMHeadModel(config).eval()
    return hf_model, interop.from_hf(hf_model).eval()


def time_ours(model, prompt, new_tokens):
    t0 = time.perf_counter()
    out = generate(model, prompt, new_tokens, temperature=0.0)
    return time.perf_counter() - t0, out


def time_hf(hf_model, prompt, new_tokens):
    import torch
    ids = torch.tensor(prompt)
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        seconds = time.perf_counter() - t0
    return seconds, out.numpy()


def blas_threads():
    """numpy's BLAS threads now (threadpoolctl), or "?" without threadpoolctl."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return "?"
    return ",".join(str(i["num_threads"]) for i in threadpool_info() if i["user_api"] == "blas")


def generation_threads(model, prompt):
    """(the threads npformer's ops use, numpy's BLAS threads) inside a decoding step of `generate`
    (which runs its ops in the caller on the CPU and leaves the products to BLAS's threads)."""
    seen = []
    step = model.decode_step

    def probe(*args, **kwargs):
        seen.append((len(threads.row_blocks(1 << 10, threads.MIN_PARALLEL_ENTRIES)), blas_threads()))
        return step(*args, **kwargs)
    model.decode_step = probe
    try:
        generate(model, prompt, 1, temperature=0.0)
    finally:
        del model.decode_step
    return seen[0]


def profile(model, prompt, new_tokens, use_cprofile):
    """Per step of our cached generation (prefill excluded: its time divides by new_tokens - 1
    steps after it): each op's forward time, and the rest (Python between the ops); or cProfile's
    top functions over the whole call."""
    generate(model, prompt, 2, temperature=0.0)  # warm-up
    if use_cprofile:
        profiler = cProfile.Profile()
        profiler.enable()
        generate(model, prompt, new_tokens, temperature=0.0)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
        return
    times = collections.Counter()

    time_functions(times, phases=("forward",))
    model.decode_step = timed(times, "decode_step", model.decode_step)
    t0 = time.perf_counter()
    generate(model, prompt, 1, temperature=0.0)  # the prefill alone
    prefill, prefill_ops = time.perf_counter() - t0, dict(times)
    times.clear()
    t0 = time.perf_counter()
    generate(model, prompt, new_tokens, temperature=0.0)
    steps = new_tokens - 1
    step = (times.pop("decode_step") - prefill_ops.pop("decode_step")) / steps
    total = (time.perf_counter() - t0 - prefill) / steps
    rows = {name: (seconds - prefill_ops.get(name, 0.0)) / steps for name, seconds in times.items()}
    rows["rest of decode_step (Python between ops)"] = step - sum(rows.values())
    rows["rest of generate (sampling, bookkeeping)"] = total - step
    print(f"batch {len(prompt)}: {1e3 * total:.2f} ms per cached step (mean of {steps} after the prefill)")
    for name, seconds in sorted(rows.items(), key=lambda kv: -kv[1]):
        print(f"  {name:<42} {1e3 * seconds:7.2f} ms  {100 * seconds / total:5.1f}%")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt", type=int, default=32, help="prompt length in tokens")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--profile", action="store_true",
                        help="time each op of our cached step instead (the first --batch)")
    parser.add_argument("--cprofile", action="store_true", help="with --profile: cProfile's table instead")
    parser.add_argument("--threads", type=int, help="threads of both libraries (default: each one's default)")
    args = parser.parse_args()
    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
        npformer.set_num_threads(args.threads)
    hf_model, ours = build()
    rng = np.random.default_rng(0)
    if args.profile:
        profile(ours, rng.integers(0, 50257, size=(args.batch[0], args.prompt)), args.new_tokens, args.cprofile)
        return
    print(f"GPT-2 small shape, random weights, {sum(p.size for p in ours.parameters()) / 1e6:.1f}M parameters, "
          f"float32, prompt {args.prompt} tokens, {args.new_tokens} new tokens, greedy, best of {args.repeat}")
    ours_threads, ours_blas = generation_threads(ours, np.zeros((1, 2), dtype=np.int64))
    print(f"threads: ours' decoding steps npformer {ours_threads} + numpy BLAS {ours_blas}, "
          f"torch {torch.get_num_threads()}; load average {os.getloadavg()[0]:.2f}")
    for batch in args.batch:
        prompt = rng.integers(0, 50257, size=(batch, args.prompt))
        time_ours(ours, prompt, 2)  # warm-up
        time_hf(hf_model, prompt, 2)
        best = {"ours": float("inf"), "hf": float("inf")}
        outs = {}
        for _ in range(args.repeat):
            for name, run in (("ours", lambda: time_ours(ours, prompt, args.new_tokens)),
                              ("hf", lambda: time_hf(hf_model, prompt, args.new_tokens))):
                seconds, outs[name] = run()
                best[name] = min(best[name], seconds)
        tokens = batch * args.new_tokens
        rate = {name: tokens / seconds for name, seconds in best.items()}
        same = np.array_equal(outs["ours"], outs["hf"])
        print(f"batch {batch}: ours {rate['ours']:7.1f} tokens/s ({1e3 * best['ours'] / args.new_tokens:6.1f} "
              f"ms/step), Hugging Face {rate['hf']:7.1f} tokens/s ({1e3 * best['hf'] / args.new_tokens:6.1f} "
              f"ms/step), ours/HF {rate['ours'] / rate['hf']:.2f}x, identical tokens: {same}")


if __name__ == "__main__":
    main()
