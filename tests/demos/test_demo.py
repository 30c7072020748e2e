"""Smoke tests of the demos: files written, metrics keys, the --checkpoint/--input mode, and the
command line as a newcomer meets it (a quick --steps 20 run, one folder per preset, one-line
errors with exit status 2, Ctrl-C saving a checkpoint that resumes)."""
import importlib.util
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

import autograd
import npformer
from npformer import functional as F
from npformer import plots
from npformer.data import SequenceTask

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


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
             "attention_decoder_self.png", "attention_cross.png", "explorer.html", "explorer.json"}
    assert names <= set(os.listdir(seed_run))
    assert all(os.path.getsize(seed_run / n) > 1000 for n in names)
    metrics = json.loads((seed_run / "metrics.json").read_text())
    assert {"exact_match", "token_accuracy", "heldout_sequences", "steps", "wall_seconds", "train_seconds",
            "parameters"} <= set(metrics)
    assert metrics["steps"] == 30 and metrics["heldout_sequences"] == 1000
    assert metrics["explorer"] == str(seed_run / "explorer.html")
    assert 0 <= metrics["exact_match"] <= metrics["token_accuracy"] <= 1
    assert metrics["settings"]["d_model"] == 32 and metrics["settings"]["min_len"] == metrics["settings"]["max_len"] == 6


def test_make_demos_explorer_is_under_5_MB(tmp_path):
    """`make demo` (the default preset, 1,000 steps) keeps a snapshot every 1000 / 40 steps and at step 0:
    41, for the same examples and shapes as this 40-step run, whose page differs from the full run's only
    by the curves of 960 more steps (about 40 kB); the full run's page is about 2.6 MB."""
    demo = _demo("reverse")
    assert demo.PRESETS["default"]["steps"] // max(1, demo.PRESETS["default"]["steps"] // demo.EXPLORER_SNAPSHOTS) == 40
    metrics = demo.main(["--steps", "40", "--batch-size", "8", "--out", str(tmp_path), "--quiet", "--no-plots"])
    data = json.loads((tmp_path / "explorer.json").read_text())
    assert [s["step"] for s in data["snapshots"]] == list(range(41))
    assert [len(e["src"]) for e in data["examples"]] == [8, 12, 3] and len(data["kinds"]) == 3
    curves = len(json.dumps(data["curves"]))
    assert os.path.getsize(metrics["explorer"]) + curves * 1000 / 40 < 5e6


def test_reverse_demo_reverses_typed_input(seed_run, capsys):
    demo = _demo("reverse")
    demo.main(["--checkpoint", str(seed_run / "checkpoint.npz"), "--input", "3 7 1 5 8 2"])
    printed = capsys.readouterr().out.split()
    assert len(printed) == 6 and all(1 <= int(s) <= 17 for s in printed)
    with pytest.raises(SystemExit) as exit_info:
        demo.main(["--checkpoint", str(seed_run / "checkpoint.npz"), "--input", "3 99"])
    assert exit_info.value.code == 2
    assert "reverse.py: error: --input: symbols: expected integers in 1..17" in capsys.readouterr().err


def test_reverse_demo_resumes_with_the_runs_preset(seed_run, tmp_path, capsys):
    metrics = _demo("reverse").main(["--resume", str(seed_run / "checkpoint.npz"), "--steps", "32",
                                     "--out", str(tmp_path), "--quiet", "--no-plots"])
    assert metrics["steps"] == 32 and metrics["settings"]["d_model"] == 32 and metrics["preset"] == "seed"
    assert "reverse: preset seed (resumed at step 30 from" in capsys.readouterr().err


def test_each_preset_writes_its_own_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    metrics = _demo("reverse").main(["--preset", "seed", "--steps", "2", "--batch-size", "4", "--quiet",
                                     "--no-plots"])
    assert metrics["checkpoint"] == os.path.join("runs", "reverse-seed-steps2", "checkpoint.npz")
    assert os.listdir(tmp_path / "runs") == ["reverse-seed-steps2"]


