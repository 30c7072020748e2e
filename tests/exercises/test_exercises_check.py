"""`python -m npformer.exercises`: the starter file, and a checker that passes a correct solution,
diagnoses every entry of the wrong-backward catalogue, and reports bad returns on their row."""
import importlib.util
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

import npformer.functional as F
from npformer.exercises import EXERCISES, check, check_file, write_starter
from npformer.exercises.__main__ import main

import solution_backprop
from wrong_backwards import CATALOGUE

HERE = pathlib.Path(__file__).resolve().parent
SOLUTION = HERE / "solution_backprop.py"
ROOT = HERE.parents[1]


def rows(out):
    """{function name: its row} of the checker's table."""
    return {line.split()[0]: line for line in out.splitlines() if line.split() and line.split()[0] in EXERCISES}


def gradient(result, name):
    return next(g for g in result.gradients if g.name == name)


def test_a_correct_solution_passes_with_exit_status_0(capsys):
    assert main(["check", str(SOLUTION)]) == 0
    table = rows(capsys.readouterr().out)
    assert list(table) == list(EXERCISES)
    assert all(row.split()[1] == "exact" for row in table.values()), table


def test_the_starter_file_runs_and_every_function_is_not_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main([]) == 0
    starter = tmp_path / "my_backprop.py"
    text = starter.read_text()
    assert text.count('raise NotImplementedError("write me")') == len(EXERCISES)
    assert "np.add.at" not in text and "sum(axis=0)" not in text       # the answers are not in it
    assert main(["check", "my_backprop.py"]) == 1
    out = capsys.readouterr().out
    assert all(row.split()[1:3] == ["not", "written"] for row in rows(out).values()) and len(rows(out)) == 8
    assert "0 of 8 backward functions pass" in out


def test_the_starter_forwards_are_the_engines(tmp_path):
    """What the starter gives is right: each forward equals npformer.functional's op."""
    spec = importlib.util.spec_from_file_location("starter_forwards", write_starter(tmp_path / "starter.py"))
    s = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(s)
    rng = np.random.default_rng(1)
    x, w, b = rng.standard_normal((4, 6)), rng.standard_normal(6), rng.standard_normal(6)
    np.testing.assert_allclose(s.softmax(x), F.softmax(x).data, rtol=1e-12)
    np.testing.assert_allclose(s.log_softmax(x), F.log_softmax(x).data, rtol=1e-12)
    target = rng.integers(0, 6, size=4)
    np.testing.assert_allclose(s.cross_entropy(x, target), F.cross_entropy(x, target).data, rtol=1e-12)
    np.testing.assert_allclose(s.layer_norm(x, w, b, 1e-5), F.layer_norm(x, 6, w, b).data, atol=1e-12)
    weight, bias = rng.standard_normal((5, 6)), rng.standard_normal(5)
    np.testing.assert_allclose(s.linear(x, weight, bias), F.linear(x, weight, bias).data, atol=1e-12)
    np.testing.assert_allclose(s.gelu(x), F.gelu(x).data, atol=1e-15)
    ids = np.array([[0, 3], [3, 1]])
    np.testing.assert_array_equal(s.embedding(ids, weight), F.embedding(ids, weight).data)
    q, k, v, mask, _, scale = EXERCISES["attention_backward"].make_inputs(rng)
    np.testing.assert_allclose(s.attention(q, k, v, mask, scale),
                               F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).data, atol=1e-12)


def test_writing_the_starter_never_overwrites_without_force(tmp_path, capsys):
    path = tmp_path / "mine.py"
    assert main(["-o", str(path)]) == 0
    path.write_text("my work")
    with pytest.raises(SystemExit) as exit_info:
        main(["-o", str(path)])
    assert exit_info.value.code == 2 and "--force" in capsys.readouterr().err
    assert path.read_text() == "my work"
    assert main(["-o", str(path), "--force"]) == 0 and "def attention_backward" in path.read_text()


def test_check_of_a_missing_file_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["check", str(tmp_path / "nowhere.py")])
    assert exit_info.value.code == 2 and "no such file" in capsys.readouterr().err


def test_the_catalogue_holds_at_least_20_mistakes_of_every_exercise():
    assert len(CATALOGUE) >= 20 and {w.exercise for w in CATALOGUE} == set(EXERCISES)


@pytest.mark.parametrize("wrong", CATALOGUE, ids=lambda w: f"{w.exercise}-{w.gradient}-{w.diagnosis}")
def test_every_wrong_backward_gets_its_diagnosis(wrong, capsys):
    result = check(wrong.exercise, wrong.backward)
    judged = gradient(result, wrong.gradient)
    assert result.verdict == "wrong" and not result.passed
    assert judged.verdict == "wrong" and judged.diagnosis.startswith(wrong.diagnosis), judged
    assert judged.diagnosis in capsys.readouterr().out


