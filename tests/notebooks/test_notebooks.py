"""Every notebook of notebooks/ runs top to bottom in a real Jupyter kernel, without an error
or a warning, draws its figures inline, in under 90 s; `make notebooks` turns the sources into
.ipynb files. The notebooks assert each gradient they derive, so a wrong derivation fails here."""
import pathlib
import shutil
import subprocess
import sys
import time

import jupytext
import nbformat
import pytest
from ipykernel.kernelspec import write_kernel_spec
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))
BUDGET_S = 90
KERNEL = "npformer-tests"


@pytest.fixture(scope="module")
def kernel_of_this_python(tmp_path_factory):
    """A kernelspec that starts this interpreter (sys.executable), on JUPYTER_PATH: the kernel
    imports this checkout's npformer whatever python the PATH names first."""
    jupyter_path = tmp_path_factory.mktemp("jupyter")
    write_kernel_spec(jupyter_path / "kernels" / KERNEL)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("JUPYTER_PATH", str(jupyter_path))
        patch.setenv("NPFORMER_NOTEBOOK_FIGURES", str(tmp_path_factory.mktemp("figures")))  # not the checkout's runs/
        yield KERNEL


def test_there_are_notebooks():
    assert [p.name for p in NOTEBOOKS][:4] == ["01_attention_backprop.py", "02_softmax_layernorm_ce.py",
                                               "03_reversal_learning.py", "04_second_order.py"]


@pytest.mark.parametrize("source", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_in_a_kernel_in_time(source, kernel_of_this_python):
    notebook = jupytext.read(source)
    client = NotebookClient(notebook, timeout=BUDGET_S, kernel_name=kernel_of_this_python,
                            resources={"metadata": {"path": str(source.parent)}})
    start = time.perf_counter()
    client.execute()                     # raises CellExecutionError, naming the cell, on any error
    seconds = time.perf_counter() - start
    assert seconds < BUDGET_S, f"{source.name} took {seconds:.0f} s (budget {BUDGET_S} s)"
    outputs = [out for cell in notebook.cells for out in cell.get("outputs", [])]
    warnings = [out["text"] for out in outputs if out.get("name") == "stderr" and "Warning" in out["text"]]
    assert not warnings, f"{source.name} warned: {warnings}"
    assert any("image/png" in out.get("data", {}) for out in outputs), f"{source.name} drew no inline figure"


def test_make_notebooks_builds_ipynb_files(tmp_path):
    """The Makefile's target, on a copy of the sources: one notebook per source, with its cells."""
    make = shutil.which("make")
    if make is None:
        pytest.skip("no make on this machine")
    shutil.copy(ROOT / "Makefile", tmp_path)
    shutil.copytree(ROOT / "notebooks", tmp_path / "notebooks", ignore=shutil.ignore_patterns("*.ipynb"))
    # the venv is this interpreter's: its learn stamp counts as made, so make installs nothing
    bin_dir = pathlib.Path(sys.executable).parent
    subprocess.run([make, "-o", ".venv/.stamp-learn", f"BIN={bin_dir}", "notebooks"], cwd=tmp_path, check=True,
                   capture_output=True)
    for source in NOTEBOOKS:
        built = nbformat.read(tmp_path / "notebooks" / f"{source.stem}.ipynb", as_version=4)
        nbformat.validate(built)
        assert len(built.cells) == len(jupytext.read(source).cells) > 5
