"""The checker cannot be fooled or stopped (issue 46 item 3): each learner function runs in a
child process under a time limit, so sys.exit, os._exit, a kill or an endless loop is a verdict
for that function alone; a complex or integer result is wrong with a reason; a name that holds
no function is reported for that name while the others are judged."""
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from npformer.exercises import EXERCISES, check, check_file
from npformer.exercises.__main__ import main

import solution_backprop

HERE = pathlib.Path(__file__).resolve().parent
SOLUTION = (HERE / "solution_backprop.py").read_text()
ROOT = HERE.parents[1]


def learner_file(tmp_path, extra):
    """The correct solution with `extra` appended (it redefines names of its own)."""
    path = tmp_path / "mine.py"
    path.write_text(SOLUTION + "\n\nimport os, signal, sys\n\n" + extra)
    return path


def verdicts(results):
    return {r.name: r.verdict for r in results}


@pytest.mark.parametrize("body, verdict, message", [
    ("sys.exit(0)", "exited", "exited the program (sys.exit(0))"),
    ("os._exit(0)", "exited", "exited the program (exit status 0, e.g. os._exit)"),
    ("os.kill(os.getpid(), signal.SIGKILL)", "exited", "the process was killed (SIGKILL)"),
    ("while True:\n        pass", "timeout", "did not return within 1 s"),
])
def test_a_function_that_exits_or_loops_gets_a_verdict_and_the_others_are_judged(tmp_path, capsys, body, verdict,
                                                                                  message):
    path = learner_file(tmp_path, f"def softmax_backward(y, dy):\n    {body}\n")
    assert main(["check", str(path), "--timeout", "1"]) == 1
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("softmax_backward"))
    assert row.split()[1] == verdict and message in row, row
    assert "7 of 8 backward functions pass; still to fix: softmax_backward" in out


def test_a_file_that_exits_at_import_is_not_a_pass(tmp_path):
    """As a user runs it: the command's own exit status is 1, whatever the file exits with."""
    for line, words in [("sys.exit(0)", "exited the program (sys.exit(0))"),
                        ("os._exit(0)", "exited the program (exit status 0")]:
        path = learner_file(tmp_path, line + "\n")
        done = subprocess.run([sys.executable, "-m", "npformer.exercises", "check", str(path)], capture_output=True,
                              text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert done.returncode == 1 and f"cannot import {path}" in done.stdout and words in done.stdout, done


def test_check_from_python_survives_sys_exit_and_loops():
    def leaves(y, dy):
        sys.exit(0)
    assert check("softmax_backward", leaves).message == "exited the program (sys.exit(0))"

    def loops(y, dy):
        while True:
            pass
    result = check("softmax_backward", loops, timeout=0.5)
    assert (result.verdict, result.message, result.passed) == ("timeout", "did not return within 0.5 s", False)
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds, got 0"):
        check("softmax_backward", loops, timeout=0)


def test_complex_and_non_float_results_are_wrong_with_a_reason():
    noise = lambda y, dy: solution_backprop.softmax_backward(y, dy) + 1e-3j * np.ones_like(y)  # noqa: E731
    result = check("softmax_backward", noise)
    assert result.verdict == "wrong" and result.message.startswith("dx is complex (complex128), expected real")
    result = check("gelu_backward", lambda x, dy: np.zeros(x.shape, dtype=int))
    assert result.verdict == "wrong" and result.message == (
        "dx has dtype int64, expected floating-point numbers (an integer array truncates a gradient)")
    result = check("gelu_backward", lambda x, dy: np.array([["a"] * 4] * 3))
    assert result.verdict == "wrong" and result.message.startswith("dx has dtype <U1, expected floating-point")
    result = check("gelu_backward", lambda x, dy: (v for v in x))
    assert result.verdict == "wrong" and result.message == "dx is generator, expected an array"


def test_a_name_that_is_no_function_is_reported_alone(tmp_path, capsys):
    results = check_file(learner_file(tmp_path, "softmax_backward = 5\n"))
    assert verdicts(results) == {name: "error" if name == "softmax_backward" else "exact" for name in EXERCISES}
    assert results[0].message == "softmax_backward is int (5), expected a function"


def test_what_the_file_prints_at_import_is_printed_once(tmp_path, capfd):
    path = learner_file(tmp_path, "print('hello from the top level')\n")
    check_file(path)
    assert capfd.readouterr().out.count("hello from the top level") == 1
