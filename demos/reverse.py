"""Train a Transformer to reverse sequences, then show what it learned.

    python demos/reverse.py                      # default preset: lengths 3..12 with padding
    python demos/reverse.py --preset seed        # the seed tutorial's setup (vocab 20, length 6)
    python demos/reverse.py --steps 2000 --min-len 2 --max-len 16 --out runs/long
    python demos/reverse.py --resume runs/reverse/checkpoint.npz --steps 1500
    python demos/reverse.py --checkpoint runs/reverse/checkpoint.npz --input "3 7 1 5"
    mpiexec -n 2 python demos/reverse.py --distributed   # data-parallel over 2 ranks (MPI)

Symbols are the integers 1..vocab-3 (ids 0, 1, 2 are PAD, BOS, EOS). Writes to --out:
metrics.json (held-out exact-sequence and token accuracy of greedy decoding on 1,000
sequences never trained on, steps, seconds, parameters), checkpoint.npz, curves.png (loss,
accuracy, lr), attention_encoder_self.png, attention_decoder_self.png, attention_cross.png
(every head of every layer for one example) and grad_norms.png (gradient norm per layer).
"""
import argparse
import json
import os
import sys
import time

START = time.perf_counter()
# One BLAS thread unless the environment says otherwise (set before numpy loads OpenBLAS):
# this model's matrices are too small to gain from threads, and on a busy machine threads
# that wait for each other make every small matrix product many times slower.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import autograd  # noqa: E402
import npformer.distributed as dist  # noqa: E402
from npformer import load_checkpoint, load_model, optim  # noqa: E402
from npformer.data import EOS, SequenceTask  # noqa: E402
from npformer.decoding import greedy_decode  # noqa: E402
from npformer.models import Seq2SeqTransformer  # noqa: E402
from npformer.training import Seq2SeqTrainer  # noqa: E402

# Each preset: task, model, optimisation. "default" is tuned to reach >= 99% exact-sequence
# accuracy on the held-out set in about a minute and a half on a 2-core CPU.
PRESETS = {
    "seed": dict(vocab=20, min_len=6, max_len=6, d_model=32, nhead=4, dim_feedforward=64, layers=2,
                 dropout=0.1, batch_size=64, steps=1500, lr=1e-3, warmup=0, schedule="constant",
                 label_smoothing=0.0, clip_norm=1.0, eval_every=250),
    "default": dict(vocab=20, min_len=3, max_len=12, d_model=64, nhead=4, dim_feedforward=128, layers=2,
                    dropout=0.0, batch_size=64, steps=1000, lr=2e-3, warmup=100, schedule="cosine",
                    label_smoothing=0.0, clip_norm=1.0, eval_every=100),
    "long": dict(vocab=32, min_len=4, max_len=24, d_model=128, nhead=8, dim_feedforward=256, layers=3,
                 dropout=0.0, batch_size=64, steps=3000, lr=1e-3, warmup=300, schedule="cosine",
                 label_smoothing=0.0, clip_norm=1.0, eval_every=250),
}
SETTINGS = tuple(PRESETS["default"])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--preset", choices=sorted(PRESETS), default="default")
    p.add_argument("--steps", type=int, help="total optimisation steps (default: the preset's)")
    p.add_argument("--vocab", type=int, help="vocabulary size including PAD/BOS/EOS")
    p.add_argument("--min-len", dest="min_len", type=int)
    p.add_argument("--max-len", dest="max_len", type=int)
    p.add_argument("--batch-size", dest="batch_size", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join("runs", "reverse"))
    p.add_argument("--resume", metavar="CKPT", help="continue training from a checkpoint of this demo")
    p.add_argument("--checkpoint", metavar="CKPT", help="with --input: load a trained model")
    p.add_argument("--input", help='with --checkpoint: symbols to reverse, e.g. "3 7 1 5"')
    p.add_argument("--no-plots", dest="plots", action="store_false", help="skip the figures")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.add_argument("--distributed", action="store_true",
                   help="data-parallel training over the ranks of an MPI job (mpiexec -n N ...): each rank "
                        "takes its share of every batch; rank 0 writes the outputs")
    args = p.parse_args(argv)
    if (args.checkpoint is None) != (args.input is None):
        p.error("--checkpoint and --input go together")
    if args.distributed and args.checkpoint:
        p.error("--distributed is for training; it does not go with --checkpoint/--input")
    try:
        autograd.backend.module_for(args.device)
    except RuntimeError as e:  # cuda asked for without CuPy or a GPU: say how to install it
        p.error(str(e))
    return args


