"""`python -m npformer.gradcheck`: one row per case of the op-case registry; the table passes for
real ops, shows FAIL for a broken one, and says so when -k matches nothing."""
import io
import subprocess
import sys
from unittest import mock

import numpy as np
import pytest

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
    assert row.count("not defined") == 2   # WrongSoftmax is differentiable once and has no jvp: not asked for


def test_the_finite_differences_are_autograd_gradcheck_with_its_random_direction():
    """The command calls autograd.gradcheck (its pass rule and its random-direction check)
    instead of a copy of it."""
    case = opcases.select("F.relu")[0]
    with mock.patch.object(autograd, "gradcheck", wraps=autograd.gradcheck) as called:
        row = gradcheck.run_case(case, second_order=False, forward_mode=False)
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


class OnceSquare(autograd.Function):
    """x**2 with a backward on raw arrays only and a jvp: differentiable once."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, dy):
        return 2.0 * dy * ctx.saved_tensors[0]

    @staticmethod
    def jvp(ctx, t):
        return 2.0 * t * ctx.saved_tensors[0]


class NoJvpSquare(OnceSquare):
    """x**2, twice differentiable, without a forward-mode rule."""

    jvp = None

    @staticmethod
    def differentiable_backward(ctx, dy):
        return 2.0 * dy * ctx.inputs[0]


def _row(case, torch):
    stream = io.StringIO()
    assert gradcheck.run([case], torch, stream) is False
    return stream.getvalue()


def test_a_once_differentiable_function_fails_the_second_order_column_naming_it_where_required(torch):
    case = opcases.OpCase("once square", lambda rng: [rng.standard_normal((3, 4))], OnceSquare.apply,
                          lambda t, x: x * x, require=("second-order",))
    row = gradcheck.run_case(case, torch)
    assert row["second"] == "ERROR" and not row["passed"]
    assert all(row[c][2] for c in ("fd", "torch", "torch32", "forward"))
    out = _row(case, torch)
    assert "second order: RuntimeError: " in out and "OnceSquare" in out and "differentiable once" in out
    assert "| FAIL" in out


def test_a_function_without_jvp_fails_the_forward_mode_column_naming_it_where_required(torch):
    case = opcases.OpCase("no-jvp square", lambda rng: [rng.standard_normal((3, 4))], NoJvpSquare.apply,
                          lambda t, x: x * x, require=("forward-mode",))
    row = gradcheck.run_case(case, torch)
    assert row["forward"] == "ERROR" and not row["passed"]
    assert all(row[c][2] for c in ("fd", "torch", "torch32", "second"))
    out = _row(case, torch)
    assert "forward mode: RuntimeError: " in out and "NoJvpSquare" in out and "no forward-mode rule" in out
    assert "| FAIL" in out


class FirstOrderSquare(OnceSquare):
    """x**2 with a right backward and nothing more."""

    jvp = None


def test_a_first_order_function_passes_with_its_higher_columns_not_defined_unless_required(torch):
    """OnceSquare without a jvp: a right backward and nothing more (most users' ops) passes; the
    command's --require (run's `require`) or the case's `require` asks for the higher columns."""
    case = opcases.OpCase("first-order square", lambda rng: [rng.standard_normal((3, 4))], FirstOrderSquare.apply,
                          lambda t, x: x * x)
    row = gradcheck.run_case(case, torch)
    assert row["passed"] and row["second"] == row["forward"] == "NOT DEFINED"   # was: two ERROR cells, FAIL
    assert all(row[c][2] for c in ("fd", "torch", "torch32", "create_graph"))
    stream = io.StringIO()
    assert gradcheck.run([case], torch, stream) is True
    out = stream.getvalue()
    assert out.count("not defined  |") == 2 and "| PASS" in out
    assert "second order: not defined: test_gradcheck_cli.FirstOrderSquare has no differentiable_backward (differentiable once); " \
           "--require second-order" in out
    assert "forward mode: not defined: test_gradcheck_cli.FirstOrderSquare has no jvp (no forward-mode rule)" in out
    row = gradcheck.run_case(case, torch, require=("second-order", "forward-mode"))
    assert not row["passed"] and row["second"] == row["forward"] == "ERROR"
    assert all(c.require == opcases.REQUIREMENTS for c in opcases.CASES)   # npformer's own cases require both
    with pytest.raises(ValueError, match=r"require must be a tuple of \('second-order', 'forward-mode'\), got "
                                         r"\('second',\)"):
        opcases.register(opcases.OpCase("bad require", lambda rng: [np.ones(2)], FirstOrderSquare.apply, require=("second",)))


def test_the_new_columns_can_be_skipped():
    row = gradcheck.run_case(opcases.select("F.relu")[0], second_order=False, forward_mode=False)
    assert row["second"] is None and row["forward"] is None and row["passed"]


class DoubledSquare(OnceSquare):
    """x**2 with a right backward and jvp, and a differentiable_backward that returns twice the
    gradient: second order and forward mode check it against itself; only the comparison with
    the plain backward sees it."""

    @staticmethod
    def differentiable_backward(ctx, dy):
        return 4.0 * dy * ctx.inputs[0]


def test_a_create_graph_gradient_that_differs_from_the_backward_fails_its_own_column_without_torch():
    case = opcases.OpCase("doubled square", lambda rng: [rng.standard_normal((3, 4))], DoubledSquare.apply)
    row = gradcheck.run_case(case, None)
    assert row["fd"][2] and not row["create_graph"][2] and not row["passed"]
    out = _row(case, None)
    assert "create_graph = plain: check_create_graph" in out and "| FAIL" in out
    assert "op test_gradcheck_cli.DoubledSquare, its input 0: wrong" in out          # the op, its input
    assert "input 0: create_graph's gradient: wrong, max diff" in out and "worst at index (" in out   # the entry
    try:
        autograd.gradgradcheck(DoubledSquare.apply, [autograd.Tensor(np.ones(3), requires_grad=True)])
    except autograd.GradcheckError as e:
        assert "DoubledSquare" in str(e)
    else:
        raise AssertionError("gradgradcheck passed a differentiable_backward that doubles the gradient")
