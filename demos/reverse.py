"""Train a Transformer to reverse sequences, then show what it learned.

    python demos/reverse.py                      # default preset: lengths 3..12 with padding -> runs/reverse/
    python demos/reverse.py --steps 20           # a quick smoke run -> runs/reverse-steps20/ (the warmup scales)
    python demos/reverse.py --preset seed        # the seed tutorial's setup (vocab 20, length 6) -> runs/reverse-seed/
    python demos/reverse.py --steps 2000 --min-len 2 --max-len 16 --out runs/long
    python demos/reverse.py --resume runs/reverse/checkpoint.npz --steps 1500
    python demos/reverse.py --checkpoint runs/reverse/checkpoint.npz --input "3 7 1 5"
    python -m npformer.distributed.launch -n 2 demos/reverse.py --distributed   # data-parallel, 2 ranks (MPI)

Symbols are the integers 1..vocab-3 (ids 0, 1, 2 are PAD, BOS, EOS). Each preset writes to its
own folder (runs/reverse for the default, runs/reverse-<preset> for the others; --out to
choose; --resume continues in the checkpoint's folder). A run shorter than its preset's
(--steps below the preset's steps) never writes over the full run: without --out it goes to
runs/reverse-steps<N> (runs/reverse-<preset>-steps<N>). Each folder holds metrics.json (held-out exact-sequence
and token accuracy of greedy decoding on 1,000 sequences never trained on, steps, seconds,
parameters), checkpoint.npz, checkpoint-step150.npz (the model after 150 steps, partly trained:
what demos/attention_grads.py studies), curves.png (loss, accuracy, lr),
attention_encoder_self.png, attention_decoder_self.png, attention_cross.png (every head of
every layer for one example), grad_norms.png (gradient norm per layer), and explorer.html with
explorer.json: P, dL/dP and dL/dS of every layer, head and attention kind for a few held-out
examples at every --explorer-every steps, with the training curves, in the browser (one
self-contained file; docs/explorer.md; `python -m npformer.explore` writes one for any run).

Results go to stdout, progress to stderr. Ctrl-C stops after the current step, saves a
checkpoint and prints the command that resumes it (exit status 130). A bad argument or file is
one line on stderr (exit status 2).
"""
import argparse
import contextlib
import json
import math
import os
import signal
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
import npformer  # noqa: E402
import npformer.distributed as dist  # noqa: E402
from npformer import load_checkpoint, load_model, optim  # noqa: E402
from npformer.checkpoint import CheckpointError  # noqa: E402
from npformer.data import EOS, SequenceTask  # noqa: E402
from npformer.decoding import greedy_decode  # noqa: E402
from npformer.explore import DATA_FILE, Collector, pick_examples, write_data, write_page  # noqa: E402
from npformer.models import Seq2SeqTransformer  # noqa: E402
from npformer.training import Seq2SeqTrainer  # noqa: E402

PROG = "reverse.py"
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
EXPLORER_SNAPSHOTS = 40  # the explorer's default: a snapshot every steps / 40 steps (and at step 0)
SNAPSHOT_STEP = 150  # attention_grads.py's default model: partly trained, so dL/dP is still large
EXIT_USAGE, EXIT_INTERRUPTED = 2, 130


class UsageError(Exception):
    """A bad argument or file: main() prints it as one line and exits with status 2."""


