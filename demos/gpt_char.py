"""Train a character-level GPT on the docstrings of Python's standard library, then sample from it.

    python demos/gpt_char.py                          # about 4 minutes on 2 CPU cores
    python demos/gpt_char.py --steps 300 --out runs/quick
    python demos/gpt_char.py --prompt "Return the "   # what the samples start with

The corpus is on every machine that runs this script: every docstring (module, class, function)
of the top-level modules of the running Python's standard library
(sysconfig.get_paths()["stdlib"]/*.py, parsed with ast: nothing is imported), modules in name
order, docstrings joined by blank lines. Every tenth module (by name) is held out. Characters
are the tokens (the vocabulary: every character of the corpus).

The model: CausalLM (pre-LN, GELU, learned positions) with d_model 128, 4 layers, 4 heads,
d_ff 512, context 64 characters, trained with AdamW (weight decay on matrices), batches of 32
random windows, warm-up then cosine decay. No dropout by default: 1,200 steps see about three
training passes over the corpus, too few to overfit, and dropout only slowed the run down
(measured: 2.42 bits per character without it in 170 s of training; 2.72 with --dropout 0.1,
whose slower steps the 225-second budget stopped at step 896). Training stops at --steps or when
--max-train-seconds have passed, whichever comes first (metrics.json says which).

Printed: samples before and after training (temperature 0.8, top-k 20; longer than the context
by sliding the window). Written to --out (default runs/gpt_char): metrics.json (held-out loss in
nats and bits per character, the unigram baseline's bits per character on the same characters,
training loss, steps, seconds, corpus, config, samples), loss.png (training loss, held-out
evaluations and the unigram baseline, in bits per character), attention.png (every head of every
layer on one held-out window) and checkpoint.npz (npformer.load_checkpoint).
"""
import argparse
import ast
import json
import math
import os
import platform
import sys
import sysconfig
import time

START = time.perf_counter()
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402

import npformer  # noqa: E402
import npformer.functional as F  # noqa: E402
from npformer import optim  # noqa: E402
from npformer.decoding import generate  # noqa: E402
from npformer.models import CausalLM  # noqa: E402

DEFAULTS = dict(d_model=128, layers=4, heads=4, d_ff=512, context=64, batch_size=32, dropout=0.0, lr=2e-3,
                weight_decay=0.1, warmup=100, steps=1200, eval_every=200, eval_windows=256)
HELD_OUT_EVERY = 10  # every tenth module (by name) is held out


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="gpt_char.py", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    for name, value in DEFAULTS.items():
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=type(value),
                       default=None if name == "warmup" else value)
    p.add_argument("--max-train-seconds", type=float, default=225.0,
                   help="stop training after this long even before --steps (keeps the run within 5 minutes)")
    p.add_argument("--prompt", default="Return the ", help="what the samples start with")
    p.add_argument("--sample-length", type=int, default=240, help="characters per sample")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join("runs", "gpt_char"))
    p.add_argument("--no-plots", dest="plots", action="store_false", help="skip the figures")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    args = p.parse_args(argv)
    check_args(p, args)
    return args


def check_args(parser, args):
    """A one-line usage error (exit status 2) for settings the run cannot use, before anything is built."""
    def option(name):
        return "--" + name.replace("_", "-")

    for name in ("d_model", "layers", "heads", "d_ff", "context", "batch_size", "steps", "eval_every", "eval_windows"):
        if getattr(args, name) < 1:
            parser.error(f"{option(name)}: expected a positive integer, got {getattr(args, name)}")
    if args.d_model % args.heads:
        parser.error(f"--heads: {args.heads} does not divide --d-model {args.d_model} (each head gets d_model / heads "
                     "features)")
    if args.warmup is None:  # the defaults' share of the steps, as demos/reverse.py
        args.warmup = round(DEFAULTS["warmup"] * args.steps / DEFAULTS["steps"])
    if not 0 <= args.warmup <= args.steps:
        parser.error(f"--warmup: expected 0..{args.steps} (at most --steps), got {args.warmup}")
    if args.sample_length < 0:
        parser.error(f"--sample-length: expected an integer >= 0, got {args.sample_length}")
    for name, low in (("lr", "> 0"), ("max_train_seconds", "> 0"), ("weight_decay", ">= 0")):
        value = getattr(args, name)
        if not (math.isfinite(value) and (value > 0 if low == "> 0" else value >= 0)):
            parser.error(f"{option(name)}: expected a finite number {low}, got {value}")
    if not 0 <= args.dropout < 1:
        parser.error(f"--dropout: expected a probability in [0, 1), got {args.dropout}")


