"""The demo's training step (demos/reverse.py, default preset): its fixed cost, and whether two
threads can use a second core for it.

    python benchmarks/demo_step.py [--steps N] [--batches 1,8,32,64] [--threads N]

1. The fixed cost: the demo's recorded trainer step at each batch size, every sequence of the
   preset's longest length (so each batch size keeps one shape and replays its recording, as the
   demo's batches of 64 do), the trainers alternated step by step; median ms per batch size.
   What batch 1 takes, every step takes whatever its batch.
2. Two threads: two trainers of half the demo's batch run `steps` steps one after the other, then
   at the same time in two Python threads; ms per pair of steps, the whole batch's step beside.
   (numpy drops the GIL only inside each call: with short calls, two threads wait on each other.)
"""
import argparse
import os
import statistics
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "demos"))
sys.path.insert(0, os.path.join(HERE, ".."))

import reverse  # noqa: E402

import npformer  # noqa: E402
from npformer.training import Seq2SeqTrainer  # noqa: E402


def trainer(batch_size, settings, record_steps=True):
    """A trainer of the demo's model, optimizer and schedule (seed 0), without evaluations; its steps
    recorded (record_steps=False: eager, as benchmarks/machinery.py compares)."""
    model, optimizer, scheduler = reverse.build(settings, 0, "cpu")
    return Seq2SeqTrainer(model, optimizer, reverse.make_task(settings, 0), scheduler=scheduler,
                          batch_size=batch_size, clip_norm=settings["clip_norm"], eval_every=0, progress=False,
                          record_steps=record_steps)


def run(trainer, steps):
    for _ in range(steps):
        trainer.train_step()


def one_shape():
    """The default preset with every sequence of its longest length: a batch keeps one shape."""
    return dict(reverse.PRESETS["default"], min_len=reverse.PRESETS["default"]["max_len"])


def fixed_cost(batches, steps):
    """{batch size: median seconds of a step}, every sequence of the preset's longest length."""
    trainers = {b: trainer(b, one_shape()) for b in batches}
    times = {b: [] for b in batches}
    for t in trainers.values():
        run(t, 3)                            # eager, recorded, first replay
    for _ in range(steps):
        for b, t in trainers.items():
            start = time.perf_counter()
            t.train_step()
            times[b].append(time.perf_counter() - start)
    return {b: statistics.median(v) for b, v in times.items()}


def two_threads(steps, repeats=3):
    """[(whole batch's step, two half steps one after the other, two at once in two threads)] in seconds."""
    settings = dict(reverse.PRESETS["default"])
    whole, half = settings["batch_size"], settings["batch_size"] // 2
    full, a, b = trainer(whole, settings), trainer(half, settings), trainer(half, settings)
    for t in (full, a, b):
        run(t, 3)
    rows = []
    for _ in range(repeats):
        start = time.perf_counter()
        run(full, steps)
        t_full = (time.perf_counter() - start) / steps
        start = time.perf_counter()
        run(a, steps)
        run(b, steps)
        t_serial = (time.perf_counter() - start) / steps
        threads = [threading.Thread(target=run, args=(t, steps)) for t in (a, b)]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        rows.append((t_full, t_serial, (time.perf_counter() - start) / steps))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="timed steps per batch size and per run (default 40)")
    parser.add_argument("--batches", default="1,8,32,64", help="batch sizes of the fixed cost's sweep")
    parser.add_argument("--threads", type=int, help="npformer's threads (npformer.set_num_threads; default: its own)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps: expected a positive integer, got {args.steps}")
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        parser.error(f"--batches: expected batch sizes separated by commas, e.g. 1,8,32,64, got {args.batches!r}")
    if not batches or min(batches) < 1:
        parser.error(f"--batches: expected positive batch sizes, got {args.batches!r}")
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads: expected a positive integer, got {args.threads}")
        npformer.set_num_threads(args.threads)
    print(f"npformer's threads: {npformer.get_num_threads()}")
    print("the demo's recorded step, every sequence of the longest length (median ms):")
    for b, seconds in fixed_cost(batches, args.steps).items():
        print(f"  batch {b:>4}: {seconds * 1e3:7.2f} ms")
    print("two trainers of half the batch (ms per pair of steps): whole batch | one after the other | two threads")
    for t_full, t_serial, t_threads in two_threads(args.steps):
        print(f"  {t_full * 1e3:7.2f} | {t_serial * 1e3:7.2f} | {t_threads * 1e3:7.2f}"
              f"  (threads / one after the other: {t_threads / t_serial:.2f})")


if __name__ == "__main__":
    main()