class Interrupted(Exception):
    """Ctrl-C during training, raised between two steps."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--preset", choices=sorted(PRESETS), default="default")
    p.add_argument("--steps", type=int, help="total optimisation steps (default: the preset's)")
    p.add_argument("--warmup", type=int, help="learning-rate warmup steps (default: the preset's share of the steps)")
    p.add_argument("--vocab", type=int, help="vocabulary size including PAD/BOS/EOS")
    p.add_argument("--min-len", dest="min_len", type=int)
    p.add_argument("--max-len", dest="max_len", type=int)
    p.add_argument("--batch-size", dest="batch_size", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="output folder (default: runs/reverse, runs/reverse-<preset>, or the folder "
                                 "of the --resume checkpoint)")
    p.add_argument("--snapshot-step", dest="snapshot_step", type=int, default=SNAPSHOT_STEP,
                   help=f"also keep the checkpoint of this step as checkpoint-step<N>.npz (default {SNAPSHOT_STEP}; "
                        "0: none)")
    p.add_argument("--explorer-every", dest="explorer_every", type=int,
                   help=f"the explorer's snapshots (P and dL/dP of a few held-out examples): every N steps (default: "
                        f"steps / {EXPLORER_SNAPSHOTS}; 0: no explorer.html)")
    p.add_argument("--explorer-examples", dest="explorer_examples", type=int, default=3,
                   help="held-out examples in the explorer (default 3)")
    p.add_argument("--resume", metavar="CKPT", help="continue training from a checkpoint of this demo")
    p.add_argument("--checkpoint", metavar="CKPT", help="with --input: load a trained model")
    p.add_argument("--input", help='with --checkpoint: symbols to reverse, e.g. "3 7 1 5"')
    p.add_argument("--no-plots", dest="plots", action="store_false", help="skip the figures")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.add_argument("--distributed", action="store_true",
                   help="data-parallel training over the ranks of an MPI job (python -m npformer.distributed.launch "
                        "-n N demos/reverse.py ..., or mpiexec -n N python demos/reverse.py ...): each rank "
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
    """The preset's settings with the command line's overrides; the warmup keeps the preset's
    share of the steps unless --warmup is given."""
    preset = PRESETS[args.preset]
    settings = dict(preset)
    for key in ("steps", "vocab", "min_len", "max_len", "batch_size", "lr"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    if settings["min_len"] > settings["max_len"]:
        if args.max_len is None:  # only --min-len given: keep a valid range
            settings["max_len"] = settings["min_len"]
        else:
            raise UsageError(f"--min-len ({settings['min_len']}) must be <= --max-len ({settings['max_len']})")
    if args.warmup is None and args.steps is not None:
        settings["warmup"] = round(preset["warmup"] * settings["steps"] / preset["steps"])
    return checked_schedule(settings, args)


def checked_schedule(settings, args):
    """The settings with --warmup applied, once steps and warmup fit together."""
    if args.warmup is not None:
        settings["warmup"] = args.warmup
    if settings["steps"] < 1:
        raise UsageError(f"--steps: expected a positive number of steps, got {settings['steps']}")
    if settings["batch_size"] < 1:
        raise UsageError(f"--batch-size: expected a positive integer, got {settings['batch_size']}")
    if not (math.isfinite(settings["lr"]) and settings["lr"] > 0):
        raise UsageError(f"--lr: expected a finite number > 0, got {settings['lr']}")
    if args.snapshot_step < 0:
        raise UsageError(f"--snapshot-step: expected an integer >= 0 (0: none), got {args.snapshot_step}")
    if args.explorer_every is not None and args.explorer_every < 0:
        raise UsageError(f"--explorer-every: expected an integer >= 0 (0: no explorer), got {args.explorer_every}")
    if args.explorer_examples < 1:
        raise UsageError(f"--explorer-examples: expected a positive integer, got {args.explorer_examples}")
    if not 0 <= settings["warmup"] <= settings["steps"]:
        raise UsageError(f"--warmup: expected 0..{settings['steps']} (at most --steps), got {settings['warmup']}"
                         + ("" if args.warmup is not None else "; give --warmup"))
    return settings


def make_task(settings, seed):
    try:
        return SequenceTask("reverse", vocab_size=settings["vocab"], min_len=settings["min_len"],
                            max_len=settings["max_len"], seed=seed)
    except ValueError as e:  # --vocab / --min-len / --max-len out of range
        raise UsageError(str(e)) from None


def build(settings, seed, device):
    """Seeded model, optimizer and scheduler for the settings."""
    npformer.manual_seed(seed)
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


def read_checkpoint(path, option):
    """The checkpoint dict of a run of this demo at `path`, or a UsageError naming `option`."""
    if not os.path.exists(path):
        raise UsageError(f"{option}: {path} does not exist (train a model first: python demos/reverse.py)")
    if os.path.isdir(path):
        raise UsageError(f"{option}: {path} is a folder; give the checkpoint file, e.g. "
                         f"{os.path.join(path, 'checkpoint.npz')}")
    try:
        ckpt = load_checkpoint(path, restore_rng=False)
    except (CheckpointError, OSError) as e:
        raise UsageError(f"{option}: {e}") from None
    if "demo" not in ckpt:
        raise UsageError(f"{option}: {path} is not a checkpoint of demos/reverse.py (it has no 'demo' settings)")
    return ckpt


def reverse_input(args):
    """--checkpoint CKPT --input "3 7 1 5": print the model's reversal."""
    demo = read_checkpoint(args.checkpoint, "--checkpoint")["demo"]
    settings = demo["settings"]
    model, _ = load_model(args.checkpoint, device=args.device)
    task = make_task(settings, demo["seed"])
    try:
        symbols = [int(s) for s in args.input.replace(",", " ").split()]
    except ValueError:
        raise UsageError(f"--input: expected symbols 1..{task.num_symbols} separated by spaces, "
                         f"got {args.input!r}") from None
    try:
        ids = task.encode(symbols)
    except ValueError as e:
        raise UsageError(f"--input: {e}") from None
    if not ids:
        raise UsageError("--input: give at least one symbol")
    longest = model.config["max_len"] - int(task.eos)  # the source and the decoded target must fit the table
    if len(ids) > longest:
        raise UsageError(f"--input: {len(ids)} symbols, but this model reads at most {longest} (its positional "
                         f"table has {model.config['max_len']} positions; it was trained on lengths "
                         f"{settings['min_len']}..{settings['max_len']})")
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
    maps = plots.attention_maps(trainer.model, batch.src, batch.tgt_in)
    labels = {"encoder_self": (src_labels, src_labels), "decoder_self": (tgt_in_labels, tgt_in_labels),
              "cross": (tgt_in_labels, src_labels)}
    for group, layers in maps.items():
        path = os.path.join(out, f"attention_{group}.png")
        query, key = labels[group]
        files.append(plots.plot_attention([w[0] for w in layers], path,
                                          f"{plots.TITLES[group]}: input {' '.join(src_labels)}", query, key))
    return files