def test_the_row_names_the_worst_entrys_axes_and_the_exit_status_is_1(tmp_path, capsys):
    """A file with one wrong function: its row says where (dk[b=.., h=.., j=.., d=..]) and what;
    the others pass; the exit status is non-zero while it is wrong."""
    mine = tmp_path / "mine.py"
    mine.write_text(SOLUTION.read_text() + "\n_right = attention_backward\n\n\n"
                    "def attention_backward(q, k, v, mask, dout, scale):  # the mask forgotten\n"
                    "    return _right(q, k, v, np.ones_like(mask), dout, scale)\n")
    assert main(["check", str(mine)]) == 1
    out = capsys.readouterr().out
    table = rows(out)
    assert [name for name, row in table.items() if row.split()[1] != "exact"] == ["attention_backward"]
    row = table["attention_backward"]
    assert re.search(r"\bdk\[b=\d, h=\d, j=\d, d=\d\] yours -?[\d.e+-]+, correct -?[\d.e+-]+: "
                     r"gradient on masked positions", row), row
    assert re.search(r"\bdq\[b=\d, h=\d, i=\d, d=\d\]", row) and "7 of 8 backward functions pass" in out


def test_python_m_runs_the_command(tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "npformer.exercises", *args], cwd=tmp_path, capture_output=True,
                              text=True, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert run().returncode == 0 and (tmp_path / "my_backprop.py").exists()
    done = run("check", "my_backprop.py")
    assert done.returncode == 1 and done.stdout.count("not written") == 8, done.stdout + done.stderr
    assert run("check", str(SOLUTION)).returncode == 0


def test_check_from_python_takes_your_inputs_and_returns_the_result(capsys):
    rng = np.random.default_rng(5)
    y, dy = F.softmax(rng.standard_normal((7, 2))).data, rng.standard_normal((7, 2))
    result = check("softmax_backward", solution_backprop.softmax_backward, y, dy)
    assert result.passed and result.verdict == "exact" and capsys.readouterr().out.startswith("softmax_backward")
    result = check("softmax_backward", lambda y, dy: y * dy, y, dy)
    assert gradient(result, "dx").diagnosis.startswith("missing the row-sum term")
    assert re.search(r"dx\[n=[0-6], c=[01]\]", gradient(result, "dx").worst)


def test_a_gradient_within_the_float64_tolerance_is_close():
    result = check("gelu_backward", lambda x, dy: solution_backprop.gelu_backward(x, dy) * (1 + 1e-8))
    assert result.verdict == "close" and result.passed and gradient(result, "dx").max_diff > 0


def test_tuple_outputs_are_judged_one_by_one():
    def dbias_wrong(x, weight, dy):
        dx, dweight, _ = solution_backprop.linear_backward(x, weight, dy)
        return dx, dweight, dy.mean(axis=(0, 1))
    result = check("linear_backward", dbias_wrong)
    assert [g.verdict for g in result.gradients] == ["exact", "exact", "wrong"]
    assert gradient(result, "dbias").diagnosis.startswith("off by the scale factor N: yours is 0.1667")


def test_bad_returns_and_exceptions_are_reported_on_their_row(capsys):
    def raises(y, dy):
        return y @ dy                                     # (3, 5) @ (3, 5): a shape error inside numpy
    result = check("softmax_backward", raises)
    assert result.verdict == "error" and re.search(r"raised ValueError: .*\(line \d+\)", result.message)
    cases = {(lambda *a: (1, 2)): "returned 2 values, expected a tuple of 3 (dx, dweight, dbias)",
             (lambda *a: (None, 2, 3)): "dx is None, expected an array",
             (lambda *a: "a string"): "returned str, expected a tuple of 3 (dx, dweight, dbias)"}
    for mine, words in cases.items():
        assert check("layer_norm_backward", mine).message == words
    result = check("gelu_backward", lambda x, dy: np.where(x > 0, np.inf, x))
    assert gradient(result, "dx").diagnosis == "not a finite number" and "dx[n=" in gradient(result, "dx").worst
    shape = check("gelu_backward", lambda x, dy: x[:2])
    assert gradient(shape, "dx").diagnosis == "shape (2, 4) expected (3, 4)"
    zeros = check("gelu_backward", lambda x, dy: np.zeros_like(x))
    assert gradient(zeros, "dx").diagnosis == "zero everywhere: no gradient reached it"
    factor = check("gelu_backward", lambda x, dy: 3.7 * solution_backprop.gelu_backward(x, dy))
    assert gradient(factor, "dx").diagnosis == "off by a constant factor: yours is 3.7 times the correct gradient"
    other = check("gelu_backward", lambda x, dy: np.cos(x) * dy)
    assert gradient(other, "dx").diagnosis == "none of the known mistakes"
    assert "none of the known mistakes" in capsys.readouterr().out


