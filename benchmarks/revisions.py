"""Two revisions of npformer side by side: the training steps of benchmarks/train_step.py (ours,
eager and recorded) and of the demo, each revision in its own process, the processes alternated
so that both see the same machine; prints each revision's median ms/step and the ratio new/old.

    python benchmarks/revisions.py OLD_CHECKOUT NEW_CHECKOUT [--configs tiny,gpt_char,base,demo]
                                   [--rounds N] [--steps N]

OLD_CHECKOUT and NEW_CHECKOUT are folders holding a checkout each (`git worktree add /tmp/old REV`).
A round runs every configuration once in each revision (old first in odd rounds, new first in
even ones); each run times `--steps` steps after warm-up steps and reports their median. The ratio
is the median of a configuration's per-round ratios new/old, so a change of the machine's speed
between rounds cancels out. Both checkouts run with this interpreter and this file's worker
(the worker imports the checkout's npformer and its benchmarks/train_step.py, demo_step.py).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

CONFIGS = ("tiny", "gpt_char", "base", "demo")
WARMUP = 3  # eager, recording, first replay


def worker(checkout, config, steps):
    """ms per step of one configuration in one checkout: {"eager": ms, "recorded": ms}."""
    import time

    sys.path[:0] = [checkout, os.path.join(checkout, "benchmarks")]
    os.chdir(checkout)
    times = {}
    for mode in ("eager", "recorded"):
        if config == "demo":
            import demo_step
            trainer = demo_step.trainer(64, demo_step.one_shape())     # recorded
            if mode == "eager":
                trainer._recorded = None                                # (Trainer's recorded step, both revisions)
            step = trainer.train_step
        else:
            import train_step
            ours = train_step.Ours(dict(train_step.CONFIGS[config], dropout=0.1), "cpu", recorded=mode == "recorded")
            step = ours.step
        for _ in range(WARMUP):
            step()
        elapsed = []
        for _ in range(steps):
            start = time.perf_counter()
            step()
            elapsed.append(time.perf_counter() - start)
        times[mode] = 1e3 * statistics.median(elapsed)
    return times


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:  # one run, in a process of its own: --worker CHECKOUT CONFIG STEPS
        print(json.dumps(worker(argv[1], argv[2], int(argv[3]))))
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=0, help="steps timed per run (default: tiny 100, demo 60, "
                                                             "gpt_char 20, base 6)")
    args = parser.parse_args(argv)
    configs = args.configs.split(",")
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or args.rounds < 1 or args.steps < 0:
        parser.error(f"--configs takes {','.join(CONFIGS)}, --rounds >= 1, --steps >= 0; got {args.configs!r}, "
                     f"{args.rounds}, {args.steps}")
    for folder in (args.old, args.new):
        if not os.path.isdir(os.path.join(folder, "npformer")):
            parser.error(f"{folder}: not a checkout of npformer (no npformer/ folder in it)")
    default_steps = {"tiny": 100, "demo": 60, "gpt_char": 20, "base": 6}
    ratios = {(c, m): [] for c in configs for m in ("eager", "recorded")}
    medians = {(c, m, side): [] for c in configs for m in ("eager", "recorded") for side in ("old", "new")}
    for r in range(args.rounds):
        for config in configs:
            order = ("old", "new") if r % 2 == 0 else ("new", "old")
            result = {}
            for side in order:
                folder = os.path.abspath(getattr(args, side))
                out = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", folder, config,
                                      str(args.steps or default_steps[config])],
                                     capture_output=True, text=True, check=True)
                result[side] = json.loads(out.stdout.strip().splitlines()[-1])
            for mode in ("eager", "recorded"):
                ratios[config, mode].append(result["new"][mode] / result["old"][mode])
                for side in ("old", "new"):
                    medians[config, mode, side].append(result[side][mode])
            print(f"round {r + 1} {config:8s} " + "  ".join(
                f"{mode} old {result['old'][mode]:8.2f} new {result['new'][mode]:8.2f} ms" for mode in ("eager", "recorded")),
                flush=True)
    print("\n| config | step | old ms | new ms | new/old |\n|---|---|---:|---:|---:|")
    for config in configs:
        for mode in ("eager", "recorded"):
            print(f"| {config} | {mode} | {statistics.median(medians[config, mode, 'old']):.2f} | "
                  f"{statistics.median(medians[config, mode, 'new']):.2f} | {statistics.median(ratios[config, mode]):.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