def start_explorer(out, model, task, examples, preset, step):
    """The explorer's Collector for a run at `step`: with the snapshots up to `step` of the run's
    explorer.json when resuming a run that has one (for the same examples), else with one now."""
    explorer = Collector(model, task, pick_examples(task, examples), title=f"sequence reversal, preset {preset}")
    saved = os.path.join(out, DATA_FILE)
    if not (step and os.path.exists(saved) and explorer.adopt(saved, step)):
        explorer.take(step)
    return explorer


def write_explorer(out, explorer, trainer):
    """explorer.html and explorer.json in `out`, with a last snapshot at the final step. -> the page's path."""
    if explorer.steps()[-1:] != [trainer.step]:
        explorer.take(trainer.step)
    data = explorer.data(trainer.history)
    write_data(os.path.join(out, DATA_FILE), data)
    return write_page(os.path.join(out, "explorer.html"), data)


def default_out(preset, steps):
    """The folder of a run without --out: runs/reverse (default preset) or runs/reverse-<preset>,
    with -steps<N> added when the run is shorter than the preset's, so that a smoke run never
    replaces the checkpoint, metrics and figures of a finished one."""
    name = "reverse" if preset == "default" else f"reverse-{preset}"
    if steps < PRESETS[preset]["steps"]:
        name += f"-steps{steps}"
    return os.path.join("runs", name)


def run_settings(args):
    """(settings, seed, preset, out, resumed checkpoint or None) of a training run: from the
    command line, or, with --resume, the run's own (only --steps and --warmup may change)."""
    if not args.resume:
        settings = settings_from(args)
        return settings, args.seed, args.preset, args.out or default_out(args.preset, settings["steps"]), None
    demo = read_checkpoint(args.resume, "--resume")["demo"]
    settings = dict(demo["settings"])
    if args.steps is not None:
        settings["steps"] = args.steps
    out = args.out or os.path.dirname(args.resume) or "."
    return checked_schedule(settings, args), demo["seed"], demo["preset"], out, demo


