"""Where a notebook's figures go and how they are shown, in Jupyter and as a script alike.

Each notebook saves its figures to runs/notebooks/<notebook>/ of the repository (the variable
NPFORMER_NOTEBOOK_FIGURES names another parent folder). In a Jupyter kernel a figure is shown
inline; run as a script (`.venv/bin/python notebooks/01_attention_backprop.py`) the notebook
prints the path of each figure instead. IPython is imported only inside a kernel, so the
scripts run with matplotlib alone (the demo's install).
"""
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def in_kernel():
    """True inside IPython (a Jupyter kernel), False in a plain `python script.py` run."""
    ipython = sys.modules.get("IPython")
    return ipython is not None and getattr(ipython, "get_ipython", lambda: None)() is not None


def figure_folder(notebook):
    """runs/notebooks/<notebook>/ (created), where the notebook `notebook` saves its figures."""
    parent = os.environ.get("NPFORMER_NOTEBOOK_FIGURES") or ROOT / "runs" / "notebooks"
    folder = pathlib.Path(parent) / notebook
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def show(path):
    """Show the saved figure at `path`: inline in a kernel, its path printed in a script."""
    if in_kernel():
        from IPython.display import Image, display
        display(Image(filename=str(path)))
    else:
        print(f"figure saved: {path}")
    return path


def show_figure(fig, path):
    """Save the matplotlib figure `fig` to `path`, close it and show the file."""
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return show(path)
