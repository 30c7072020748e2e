"""`python -m npformer.gradcheck`: one row per case of the op-case registry; the table passes for
real ops, shows FAIL for a broken one, and says so when -k matches nothing."""
import io
import subprocess
import sys
from unittest import mock

import numpy as np

import autograd
from npformer import gradcheck, opcases

from helpers import WrongSoftmax


def test_main_passes_on_a_subset_of_ops_and_modules(capsys, torch):
    assert gradcheck.main(["-k", "softmax"]) == 0
    assert gradcheck.main(["-k", "nn.LayerNorm"]) == 0
    out = capsys.readouterr().out
    assert "F.softmax [[-1000, 1]]" in out and "nn.LayerNorm" in out and "FAIL" not in out
    expected = len(opcases.select("softmax")) + len(opcases.select("nn.LayerNorm"))
    assert out.count("PASS") == expected and out.count("all passed") == 2


def test_a_broken_op_shows_fail_in_every_column(torch):
    broken = opcases.OpCase("broken softmax", lambda rng: [rng.standard_normal((3, 4))], WrongSoftmax.apply,
                            lambda t, x: t.softmax(x, dim=-1), family="softmax")
    stream = io.StringIO()
    assert gradcheck.run([broken], torch, stream) is False
    row = next(line for line in stream.getvalue().splitlines() if line.startswith("broken softmax"))
    assert row.rstrip().endswith("FAIL") and row.count("!") == 3   # finite differences and torch (both dtypes) flag it


def test_the_finite_differences_are_autograd_gradcheck_with_its_random_direction():
    """The command calls autograd.gradcheck (its pass rule and its random-direction check)
    instead of a copy of it."""
    case = opcases.select("F.relu")[0]
    with mock.patch.object(autograd, "gradcheck", wraps=autograd.gradcheck) as called:
        row = gradcheck.run_case(case)
    assert called.call_count == 1 and row["fd"][2]
    report = []
    opcases.gradcheck_case(case, np.random.default_rng(0), report=report)
    assert [what for what, _, _ in report] == ["input", "random direction over all inputs"]


def test_every_functional_op_and_module_has_a_row():
    names = [c.name for c in opcases.CASES]
    for op in ("linear", "relu", "gelu", "dropout", "softmax", "log_softmax", "layer_norm", "embedding",
               "cross_entropy", "sdpa", "sdpa memory-efficient", "split_heads", "apply_rotary_emb"):
        assert any(n.startswith(f"F.{op}") for n in names), op
    for module in ("Linear", "Embedding", "LayerNorm", "Dropout (eval)", "Dropout (train", "MultiheadAttention",
                   "TransformerEncoderLayer", "TransformerDecoderLayer", "Transformer (", "RotaryEmbedding"):
        assert any(n.startswith(f"nn.{module}") for n in names), module


def test_command_line_exit_status():
    result = subprocess.run([sys.executable, "-m", "npformer.gradcheck", "-k", "F.relu", "--no-torch"],
                            capture_output=True, text=True)
    assert result.returncode == 0 and "PASS" in result.stdout
    assert np.isfinite(float(result.stdout.split("in ")[-1].split(" s")[0]))


def test_a_pattern_that_matches_nothing_says_so_and_fails(capsys):
    assert gradcheck.main(["-k", "swish"]) == 2
    err = capsys.readouterr().err
    assert "no case matches -k 'swish'" in err and "softmax" in err   # and lists the op families
    result = subprocess.run([sys.executable, "-m", "npformer.gradcheck", "-k", "swish", "--no-torch"],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "no case matches" in result.stderr and "PASS" not in result.stdout


def test_a_device_that_is_not_there_is_a_usage_error_with_exit_status_2(capsys):
    with mock.patch.object(autograd.backend, "cuda_available", return_value=False):
        try:
            gradcheck.main(["--device", "cuda", "-k", "F.relu", "--no-torch"])
        except SystemExit as e:  # was a RuntimeError traceback from inside the first case, exit status 1
            assert e.code == 2
        else:
            raise AssertionError("no SystemExit")
    err = capsys.readouterr().err
    assert "python -m npformer.gradcheck: error: --device cuda: " in err and "CuPy" in err and "Traceback" not in err
    with mock.patch("sys.argv", ["x", "--device", "gpu"]):
        try:
            gradcheck.main()
        except SystemExit as e:
            assert e.code == 2
    assert "invalid choice: 'gpu'" in capsys.readouterr().err