def run_demo(*args, cwd):
    """demos/reverse.py in a fresh process: (exit status, stdout, stderr)."""
    done = subprocess.run([sys.executable, os.path.join(ROOT, "demos", "reverse.py"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    return done.returncode, done.stdout, done.stderr


def test_a_quick_run_of_20_steps(tmp_path):
    """The default preset (warmup 100 of 1,000 steps) with --steps 20: the warmup scales to 2
    steps; results on stdout, the header on stderr; the snapshot of --snapshot-step is kept; the
    run goes to runs/reverse-steps20 and leaves the finished run in runs/reverse byte for byte."""
    finished = tmp_path / "runs" / "reverse"
    finished.mkdir(parents=True)
    before = {}
    for name in ("checkpoint.npz", "checkpoint-step10.npz", "metrics.json", "curves.png"):
        (finished / name).write_bytes(name.encode() * 3)
        before[name] = (finished / name).read_bytes()
    code, out, err = run_demo("--steps", "20", "--batch-size", "8", "--snapshot-step", "10", "--no-plots", "--quiet",
                              cwd=tmp_path)
    assert code == 0, err
    assert out.startswith("example: ") and "held-out (1000 unseen sequences): exact-sequence accuracy" in out
    assert err.startswith("reverse: preset default, ") and "held-out" not in err
    assert {p.name: p.read_bytes() for p in finished.iterdir()} == before
    run = tmp_path / "runs" / "reverse-steps20"
    assert f"wrote {os.path.join('runs', 'reverse-steps20')}/" in out
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["steps"] == 20 and metrics["settings"]["warmup"] == 2
    assert {"checkpoint.npz", "checkpoint-step10.npz"} <= set(os.listdir(run))
    assert npformer.load_checkpoint(run / "checkpoint-step10.npz", restore_rng=False)["step"] == 10


@pytest.mark.parametrize("args, message", [
    (["--checkpoint", "missing.npz", "--input", "3 7"], "--checkpoint: missing.npz does not exist"),
    (["--checkpoint", "notes.txt", "--input", "3 7"], "--checkpoint: notes.txt: not a"),
    (["--checkpoint", "{ckpt}", "--input", "1 2 3 4 5 6 7 8 9"],
     "--input: 9 symbols, but this model reads at most 8 (its positional table has 8 positions; it was trained "
     "on lengths 6..6)"),
    (["--checkpoint", "{ckpt}", "--input", "3 x"], "--input: expected symbols 1..17 separated by spaces, got '3 x'"),
    (["--resume", "missing.npz"], "--resume: missing.npz does not exist"),
    (["--steps", "10", "--warmup", "20"], "--warmup: expected 0..10 (at most --steps), got 20"),
    (["--steps", "2", "--batch-size", "0"], "--batch-size: expected a positive integer, got 0"),  # were tracebacks
    (["--steps", "2", "--lr", "nan"], "--lr: expected a finite number > 0, got nan"),
    (["--steps", "2", "--lr", "-1"], "--lr: expected a finite number > 0, got -1.0"),
    (["--steps", "2", "--snapshot-step", "-1"], "--snapshot-step: expected an integer >= 0 (0: none), got -1"),
    (["--steps", "2", "--explorer-every", "-1"], "--explorer-every: expected an integer >= 0 (0: no explorer), got -1"),
    (["--steps", "2", "--explorer-examples", "0"], "--explorer-examples: expected a positive integer, got 0"),
])
def test_mistakes_are_one_line_errors_with_exit_status_2(args, message, seed_run, tmp_path):
    (tmp_path / "notes.txt").write_text("not a checkpoint\n")
    code, out, err = run_demo(*[a.format(ckpt=seed_run / "checkpoint.npz") for a in args], cwd=tmp_path)
    assert code == 2 and out == ""
    assert err == f"reverse.py: error: {message}" + err[len(f"reverse.py: error: {message}"):]
    assert err.count("\n") == 1 and "Traceback" not in err, err


def test_ctrl_c_saves_a_checkpoint_that_resumes(tmp_path):
    demo = subprocess.Popen([sys.executable, os.path.join(ROOT, "demos", "reverse.py"), "--steps", "100000",
                             "--warmup", "0", "--batch-size", "8", "--quiet", "--no-plots"], cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": ROOT})
    try:
        header = demo.stderr.readline()  # printed once Ctrl-C is handled
        assert header.startswith("reverse: preset default"), header
        demo.send_signal(signal.SIGINT)
        out, err = demo.communicate(timeout=120)
    finally:
        if demo.poll() is None:
            demo.kill()
    checkpoint = os.path.join("runs", "reverse", "checkpoint.npz")
    assert demo.returncode == 130 and out == ""
    assert "Traceback" not in err and f"resume with: python demos/reverse.py --resume {checkpoint}" in err
    step = npformer.load_checkpoint(tmp_path / checkpoint, restore_rng=False)["step"]
    assert 1 <= step < 100000 and f"interrupted at step {step}/100000; saved {checkpoint}" in err
    metrics = _demo("reverse").main(["--resume", str(tmp_path / checkpoint), "--steps", str(step + 1), "--quiet",
                                     "--no-plots"])
    assert metrics["steps"] == step + 1 and metrics["settings"]["batch_size"] == 8


def test_attention_grads_demo(seed_run, tmp_path, capsys):
    demo = _demo("attention_grads")
    path = demo.main(["--checkpoint", str(seed_run / "checkpoint.npz"), "--out", str(tmp_path / "grads.png")])
    assert os.path.getsize(path) > 1000
    printed = capsys.readouterr().out
    assert printed.startswith("transformer.decoder.layers.1.multihead_attn: loss ") and "max |dL/dP|" in printed
    # the recorded path computes the same loss as the model's own attention
    model, ckpt = npformer.load_model(seed_run / "checkpoint.npz")
    task = SequenceTask(**ckpt["trainer"]["task"]["config"])
    batch = task.collate(task.heldout[:1])
    weights, grads, loss = demo.weights_and_grads(model, batch, "transformer.decoder.layers.1.multihead_attn")
    logits = model(batch.src, batch.tgt_in)
    expected = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch.tgt_out.reshape(-1)).item()
    assert loss == pytest.approx(expected, rel=1e-6)
    assert weights.shape == grads.shape == (4, 6, 6) and np.allclose(weights.sum(axis=-1), 1, atol=1e-6)
    assert np.abs(grads).max() > 0
    assert demo.module_name(model, "encoder", -2) == ("transformer.encoder.layers.0.self_attn", "encoder layer 0 of 2")


def test_attention_grads_greys_the_masked_keys_and_shows_the_gradient_that_reaches_the_scores(seed_run):
    """In the decoder's causal self-attention dL/dP is not 0 at the masked future keys (P = 0
    there, nothing flows): the figure masks them, and its dL/dS row is the softmax's backward,
    checked against autograd's."""
    demo = _demo("attention_grads")
    model, ckpt = npformer.load_model(seed_run / "checkpoint.npz")
    task = SequenceTask(**ckpt["trainer"]["task"]["config"])
    weights, grads, _ = demo.weights_and_grads(model, task.collate(task.heldout[:1]),
                                                "transformer.decoder.layers.0.self_attn")
    future = np.triu(np.ones(weights.shape[1:], dtype=bool), 1)                  # (Tq, Tk)
    assert (weights[:, future] == 0).all() and np.abs(grads[:, future]).max() > 1e-3   # what was drawn before
    panels = plots.attention_panels(weights, grads)
    for name in ("P", "dL/dP", "dL/dS"):
        assert (panels[name].mask == np.broadcast_to(future, weights.shape)).all(), name
    scores = autograd.Tensor(np.log(np.where(weights > 0, weights, 1.0)) + np.where(weights > 0, 0.0, -np.inf),
                             requires_grad=True)                                # softmax(scores) = P
    F.softmax(scores, dim=-1).backward(grads)
    np.testing.assert_allclose(panels["dL/dS"].filled(0.0), scores.grad, atol=1e-5 * np.abs(grads).max())
    np.testing.assert_allclose(panels["dL/dS"].sum(-1), 0.0, atol=1e-5 * np.abs(grads).max())


def test_attention_grads_trains_the_snapshot_when_there_is_none(tmp_path, monkeypatch, capsys):
    demo = _demo("attention_grads")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(demo.reverse, "SNAPSHOT_STEP", 2)
    demo.main(["--attention", "decoder", "--layer", "0"])
    assert (tmp_path / "runs" / "reverse" / "attention_grads.png").exists()
    captured = capsys.readouterr()
    assert "training the default preset for 2 steps first" in captured.err
    assert captured.out.startswith("transformer.decoder.layers.0.self_attn: loss ")
    with pytest.raises(SystemExit) as exit_info:
        demo.main(["--layer", "2"])
    assert exit_info.value.code == 2
    assert "--layer: the decoder has 2 layers (0..1, or -1..-2 from the last), got 2" in capsys.readouterr().err
