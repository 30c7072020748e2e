"""A user's module of Functions and their cases, outside the library (the example of
docs/gradient_checking.md, "Your own op in the suite": one right and one wrong backward, and a
right first-order op): `python -m npformer.gradcheck --module` shows PASS, FAIL and PASS (its
higher columns "not defined") and exits 1, and the pytest plugin (bare `pytest
--gradcheck-module`, from the folder holding the package) reports two passed and one failed,
with the same messages, a one-line summary and test ids that rerun as printed."""
import importlib.metadata
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "gradient_checking.md").read_text()
SECTION = DOC.split("## Your own op in the suite")[1]
EXAMPLE = re.search(r"```python\n(.*?)```", SECTION, re.S).group(1)


@pytest.fixture
def user_project(tmp_path):
    """A folder holding mypkg/ops.py, the docs' example, and an environment that finds npformer."""
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "ops.py").write_text(EXAMPLE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return tmp_path, env


def _command(folder, env, *args):
    return subprocess.run([sys.executable, "-m", "npformer.gradcheck", *args], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=300)


def _rows(stdout):
    return {line.split(" |")[0].strip(): line for line in stdout.splitlines() if " | " in line}


def test_the_command_shows_pass_and_fail_for_the_users_cases_only(user_project, torch):
    folder, env = user_project
    for module in ("mypkg.ops", "mypkg/ops.py"):     # a dotted name or a path
        result = _command(folder, env, "--module", module)
        assert result.returncode == 1, result.stdout + result.stderr
        rows = _rows(result.stdout)
        assert set(rows) == {"case", "", "swish", "forgetful swish", "softplus"}          # only the module's cases
    # fd, torch x2, twin, create_graph (exact: 0.0e+00, no "e-"), 2nd, fwd
    assert rows["swish"].rstrip().endswith("PASS") and rows["swish"].count("e-") == 12
    # the backward's columns only: fd, torch x2 (create_graph, second order and forward mode are right)
    assert rows["forgetful swish"].rstrip().endswith("FAIL") and rows["forgetful swish"].count("!") == 3
    after = result.stdout.split(rows["forgetful swish"])[1]
    assert re.search(r"\n {6}x: wrong, max diff \S+, worst at index \(\d, \d\): yours \S+, reference \S+", after)
    assert "3 checks in" in result.stdout and "FAILURES" in result.stdout


def test_a_right_first_order_op_passes_with_its_higher_columns_not_defined_unless_required(user_project, torch):
    folder, env = user_project
    rows = _rows(_command(folder, env, "--module", "mypkg.ops").stdout)
    assert rows["softplus"].rstrip().endswith("PASS") and "!" not in rows["softplus"]   # was: FAIL, two ERROR cells
    assert rows["softplus"].count("not defined") == 2 and "ERROR" not in rows["softplus"]
    result = _command(folder, env, "--module", "mypkg.ops", "--require", "second-order,forward-mode")
    rows = _rows(result.stdout)
    assert rows["softplus"].rstrip().endswith("FAIL") and rows["softplus"].count("ERROR") == 2
    assert "mypkg.ops.Softplus is differentiable once" in result.stdout
    assert "mypkg.ops.Softplus has no forward-mode rule" in result.stdout
    assert rows["swish"].rstrip().endswith("PASS")       # it defines both, and its case requires them
    result = _command(folder, env, "--module", "mypkg.ops", "--require", "third-order")
    assert result.returncode == 2 and "--require: expected a comma-separated list of second-order, forward-mode, " \
                                      "got third-order" in result.stderr


PYTEST = pathlib.Path(sys.executable).with_name("pytest")


def _pytest(folder, env, *args):
    return subprocess.run([str(PYTEST), "-p", "no:cacheprovider", *args], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_pytest_plugin_runs_each_case_as_a_test(user_project, torch):
    assert "npformer.opcases.pytest_plugin" in [e.value for e in importlib.metadata.entry_points(group="pytest11")], \
        "the plugin's entry point (setup.cfg) is not installed: pip install -e . (make .venv/.stamp-dev does)"
    folder, env = user_project
    env = dict(env, COLUMNS="200")   # the summary line is cut to the terminal's width
    result = _pytest(folder, env, "--gradcheck-module", "mypkg.ops")   # bare pytest: was "No module named 'mypkg'"
    assert result.returncode == 1, result.stdout + result.stderr
    assert "collected 3 items" in result.stdout and "1 failed, 2 passed" in result.stdout
    # one line: the input, the worst entry, the column (was: the table's header)
    assert re.search(r"FAILED mypkg/ops.py::forgetful swish - x: wrong at index \(2, 1\): yours 0.505194, "
                     r"reference 0.00657986 \(finite differences; also failed: torch float64, torch float32\)\n",
                     result.stdout), result.stdout
    assert "gradcheck: forgetful swish" in result.stdout and "x: wrong, max diff" in result.stdout
    assert "Warning" not in result.stdout     # was: 18 torch.jit.script DeprecationWarnings under the user's tests
    rerun = _pytest(folder, env, "--gradcheck-module", "mypkg.ops", "mypkg/ops.py::forgetful swish")   # as printed
    assert rerun.returncode == 1 and "collected 1 item" in rerun.stdout and "1 failed in" in rerun.stdout, rerun.stdout
    selected = _pytest(folder, env, "--gradcheck-module", "mypkg/ops.py", "-k", "not forgetful")   # a path
    assert selected.returncode == 0 and "2 passed, 1 deselected" in selected.stdout, selected.stdout
    required = _pytest(folder, env, "--gradcheck-module", "mypkg.ops", "--gradcheck-require", "forward-mode",
                       "mypkg/ops.py::softplus")
    assert required.returncode == 1 and "FAILED mypkg/ops.py::softplus - RuntimeError: mypkg.ops.Softplus has no " \
                                        "forward-mode rule" in required.stdout, required.stdout


LOOPS = """
from autograd import Function
from npformer.opcases import OpCase, register


class Forever(Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2.0

    @staticmethod
    def backward(ctx, dy):
        while True:
            pass


register(OpCase("forever", lambda rng: [rng.standard_normal(3)], Forever.apply),
         OpCase("double", lambda rng: [rng.standard_normal(3)], lambda x: x * 2.0))
"""


def test_a_case_that_never_returns_is_a_verdict_not_a_hang(user_project):
    folder, env = user_project
    (folder / "mypkg" / "loops.py").write_text(LOOPS)
    result = _command(folder, env, "--module", "mypkg.loops", "--no-torch", "--time-limit", "2")
    assert result.returncode == 1, result.stdout + result.stderr
    rows = _rows(result.stdout)
    assert "TIME LIMIT" in rows["forever"] and rows["forever"].rstrip().endswith("FAIL")
    assert "finite differences: did not return within 2 s" in result.stdout
    assert rows["double"].rstrip().endswith("PASS")      # the table went on
    (folder / "mypkg" / "hangs.py").write_text("while True:\n    pass\n")
    result = _command(folder, env, "--module", "mypkg.hangs", "--no-torch", "--timeout", "2")   # the checker's name
    assert result.returncode == 2 and "--module mypkg.hangs: importing it did not return within 2 s" in result.stderr
    result = _command(folder, env, "--module", "mypkg.loops", "--time-limit", "-1")
    assert result.returncode == 2 and "--time-limit: expected a number of seconds >= 0" in result.stderr
    result = _pytest(folder, env, "--gradcheck-module", "mypkg.loops", "--gradcheck-time-limit", "2")
    assert result.returncode == 1 and "1 failed, 1 passed" in result.stdout, result.stdout
    assert "did not return within 2 s" in result.stdout


def test_a_module_without_cases_or_that_cannot_be_imported_is_a_usage_error(user_project):
    folder, env = user_project
    (folder / "mypkg" / "empty.py").write_text("")
    for module, message in (("mypkg.empty", "it registers no case"),
                            ("mypkg.missing", "importing it raised ModuleNotFoundError")):
        result = subprocess.run([sys.executable, "-m", "npformer.gradcheck", "--module", module, "--no-torch"],
                                cwd=folder, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 2 and f"--module {module}: {message}" in result.stderr, result.stderr
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--gradcheck-module",
                             "mypkg.empty"], cwd=folder, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 4 and "--gradcheck-module mypkg.empty: it registers no case" in result.stderr
