"""Smoke tests of the demos: files written, metrics keys, the --checkpoint/--input mode."""
import importlib.util
import json
import os

import numpy as np
import pytest

import npformer
from npformer import functional as F
from npformer.data import SequenceTask

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def _demo(name):
    spec = importlib.util.spec_from_file_location(f"demo_{name}", os.path.join(ROOT, "demos", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def seed_run(tmp_path_factory):
    pytest.importorskip("matplotlib", reason="the demo's figures need matplotlib (pip install -e .[plot])")
    out = tmp_path_factory.mktemp("reverse")
    _demo("reverse").main(["--preset", "seed", "--steps", "30", "--out", str(out), "--quiet"])
    return out


def test_reverse_demo_writes_metrics_checkpoint_and_figures(seed_run):
    names = {"metrics.json", "checkpoint.npz", "curves.png", "grad_norms.png", "attention_encoder_self.png",
             "attention_decoder_self.png", "attention_cross.png"}
    assert names <= set(os.listdir(seed_run))
    assert all(os.path.getsize(seed_run / n) > 1000 for n in names)
    metrics = json.loads((seed_run / "metrics.json").read_text())
    assert {"exact_match", "token_accuracy", "heldout_sequences", "steps", "wall_seconds", "train_seconds",
            "parameters"} <= set(metrics)
    assert metrics["steps"] == 30 and metrics["heldout_sequences"] == 1000
    assert 0 <= metrics["exact_match"] <= metrics["token_accuracy"] <= 1
    assert metrics["settings"]["d_model"] == 32 and metrics["settings"]["min_len"] == metrics["settings"]["max_len"] == 6


def test_reverse_demo_reverses_typed_input(seed_run, capsys):
    demo = _demo("reverse")
    demo.main(["--checkpoint", str(seed_run / "checkpoint.npz"), "--input", "3 7 1 5 8 2"])
    printed = capsys.readouterr().out.split()
    assert len(printed) == 6 and all(1 <= int(s) <= 17 for s in printed)
    with pytest.raises(SystemExit, match="1..17"):
        demo.main(["--checkpoint", str(seed_run / "checkpoint.npz"), "--input", "3 99"])


def test_reverse_demo_resumes(seed_run, tmp_path):
    metrics = _demo("reverse").main(["--resume", str(seed_run / "checkpoint.npz"), "--steps", "32",
                                     "--out", str(tmp_path), "--quiet", "--no-plots"])
    assert metrics["steps"] == 32 and metrics["settings"]["d_model"] == 32


def test_attention_grads_demo(seed_run, tmp_path):
    demo = _demo("attention_grads")
    path = demo.main(["--checkpoint", str(seed_run / "checkpoint.npz"), "--out", str(tmp_path / "grads.png")])
    assert os.path.getsize(path) > 1000
    # the explicit P @ V path computes the same loss as the model's own attention
    model, ckpt = npformer.load_model(seed_run / "checkpoint.npz")
    task = SequenceTask(**ckpt["trainer"]["task"]["config"])
    batch = task.collate(task.heldout[:1])
    weights, grads, loss = demo.weights_and_grads(model, model.transformer.decoder.layers[1].multihead_attn, batch)
    logits = model(batch.src, batch.tgt_in)
    expected = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch.tgt_out.reshape(-1)).item()
    assert loss == pytest.approx(expected, rel=1e-6)
    assert weights.shape == grads.shape == (4, 6, 6) and np.allclose(weights.sum(axis=-1), 1, atol=1e-6)
    assert np.abs(grads).max() > 0