# -- the corpus ---------------------------------------------------------------------------------
def docstrings(path):
    """The docstrings of a Python source file (module, classes, functions), in source order."""
    try:
        tree = ast.parse(open(path, encoding="utf-8").read())
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    nodes = (n for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                                         ast.AsyncFunctionDef)))
    found = [(getattr(n, "lineno", 0), ast.get_docstring(n)) for n in nodes]
    return [doc for _, doc in sorted(found, key=lambda item: item[0]) if doc]


def load_corpus():
    """(train text, held-out text, description) from the standard library's docstrings."""
    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(f for f in os.listdir(stdlib) if f.endswith(".py"))
    train, heldout = [], []
    for i, name in enumerate(files):
        (heldout if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else train).extend(docstrings(os.path.join(stdlib, name)))
    train_text, heldout_text = "\n\n".join(train), "\n\n".join(heldout)
    if len(train_text) < 10_000 or len(heldout_text) < 1_000:
        raise SystemExit(f"gpt_char: too few docstrings found in {stdlib} ({len(train_text)} + {len(heldout_text)} "
                         f"characters); this demo needs the standard library's .py sources")
    description = {"source": "docstrings of the Python standard library's top-level modules (parsed with ast)",
                   "stdlib": stdlib, "python": platform.python_version(), "modules": len(files),
                   "held_out": f"every {HELD_OUT_EVERY}th module by name", "train_characters": len(train_text),
                   "heldout_characters": len(heldout_text)}
    return train_text, heldout_text, description


class Characters:
    """Characters <-> ids over a fixed vocabulary."""

    def __init__(self, text):
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    def encode(self, text):
        unknown = sorted(set(text) - set(self.index))
        if unknown:
            raise SystemExit(f"gpt_char: characters outside the vocabulary: {unknown!r}")
        return np.array([self.index[c] for c in text], dtype=np.int64)

    def decode(self, ids):
        return "".join(self.chars[int(i)] for i in ids)


def unigram_bits(train_ids, targets, vocab):
    """Cross-entropy (bits per character) of `targets` under the training text's character
    frequencies (add-one smoothed): what a model without context achieves."""
    counts = np.bincount(train_ids, minlength=vocab) + 1.0
    return float(-np.log2(counts / counts.sum())[targets].mean())


