"""A short run of demos/reverse.py with the explorer's snapshots, shared by the explorer's tests
(made once per session), and npformer's own P and dL/dP of a checkpoint, recomputed here with
nn.record_attention. A helper module, not a conftest.py: a second module named conftest would
replace tests/conftest.py in sys.modules for the tests that import from it."""
import importlib.util
import os

import numpy as np
import pytest

from npformer import functional as F
from npformer import load_checkpoint, load_model, nn
from npformer.data import PAD, SequenceTask

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
# a short run: lengths 3..6 (EOS, examples of different lengths), snapshots every 4 steps, step 8 kept
RUN_ARGS = ["--preset", "seed", "--steps", "12", "--batch-size", "8", "--min-len", "3", "--max-len", "6",
            "--explorer-every", "4", "--snapshot-step", "8", "--explorer-examples", "2", "--no-plots", "--quiet"]


def demo(name):
    spec = importlib.util.spec_from_file_location(f"demo_{name}", os.path.join(ROOT, "demos", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_RUNS = {}


@pytest.fixture(scope="session")
def short_run(tmp_path_factory):
    """The folder of a 12-step run (checkpoint-step8.npz, checkpoint.npz, explorer.html, explorer.json),
    made once however many test modules import this fixture."""
    if "short" not in _RUNS:
        out = tmp_path_factory.mktemp("explorer_run")
        demo("reverse").main(RUN_ARGS + ["--out", str(out)])
        _RUNS["short"] = out
    return _RUNS["short"]


def recorded(checkpoint, example):
    """npformer's values for held-out example `example` of the checkpoint's task, recomputed from
    the checkpoint: {kind: [per layer (P, dL/dP) float32 (H, Tq, Tk)]}, the batch and the loss."""
    demo_state = load_checkpoint(checkpoint, restore_rng=False)["demo"]
    settings = demo_state["settings"]
    task = SequenceTask("reverse", vocab_size=settings["vocab"], min_len=settings["min_len"],
                        max_len=settings["max_len"], seed=demo_state["seed"])
    batch = task.collate([task.heldout[example]])
    model = load_model(checkpoint)[0]
    with nn.record_attention(model) as recorder:
        logits = model(batch.src, batch.tgt_in)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch.tgt_out.reshape(-1), ignore_index=PAD)
        loss.backward()
    out = {"encoder_self": [], "decoder_self": [], "cross": []}
    for record in recorder:   # call order: encoder layers, then per decoder layer self then cross
        kind = "cross" if record.name.endswith("multihead_attn") else \
            "decoder_self" if ".decoder." in record.name else "encoder_self"
        out[kind].append((np.asarray(record.weights.numpy()[0]), np.asarray(record.grad[0])))
    return out, batch, loss.item()
