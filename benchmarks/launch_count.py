"""GPU launches of one training step (forward + cross-entropy + backward, then Adam) of
Seq2SeqTransformer as it runs on "cuda", counted on the "test" device (no GPU needed): each
array-library call (a CuPy kernel, or more) and each launch of npformer's own CUDA kernels. On a
GPU a step of this size is bound by launches (each costs host time), so fewer is faster.

    python benchmarks/launch_count.py [--config paper] [--reference]

The kernel tables run their "cuda" implementations here, with every launch of a hand-written
kernel counted instead of run (the step's numbers are garbage; only the count matters);
--reference counts the references instead (what runs where a table has no CUDA kernel).
The structure of the configuration counts, not its sizes: the model is built with the
configuration's layers and tiny widths. Counted: every ufunc on a test-device array, every
function called through the test device's module (allocations too), each outermost only.
"""
import argparse
import collections
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from npformer.runtime import kernels, testdevice  # noqa: E402
from npformer.functional import cuda  # noqa: E402
from train_step import CONFIGS, Ours  # noqa: E402

counts = collections.Counter()


def counted(function, label):
    def wrapper(*args, **kwargs):
        outermost = not testdevice._in_xp_call()
        if outermost:
            counts[label] += 1
        testdevice._calls.depth = getattr(testdevice._calls, "depth", 0) + 1  # calls inside are not launches
        try:
            return function(*args, **kwargs)
        finally:
            testdevice._calls.depth -= 1
    return wrapper


def counting_loader(source, kernel, dtype, extra=None):
    """A stand-in for a compiled kernel: counts its launches, computes nothing."""
    def launch(grid, block, args):
        counts["ours"] += 1
        counts[f"kernel {kernel}"] += 1
    return launch


def use_cuda_kernels_on_the_test_device():
    cuda._loader = counting_loader
    for table in kernels.TABLES:
        if "cuda" in table.implementations:
            table.implementations["test"] = table.implementations["cuda"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="paper")
    parser.add_argument("--reference", action="store_true", help="count the kernel tables' references instead")
    args = parser.parse_args()
    cfg = dict(CONFIGS[args.config], d_model=16, nhead=2, d_ff=32, seq=8, batch=2, vocab=50)
    ours = Ours(cfg, "test")
    ours.step()  # optimizer state exists from here on
    if not args.reference:
        use_cuda_kernels_on_the_test_device()
        np.seterr(all="ignore")  # the kernels compute nothing: the arrays hold garbage
    testdevice.TestDeviceArray.__array_ufunc__ = counted(testdevice.TestDeviceArray.__array_ufunc__, "calls")
    testdevice._OnTestDevice.__call__ = counted(testdevice._OnTestDevice.__call__, "calls")
    src, tgt_in, tgt_out = ours.batch
    logits = ours.model(src, tgt_in)
    loss = ours.F.cross_entropy(logits.reshape(-1, cfg["vocab"]), tgt_out.reshape(-1))
    ours.optimizer.zero_grad()
    loss.backward()
    forward_backward = counts.pop("calls") + counts.pop("ours", 0)
    ours.optimizer.step()
    adam = counts.pop("calls", 0) + counts.pop("ours", 0)
    print(f"{args.config}{' (references)' if args.reference else ''}: forward + backward {forward_backward:,} "
          f"launches, Adam {adam:,} ({len(ours.optimizer.state)} parameters), total {forward_backward + adam:,}")
    for name, n in sorted(counts.items()):
        print(f"  {name}: {n}")


if __name__ == "__main__":
    main()
