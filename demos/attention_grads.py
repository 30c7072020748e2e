"""Attention weights next to the gradient of the loss with respect to them (dL/dP), per head.

    python demos/attention_grads.py            # runs/reverse/checkpoint-step150.npz, cross-attention, last layer
    python demos/attention_grads.py --attention encoder --layer 0 --index 3
    python demos/attention_grads.py --checkpoint runs/reverse/checkpoint.npz --out trained.png

For one held-out example of the reversal task, `npformer.nn.record_attention` records the
probabilities P = softmax(Q K^T / sqrt(hd) + mask) of every attention module and, after the
teacher-forced cross-entropy's backward pass, dL/dP. Positive dL/dP (red): attending more to
that key would raise the loss; negative (blue): lower it. Cells where P = 0 (masked keys: the
decoder's future positions, padding) are grey: dL/dP is not 0 there, but nothing flows through
them. The bottom row is dL/dS = P * (dL/dP - r), r = sum over the keys of P dL/dP, the
gradient that reaches the scores S = Q K^T / sqrt(hd) (the softmax's backward; it sums to 0
over each query's keys). The default model is the snapshot demos/reverse.py keeps after 150
steps: partly trained, so dL/dP is still large and shows which keys would help; in a fully
trained model the loss is nearly 0 and so is dL/dP (about 1e-4). Without that file, the same 150 steps are trained first (~20 s).
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import reverse  # noqa: E402  (demos/reverse.py: the task, the model and its snapshot)
from autograd import backend  # noqa: E402
from npformer import functional as F  # noqa: E402
from npformer import load_model, nn, plots  # noqa: E402
from npformer.data import PAD  # noqa: E402
from npformer.training import Seq2SeqTrainer  # noqa: E402

DEFAULT_CHECKPOINT = os.path.join("runs", "reverse", f"checkpoint-step{reverse.SNAPSHOT_STEP}.npz")
KINDS = {"cross": ("decoder", "multihead_attn", "cross-attention (decoder queries, encoder keys)"),
         "encoder": ("encoder", "self_attn", "encoder self-attention"),
         "decoder": ("decoder", "self_attn", "decoder self-attention (causal)")}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="attention_grads.py", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--checkpoint", default=DEFAULT_CHECKPOINT, help="a checkpoint of demos/reverse.py")
    p.add_argument("--attention", choices=sorted(KINDS), default="cross")
    p.add_argument("--layer", type=int, default=-1, help="layer index (negative counts from the last)")
    p.add_argument("--index", type=int, default=0, help="which held-out sequence")
    p.add_argument("--out", default=os.path.join("runs", "reverse", "attention_grads.png"))
    return p.parse_args(argv)


def snapshot_model():
    """(model, task): the default preset trained for SNAPSHOT_STEP steps exactly as
    demos/reverse.py trains it, so the result equals its checkpoint-step150.npz."""
    settings = reverse.PRESETS["default"]
    task = reverse.make_task(settings, 0)
    model, optimizer, scheduler = reverse.build(settings, 0, "cpu")
    trainer = Seq2SeqTrainer(model, optimizer, task, scheduler=scheduler, batch_size=settings["batch_size"],
                             clip_norm=settings["clip_norm"])
    for _ in range(reverse.SNAPSHOT_STEP):
        trainer.train_step()
    return model, task


def load(args):
    """(model, task, training step) of the checkpoint, or of the snapshot trained now when the
    default file is missing."""
    if os.path.exists(args.checkpoint):
        ckpt = reverse.read_checkpoint(args.checkpoint, "--checkpoint")
        task = reverse.make_task(ckpt["demo"]["settings"], ckpt["demo"]["seed"])
        return load_model(args.checkpoint)[0], task, ckpt.get("step", "?")
    if args.checkpoint != DEFAULT_CHECKPOINT:
        raise reverse.UsageError(f"--checkpoint: {args.checkpoint} does not exist")
    print(f"no {DEFAULT_CHECKPOINT} (python demos/reverse.py writes it): training the default preset for "
          f"{reverse.SNAPSHOT_STEP} steps first", file=sys.stderr)
    return snapshot_model() + (reverse.SNAPSHOT_STEP,)


def module_name(model, kind, layer):
    """The name of the attention module asked for, and a title for it ('decoder layer 1 of 2')."""
    stack_name, attn, _ = KINDS[kind]
    layers = getattr(model.transformer, stack_name).layers
    if not -len(layers) <= layer < len(layers):
        raise reverse.UsageError(f"--layer: the {stack_name} has {len(layers)} layers (0..{len(layers) - 1}, or "
                                 f"-1..-{len(layers)} from the last), got {layer}")
    index = layer % len(layers)
    return f"transformer.{stack_name}.layers.{index}.{attn}", f"{stack_name} layer {index} of {len(layers)}"


def weights_and_grads(model, batch, name):
    """P and dL/dP (H, Tq, Tk) of the attention module `name` for a one-sequence batch, and
    the teacher-forced loss, recorded with nn.record_attention."""
    model.eval()  # no dropout: P are the probabilities
    with nn.record_attention(model) as recorder:
        logits = model(batch.src, batch.tgt_in)                                       # (1, T, V)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch.tgt_out.reshape(-1), ignore_index=PAD)
        loss.backward()
    record = recorder[name]
    return record.weights.numpy()[0], backend.as_numpy(record.grad)[0], loss.item()


def run(args):
    model, task, step = load(args)
    if not 0 <= args.index < len(task.heldout):
        raise reverse.UsageError(f"--index: expected 0..{len(task.heldout) - 1}, got {args.index}")
    batch = task.collate([task.heldout[args.index]])
    name, where = module_name(model, args.attention, args.layer)
    weights, grads, loss = weights_and_grads(model, batch, name)
    src = [str(s) for s in task.decode(batch.src[0])]
    tgt_in = ["BOS"] + [str(s) for s in task.decode(batch.tgt_in[0, 1:])]
    (query, query_side), (key, key_side) = {
        "encoder": ((src, "source"), (src, "source")), "decoder": ((tgt_in, "decoder input"), (tgt_in, "decoder input")),
        "cross": ((tgt_in, "decoder input"), (src, "source"))}[args.attention]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    title = (f"{KINDS[args.attention][2]}, {where}: P, dL/dP and dL/dS for the input {' '.join(src)} "
             f"(loss {loss:.3g}, after {step} training steps)")
    plots.plot_attention_and_grads(weights, grads, args.out, title, query, key,
                                   query_axis=f"query: {query_side}", key_axis=f"key: {key_side}")
    print(f"{name}: loss {loss:.4g}")
    panels = plots.attention_panels(weights, grads)
    for h in range(weights.shape[0]):
        print(f"head {h}: max P {weights[h].max():.3f}, max |dL/dP| {abs(panels['dL/dP'][h]).max():.3g} "
              f"(where P > 0), max |dL/dS| {abs(panels['dL/dS'][h]).max():.3g}")
    print(f"wrote {args.out}", file=sys.stderr)
    return args.out


def main(argv=None):
    args = parse_args(argv)
    try:
        return run(args)
    except reverse.UsageError as e:
        print(f"attention_grads.py: error: {e}", file=sys.stderr)
        raise SystemExit(reverse.EXIT_USAGE) from None


if __name__ == "__main__":
    main()