def test_a_file_without_a_function_counts_it_not_written(tmp_path, capsys):
    partial = tmp_path / "partial.py"
    partial.write_text("import numpy as np\n\ndef gelu_backward(x, dy):\n    return dy\n")
    results = check_file(partial)
    assert [r.verdict for r in results].count("not written") == 7
    assert "defines no attention_backward" in rows(capsys.readouterr().out)["attention_backward"]


def test_check_refuses_bad_arguments_with_clear_errors():
    with pytest.raises(KeyError, match="no exercise 'softmax'; the exercises are softmax_backward"):
        check("softmax", solution_backprop.softmax_backward)
    with pytest.raises(TypeError, match="softmax_backward takes 2 inputs \\(y, dy\\), got 1"):
        check("softmax_backward", solution_backprop.softmax_backward, np.ones((2, 3)))
    with pytest.raises(TypeError, match="mine must be your softmax_backward function, got int"):
        check("softmax_backward", 3)
    with pytest.raises(ValueError, match=r"cannot take these inputs for softmax_backward\(y, dy\).*\(3, 2\)"):
        check("softmax_backward", solution_backprop.softmax_backward, np.full((2, 3), 1 / 3), np.ones((3, 2)))


def test_default_inputs_give_every_axis_its_own_size():
    """So that a transposed result has another shape and a named index names one axis."""
    for exercise in EXERCISES.values():
        for a in exercise.make_inputs(np.random.default_rng(0)):
            if isinstance(a, np.ndarray):
                assert len(set(a.shape)) == a.ndim, (exercise.name, a.shape)


def test_a_file_that_does_not_import_says_why_with_exit_status_1(tmp_path, capsys):
    broken = tmp_path / "broken.py"
    broken.write_text("def softmax_backward(y, dy):\n    return y *\n")
    assert main(["check", str(broken)]) == 1
    out = capsys.readouterr().out
    assert f"cannot import {broken}" in out and "SyntaxError" in out and "line 2" in out


def test_a_single_gradient_returned_in_a_tuple_is_named():
    result = check("gelu_backward", lambda x, dy: (solution_backprop.gelu_backward(x, dy),))
    assert result.message == "returned a tuple of 1, expected one array (dx)"


def test_write_starter_and_check_file_refuse_bad_arguments(tmp_path):
    with pytest.raises(TypeError, match="write_starter: path must be a str or os.PathLike, got int"):
        write_starter(3)
    with pytest.raises(TypeError, match="force"):
        write_starter(tmp_path / "s.py", force="yes")
    assert not (tmp_path / "s.py").exists()
    with pytest.raises(FileNotFoundError, match="check_file: no file"):
        check_file(tmp_path / "nowhere.py")
    with pytest.raises(KeyError, match="no exercise"):
        check(["softmax_backward"], solution_backprop.softmax_backward)


def test_a_constant_upstream_gradient_is_warned_about_and_checked_with_a_random_one(capsys):
    """The learner's own inputs with dy all ones (what sum() gives): a softmax backward without
    its outer factor y gives 0 there, as the correct one does; the checker warns and checks again."""
    y = F.softmax(np.random.default_rng(3).standard_normal((3, 5))).data
    forgot_y = lambda y, dy: dy - (dy * y).sum(axis=-1, keepdims=True)  # noqa: E731
    result = check("softmax_backward", forgot_y, y, np.ones_like(y))
    assert result.verdict == "wrong" and result.warning == (
        "warning: your upstream gradient dy is all ones, which hides mistakes (a softmax's Jacobian rows sum to 0); "
        "with a random dy: wrong")
    assert result.warning in capsys.readouterr().out
    right = check("softmax_backward", solution_backprop.softmax_backward, y, np.full_like(y, 0.5))
    assert right.verdict == "exact" and "is constant (0.5 everywhere)" in right.warning and \
        right.warning.endswith("with a random dy: exact")
    assert check("softmax_backward", solution_backprop.softmax_backward, y, np.ones_like(y) * y).warning == ""


def test_ds_at_q_without_a_transpose_is_named_when_t_equals_s():
    """With T = S, dk = dS @ q has dk's shape: only the values tell the missing transpose."""
    rng = np.random.default_rng(5)
    q, k, v, dout = (rng.standard_normal((2, 3, 5, 6)) for _ in range(4))
    mask = np.tril(np.ones((5, 5), dtype=bool))[None, None]
    scale = 1 / np.sqrt(6)

    def no_transpose(q, k, v, mask, dout, scale):
        dq, dk, dv = solution_backprop.attention_backward(q, k, v, mask, dout, scale)
        dS = dq / scale @ np.linalg.pinv(k)                     # dq = dS @ k * scale
        return dq, dS @ q * scale, dv
    result = check("attention_backward", no_transpose, q, k, v, mask, dout, scale)
    assert gradient(result, "dk").diagnosis.startswith("dk = dS @ q: dS needs a transpose"), result
