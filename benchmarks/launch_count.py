"""Array-library calls in one training step (forward + cross-entropy + backward, then Adam) of
Seq2SeqTransformer on the "test" device, which takes the GPU code paths: each call is one
kernel launch (or more) on CuPy, where a step of this size is bound by launches.

    python benchmarks/launch_count.py [--config paper]

The structure of the configuration counts, not its sizes: the model is built with the
configuration's layers and tiny widths. Counted: every ufunc on a test-device array, every
function called through the test device's module, every fused kernel (as one), each outermost
only (a kernel run by numpy on the test device counts once).
"""
import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from autograd import backend, testdevice  # noqa: E402
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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="paper")
    args = parser.parse_args()
    cfg = dict(CONFIGS[args.config], d_model=16, nhead=2, d_ff=32, seq=8, batch=2, vocab=50)
    ours = Ours(cfg, "test")
    ours.step()  # optimizer state exists from here on
    testdevice.TestDeviceArray.__array_ufunc__ = counted(testdevice.TestDeviceArray.__array_ufunc__, "calls")
    testdevice._OnTestDevice.__call__ = counted(testdevice._OnTestDevice.__call__, "calls")
    src, tgt_in, tgt_out = ours.batch
    logits = ours.model(src, tgt_in)
    loss = ours.F.cross_entropy(logits.reshape(-1, cfg["vocab"]), tgt_out.reshape(-1))
    ours.optimizer.zero_grad()
    loss.backward()
    forward_backward = counts.pop("calls")
    ours.optimizer.step()
    adam = counts.pop("calls")
    print(f"{args.config}: forward + backward {forward_backward:,} calls, Adam {adam:,} "
          f"({len(ours.optimizer.state)} parameters), total {forward_backward + adam:,}")


if __name__ == "__main__":
    main()