def heldout_windows(ids, context, count):
    """Up to `count` non-overlapping windows of context + 1 characters spread over `ids`."""
    starts = np.linspace(0, len(ids) - context - 1, num=min(count, (len(ids) - 1) // (context + 1)), dtype=np.int64)
    return np.stack([ids[s:s + context + 1] for s in starts])                       # (N, context + 1)


# -- training -----------------------------------------------------------------------------------
def build(settings, vocab, seed):
    npformer.manual_seed(seed)
    model = CausalLM(vocab, d_model=settings["d_model"], nhead=settings["heads"], num_layers=settings["layers"],
                     dim_feedforward=settings["d_ff"], dropout=settings["dropout"], max_len=settings["context"])
    matrices = [p for p in model.parameters() if p.ndim == 2]
    others = [p for p in model.parameters() if p.ndim != 2]
    optimizer = optim.AdamW([{"params": matrices, "weight_decay": settings["weight_decay"]},
                             {"params": others, "weight_decay": 0.0}], lr=settings["lr"], betas=(0.9, 0.99))
    scheduler = optim.WarmupCosineLR(optimizer, settings["warmup"], settings["steps"], min_ratio=0.1)
    return model, optimizer, scheduler


def evaluate(model, windows, batch_size):
    """Mean next-character cross-entropy (nats) over every position of the held-out windows."""
    total, count = 0.0, 0
    model.eval()
    with npformer.no_grad():
        for i in range(0, len(windows), batch_size):
            batch = windows[i:i + batch_size]
            logits = model(batch[:, :-1])                                            # (b, T, V)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum")
            total, count = total + loss.item(), count + batch[:, 1:].size
    model.train()
    return total / count


def sample(model, chars, prompt, length, context, seed):
    """`length` characters after `prompt` (temperature 0.8, top-k 20), sliding the context
    window: each call continues the last 3/4 of a context by a quarter of one."""
    ids = list(chars.encode(prompt))
    rng_seed, chunk = seed, max(1, context // 4)
    while len(ids) < len(prompt) + length:
        window = ids[-(context - chunk):]
        new = min(chunk, len(prompt) + length - len(ids))
        out = generate(model, np.array([window]), new, temperature=0.8, top_k=20, seed=rng_seed)
        ids.extend(out[0, len(window):].tolist())
        rng_seed += 1
    return chars.decode(ids)


def write_figures(out, history, model, chars, window, unigram):
    from npformer import plots

    bits = 1 / math.log(2)
    files = [plots.plot_loss(history["step"], np.array(history["loss"]) * bits, os.path.join(out, "loss.png"),
                             "character-level GPT on the standard library's docstrings",
                             {"held-out": (history["eval_step"], np.array(history["eval_loss"]) * bits)},
                             {"unigram baseline (held-out)": unigram}, ylabel="cross-entropy (bits per character)")]
    maps = plots.attention_maps(model, window[None])["encoder_self"]                # layers of (1, H, T, T)
    labels = [repr(c)[1:-1] or " " for c in chars.decode(window)]
    files.append(plots.plot_attention([m[0] for m in maps], os.path.join(out, "attention.png"),
                                      f"causal self-attention, every head: {chars.decode(window)!r}", labels, labels))
    return files


def main(argv=None):
    args = parse_args(argv)
    settings = {name: getattr(args, name) for name in DEFAULTS}
    os.makedirs(args.out, exist_ok=True)
    log = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))
    train_text, heldout_text, corpus = load_corpus()
    chars = Characters(train_text + heldout_text + args.prompt)
    train_ids, heldout_ids = chars.encode(train_text), chars.encode(heldout_text)
    context, vocab = settings["context"], len(chars.chars)
    windows = heldout_windows(heldout_ids, context, settings["eval_windows"])
    unigram = unigram_bits(train_ids, windows[:, 1:].reshape(-1), vocab)
    model, optimizer, scheduler = build(settings, vocab, args.seed)
    parameters = sum(p.size for p in model.parameters())
    log(f"gpt_char: {corpus['train_characters']:,} training and {corpus['heldout_characters']:,} held-out "
        f"characters ({corpus['source']}, Python {corpus['python']}), vocabulary {vocab}, {parameters:,} parameters, "
        f"npformer threads {npformer.get_num_threads()}")
    before = sample(model, chars, args.prompt, args.sample_length, context, args.seed)
    log(f"sample before training:\n{before}\n")

    rng = np.random.default_rng(args.seed)
    offsets = np.arange(context + 1)
    history = {"step": [], "loss": [], "eval_step": [], "eval_loss": []}
    train_start = time.perf_counter()
    stopped_by = "steps"
    for step in range(1, settings["steps"] + 1):
        starts = rng.integers(0, len(train_ids) - context - 1, size=settings["batch_size"])
        batch = train_ids[starts[:, None] + offsets]                                    # (B, T + 1)
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, vocab), batch[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optim.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        history["step"].append(step)
        history["loss"].append(loss.item())
        out_of_time = time.perf_counter() - train_start > args.max_train_seconds
        if step % settings["eval_every"] == 0 or step == settings["steps"] or out_of_time:
            history["eval_step"].append(step)
            history["eval_loss"].append(evaluate(model, windows, settings["batch_size"]))
            log(f"step {step:5d}  train {history['loss'][-1] / math.log(2):.3f}  held-out "
                f"{history['eval_loss'][-1] / math.log(2):.3f} bits/char  ({time.perf_counter() - train_start:.0f} s)")
        if out_of_time:
            stopped_by = "max_train_seconds"
            break
    train_seconds = time.perf_counter() - train_start

    after = sample(model, chars, args.prompt, args.sample_length, context, args.seed)
    log(f"\nsample after training:\n{after}\n")
    heldout_nats = history["eval_loss"][-1]
    files = write_figures(args.out, history, model, chars, windows[0, :-1][:24], unigram) if args.plots else []
    checkpoint = os.path.join(args.out, "checkpoint.npz")
    npformer.save_checkpoint(checkpoint, model, optimizer, demo={"settings": settings, "vocabulary": chars.chars})
    metrics = {
        "heldout_loss_nats": round(heldout_nats, 4), "heldout_bits_per_char": round(heldout_nats / math.log(2), 4),
        "unigram_bits_per_char": round(unigram, 4),
        "heldout_characters_scored": int(windows[:, 1:].size),
        "train_loss_bits_per_char_last_50": round(float(np.mean(history["loss"][-50:])) / math.log(2), 4),
        "steps": history["step"][-1], "stopped_by": stopped_by, "train_seconds": round(train_seconds, 1),
        "wall_seconds": round(time.perf_counter() - START, 1), "cpu_seconds": round(time.process_time(), 1),
        "npformer_threads": npformer.get_num_threads(), "parameters": int(parameters), "vocabulary": vocab,
        "corpus": corpus, "settings": settings, "seed": args.seed, "model_config": model.config,
        "sample_before": before, "sample_after": after, "checkpoint": checkpoint, "figures": files,
    }
    with open(os.path.join(args.out, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)
    print(f"held-out: {metrics['heldout_bits_per_char']:.3f} bits per character (unigram baseline "
          f"{metrics['unigram_bits_per_char']:.3f}) after {metrics['steps']} steps, {metrics['wall_seconds']:.0f} s; "
          f"wrote {args.out}/", file=sys.stderr)
    return metrics


if __name__ == "__main__":
    main()
