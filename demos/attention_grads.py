"""Attention weights next to the gradient of the loss with respect to them (dL/dP), per head.

    python demos/attention_grads.py                                   # uses runs/reverse/checkpoint.npz
    python demos/attention_grads.py --attention encoder --layer 0 --index 3
    python demos/attention_grads.py --checkpoint my.npz --out grads.png

For one held-out example of the reversal task, the chosen attention module computes its
probabilities P = softmax(Q K^T / sqrt(hd) + mask) with F.scaled_dot_product_attention(...,
return_weights=True), then its output as P @ V with autograd, so after the teacher-forced
cross-entropy's backward pass `P.grad` (kept by `retain_grad()`) is dL/dP. Positive dL/dP:
attending more to that key would raise the loss; negative: lower it. Without a checkpoint
(and none at the default path) a small model is trained first with the seed preset.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import autograd  # noqa: E402
from npformer import functional as F  # noqa: E402
from npformer import load_model, optim, plots  # noqa: E402
from npformer.data import PAD, SequenceTask  # noqa: E402
from npformer.models import Seq2SeqTransformer  # noqa: E402
from npformer.training import Trainer  # noqa: E402

DEFAULT_CHECKPOINT = os.path.join("runs", "reverse", "checkpoint.npz")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--checkpoint", default=DEFAULT_CHECKPOINT, help="a checkpoint of demos/reverse.py")
    p.add_argument("--attention", choices=["cross", "encoder", "decoder"], default="cross")
    p.add_argument("--layer", type=int, default=-1, help="layer index (negative counts from the last)")
    p.add_argument("--index", type=int, default=0, help="which held-out sequence")
    p.add_argument("--steps", type=int, default=300, help="training steps when there is no checkpoint")
    p.add_argument("--out", default=os.path.join("runs", "reverse", "attention_grads.png"))
    return p.parse_args(argv)


def trained_model(args):
    """(model, task): from the checkpoint, or a short training run of the tutorial's setup."""
    if os.path.exists(args.checkpoint):
        model, ckpt = load_model(args.checkpoint)
        return model, SequenceTask(**ckpt["trainer"]["task"]["config"])
    if args.checkpoint != DEFAULT_CHECKPOINT:
        raise SystemExit(f"--checkpoint: {args.checkpoint} does not exist")
    print(f"no {DEFAULT_CHECKPOINT}: training the seed preset for {args.steps} steps first", file=sys.stderr)
    autograd.manual_seed(0)
    task = SequenceTask("reverse", vocab_size=20, min_len=6, seed=0)
    model = Seq2SeqTransformer(20, 20, d_model=32, nhead=4, num_encoder_layers=2, num_decoder_layers=2,
                               dim_feedforward=64, dropout=0.1, pad_idx=PAD)
    Trainer(model, optim.Adam(model.parameters(), lr=3e-3), task, batch_size=64).fit(args.steps)
    return model, task


def attention_module(model, kind, layer):
    stack = model.transformer.encoder if kind == "encoder" else model.transformer.decoder
    if not -len(stack.layers) <= layer < len(stack.layers):
        raise SystemExit(f"--layer: the {kind} stack has {len(stack.layers)} layers, got {layer}")
    block = stack.layers[layer]
    return block.multihead_attn if kind == "cross" else block.self_attn


def weights_and_grads(model, module, batch):
    """Run the example with `module` computing P explicitly; return (P, dL/dP, loss) of the example."""
    captured = {}

    def attend(q, k, v, mask=None, is_causal=False, need_weights=False, average_attn_weights=True):
        _, probs = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                                  return_weights=True)          # (B, H, Tq, Tk) P
        probs.retain_grad()
        captured["P"] = probs
        B, H, T, hd = q.shape
        out = (probs @ v).transpose(1, 2).reshape(B, T, H * hd)               # (B, T, E) heads joined
        return module.out_proj(out), None

    module.__dict__["attend"] = attend  # shadows MultiheadAttention.attend for this call only
    try:
        model.eval()  # no dropout: P are the probabilities
        logits = model(batch.src, batch.tgt_in)                               # (1, T, V)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch.tgt_out.reshape(-1), ignore_index=PAD)
        loss.backward()
    finally:
        del module.__dict__["attend"]
    probs = captured["P"]
    return probs.numpy()[0], autograd.backend.as_numpy(probs.grad)[0], loss.item()


def main(argv=None):
    args = parse_args(argv)
    model, task = trained_model(args)
    if not 0 <= args.index < len(task.heldout):
        raise SystemExit(f"--index: expected 0..{len(task.heldout) - 1}, got {args.index}")
    batch = task.collate([task.heldout[args.index]])
    module = attention_module(model, args.attention, args.layer)
    weights, grads, loss = weights_and_grads(model, module, batch)
    src = [str(s) for s in task.decode(batch.src[0])]
    tgt_in = ["BOS"] + [str(s) for s in task.decode(batch.tgt_in[0, 1:])]
    query, key = {"encoder": (src, src), "decoder": (tgt_in, tgt_in), "cross": (tgt_in, src)}[args.attention]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    title = (f"{args.attention} attention, layer {args.layer}: P and dL/dP for input {' '.join(src)} "
             f"(loss {loss:.3g})")
    plots.plot_attention_and_grads(weights, grads, args.out, title, query, key)
    for h in range(weights.shape[0]):
        print(f"head {h}: max P {weights[h].max():.3f}, max |dL/dP| {abs(grads[h]).max():.3g}", file=sys.stderr)
    print(f"wrote {args.out}", file=sys.stderr)
    return args.out


if __name__ == "__main__":
    main()
