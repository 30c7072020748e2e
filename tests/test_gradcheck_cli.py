"""`python -m npformer.gradcheck`: the table passes for real ops and shows FAIL for a broken one."""
import io
import subprocess
import sys

import numpy as np

from npformer import gradcheck

from test_autograd import WrongSoftmax


def test_main_passes_on_a_subset_of_ops_and_modules(capsys, torch):
    assert gradcheck.main(["-k", "softmax"]) == 0
    assert gradcheck.main(["-k", "nn.LayerNorm"]) == 0
    out = capsys.readouterr().out
    assert "F.softmax [[-1000, 1]]" in out and "nn.LayerNorm" in out and "FAIL" not in out
    assert out.count("PASS") == 4 and "all passed" in out


def test_a_broken_op_shows_fail_in_every_column(torch):
    broken = gradcheck.Check("broken softmax", lambda rng: gradcheck.functional_case(
        WrongSoftmax.apply, [rng.standard_normal((3, 4))], lambda t, x: t.softmax(x, dim=-1), twin=False))
    stream = io.StringIO()
    assert gradcheck.run([broken], torch, stream) is False
    row = next(line for line in stream.getvalue().splitlines() if line.startswith("broken softmax"))
    assert row.rstrip().endswith("FAIL") and row.count("!") == 2   # finite differences and torch both flag it


def test_every_functional_op_and_module_has_a_row():
    names = [c.name for c in gradcheck.all_checks()]
    for op in ("linear", "relu", "gelu", "dropout", "softmax", "log_softmax", "layer_norm", "embedding",
               "cross_entropy", "sdpa", "sdpa memory-efficient", "split_heads", "apply_rotary_emb"):
        assert any(n.startswith(f"F.{op}") for n in names), op
    for module in ("Linear", "Embedding", "LayerNorm", "Dropout (eval)", "Dropout (train", "MultiheadAttention",
                   "TransformerEncoderLayer", "TransformerDecoderLayer", "Transformer ("):
        assert any(n.startswith(f"nn.{module}") for n in names), module


def test_command_line_exit_status():
    result = subprocess.run([sys.executable, "-m", "npformer.gradcheck", "-k", "F.relu", "--no-torch"],
                            capture_output=True, text=True)
    assert result.returncode == 0 and "PASS" in result.stdout
    assert np.isfinite(float(result.stdout.split("in ")[-1].split(" s")[0]))
