"""A small seeded training run with frequent checkpoints, started as a subprocess by
test_faults.py (it is not a test module itself).

    python tests/fault_training_run.py OUT --steps 60 --checkpoint-every 20 [--resume] [--slow-save N]

Trains the seed preset's Transformer (vocab 20, d_model 32, 4 heads, d_ff 64, 2 + 2 layers,
dropout 0.1) on reversal with AdamW, a warmup-cosine schedule and clipping, saving
OUT/checkpoint.npz every `--checkpoint-every` steps; `--resume` continues from it. At the end
it writes OUT/metrics.json: every step's loss and lr and the final held-out evaluation.

`--slow-save N` makes the N-th save of this process trickle its bytes into the temporary
file (16 KiB, then a pause, ...), so that the test can see the half-written file and kill the
process while the write is in progress.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import npformer  # noqa: E402
from npformer import checkpoint, optim  # noqa: E402
from npformer.data import PAD, SequenceTask  # noqa: E402
from npformer.models import Seq2SeqTransformer  # noqa: E402
from npformer.training import Seq2SeqTrainer  # noqa: E402

CHUNK, PAUSE = 16 * 1024, 0.2


class TricklingFile:
    """A file object whose writes reach the disk CHUNK bytes at a time, PAUSE seconds apart."""

    def __init__(self, file):
        self.file = file

    def write(self, data):
        data = memoryview(data).cast("B")
        for start in range(0, len(data), CHUNK):
            self.file.write(data[start:start + CHUNK])
            self.file.flush()
            time.sleep(PAUSE)
        return len(data)

    def __getattr__(self, name):  # seek, tell, flush, ... of the real file
        return getattr(self.file, name)


def slow_down_save(which):
    write_npz, saves = checkpoint._write_npz, []

    def write(fileobj, arrays):
        saves.append(None)
        write_npz(TricklingFile(fileobj) if len(saves) == which else fileobj, arrays)

    checkpoint._write_npz = write


def make_trainer(steps):
    npformer.manual_seed(0)
    model = Seq2SeqTransformer(20, 20, d_model=32, nhead=4, num_encoder_layers=2, num_decoder_layers=2,
                               dim_feedforward=64, dropout=0.1, max_len=8, pad_idx=PAD)
    task = SequenceTask("reverse", vocab_size=20, min_len=6, seed=0, heldout_size=100)
    optimizer = optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = optim.WarmupCosineLR(optimizer, warmup_steps=10, total_steps=steps)
    return Seq2SeqTrainer(model, optimizer, task, scheduler=scheduler, batch_size=16, clip_norm=1.0,
                          grad_norm_every=5, progress=False)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--checkpoint-every", type=int, default=20)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--slow-save", type=int)
    args = parser.parse_args()
    if args.slow_save:
        slow_down_save(args.slow_save)
    path = os.path.join(args.out, "checkpoint.npz")
    trainer = make_trainer(args.steps)
    if args.resume:
        trainer.resume(path)
    result = trainer.fit(args.steps, checkpoint_path=path, checkpoint_every=args.checkpoint_every)
    with open(os.path.join(args.out, "metrics.json"), "w") as f:
        json.dump({"loss": trainer.history["loss"], "lr": trainer.history["lr"], "final": result}, f)


if __name__ == "__main__":
    main()