def settings_from(args):
    """The preset's settings with the command line's overrides."""
    settings = dict(PRESETS[args.preset])
    for key in ("steps", "vocab", "min_len", "max_len", "batch_size", "lr"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    if settings["min_len"] > settings["max_len"]:
        if args.max_len is None:  # only --min-len given: keep a valid range
            settings["max_len"] = settings["min_len"]
        else:
            raise SystemExit(f"--min-len ({settings['min_len']}) must be <= --max-len ({settings['max_len']})")
    return settings


def make_task(settings, seed):
    return SequenceTask("reverse", vocab_size=settings["vocab"], min_len=settings["min_len"],
                        max_len=settings["max_len"], seed=seed)


def build(settings, seed, device):
    """Seeded model, optimizer and scheduler for the settings."""
    autograd.manual_seed(seed)
    model = Seq2SeqTransformer(
        settings["vocab"], settings["vocab"], d_model=settings["d_model"], nhead=settings["nhead"],
        num_encoder_layers=settings["layers"], num_decoder_layers=settings["layers"],
        dim_feedforward=settings["dim_feedforward"], dropout=settings["dropout"],
        max_len=settings["max_len"] + 2, pad_idx=0)
    model.to(device)
    optimizer = optim.AdamW(model.parameters(), lr=settings["lr"], betas=(0.9, 0.98), weight_decay=0.0)
    scheduler = None
    if settings["schedule"] == "cosine":
        scheduler = optim.WarmupCosineLR(optimizer, settings["warmup"], settings["steps"])
    return model, optimizer, scheduler


def demo_state(ckpt, path):
    """The settings a checkpoint of this demo was trained with."""
    if "demo" not in ckpt:
        raise SystemExit(f"{path}: not a checkpoint of demos/reverse.py (it has no 'demo' settings)")
    return ckpt["demo"]


def reverse_input(args):
    """--checkpoint CKPT --input "3 7 1 5": print the model's reversal."""
    model, ckpt = load_model(args.checkpoint, device=args.device)
    demo = demo_state(ckpt, args.checkpoint)
    settings = demo["settings"]
    task = make_task(settings, demo["seed"])
    try:
        ids = task.encode(args.input.replace(",", " ").split())
    except ValueError as e:
        raise SystemExit(f"--input: {e}")
    if not ids:
        raise SystemExit("--input: give at least one symbol")
    if not settings["min_len"] <= len(ids) <= settings["max_len"]:
        print(f"note: the model was trained on lengths {settings['min_len']}..{settings['max_len']}, "
              f"this input has {len(ids)} symbols", file=sys.stderr)
    predicted = greedy_decode(model, [ids], len(ids) + task.eos, eos=EOS if task.eos else None)
    print(" ".join(str(s) for s in task.decode(predicted[0])))


def example_for_plots(task):
    """One held-out sequence of the longest trained length (or the longest one there is)."""
    longest = max(task.heldout, key=len)
    example = next((s for s in task.heldout if len(s) == min(len(longest), 8)), longest)
    return task.collate([example])


def write_figures(out, trainer, task):
    from npformer import plots

    batch = example_for_plots(task)
    src_labels = [str(s) for s in task.decode(batch.src[0])]
    tgt_in_labels = ["BOS"] + [str(s) for s in task.decode(batch.tgt_in[0, 1:])]
    files = [plots.plot_curves(trainer.history, os.path.join(out, "curves.png"), "sequence reversal"),
             plots.plot_grad_norms(trainer.history, os.path.join(out, "grad_norms.png"))]
    maps = plots.record_attention(trainer.model, batch.src, batch.tgt_in)
    labels = {"encoder_self": (src_labels, src_labels), "decoder_self": (tgt_in_labels, tgt_in_labels),
              "cross": (tgt_in_labels, src_labels)}
    for group, layers in maps.items():
        path = os.path.join(out, f"attention_{group}.png")
        query, key = labels[group]
        files.append(plots.plot_attention([w[0] for w in layers], path,
                                          f"{plots.TITLES[group]}: input {' '.join(src_labels)}", query, key))
    return files


def main(argv=None):
    args = parse_args(argv)
    if args.checkpoint:
        return reverse_input(args)
    settings, seed = settings_from(args), args.seed
    if args.resume:  # the run's own settings; only --steps may change
        demo = demo_state(load_checkpoint(args.resume, restore_rng=False), args.resume)
        settings, seed = demo["settings"], demo["seed"]
        if args.steps is not None:
            settings["steps"] = args.steps
    ranks, main_rank = 1, True
    if args.distributed:  # before the model is built: with GPUs, each rank takes its own
        ranks, main_rank = dist.init().size, dist.rank() == 0
    os.makedirs(args.out, exist_ok=True)
    task = make_task(settings, seed)
    model, optimizer, scheduler = build(settings, seed, args.device)
    trained = dist.DistributedDataParallel(model) if args.distributed else model
    trainer = Seq2SeqTrainer(trained, optimizer, task, scheduler=scheduler, batch_size=settings["batch_size"],
                             label_smoothing=settings["label_smoothing"], clip_norm=settings["clip_norm"],
                             eval_every=settings["eval_every"], eval_size=200, progress=not args.quiet,
                             extra_state={"demo": {"settings": settings, "seed": seed, "preset": args.preset}})
    if args.resume:
        trainer.resume(args.resume)
    parameters = sum(p.size for p in model.parameters())
    if main_rank:
        print(f"reverse: preset {args.preset}, {task}, {parameters:,} parameters, {settings['steps']} steps "
              f"on {args.device}" + (f", {ranks} ranks" if args.distributed else ""), file=sys.stderr)

    train_start = time.perf_counter()
    checkpoint_path = os.path.join(args.out, "checkpoint.npz")
    result = trainer.fit(settings["steps"], checkpoint_path=checkpoint_path, checkpoint_every=500)
    train_seconds = time.perf_counter() - train_start
    if not main_rank:
        return None

    example = task.heldout[0]
    predicted = greedy_decode(model, [example], task.max_target_len, eos=EOS if task.eos else None)
    print(f"example: {' '.join(map(str, task.decode(example)))} -> "
          f"{' '.join(map(str, task.decode(predicted[0])))}", file=sys.stderr)
    files = write_figures(args.out, trainer, task) if args.plots else []
    metrics = {
        "exact_match": result["exact_match"], "token_accuracy": result["token_accuracy"],
        "heldout_sequences": result["sequences"], "decoding": "greedy, KV cache",
        "steps": trainer.step, "train_seconds": round(train_seconds, 2),
        "wall_seconds": round(time.perf_counter() - START, 2), "cpu_seconds": round(time.process_time(), 2),
        "parameters": int(parameters),
        "preset": args.preset, "seed": seed, "device": args.device, "ranks": ranks, "settings": settings,
        "model_config": model.config, "checkpoint": checkpoint_path, "figures": files,
    }
    with open(os.path.join(args.out, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)
    print(f"held-out ({result['sequences']} unseen sequences): exact-sequence accuracy "
          f"{result['exact_match']:.2%}, token accuracy {result['token_accuracy']:.2%}; "
          f"{trainer.step} steps, {metrics['wall_seconds']:.0f} s; wrote {args.out}/", file=sys.stderr)
    return metrics


if __name__ == "__main__":
    main()
