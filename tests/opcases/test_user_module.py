"""A user's module of Functions and their cases, outside the library (the example of
docs/gradient_checking.md, "Your own op in the suite": one right and one wrong backward):
`python -m npformer.gradcheck --module` shows PASS and FAIL and exits 1, and the pytest plugin
(`pytest --gradcheck-module`) reports one passed and one failed, with the same messages."""
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


def test_the_command_shows_pass_and_fail_for_the_users_cases_only(user_project, torch):
    folder, env = user_project
    result = subprocess.run([sys.executable, "-m", "npformer.gradcheck", "--module", "mypkg.ops"], cwd=folder,
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr
    rows = {line.split(" |")[0].strip(): line for line in result.stdout.splitlines() if " | " in line}
    assert set(rows) == {"case", "", "swish", "forgetful swish"}          # only the module's cases
    # fd, torch x2, twin, create_graph (exact: 0.0e+00, no "e-"), 2nd, fwd
    assert rows["swish"].rstrip().endswith("PASS") and rows["swish"].count("e-") == 12
    # fd, torch x2, create_graph (its differentiable_backward is right), 2nd (judged against the wrong backward)
    assert rows["forgetful swish"].rstrip().endswith("FAIL") and rows["forgetful swish"].count("!") == 5
    after = result.stdout.split(rows["forgetful swish"])[1]
    assert re.search(r"\n {6}x: wrong, max diff \S+, worst at index \(\d, \d\): yours \S+, reference \S+", after)
    assert "2 checks in" in result.stdout and "FAILURES" in result.stdout


def test_the_pytest_plugin_runs_each_case_as_a_test(user_project, torch):
    assert "npformer.opcases.pytest_plugin" in [e.value for e in importlib.metadata.entry_points(group="pytest11")], \
        "the plugin's entry point (setup.cfg) is not installed: pip install -e . (make .venv/.stamp-dev does)"
    folder, env = user_project
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--gradcheck-module", "mypkg.ops"],
                            cwd=folder, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "collected 2 items" in result.stdout and "1 failed, 1 passed" in result.stdout
    assert "FAILED mypkg.ops::forgetful swish" in result.stdout
    assert "gradcheck: forgetful swish" in result.stdout and "x: wrong, max diff" in result.stdout
    selected = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--gradcheck-module",
                               "mypkg.ops", "-k", "not forgetful"], cwd=folder, env=env, capture_output=True, text=True,
                              timeout=300)
    assert selected.returncode == 0 and "1 passed, 1 deselected" in selected.stdout, selected.stdout


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