@contextlib.contextmanager
def stop_on_ctrl_c(state):
    """While open, the first Ctrl-C (SIGINT) asks to stop (sets state["asked"]; the training
    loop stops after the current step); a second one stops at once (KeyboardInterrupt)."""

    def ask(signum, frame):
        if state["asked"]:
            raise KeyboardInterrupt
        state["asked"] = True
        print("\nCtrl-C: stopping after this step and saving a checkpoint (Ctrl-C again: stop now, unsaved)",
              file=sys.stderr, flush=True)

    try:
        previous = signal.signal(signal.SIGINT, ask)
    except ValueError:  # not the main thread: leave Ctrl-C alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def train(args):
    settings, seed, preset, out, resumed = run_settings(args)
    ranks, main_rank = 1, True
    if args.distributed:  # before the model is built: with GPUs, each rank takes its own
        ranks, main_rank = dist.init().size, dist.rank() == 0
        if "NPFORMER_NUM_THREADS" not in os.environ:  # the ranks share the cores (as torchrun's OMP_NUM_THREADS)
            npformer.runtime.threads.set_num_threads(max(1, npformer.runtime.threads.available_cores() // ranks))
    os.makedirs(out, exist_ok=True)
    task = make_task(settings, seed)
    model, optimizer, scheduler = build(settings, seed, args.device)
    trained = dist.DistributedDataParallel(model) if args.distributed else model
    checkpoint_path = os.path.join(out, "checkpoint.npz")
    snapshot_path = os.path.join(out, f"checkpoint-step{args.snapshot_step}.npz")
    ctrl_c = {"asked": False}  # set by the first Ctrl-C while training (stop_on_ctrl_c)

    every = args.explorer_every if args.explorer_every is not None else max(1, settings["steps"] // EXPLORER_SNAPSHOTS)
    explorer = None  # the explorer's Collector; none with --distributed (its backward would run on one rank alone)

    def between_steps(trainer, record):
        """The step callback (between two steps the run is consistent): keep the snapshot and the
        explorer's, stop on Ctrl-C."""
        if trainer.step == args.snapshot_step:
            trainer.save(snapshot_path)
        if explorer is not None and trainer.step % every == 0:
            explorer.take(trainer.step)
        if ctrl_c["asked"]:
            raise Interrupted

    trainer = Seq2SeqTrainer(trained, optimizer, task, scheduler=scheduler, batch_size=settings["batch_size"],
                             label_smoothing=settings["label_smoothing"], clip_norm=settings["clip_norm"],
                             eval_every=settings["eval_every"], eval_size=200, progress=not args.quiet,
                             extra_state={"demo": {"settings": settings, "seed": seed, "preset": preset}},
                             callbacks=[between_steps], record_steps=True)
    if resumed:
        trainer.resume(args.resume)
    if every and not args.distributed:
        explorer = start_explorer(out, model, task, args.explorer_examples, preset, trainer.step)
    parameters = sum(p.size for p in model.parameters())

    with stop_on_ctrl_c(ctrl_c):
        if main_rank:
            print(f"reverse: preset {preset}" + (f" (resumed at step {trainer.step} from {args.resume})" if resumed
                                                 else "")
                  + f", {task}, {parameters:,} parameters, {settings['steps']} steps on {args.device}"
                  + (f", {ranks} ranks" if args.distributed else ""), file=sys.stderr)
        train_start = time.perf_counter()
        try:
            result = trainer.fit(settings["steps"], checkpoint_path=checkpoint_path, checkpoint_every=500)
            if ctrl_c["asked"]:  # during the final evaluation: the checkpoint is saved, skip the rest
                raise Interrupted
        except Interrupted:
            trainer.save(checkpoint_path)
            print(f"interrupted at step {trainer.step}/{settings['steps']}; saved {checkpoint_path}\n"
                  f"resume with: python demos/reverse.py --resume {checkpoint_path}", file=sys.stderr)
            raise SystemExit(EXIT_INTERRUPTED) from None
    train_seconds = time.perf_counter() - train_start
    if not main_rank:
        return None

    example = task.heldout[0]
    predicted = greedy_decode(model, [example], task.max_target_len, eos=EOS if task.eos else None)
    print(f"example: {' '.join(map(str, task.decode(example)))} -> {' '.join(map(str, task.decode(predicted[0])))}")
    files = write_figures(out, trainer, task) if args.plots else []
    explorer_page = write_explorer(out, explorer, trainer) if explorer is not None else None
    metrics = {
        "exact_match": result["exact_match"], "token_accuracy": result["token_accuracy"],
        "heldout_sequences": result["sequences"], "decoding": "greedy, KV cache",
        "steps": trainer.step, "train_seconds": round(train_seconds, 2),
        "wall_seconds": round(time.perf_counter() - START, 2), "cpu_seconds": round(time.process_time(), 2),
        "parameters": int(parameters),
        "preset": preset, "seed": seed, "device": args.device, "ranks": ranks,
        "threads_per_rank": npformer.runtime.threads.get_num_threads(), "settings": settings,
        "model_config": model.config, "checkpoint": checkpoint_path, "figures": files,
        "explorer": explorer_page,
    }
    with open(os.path.join(out, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)
    print(f"held-out ({result['sequences']} unseen sequences): exact-sequence accuracy "
          f"{result['exact_match']:.2%}, token accuracy {result['token_accuracy']:.2%}; "
          f"{trainer.step} steps, {metrics['wall_seconds']:.0f} s; wrote {out}/")
    return metrics


def main(argv=None):
    args = parse_args(argv)
    try:
        return reverse_input(args) if args.checkpoint else train(args)
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from None
    except KeyboardInterrupt:
        print("\ninterrupted (nothing saved since the last checkpoint)", file=sys.stderr)
        raise SystemExit(EXIT_INTERRUPTED) from None


if __name__ == "__main__":
    main()
