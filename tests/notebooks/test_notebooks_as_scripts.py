"""The Learn path after `make demo` alone: every notebook runs as a plain script with what the
demo installs (numpy, matplotlib), IPython and torch hidden; it saves its figures to
runs/notebooks/<name>/ (here under NPFORMER_NOTEBOOK_FIGURES) and prints their paths, never an
`<IPython.core.display.Image object>`; the cell that compares with torch says it skips."""
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))

# runs a notebook as `python notebooks/NN_name.py` would, with the modules the demo's install
# lacks made unimportable
RUNNER = """
import importlib.abc, runpy, sys
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("IPython", "torch", "ipykernel", "jupytext"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Hide())
sys.argv = [sys.argv[1]]
sys.path.insert(0, str(__import__("pathlib").Path(sys.argv[0]).parent))
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("source", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_as_a_script_without_ipython_or_torch(source, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NPFORMER_NOTEBOOK_FIGURES": str(tmp_path),
           "MPLBACKEND": "Agg"}
    done = subprocess.run([sys.executable, "-c", RUNNER, str(source)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "IPython" not in done.stdout and "Warning" not in done.stderr, done.stdout + done.stderr
    figures = sorted((tmp_path / source.stem).glob("*.png"))
    assert figures, f"{source.name} saved no figure under {tmp_path / source.stem}"
    assert all(f"figure saved: {f}" in done.stdout for f in figures), done.stdout
    if source.stem == "02_softmax_layernorm_ce":   # the gradcheck failure is printed with its verdict
        assert "gradcheck with a random upstream gradient says the op is wrong:" in done.stdout
        assert "input 0: wrong, max diff" in done.stdout
    if source.stem == "04_second_order":
        assert "skipped the comparison with torch's Hessian: it needs torch" in done.stdout
