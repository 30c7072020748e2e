"""npformer.plots: the figures of a run and of attention, on the inputs a run can give them
(empty, non-finite or zero values, many heads), written atomically, and a clear error without
matplotlib."""
import os
import sys

import numpy as np
import pytest

from npformer import plots

pytest.importorskip("matplotlib", reason="the figures need matplotlib (pip install -e .[plot])")

HISTORY = {"step": [1, 2, 3], "loss": [3.0, 2.0, 1.5], "lr": [1e-3] * 3, "grad_norm": [1.0, 0.5, 0.25],
           "layer_grad_norm_step": [1, 3], "layer_grad_norm": {"encoder.layers.0": [0.5, 0.1], "embedding": [1.0, 0.2]}}


def png_size(path):
    """(width, height) in pixels from a PNG's header."""
    with open(path, "rb") as f:
        header = f.read(24)
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(header[16:20], "big"), int.from_bytes(header[20:24], "big")


def every_figure(folder):
    """Each plotting function once, writing into `folder`; -> the paths written."""
    weights = np.full((2, 3, 3), 1 / 3)
    return [plots.plot_curves(HISTORY, os.path.join(folder, "curves.png")),
            plots.plot_grad_norms(HISTORY, os.path.join(folder, "grad_norms.png")),
            plots.plot_attention([weights], os.path.join(folder, "attention.png"), "t", "abc", "abc"),
            plots.plot_attention_and_grads(weights, weights - 0.5, os.path.join(folder, "grads.png"), "t", "abc", "abc")]


def test_figures_go_into_folders_that_do_not_exist_yet(tmp_path):
    for path in every_figure(tmp_path / "runs" / "new"):
        assert png_size(path)[0] > 100


def test_a_figure_that_fails_midway_leaves_the_old_file_and_its_mode(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    path = tmp_path / "curves.png"
    plots.plot_curves(HISTORY, path)
    os.chmod(path, 0o640)
    before = path.read_bytes()

    def half_written(self, fname, **kwargs):
        with open(fname, "wb") as f:
            f.write(b"\x89PNG half")
        raise OSError("disk full")
    monkeypatch.setattr(Figure, "savefig", half_written)
    with pytest.raises(OSError, match="disk full"):
        plots.plot_curves(HISTORY, path)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["curves.png"]
    monkeypatch.undo()
    plots.plot_curves(HISTORY, path)
    assert os.stat(path).st_mode & 0o777 == 0o640


def test_a_path_without_extension_is_written_as_png_where_asked(tmp_path):
    assert plots.plot_curves(HISTORY, tmp_path / "curves") == tmp_path / "curves"
    assert os.listdir(tmp_path) == ["curves"] and png_size(tmp_path / "curves")[0] > 100


def test_every_figure_says_how_to_install_matplotlib_without_it(tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    for draw in (lambda: plots.plot_curves(HISTORY, tmp_path / "a.png"),
                 lambda: plots.plot_grad_norms(HISTORY, tmp_path / "b.png"),
                 lambda: plots.plot_attention([np.ones((1, 2, 2))], tmp_path / "c.png", "t", "ab", "ab")):
        with pytest.raises(ImportError, match="npformer.plots needs matplotlib: pip install"):
            draw()
