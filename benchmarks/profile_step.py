"""Where the time of one training step goes: per-op forward/backward times, dropout masks,
the optimizer, and the rest (Python between ops), for a config of train_step.py.

    python benchmarks/profile_step.py --config base [--steps N] [--threads N] [--cprofile | --torch]

Every `Function` subclass gets its forward and backward wrapped in a timer (monkeypatched
here only); the dropout masks where they are drawn apart (`keep_mask`, the reference paths; the
CPU draws F.dropout's inside DropoutFunction.forward's row), attention's (`attention_keep_mask`) and
`Adam.step` are timed the same way. The median of `steps`
steps after one warm-up is shown per row. --cprofile prints cProfile's top functions instead,
--torch the torch.profiler table of the torch model (torch.set_num_threads(--threads)).
"""
import argparse
import collections
import cProfile
import os
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from timing import time_functions, timed  # noqa: E402
from train_step import CONFIGS, Ours, Torch  # noqa: E402

import npformer  # noqa: E402
import npformer.functional.activation as activation  # noqa: E402
import npformer.functional.attention as attention  # noqa: E402
from npformer import optim  # noqa: E402

TIMES = collections.defaultdict(float)


def instrument():
    time_functions(TIMES)
    activation.keep_mask = timed(TIMES, "dropout masks", activation.keep_mask)
    attention.dropout.attention_keep_mask = timed(TIMES, "attention dropout masks", attention.attention_keep_mask)
    optim.Adam.step = timed(TIMES, "Adam.step", optim.Adam.step)


def profile_torch(args):
    import torch
    from torch.profiler import ProfilerActivity, profile
    torch.set_num_threads(args.threads)
    runner = Torch(CONFIGS[args.config], "cpu")
    runner.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            runner.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=CONFIGS, default="base")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--cprofile", action="store_true")
    parser.add_argument("--torch", action="store_true", help="torch.profiler's table of the torch side instead")
    parser.add_argument("--threads", type=int, default=1,
                        help="npformer.set_num_threads (above 1, numpy's BLAS runs one thread)")
    args = parser.parse_args()
    npformer.set_num_threads(args.threads)
    if args.torch:
        profile_torch(args)
        return
    runner = Ours(CONFIGS[args.config], "cpu")
    runner.step()
    if args.cprofile:
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.steps):
            runner.step()
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)
        return
    instrument()
    per_step = collections.defaultdict(list)
    totals = []
    for _ in range(args.steps):
        TIMES.clear()
        t0 = time.perf_counter()
        runner.step()
        totals.append(time.perf_counter() - t0)
        for name in set(TIMES) | set(per_step):
            per_step[name].append(TIMES.get(name, 0.0))
    total = statistics.median(totals)
    rows = {name: statistics.median(values) for name, values in per_step.items()}
    rows["rest (Python, glue, loss.item)"] = total - sum(rows.values())
    print(f"config {args.config}: {total * 1e3:.1f} ms/step (median of {args.steps}), "
          f"npformer threads {args.threads}")
    for name, seconds in sorted(rows.items(), key=lambda kv: -kv[1]):
        print(f"  {name:<34} {seconds * 1e3:8.1f} ms  {100 * seconds / total:5.1f}%")


if __name__ == "__main__":
    main()
