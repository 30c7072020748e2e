"""Smoke test of demos/gpt_char.py with a tiny model and a few steps: the corpus is found, the
files are written, metrics.json holds the held-out and unigram figures, the checkpoint loads."""
import importlib.util
import json
import os
import re

import pytest

import npformer

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    pytest.importorskip("matplotlib", reason="the demo's figures need matplotlib (pip install -e .[plot])")
    spec = importlib.util.spec_from_file_location("demo_gpt_char", os.path.join(ROOT, "demos", "gpt_char.py"))
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    out = tmp_path_factory.mktemp("gpt_char")
    metrics = demo.main(["--steps", "4", "--d-model", "16", "--layers", "1", "--heads", "2", "--d-ff", "32",
                         "--context", "16", "--batch-size", "4", "--eval-windows", "8", "--eval-every", "2",
                         "--warmup", "1", "--sample-length", "20", "--out", str(out), "--quiet"])
    return out, metrics


def test_writes_metrics_figures_and_checkpoint(run):
    out, metrics = run
    assert {"metrics.json", "loss.png", "attention.png", "checkpoint.npz"} <= set(os.listdir(out))
    assert json.loads((out / "metrics.json").read_text()) == metrics
    assert metrics["steps"] == 4 and metrics["stopped_by"] == "steps"
    assert metrics["heldout_characters_scored"] == 8 * 16
    assert 0 < metrics["heldout_bits_per_char"] < 10 and 3 < metrics["unigram_bits_per_char"] < 7
    assert metrics["corpus"]["train_characters"] > 100_000 and "docstrings" in metrics["corpus"]["source"]
    assert metrics["sample_after"].startswith("Return the ") and len(metrics["sample_after"]) == len("Return the ") + 20
    ckpt = npformer.load_checkpoint(out / "checkpoint.npz", restore_rng=False)
    assert ckpt["config"]["d_model"] == 16 and len(ckpt["demo"]["vocabulary"]) == metrics["vocabulary"]


def _load_demo():
    spec = importlib.util.spec_from_file_location("demo_gpt_char_args", os.path.join(ROOT, "demos", "gpt_char.py"))
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    return demo


@pytest.mark.parametrize("args, message", [
    (["--steps", "0"], "--steps: expected a positive integer, got 0"),  # was a WarmupCosineLR traceback
    (["--eval-every", "0"], "--eval-every: expected a positive integer, got 0"),  # was ZeroDivisionError
    (["--batch-size", "0"], "--batch-size: expected a positive integer, got 0"),
    (["--context", "-1"], "--context: expected a positive integer, got -1"),
    (["--heads", "3"], r"--heads: 3 does not divide --d-model 128 \(each head gets d_model / heads features\)"),
    (["--steps", "10", "--warmup", "20"], r"--warmup: expected 0..10 \(at most --steps\), got 20"),
    (["--lr", "nan"], "--lr: expected a finite number > 0, got nan"),
    (["--weight-decay", "-1"], "--weight-decay: expected a finite number >= 0, got -1.0"),
    (["--dropout", "1.5"], r"--dropout: expected a probability in \[0, 1\), got 1.5"),
    (["--sample-length", "-1"], "--sample-length: expected an integer >= 0, got -1"),  # was silently no sample
    (["--max-train-seconds", "0"], "--max-train-seconds: expected a finite number > 0, got 0.0"),
    (["--steps", "x"], "argument --steps: invalid int value: 'x'"),
])
def test_bad_arguments_are_one_line_usage_errors(args, message, capsys):
    demo = _load_demo()
    with pytest.raises(SystemExit) as exit:
        demo.parse_args(args)
    err = capsys.readouterr().err
    assert exit.value.code == 2 and "Traceback" not in err
    assert err.splitlines()[-1].startswith("gpt_char.py: error: ") and re.search(message, err.splitlines()[-1]), err


def test_the_warmup_scales_with_the_steps():  # `--steps 50` alone was a usage error (warmup 100 > 50 steps)
    demo = _load_demo()
    assert demo.parse_args([]).warmup == demo.DEFAULTS["warmup"]
    assert demo.parse_args(["--steps", "50"]).warmup == 4  # 100 of 1,200 steps: the same share
    assert demo.parse_args(["--steps", "50", "--warmup", "0"]).warmup == 0
